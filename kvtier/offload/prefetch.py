"""Owns prefetches: reads from the lower tiers started when a request arrives, while it waits.

When a request enters the engine's queue (:meth:`OffloadManager.arrived
<kvtier.offload.OffloadManager.arrived>`), its blocks missing from the host tier
are promoted at once (:mod:`~kvtier.offload.moves` probes the lower tiers, then
reserves slots for the blocks they hold and plans their reads), instead of at its
first lookup. This module keeps, per waiting
request, what was read for it and decides what its lookups answer meanwhile:

- ``wait_complete``: "ask again" until every rank reported the probe and the reads;
- ``timeout``: the same until ``timeout_s`` after the request arrived;
- ``best_effort``: the host tier's hits at once.

The cost guard judges a prefetch when it starts only if no request that arrived
before it still waits for its turn: behind them, its reads run while it queues.
Under the first two policies, a lookup that finds reads still running stops
waiting if the guard predicts every tier's read slower than recomputing the
blocks.

A lookup that stops waiting for reads still in flight expires the prefetch: the
request computes those blocks (a miss), and the blocks, once read, are ordinary
host-tier blocks. Blocks read for a request stay pinned until the engine
allocated it (the load pins them then) or it finished, so no store evicts them
before their use.

Bounds: the slots reserved or pinned for waiting requests, with the host hits
kept for lookups that wait for the rest, stay within ``max_host_share`` of the
host tier; a prefetch past it reads fewer blocks (or none). As slots in the
share come free (a request allocated, finished, or a read that found less), the
next plan goes on with the prefetches it left short, the longest waiting first.
The request's first lookup promotes what is still missing, at once if the
prefetch's reads still run (beside them), else once they landed; not where a
probe found the tiers hold no more, unless this engine wrote the block down the
chain since. The host tier's index makes the room, as for any store: it evicts
only unpinned readable blocks, and its policy may decline (an admission filter
that values what it holds more).

A request that finishes before it was allocated (an abort) cancels its
prefetch: reads not yet planned are dropped with their slots, its pins go and
it leaves the share at once; reads already planned land as ordinary blocks.

Counted (:data:`~kvtier.offload.stats.OFFLOAD_COUNTERS`): prefetches started,
completed, cancelled and expired; blocks prefetched, and of them those the
engine later loaded or that were evicted first (wasted reads); per request, the
seconds its reads ran while it waited (``prefetch_covered_seconds``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.config.model import PrefetchConfig
from kvtier.index.base import BlockKey
from kvtier.offload.setup import ManagerSetup
from kvtier.offload.stats import Counters


@dataclass
class Prefetch:
    """One waiting request's prefetch."""

    arrived_at: float
    batches: set[int]
    """Its promotions (one per kv-cache group) not reported by every rank yet."""
    slots: int
    """Host slots it counts against the share: asked about by probes in flight, reserved for
    reads in flight, or pinned."""
    start: int
    """The request's first block (counted from its prompt's start) the prefetch asked for."""
    end: int
    """The block after the last one it asked for."""
    pinned: list[BlockKey] = field(default_factory=list)
    short: bool = False
    """Some rank found fewer blocks than were asked for: from :attr:`start` on, the tiers hold
    no more of the prefix."""
    rest_from: int | None = None
    """From which block its request's lookup promoted what it still missed."""
    ahead: bool = False
    """Its request's lookup promoted the blocks from :attr:`end` on while its reads ran."""
    read_at: float | None = None
    """When its last read was reported."""
    looked_up: bool = False
    """Its request's first lookup came."""
    gave_up: bool = False
    """A lookup stopped waiting for its reads (it expired)."""
    judged: bool = False
    """The cost guard said whether its reads in flight are worth a lookup's wait."""


class Prefetches:
    """The prefetches of waiting requests, their share of the host tier and their counts."""

    def __init__(self, setup: ManagerSetup, counters: Counters) -> None:
        config = setup.prefetch or PrefetchConfig()
        self.setup = setup
        self.counters = counters
        self.enabled = config.policy != "off"
        self.policy = config.policy
        self.timeout_s = config.timeout_s
        self.share = int(config.max_host_share * setup.index.num_slots)
        """The most host slots prefetches of waiting requests hold at once."""
        self.waiting: dict[str, Prefetch] = {}
        self.reserved = 0
        """Host slots held for waiting requests now (within :attr:`share`)."""
        self.kept = 0
        """Host hits pinned for lookups that wait for the rest (within the share too)."""
        self.unused: set[BlockKey] = set()
        """Blocks prefetched and readable that the engine has not loaded yet."""
        self.queued: dict[str, None] = {}
        """Requests that arrived and were not allocated yet, in arrival order."""
        self.cut: dict[str, tuple[Sequence[bytes], int, int]] = {}
        """Waiting requests the share left short of their blocks, in arrival order, with their
        block hashes, computed tokens and tokens."""

    @property
    def room(self) -> int:
        """Host slots a new prefetch (or a waiting lookup's hits) may still take."""
        return self.share - self.reserved - self.kept

    def behind(self, request_id: str) -> bool:
        """Whether requests that arrived before ``request_id`` still wait for their turn."""
        return next(iter(self.queued), request_id) != request_id

    @property
    def refill_due(self) -> bool:
        """Whether a request the share left short waits and room came free for it."""
        return bool(self.cut) and self.room >= self.setup.num_groups

    def started(
        self, request_id: str, batch_ids: Iterable[int], slots: int, start: int, end: int
    ) -> None:
        """Probes of ``slots`` blocks, the request's blocks ``start`` to ``end``, were
        planned for the arriving ``request_id``: they count against the share as if reserved
        until answered."""
        self.waiting[request_id] = Prefetch(self.setup.clock(), set(batch_ids), slots, start, end)
        self.reserved += slots
        self.counters.add("prefetches_started", 1)

    def extended(self, request_id: str, batch_ids: Iterable[int], slots: int, end: int) -> None:
        """The prefetch of ``request_id`` goes on up to its block ``end`` with probes (or
        reads) of ``slots`` blocks, counted as :meth:`started` counts them."""
        prefetch = self.waiting[request_id]
        prefetch.batches.update(batch_ids)
        prefetch.slots += slots
        prefetch.end = end
        self.reserved += slots

    def probed(
        self,
        request_id: str,
        probe_id: int,
        batch_ids: Iterable[int],
        asked: int,
        slots: int,
        *,
        short: bool,
    ) -> None:
        """The probe ``probe_id`` of ``asked`` slots' blocks of a waiting request was
        answered: reads of ``slots`` reserved slots were planned (``batch_ids``); ``short``:
        the tiers hold fewer blocks than were asked about."""
        prefetch = self.waiting[request_id]
        prefetch.batches.discard(probe_id)
        prefetch.batches.update(batch_ids)
        prefetch.slots += slots - asked
        self.reserved += slots - asked
        prefetch.short |= short
        self._complete(prefetch)

    def landed(self, request_id: str, batch_id: int, found: Sequence[BlockKey], asked: int) -> None:
        """Every rank reported a prefetch's promotion, which found the first ``found`` of its
        ``asked`` blocks: pin them for the request if it still waits for them."""
        self.unused.update(found)
        self.counters.add("prefetched_blocks", len(found))
        prefetch = self.waiting.get(request_id)
        if prefetch is None or batch_id not in prefetch.batches:
            return
        prefetch.batches.discard(batch_id)
        prefetch.short |= len(found) < asked
        if prefetch.gave_up:
            return
        kept = len(found)
        if found:
            self.setup.index.pin(found)
            prefetch.pinned.extend(found)
        prefetch.slots -= asked - kept
        self.reserved -= asked - kept
        self._complete(prefetch)

    def _complete(self, prefetch: Prefetch) -> None:
        if not prefetch.batches:
            if prefetch.read_at is None:  # once, however often it went on
                self.counters.add("prefetches_completed", 1)
            prefetch.read_at = self.setup.clock()

    def waits(self, request_id: str, reading: bool, pays: Callable[[], bool]) -> bool:
        """Whether a lookup of ``request_id`` waits for its prefetch; ``reading``: some of its
        reads are still in flight, then ``pays`` says (asked once) whether they are worth
        waiting for (:meth:`CostGuard.worth_waiting
        <kvtier.offload.costguard.CostGuard.worth_waiting>`). A lookup that stops waiting for
        reads expires it."""
        prefetch = self.waiting.get(request_id)
        if prefetch is None or prefetch.gave_up:
            return reading
        now = self.setup.clock()
        if not prefetch.looked_up:
            prefetch.looked_up = True
            read_at = now if prefetch.batches or prefetch.read_at is None else prefetch.read_at
            counters = self.counters
            counters.observe(
                counters.observations.prefetch_covered_seconds, read_at - prefetch.arrived_at
            )
        if not reading:
            return False
        if self.policy == "wait_complete" or (
            self.policy == "timeout" and now < prefetch.arrived_at + self.timeout_s
        ):
            if prefetch.judged:
                return True
            prefetch.judged = True
            if pays():
                return True
        prefetch.gave_up = True
        self.counters.add("prefetches_expired", 1)
        in_flight = prefetch.slots - len(prefetch.pinned)
        prefetch.slots -= in_flight
        self.reserved -= in_flight
        return False

    def rest_ahead(self, request_id: str, wanted_end: int) -> int | None:
        """A lookup that waits for the prefetch's reads wants the request's blocks up to
        ``wanted_end``: from which block to promote at once, beside those reads, what the
        share left out (``None``: nothing, or asked already). Once."""
        prefetch = self.waiting[request_id]
        if prefetch.ahead or prefetch.rest_from is not None or prefetch.end >= wanted_end:
            return None
        prefetch.ahead = True
        return prefetch.end

    def rest_wanted(self, request_id: str, missing_from: int, *, written: bool) -> bool:
        """Whether a lookup that still misses blocks from the request's block ``missing_from``
        on should promote them: those the prefetch had no room for, or that left the
        engine's or the host tier's cache since. Once, unless the engine lost blocks before
        those since; and not from where a probe found the tiers hold no more or a promotion
        beside the prefetch asked already, unless ``written``: this engine wrote the first
        missing block down the chain (another request computed it after the probe, and it
        left the host tier since)."""
        prefetch = self.waiting.get(request_id)
        if prefetch is None or prefetch.batches:
            return False
        if prefetch.rest_from is not None and missing_from >= prefetch.rest_from:
            return False
        if not written and (
            (prefetch.short and missing_from >= prefetch.start)
            or (prefetch.ahead and missing_from >= prefetch.end)
        ):
            return False
        prefetch.rest_from = missing_from
        return True

    def release(self, request_id: str, *, cancelled: bool) -> bool:
        """The request was allocated (or preempted), or finished: unpin its blocks and leave
        the share. ``cancelled``: it finished before being allocated. Whether it had one."""
        prefetch = self.waiting.pop(request_id, None)
        if prefetch is None:
            return False
        if prefetch.pinned:
            self.setup.index.unpin(prefetch.pinned)
        self.reserved -= prefetch.slots
        if cancelled:
            self.counters.add("prefetches_cancelled", 1)
        return True

    def used(self, keys: Iterable[BlockKey]) -> None:
        """The engine loads these blocks from the host tier."""
        unused = self.unused
        count = 0
        for key in keys:
            if key in unused:
                unused.discard(key)
                count += 1
        if count:
            self.counters.add("prefetched_used_blocks", count)

    def evicted(self, keys: Iterable[BlockKey]) -> None:
        """These blocks left the host tier."""
        unused = self.unused
        count = 0
        for key in keys:
            if key in unused:
                unused.discard(key)
                count += 1
        if count:
            self.counters.add("prefetched_unused_blocks", count)

    def reset(self) -> None:
        """A reset forgets every block: pinned ones leave the tier as their pins end."""
        pinned = [key for prefetch in self.waiting.values() for key in prefetch.pinned]
        if pinned:
            self.setup.index.discard(pinned)
        self.unused.clear()
