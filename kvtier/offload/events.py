"""KV-cache events of the host tier, told in the engine's terms: group, block hash and tokens.

The manager's :meth:`~kvtier.offload.OffloadManager.take_events` yields index
events keyed by namespaced keys. Engines publish events by their own block
hash, and a *stored* event also carries the block's token ids and its parent's
hash, which only the live requests know. :class:`RequestTokens` keeps those
requests (their growing lists of block hashes and token ids, never copies) and
turns index events into :class:`BlockEvent` s:

1. :meth:`RequestTokens.track` — a request got device blocks.
2. :meth:`RequestTokens.forget` — a request is over (its blocks are released);
   it is dropped only after the next :meth:`RequestTokens.describe`, so the
   events of its last stores still find its tokens.
3. :meth:`RequestTokens.describe` — once per step, the events drained from the
   manager.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.index.base import EventKind, IndexEvent
from kvtier.keys import KeyNamespace


@dataclass(frozen=True)
class BlockEvent:
    """A block stored in or evicted from the host tier, by the engine's hash of it."""

    kind: EventKind
    group: int
    """The kv-cache group of the block."""
    block_hash: bytes
    """The engine's hash of the block."""
    parent_hash: bytes | None = None
    """For a stored block, the engine's hash of the block before it (``None`` for a first block
    or when no live request holds the block)."""
    token_ids: tuple[int, ...] = ()
    """For a stored block, its token ids (empty when no live request holds the block)."""


@dataclass
class _Tracked:
    block_hashes: Sequence[bytes]
    token_ids: Sequence[int]


class RequestTokens:
    """The live requests' block hashes and token ids, to describe the tier's events."""

    def __init__(self, block_tokens: int, *, keep_forgotten: bool = True) -> None:
        """Args:
        block_tokens: Tokens per block (the engine's block size).
        keep_forgotten: Keep requests passed to :meth:`forget` until the next
            :meth:`describe` (events of that step may name their blocks); without
            it they are dropped at once, for engines that publish no events.
        """
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self._requests: dict[str, _Tracked] = {}
        self._forget: list[str] = []
        self._keep_forgotten = keep_forgotten

    def track(
        self, request_id: str, block_hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> None:
        """Keep ``request_id``'s hashes and tokens; the engine may keep growing both sequences."""
        self._requests[request_id] = _Tracked(block_hashes, token_ids)

    def block_hashes(self, request_id: str) -> Sequence[bytes] | None:
        """The tracked request's block hashes, or ``None`` if it is not tracked."""
        tracked = self._requests.get(request_id)
        return tracked.block_hashes if tracked is not None else None

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop these requests after the next :meth:`describe` (or now, see ``keep_forgotten``)."""
        self._forget.extend(request_ids)
        if not self._keep_forgotten:
            self._drop_forgotten()

    def describe(self, events: Sequence[IndexEvent], namespace: KeyNamespace) -> list[BlockEvent]:
        """Tell ``events`` (keys made by ``namespace``) in the engine's terms, in order.

        Tokens are looked up only for the hashes of stored blocks, each once.
        Then the requests passed to :meth:`forget` are dropped.
        """
        if not events:
            self._drop_forgotten()
            return []
        split = [(event.kind, namespace.split(event.key)) for event in events]
        wanted = {key.block_hash for kind, key in split if kind is EventKind.STORED}
        found = self._tokens_of(wanted)
        described = []
        for kind, (group, block_hash) in split:
            if kind is EventKind.STORED:
                parent, tokens = found.get(block_hash, (None, ()))
                described.append(BlockEvent(kind, group, block_hash, parent, tokens))
            else:
                described.append(BlockEvent(kind, group, block_hash))
        self._drop_forgotten()
        return described

    def _drop_forgotten(self) -> None:
        for request_id in self._forget:
            self._requests.pop(request_id, None)
        self._forget.clear()

    @property
    def num_requests(self) -> int:
        """Requests tracked now."""
        return len(self._requests)

    def _tokens_of(self, wanted: set[bytes]) -> dict[bytes, tuple[bytes | None, tuple[int, ...]]]:
        found: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        if not wanted:
            return found
        size = self.block_tokens
        for tracked in self._requests.values():
            hashes = tracked.block_hashes
            for position in range(len(hashes)):
                if hashes[position] not in wanted or hashes[position] in found:
                    continue
                parent = hashes[position - 1] if position else None
                start = position * size
                found[hashes[position]] = (parent, tuple(tracked.token_ids[start : start + size]))
        return found
