"""Every tier's KV-cache events told in the engine's terms: group, block hash, parent, tokens and
adapter, and the lower tiers' events made of the workers' reports."""

from __future__ import annotations

import pickle

import pytest

from kvtier.index.base import EventKind, IndexEvent
from kvtier.keys import KeyNamespace
from kvtier.offload.events import (
    Adapter,
    BlockEvent,
    LowerTierEvents,
    RequestTokens,
    TierEvent,
)
from kvtier.offload.messages import WorkerReport
from kvtier.tiers.chain import TierBlock

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
    tokens = RequestTokens(block_tokens=2, remember_tokens=0)
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


def on_disk(block_hash: bytes, group: int = 0) -> TierBlock:
    return TierBlock("disk", False, group, block_hash)


def test_a_lower_tier_block_is_in_once_every_rank_stored_it_and_out_at_the_first_loss() -> None:
    events = LowerTierEvents(world_size=2)
    events.count(WorkerReport(tier_stored={on_disk(b"h0"): 1, on_disk(b"h1"): 2}))
    assert events.take() == [TierEvent(EventKind.STORED, on_disk(b"h1"))]
    events.count(WorkerReport(tier_stored={on_disk(b"h0"): 1}, tier_removed={on_disk(b"h1"): 1}))
    assert events.take() == [
        TierEvent(EventKind.STORED, on_disk(b"h0")),
        TierEvent(EventKind.EVICTED, on_disk(b"h1")),
    ]
    events.count(WorkerReport(tier_removed={on_disk(b"h1"): 1}))
    assert events.take() == [], "the second rank's loss of a block already gone is no news"
    events.count(WorkerReport(tier_stored={on_disk(b"h1"): 2}))
    events.count(WorkerReport(tier_removed={on_disk(b"h1"): 1}))
    assert [event.kind for event in events.take()] == [EventKind.STORED, EventKind.EVICTED]


def test_a_rank_that_lost_its_shard_no_longer_counts_towards_a_store() -> None:
    events = LowerTierEvents(world_size=2)
    events.count(WorkerReport(tier_stored={on_disk(b"h0"): 1}))
    events.count(WorkerReport(tier_removed={on_disk(b"h0"): 1}))
    events.count(WorkerReport(tier_stored={on_disk(b"h0"): 1}))
    assert [event.kind for event in events.take()] == [EventKind.EVICTED]


def test_blocks_some_ranks_never_report_are_forgotten_oldest_first() -> None:
    events = LowerTierEvents(world_size=2, max_pending=2)
    for block_hash in (b"h0", b"h1", b"h2"):
        events.count(WorkerReport(tier_stored={on_disk(block_hash): 1}))
    assert events.forgotten == 1
    events.count(WorkerReport(tier_stored={on_disk(b"h0"): 1, on_disk(b"h2"): 1}))
    assert events.take() == [TierEvent(EventKind.STORED, on_disk(b"h2"))]


def test_reports_add_up_lower_tier_blocks_over_workers() -> None:
    one = WorkerReport(tier_stored={on_disk(b"h0"): 1}, tier_removed={on_disk(b"h1"): 1})
    merged = WorkerReport.merge_all([one, one, None])
    assert pickle.loads(pickle.dumps(merged)) == merged, "reports cross process boundaries"
    assert merged.tier_stored == {on_disk(b"h0"): 2}
    assert merged.tier_removed == {on_disk(b"h1"): 2}
    assert not merged.empty and WorkerReport().empty


def test_lower_tier_events_follow_the_host_tiers_and_keep_their_place() -> None:
    tokens = RequestTokens(block_tokens=2)
    tokens.track("r", HASHES, [10, 11, 12, 13, 14, 15])
    redis = TierBlock("redis", True, 0, b"h1")
    described = tokens.describe(
        [stored(b"h0")],
        NAMESPACE,
        [TierEvent(EventKind.STORED, redis), TierEvent(EventKind.EVICTED, on_disk(b"h2"))],
    )
    assert described == [
        BlockEvent(EventKind.STORED, 0, b"h0", None, (10, 11)),
        BlockEvent(EventKind.STORED, 0, b"h1", b"h0", (12, 13), "redis", True),
        BlockEvent(EventKind.EVICTED, 0, b"h2", tier="disk"),
    ]


def test_tokens_of_blocks_described_are_remembered_after_their_request_is_over() -> None:
    tokens = RequestTokens(block_tokens=2, remember_tokens=4)
    tokens.track("r", HASHES, [10, 11, 12, 13, 14, 15])
    tokens.describe([stored(b"h0"), stored(b"h1"), stored(b"h2")], NAMESPACE)
    tokens.forget(["r"])
    tokens.describe([], NAMESPACE)
    assert tokens.num_requests == 0
    demoted = [TierEvent(EventKind.STORED, on_disk(h)) for h in HASHES]
    assert [event.token_ids for event in tokens.describe([], NAMESPACE, demoted)] == [
        (),
        (12, 13),
        (14, 15),
    ], "the two blocks described last are remembered"


def test_stored_blocks_carry_their_requests_adapter_also_once_the_request_is_over() -> None:
    tokens = RequestTokens(block_tokens=2)
    adapter = Adapter(7, "support-bot")
    tokens.track("tuned", HASHES[:2], [10, 11, 12, 13], adapter)
    tokens.track("base", [b"b0"], [20, 21])
    described = tokens.describe(
        [stored(b"h0"), stored(b"b0"), IndexEvent(EventKind.EVICTED, NAMESPACE.key(b"h0"))],
        NAMESPACE,
    )
    assert [event.adapter for event in described] == [adapter, None, None]
    tokens.forget(["tuned", "base"])
    tokens.describe([], NAMESPACE)
    demoted = [TierEvent(EventKind.STORED, on_disk(h)) for h in (b"h0", b"b0", b"h1")]
    assert [event.adapter for event in tokens.describe([], NAMESPACE, demoted)] == [
        adapter,
        None,
        None,
    ], "the adapter is remembered with the tokens; a block never described has neither"
