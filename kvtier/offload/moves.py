"""Owns the moves between the host tier and the tiers below it: promotions and writes.

A lookup that misses in the host tier plans a *promotion* of the missing
blocks in two rounds: a probe asks the workers how many of them the lower tiers
hold, reading none; then host slots are reserved for those (evicting host blocks
only for blocks that exist below), workers read them into the slots, and the
blocks every worker found become host hits. A miss in every tier thus costs
the host tier nothing, at the price of one more report before a hit is read.

Blocks go down the chain as :mod:`~kvtier.offload.writes` says.

A promotion may also start when a request arrives, before its first lookup: a
*prefetch*, bounded and answered as :mod:`~kvtier.offload.prefetch` says.

The :mod:`~kvtier.offload.costguard` names the tiers a promotion must not read
(predicted slower than recomputing its blocks); when it names all of them, the
blocks are not promoted and the request computes them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.index.base import BlockKey
from kvtier.offload.costguard import CostGuard
from kvtier.offload.failures import FailureCause
from kvtier.offload.ledger import BatchLedger
from kvtier.offload.messages import Promotion, WorkerReport
from kvtier.offload.prefetch import Prefetches
from kvtier.offload.setup import ManagerSetup
from kvtier.offload.stats import Counters
from kvtier.offload.writes import LowerTierWrites

logger = logging.getLogger(__name__)


@dataclass
class PromotionBatch:
    """A promotion in flight: one request's blocks of one group, read into reserved slots."""

    message: Promotion
    keys: tuple[BlockKey, ...]
    request_id: str
    planned_at: float
    reported: int = 0
    found: int = 0
    expired: bool = False
    prefetch: bool = False
    probed: tuple[Sequence[bytes], int] | None = None
    """For a probe (no keys, no slots): the request's wanted blocks and its host hits then."""
    tries: int = 0
    """For an answered probe: the reads of what it found tried so far."""


READ_TRIES = 4
"""Plans of steps that compute something at which a read that found no free host slot for the
blocks its probe found is tried again before its request computes them (it is tried at every
plan; steps that compute nothing come in quick succession and do not count)."""


class LowerTierMoves:
    """Promotions in flight and to plan, and the evicted blocks to demote."""

    def __init__(
        self, setup: ManagerSetup, ledger: BatchLedger, counters: Counters, guard: CostGuard
    ) -> None:
        self.setup = setup
        self.ledger = ledger
        self.counters = counters
        self.guard = guard
        self.prefetches = Prefetches(setup, counters)
        self.promotions: dict[int, PromotionBatch] = {}
        self._to_plan: list[Promotion] = []
        # Requests whose lookup waits for promotions (batch ids), or got its answer (empty set).
        self._promoting: dict[str, set[int]] = {}
        # Blocks promoted for a request whose lookup waited for them, and its host hits while
        # it waited, pinned until it is allocated or finished; how many of the latter.
        self._pinned: dict[str, list[BlockKey]] = {}
        self._kept_hits: dict[str, int] = {}
        # Requests whose lookup promoted blocks (not a prefetch): from which of their blocks on.
        self._promoted_from: dict[str, int] = {}
        # Answered probes whose blocks found no free host slot yet, by probe (a request may
        # have two: its prefetch's and its lookup's for the rest).
        self._unread: dict[int, PromotionBatch] = {}
        self.writes = LowerTierWrites(setup, ledger, counters)

    @property
    def idle(self) -> bool:
        """Whether no promotion is in flight and no write or promotion waits for a plan."""
        return not (self.promotions or self.has_work)

    @property
    def unread(self) -> bool:
        """Whether reads wait for a free host slot (:meth:`read_again`)."""
        return bool(self._unread)

    @property
    def has_work(self) -> bool:
        """Whether writes, promotions, reads to try again or prefetches to go on with (room
        came free in the share) wait for the next plan."""
        return bool(
            self.writes.pending or self._to_plan or self._unread or self.prefetches.refill_due
        )

    def wait_for(self, request_id: str, wanted: Sequence[bytes], hits: int, first: int) -> bool:
        """Whether a lookup that found ``hits`` of ``wanted`` (from the request's block
        ``first`` on) must be asked again later (:meth:`_waits`). While it waits, the host
        tier's hits stay pinned for the request, until it is allocated or finished: a store
        meanwhile evicts none of the blocks the promoted ones would extend (nor does the
        promotion's own reservation: they are pinned before it). They count against the
        prefetches' share of the host tier; hits past it are not kept."""
        keys: list[BlockKey] = []
        if 0 < hits < len(wanted):  # a lookup waits only for missing blocks
            namespace, known = self.setup.namespace, set(self._pinned.get(request_id, ()))
            keys = [
                key
                for group, window in enumerate(self.setup.windows)
                if window is None
                for key in namespace.keys(wanted[:hits], group)
                if key not in known
            ]
            if len(keys) > self.prefetches.room:
                keys = []
            if keys:
                self.setup.index.pin(keys)
        if self._waits(request_id, wanted, hits, first):
            if keys:
                self._pinned.setdefault(request_id, []).extend(keys)
                self._kept_hits[request_id] = self._kept_hits.get(request_id, 0) + len(keys)
                self.prefetches.kept += len(keys)
            return True
        if keys:
            self.setup.index.unpin(keys)
        return False

    def _waits(self, request_id: str, wanted: Sequence[bytes], hits: int, first: int) -> bool:
        """:meth:`wait_for`, without the pins.

        A request's first host miss starts a promotion of the missing blocks (a
        probe, then a read of those found, as many as host slots can be reserved
        for) and the answer is "later" until every worker reported both; then the
        blocks found are host hits, kept for the request until it is allocated. Later
        lookups answer from the host tier, unless the engine lost blocks before those the
        last promotion started from: those are promoted then. A request prefetched at its
        arrival waits as the prefetch policy says; a lookup that waits for the prefetch's
        reads promotes at once what the prefetch had no room for, beside them.
        """
        prefetches = self.prefetches
        if prefetches.cut:
            prefetches.cut.pop(request_id, None)  # the lookup promotes the rest itself
        waiting = self._promoting.get(request_id)
        missing = hits < len(wanted)
        if waiting is None or (
            missing and not waiting and first + hits < self._promoted_from.get(request_id, 0)
        ):
            if not missing or not self._promote(request_id, wanted, hits):
                return False
            self._promoted_from[request_id] = first + hits
            return True
        if request_id in prefetches.waiting:
            pays = functools.partial(self.guard.worth_waiting, len(wanted) - hits)
            if prefetches.waits(request_id, missing and bool(waiting), pays):
                promotions = self.promotions
                if all(b in promotions and promotions[b].probed is None for b in waiting):
                    ahead = prefetches.rest_ahead(request_id, first + len(wanted))
                    if ahead is not None:
                        self._promote(request_id, wanted, max(ahead - first, hits))
                return True
            waiting.clear()  # reads it stopped waiting for land as ordinary blocks
            self._drop_unread(request_id)
            if missing:
                salt = self.ledger.requests.salts.get(request_id)
                written = self.writes.written_down(wanted[hits : hits + 1], salt)
                if prefetches.rest_wanted(request_id, first + hits, written=written):
                    return bool(self._promote(request_id, wanted, hits))
        return missing and bool(waiting)

    def prefetch(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int,
        num_tokens: int,
    ) -> None:  # fmt: skip
        """The request arrived (or room came free in the share since): start promoting the
        blocks its lookup would want that the host tier lacks, within the prefetches' share of
        the host tier. A request the share leaves short is gone on with in a later plan, in
        arrival order, as room comes free (:meth:`refill`)."""
        cut = self.prefetches.cut
        self.prefetches.queued.setdefault(request_id)
        if self._prefetch(request_id, block_hashes, num_computed_tokens, num_tokens):
            cut[request_id] = (block_hashes, num_computed_tokens, num_tokens)
        else:
            cut.pop(request_id, None)

    def _prefetch(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int,
        num_tokens: int,
    ) -> bool:  # fmt: skip
        """:meth:`prefetch`; whether the share left the request short."""
        prefetches = self.prefetches
        if request_id in self._promoting and request_id not in prefetches.waiting:
            return False  # looked up already (or the cost guard decided): its lookups promote
        first, wanted, hits = self.ledger.requests.hits(
            block_hashes, num_computed_tokens, num_tokens
        )
        prefetch = prefetches.waiting.get(request_id)
        if prefetch is not None:
            if prefetch.looked_up or prefetch.gave_up or prefetch.short:
                return False
            hits = max(hits, prefetch.end - first)
        if hits >= len(wanted):
            return False
        room = prefetches.room // self.setup.num_groups
        if room <= 0:
            return True
        asked = set(self._promoting.get(request_id, ()))
        # behind requests that wait for their turn, its reads run while it queues: the cost
        # guard judges them at its lookup if they still run
        guarded = not prefetches.behind(request_id)
        count = self._promote(request_id, wanted, hits, limit=room, guarded=guarded)
        if count is None:
            return False  # the cost guard decided for the request: its lookups answer from the host
        if count == 0:
            if prefetch is None:
                del self._promoting[request_id]  # its lookup promotes as without prefetch
            return False
        batch_ids = self._promoting[request_id] - asked
        slots, end = count * self.setup.num_groups, first + hits + count
        if prefetch is None:
            prefetches.started(request_id, batch_ids, slots, first + hits, end)
        else:
            prefetches.extended(request_id, batch_ids, slots, end)
        # short of its blocks only if the share was: the host tier's index may make less room
        return count == room and hits + count < len(wanted)

    def refill(self) -> None:
        """Go on with the prefetches the share left short, in arrival order, while room is
        free in it."""
        prefetches = self.prefetches
        while prefetches.refill_due:
            request_id, request = next(iter(prefetches.cut.items()))
            self.prefetch(request_id, *request)

    def forget(self, request_id: str, *, finished: bool = False) -> None:
        """The request was allocated, preempted or ``finished``: its next lookup may promote
        again; its prefetch ends (one that finished first is cancelled)."""
        self._promoting.pop(request_id, None)
        self._promoted_from.pop(request_id, None)
        self._drop_unread(request_id)
        self.prefetches.cut.pop(request_id, None)
        self.prefetches.queued.pop(request_id, None)
        pinned = self._pinned.pop(request_id, None)
        if pinned:
            self.setup.index.unpin(pinned)
        self.prefetches.kept -= self._kept_hits.pop(request_id, 0)
        if self.prefetches.release(request_id, cancelled=finished) and finished:
            self._unplan(request_id)

    def _drop_unread(self, request_id: str) -> None:
        """Forget the request's probes whose reads wait for a free host slot."""
        if self._unread:
            for batch_id in [b for b, p in self._unread.items() if p.request_id == request_id]:
                del self._unread[batch_id]

    def _unplan(self, request_id: str) -> None:
        """Drop the request's prefetch probes and reads no plan carried yet, and free the
        reads' slots."""
        kept = []
        for message in self._to_plan:
            promotion = self.promotions[message.batch_id]
            if promotion.request_id != request_id or not promotion.prefetch:
                kept.append(message)
                continue
            del self.promotions[message.batch_id]
            if promotion.keys:  # a read, not a probe
                for key in promotion.keys:
                    del self.ledger.writing[key]
                self.ledger.give_up(promotion.keys)
        self._to_plan = kept

    def _promote(
        self, request_id: str, wanted: Sequence[bytes], hits: int, limit: int | None = None,
        guarded: bool = True,
    ) -> int | None:  # fmt: skip
        """Probe the lower tiers for ``wanted[hits:]`` (at most ``limit`` blocks, for a
        prefetch): once every worker said how many leading blocks they hold, host slots are
        reserved for those and their read planned (:meth:`_read`). A block no tier holds
        takes no slot and evicts nothing. How many blocks were asked about (``None``: the
        cost guard, if ``guarded``, found no tier worth reading). The request's lookups wait
        for it beside the promotions they wait for already."""
        setup = self.setup
        self._promoting.setdefault(request_id, set())
        if setup.windowed:
            return 0  # a windowed group's hit needs other blocks than the prefix's
        missing = wanted[hits:] if limit is None else wanted[hits : hits + limit]
        skip = self.guard.skipped_tiers(len(missing)) if guarded else frozenset()
        if skip and len(skip) == len(self.guard.tier_names):
            return None
        salt = self.ledger.requests.salts.get(request_id)
        if self.writes.written_down(missing, salt):
            count, batch_ids = self._read(
                request_id, wanted, hits, len(missing), skip, limit is not None
            )
            if batch_ids:
                self._promoting[request_id].update(batch_ids)
                return count
        # the first group's records stand for every group's: a read finding fewer gives up the rest
        message = Promotion(self.ledger.new_batch_id(), 0, tuple(missing), (), skip, salt)
        self.promotions[message.batch_id] = PromotionBatch(
            message, (), request_id, setup.clock(), found=len(missing),
            prefetch=limit is not None, probed=(tuple(wanted), hits),
        )  # fmt: skip
        self._to_plan.append(message)
        self._promoting[request_id].add(message.batch_id)
        return len(missing)

    def _probed(self, probe: PromotionBatch) -> None:
        """Every worker answered ``probe``: read the leading blocks they all hold, if its
        request still waits for it. With no host slot free for them (every one pinned or
        being written), the read is tried again at every plan, for :data:`READ_TRIES` plans
        of steps that compute something and within ``report_deadline_s`` of the probe, and
        the request's lookups wait meanwhile."""
        assert probe.probed is not None
        request_id = probe.request_id
        waiting = self._promoting.get(request_id)
        if waiting is None or probe.message.batch_id not in waiting:
            return  # expired, or the request was allocated or finished meanwhile
        self._unread[probe.message.batch_id] = probe
        self._read_probed(probe, waiting)

    def _read_probed(self, probe: PromotionBatch, waiting: set[int], counted: bool = True) -> None:
        """Try to read what ``probe`` found; once read, or out of tries, it is answered.
        ``counted``: the try counts against :data:`READ_TRIES`."""
        assert probe.probed is not None
        message, request_id = probe.message, probe.request_id
        setup = self.setup
        wanted, hits = probe.probed
        found = wanted[hits : hits + probe.found]
        # the leading blocks another request brought into the host tier since are hits now
        present = min(
            setup.index.lookup(setup.namespace.keys(found, group))
            for group in range(setup.num_groups)
        )
        left = len(found) - present
        count, batch_ids = self._read(
            request_id, wanted, hits + present, left, message.skip_tiers, probe.prefetch
        )
        probe.tries += counted
        late = setup.clock() - probe.planned_at > setup.report_deadline_s
        if not batch_ids and left and probe.tries <= READ_TRIES and not late:
            return
        if count < left:
            self.counters.add("unread_blocks", left - count)
        del self._unread[message.batch_id]
        waiting.discard(message.batch_id)
        waiting.update(batch_ids)
        if probe.prefetch:
            groups = setup.num_groups
            asked = len(message.block_hashes)
            self.prefetches.probed(
                request_id, message.batch_id, batch_ids, asked * groups, count * groups,
                short=probe.found < asked,
            )  # fmt: skip

    def read_again(self, idle: bool) -> None:
        """Try again the reads that found no free host slot, before the plan's stores take the
        slots freed since (waiting requests' hits first); in a step that computes nothing,
        ``idle``, without counting the try."""
        for probe in list(self._unread.values()):
            self._read_probed(probe, self._promoting[probe.request_id], counted=not idle)

    def _read(
        self,
        request_id: str,
        wanted: Sequence[bytes],
        hits: int,
        count: int,
        skip: frozenset[str],
        prefetch: bool,
    ) -> tuple[int, list[int]]:
        """Reserve host slots for ``wanted[hits : hits + count]`` and plan their read from the
        tiers not in ``skip``; how many blocks per group were, and the reads' batch ids."""
        setup = self.setup
        index, namespace = setup.index, setup.namespace
        missing = wanted[hits : hits + count]
        if not missing:
            return 0, []
        reserved: list[tuple[int, list[BlockKey], list[int | None]]] = []
        for group in range(setup.num_groups):
            # blocks of this prefix still in the host tier, before the missing ones or among
            # them, are not the ones to make room with
            index.touch(namespace.keys(wanted, group))
        for group in range(setup.num_groups):
            keys = namespace.keys(missing, group)
            parent = namespace.key(wanted[hits - 1], group) if hits else None
            slots = index.reserve(keys, parent)
            leading = next((i for i, slot in enumerate(slots) if slot is None), len(slots))
            count = min(count, leading)
            reserved.append((group, keys, slots))
        for _, keys, slots in reserved:
            # past the shortest leading run, no group's blocks can make a prefix hit
            extra = [
                key
                for key, slot in zip(keys[count:], slots[count:], strict=True)
                if slot is not None
            ]
            if extra:
                index.abort(extra)
        if count == 0:
            return 0, []
        now = setup.clock()
        salt = self.ledger.requests.salts.get(request_id)
        batch_ids = []
        for group, keys, slots in reserved:
            message = Promotion(
                self.ledger.new_batch_id(),
                group,
                tuple(missing[:count]),
                tuple(slot for slot in slots[:count] if slot is not None),
                skip,
                salt,
            )
            self.promotions[message.batch_id] = PromotionBatch(
                message, tuple(keys[:count]), request_id, now, found=count, prefetch=prefetch
            )
            for key in keys[:count]:
                self.ledger.writing[key] = message.batch_id
            if salt is not None:
                self.ledger.requests.block_salts.update(dict.fromkeys(keys[:count], salt))
            self._to_plan.append(message)
            batch_ids.append(message.batch_id)
        return count, batch_ids

    def take_promotions(self) -> tuple[Promotion, ...]:
        promotions, self._to_plan = tuple(self._to_plan), []
        return promotions

    def settle(self, committed: Iterable[tuple[Sequence[BlockKey], Sequence[int]]]) -> None:
        """After the ledger settled the reports: the stores made readable (``committed``) may
        be written down the chain; expire late promotions."""
        if self.setup.lower_tiers:
            self.writes.committed(committed)
        self._expire()

    def reused(self, keys: Iterable[BlockKey]) -> None:
        """The engine loads these readable blocks from the host tier."""
        if self.prefetches.unused:
            self.prefetches.used(keys)
        if self.setup.reuse_tiers:
            self.writes.reused(keys)

    def evicted(self, keys: Sequence[BlockKey]) -> None:
        """The index's eviction sink: ``keys`` left the host tier. The ledger counts them;
        those whose slots are known are demoted by the next plan."""
        self.ledger.count_evicted(keys)
        if self.prefetches.unused:
            self.prefetches.evicted(keys)
        if self.setup.lower_tiers:
            self.writes.evicted(keys)

    def count(self, reports: Iterable[WorkerReport]) -> None:
        """Add the reports' promotion answers; commit what every worker found."""
        for batch_id, (workers, found) in (
            entry for report in reports for entry in report.promoted.items()
        ):
            promotion = self.promotions.get(batch_id)
            if (
                promotion is None
                or workers <= 0
                or promotion.reported + workers > self.setup.world_size
                or not 0 <= found <= len(promotion.message.block_hashes)
            ):
                self.counters.add("rejected_reports", 1)
                self.counters.failures.failed(
                    FailureCause.REJECTED_REPORT,
                    "ignored a worker report for promotion %s (workers=%s, found=%s): it is not "
                    "in flight or the numbers cannot be right",
                    batch_id,
                    workers,
                    found,
                )
                continue
            promotion.reported += workers
            promotion.found = min(promotion.found, found)
            if promotion.reported == self.setup.world_size:
                self._complete(promotion)

    def _complete(self, promotion: PromotionBatch) -> None:
        message = promotion.message
        del self.promotions[message.batch_id]
        if promotion.probed is not None:
            self._probed(promotion)
            return
        for key in promotion.keys:
            del self.ledger.writing[key]
        found = promotion.keys[: promotion.found]
        if found:
            self.ledger.commit(found)
            self.writes.promoted(found, message.host_slots)
        if promotion.found < len(promotion.keys):
            self.ledger.give_up(promotion.keys[promotion.found :])
        self.counters.add("promoted_blocks", promotion.found)
        if promotion.prefetch:
            self.prefetches.landed(
                promotion.request_id, message.batch_id, found, len(promotion.keys)
            )
        elif found and message.batch_id in self._promoting.get(promotion.request_id, ()):
            # kept for the request until it is allocated, as a prefetch's blocks are
            self.setup.index.pin(found)
            self._pinned.setdefault(promotion.request_id, []).extend(found)
        self._answer(promotion)
        logger.debug(
            "request %s: %d of %d blocks promoted from the lower tiers",
            promotion.request_id,
            promotion.found,
            len(promotion.keys),
        )

    def _answer(self, promotion: PromotionBatch) -> None:
        waiting = self._promoting.get(promotion.request_id)
        if waiting is not None:
            waiting.discard(promotion.message.batch_id)

    def _expire(self) -> None:
        """Answer the lookups of promotions not reported in time; their slots stay reserved."""
        setup = self.setup
        late = setup.clock() - setup.report_deadline_s
        for promotion in self.promotions.values():
            if promotion.expired or promotion.planned_at > late:
                continue
            promotion.expired = True
            self.counters.add("expired_promotions", 1)
            self._answer(promotion)
            self.counters.failures.failed(
                FailureCause.REPORT_DEADLINE,
                "promotion %d of %d blocks was not reported by every worker within "
                "report_deadline_s=%s; request %s recomputes them, and their host slots stay "
                "reserved until every worker reported",
                promotion.message.batch_id,
                len(promotion.keys),
                setup.report_deadline_s,
                promotion.request_id,
            )

    def reset(self) -> None:
        """A reset forgets blocks; it does not move them down the chain
        (:meth:`LowerTierWrites.reset <kvtier.offload.writes.LowerTierWrites.reset>`)."""
        self.prefetches.reset()
        self._unread.clear()
        pinned = [key for keys in self._pinned.values() for key in keys]
        if pinned:  # they leave the tier as their requests' pins end
            self.setup.index.discard(pinned)
        self.writes.reset()
