"""The tier's KV-cache events told in the engine's terms: group, block hash, parent and tokens."""

from __future__ import annotations

import pytest

from kvtier.index.base import EventKind, IndexEvent
from kvtier.keys import KeyNamespace
from kvtier.offload.events import BlockEvent, RequestTokens

NAMESPACE = KeyNamespace("model")
HASHES = [b"h0", b"h1", b"h2"]


def stored(block_hash: bytes, group: int = 0) -> IndexEvent:
    return IndexEvent(EventKind.STORED, NAMESPACE.key(block_hash, group))


def test_stored_blocks_get_their_tokens_and_parent() -> None:
    tokens = RequestTokens(block_tokens=2)
    tokens.track("r", HASHES, [10, 11, 12, 13, 14, 15, 16])
    events = [stored(b"h1", 1), IndexEvent(EventKind.EVICTED, NAMESPACE.key(b"h0")), stored(b"h0")]
    assert tokens.describe(events, NAMESPACE) == [
        BlockEvent(EventKind.STORED, 1, b"h1", b"h0", (12, 13)),
        BlockEvent(EventKind.EVICTED, 0, b"h0"),
        BlockEvent(EventKind.STORED, 0, b"h0", None, (10, 11)),
    ]


def test_requests_are_read_live_and_forgotten_after_the_next_events() -> None:
    hashes: list[bytes] = []
    token_ids: list[int] = []
    tokens = RequestTokens(block_tokens=2)
    tokens.track("r", hashes, token_ids)
    hashes.extend(HASHES[:2])
    token_ids.extend([1, 2, 3, 4])
    assert tokens.block_hashes("r") is hashes
    tokens.forget(["r"])
    (event,) = tokens.describe([stored(b"h1")], NAMESPACE)
    assert event.token_ids == (3, 4), "a forgotten request still serves this step's events"
    assert tokens.num_requests == 0
    assert tokens.describe([stored(b"h1")], NAMESPACE) == [
        BlockEvent(EventKind.STORED, 0, b"h1", None, ())
    ]


def test_without_events_forgotten_requests_are_dropped_at_once() -> None:
    tokens = RequestTokens(block_tokens=2, keep_forgotten=False)
    tokens.track("r", HASHES, [1, 2, 3, 4])
    tokens.track("s", HASHES, [5, 6, 7, 8])
    tokens.forget(["r"])
    assert tokens.num_requests == 1 and tokens.block_hashes("r") is None


def test_keys_of_another_namespace_are_refused() -> None:
    with pytest.raises(ValueError, match="namespace"):
        RequestTokens(2).describe([stored(b"h0")], KeyNamespace("other"))
