"""KV-cache events of every tier, told in the engine's terms: tier, group, block hash and tokens.

The manager's :meth:`~kvtier.offload.OffloadManager.take_events` yields the
host tier's index events, keyed by namespaced keys, and
:meth:`~kvtier.offload.OffloadManager.take_tier_events` the lower tiers'
:class:`TierEvent` s, which :class:`LowerTierEvents` makes of the workers'
reports. Engines publish events by their own block hash, and a *stored* event
also carries the block's token ids, its parent's hash and the adapter it was
computed under, which only the live requests know. :class:`RequestTokens` keeps
those requests (their growing lists of block hashes and token ids, never
copies, and their adapter), and what it found of the blocks it described last,
and turns both kinds of events into :class:`BlockEvent` s:

1. :meth:`RequestTokens.track` — a request got device blocks.
2. :meth:`RequestTokens.forget` — a request is over (its blocks are released);
   it is dropped only after the next :meth:`RequestTokens.describe`, so the
   events of its last stores still find its tokens.
3. :meth:`RequestTokens.describe` — once per step, the events drained from the
   manager.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.index.base import EventKind, IndexEvent
from kvtier.keys import KeyNamespace
from kvtier.offload.messages import WorkerReport
from kvtier.tiers.chain import TierBlock

logger = logging.getLogger(__name__)

MAX_PENDING_TIER_BLOCKS = 1 << 16
"""Lower-tier blocks reported by some workers and not yet by all, kept at most."""

REMEMBERED_TOKENS = 1 << 20
"""Token ids :class:`RequestTokens` keeps of blocks whose requests are over, at most (8 MiB)."""


class Adapter(NamedTuple):
    """The fine-tuned adapter (a LoRA) a request runs under, as the engine names it.

    An engine that hashes blocks puts the adapter in the hash, so one block hash
    belongs to one adapter (or to none: the base model).
    """

    adapter_id: int
    """The engine's integer id of the adapter."""
    name: str
    """The adapter's name."""


class TierEvent(NamedTuple):
    """A block stored in or removed from a lower tier, on every worker's account."""

    kind: EventKind
    block: TierBlock


@dataclass(frozen=True)
class BlockEvent:
    """A block stored in or evicted from a tier, by the engine's hash of it."""

    kind: EventKind
    group: int
    """The kv-cache group of the block."""
    block_hash: bytes
    """The engine's hash of the block."""
    parent_hash: bytes | None = None
    """For a stored block, the engine's hash of the block before it (``None`` for a first block
    or when no live request holds the block)."""
    token_ids: tuple[int, ...] = ()
    """For a stored block, its token ids (empty when no live request holds the block and its
    tokens are no longer remembered)."""
    tier: str | None = None
    """The lower tier the block is stored in or removed from, by name; ``None``: the host tier."""
    shared: bool = False
    """Whether that lower tier is a store other engines reach (the fleet's, not this host's)."""
    adapter: Adapter | None = None
    """For a stored block, the adapter it was computed under (``None`` for the base model,
    or when its tokens are not known either)."""


class LowerTierEvents:
    """The lower tiers' stores and removals, once the workers' reports add up.

    Each worker stores its own shard of a block under its own key: a block is
    in a tier once all ``world_size`` workers reported storing it, and leaves it
    when the first worker reports losing its shard (one event each, not one
    per worker). A removal reported in the same report as a store of the same
    block is taken as the later of the two. Blocks reported by some workers and
    not yet by all wait, ``max_pending`` at most; past that the oldest are
    forgotten (a worker whose put was dropped never reports the block).
    """

    def __init__(self, world_size: int, *, max_pending: int = MAX_PENDING_TIER_BLOCKS) -> None:
        if world_size <= 0 or max_pending <= 0:
            raise ValueError(
                f"world_size and max_pending must be positive, got {world_size} and {max_pending}"
            )
        self.world_size = world_size
        self.max_pending = max_pending
        self._storing: dict[TierBlock, int] = {}
        self._removing: dict[TierBlock, int] = {}
        self._events: list[TierEvent] = []
        self.forgotten = 0
        """Pending blocks forgotten to keep within ``max_pending``."""

    @property
    def idle(self) -> bool:
        """Whether no event waits for :meth:`take`."""
        return not self._events

    def count(self, report: WorkerReport) -> None:
        """Add one (merged) report's lower-tier stores and removals."""
        for block, workers in report.tier_stored.items():
            stored = self._storing.pop(block, 0) + workers
            if stored >= self.world_size:
                self._removing.pop(block, None)  # a later loss is news again
                self._events.append(TierEvent(EventKind.STORED, block))
            else:
                self._keep(self._storing, block, stored)
        for block, workers in report.tier_removed.items():
            removed = self._removing.pop(block, 0)
            if not removed:
                self._events.append(TierEvent(EventKind.EVICTED, block))
            still_stored = self._storing.pop(block, 0) - workers
            if still_stored > 0:
                self._storing[block] = still_stored
            if removed + workers < self.world_size:
                self._keep(self._removing, block, removed + workers)

    def _keep(self, pending: dict[TierBlock, int], block: TierBlock, workers: int) -> None:
        pending[block] = workers
        if len(pending) > self.max_pending:
            del pending[next(iter(pending))]
            self.forgotten += 1
            logger.debug("forgot a lower-tier block some workers never reported")

    def take(self) -> list[TierEvent]:
        """Return and forget the events since the last call, in the order they completed."""
        events, self._events = self._events, []
        return events


_Found = tuple[bytes | None, tuple[int, ...], Adapter | None]
"""A stored block's parent hash, token ids and adapter."""
_UNKNOWN: _Found = (None, (), None)


@dataclass
class _Tracked:
    block_hashes: Sequence[bytes]
    token_ids: Sequence[int]
    adapter: Adapter | None


class RequestTokens:
    """The live requests' block hashes and token ids, to describe the tier's events."""

    def __init__(
        self,
        block_tokens: int,
        *,
        keep_forgotten: bool = True,
        remember_tokens: int = REMEMBERED_TOKENS,
    ) -> None:
        """Args:
        block_tokens: Tokens per block (the engine's block size).
        keep_forgotten: Keep requests passed to :meth:`forget` until the next
            :meth:`describe` (events of that step may name their blocks); without
            it they are dropped at once, for engines that publish no events.
        remember_tokens: Keep the parent, tokens and adapter of the blocks last
            described as stored, up to this many tokens, for later stores of the same
            blocks (a lower tier stores a block when the host tier evicts it,
            often after its request is over).
        """
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self._requests: dict[str, _Tracked] = {}
        self._forget: list[str] = []
        self._keep_forgotten = keep_forgotten
        self._remember_blocks = remember_tokens // block_tokens
        # block hash -> (parent hash, token ids as 8-byte integers, adapter), oldest first
        self._remembered: dict[bytes, tuple[bytes | None, array[int], Adapter | None]] = {}

    def track(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        adapter: Adapter | None = None,
    ) -> None:
        """Keep ``request_id``'s hashes and tokens (the engine may keep growing both
        sequences) and the adapter it runs under (``None``: the base model)."""
        self._requests[request_id] = _Tracked(block_hashes, token_ids, adapter)

    def block_hashes(self, request_id: str) -> Sequence[bytes] | None:
        """The tracked request's block hashes, or ``None`` if it is not tracked."""
        tracked = self._requests.get(request_id)
        return tracked.block_hashes if tracked is not None else None

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop these requests after the next :meth:`describe` (or now, see ``keep_forgotten``)."""
        self._forget.extend(request_ids)
        if not self._keep_forgotten:
            self._drop_forgotten()

    def describe(
        self,
        events: Sequence[IndexEvent],
        namespace: KeyNamespace,
        tier_events: Sequence[TierEvent] = (),
    ) -> list[BlockEvent]:
        """Tell the host tier's ``events`` (keys made by ``namespace``), then the lower
        tiers' ``tier_events``, in the engine's terms, in order.

        Tokens (and adapters) are looked up only for the hashes of stored blocks, each once.
        Then the requests passed to :meth:`forget` are dropped.
        """
        if not (events or tier_events):
            self._drop_forgotten()
            return []
        split = [(event.kind, None, False, *namespace.split(event.key)) for event in events]
        split += [(kind, *block) for kind, block in tier_events]
        wanted = {block_hash for kind, *_, block_hash in split if kind is EventKind.STORED}
        found = self._tokens_of(wanted)
        described = []
        for kind, tier, shared, group, block_hash in split:
            if kind is EventKind.STORED:
                parent, tokens, adapter = found.get(block_hash, _UNKNOWN)
                described.append(
                    BlockEvent(kind, group, block_hash, parent, tokens, tier, shared, adapter)
                )
            else:
                described.append(BlockEvent(kind, group, block_hash, tier=tier, shared=shared))
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

    def _tokens_of(self, wanted: set[bytes]) -> dict[bytes, _Found]:
        """Parent, tokens and adapter of the ``wanted`` blocks that are remembered or that a
        live request holds (a hash fixes all three); what is found is remembered as the
        newest."""
        found: dict[bytes, _Found] = {}
        if not wanted:
            return found
        remembered = self._remembered
        for block_hash in wanted:
            kept = remembered.pop(block_hash, None)
            if kept is not None:
                found[block_hash] = (kept[0], tuple(kept[1]), kept[2])
        missing = wanted - found.keys()
        size = self.block_tokens
        for tracked in self._requests.values() if missing else ():
            hashes = tracked.block_hashes
            for position in range(len(hashes)):
                if hashes[position] not in missing or hashes[position] in found:
                    continue
                parent = hashes[position - 1] if position else None
                start = position * size
                tokens = tuple(tracked.token_ids[start : start + size])
                found[hashes[position]] = (parent, tokens, tracked.adapter)
        for block_hash, (parent, tokens, adapter) in found.items():
            remembered[block_hash] = (parent, array("q", tokens), adapter)
        while len(remembered) > self._remember_blocks:
            del remembered[next(iter(remembered))]
        return found
