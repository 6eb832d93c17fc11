"""Owns the moves between the host tier and the tiers below it: promotions and writes.

A lookup that misses in the host tier plans a *promotion* of the missing
blocks in two rounds: a probe asks the workers how many of them the lower tiers
hold, reading none; then host slots are reserved for those (evicting host blocks
only for blocks that exist below), workers read them into the slots, and the
blocks every worker found become host hits. A miss in every tier thus costs
the host tier nothing, at the price of one more report before a hit is read.

Blocks go down the chain as each lower tier's write policy
(:data:`~kvtier.models.WritePolicy`) says, each at most once per tier while it
stays in the host tier. The next plan has workers copy them out of their
slots, before anything reuses the slots, and queue them to the tiers named:

- a store made readable is *written through* to the ``write_through`` tiers;
- a block the engine loads from the host tier for the first time (a reuse) is
  written through to the ``write_through_admitted`` tiers;
- a block the host tier evicts is *demoted* to the ``write_back`` tiers.

A block promoted from below is never written through: it is held below
already (whoever stored it wrote it through), and written back on eviction as
a stored one is (a disk tier skips a record it holds).

With ``write_back`` or ``write_through`` tiers, stores carry their blocks'
hashes, and a worker keeps, per slot, the tiers its block is owed to: a
graceful close (:meth:`~kvtier.offload.worker.OffloadWorker.close`) writes the
blocks still in their slots to the ``write_back`` tiers, and to the
``write_through`` tiers the blocks whose write-through no plan carried yet (the
engine's last stores are made readable by its last report, and no plan
follows). A write-through, a demotion, a new copy into the slot or a reset (a
demotion to no tier) settles what a slot owes.
Every write is a put on a tier's bounded queue: a full queue drops it, counted
by the tier, and it is not tried again.

A promotion may also start when a request arrives, before its first lookup: a
*prefetch*, bounded and answered as :mod:`~kvtier.offload.prefetch` says.

The :mod:`~kvtier.offload.costguard` names the tiers a promotion must not read
(predicted slower than recomputing its blocks); when it names all of them, the
blocks are not promoted and the request computes them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.index.base import BlockKey
from kvtier.offload.costguard import CostGuard
from kvtier.offload.failures import FailureCause
from kvtier.offload.ledger import BatchLedger
from kvtier.offload.messages import Demotion, Promotion, WorkerReport
from kvtier.offload.prefetch import Prefetches
from kvtier.offload.setup import ManagerSetup
from kvtier.offload.stats import Counters

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


WRITTEN_KEYS = 1 << 16
"""Blocks this engine last wrote down the chain that a promotion reads without probing first
(about 6 MiB of keys)."""

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
        # Blocks promoted for a request whose lookup waited for them, pinned until it is
        # allocated or finished.
        self._pinned: dict[str, list[BlockKey]] = {}
        # Answered probes whose blocks found no free host slot yet, by request.
        self._unread: dict[str, PromotionBatch] = {}
        # Slots of readable blocks, to find an evicted block's bytes.
        self._slots: dict[BlockKey, int] = {}
        # Readable blocks a reuse does not write through again: written already, or promoted.
        self._reused: set[BlockKey] = set()
        # Blocks to write in the next plan, with the slot that still holds each and the
        # positions of the tiers to write: evicted ones (demotions), kept ones (write-throughs).
        self.demotions: dict[BlockKey, tuple[int, tuple[int, ...]]] = {}
        self.write_throughs: dict[BlockKey, tuple[int, tuple[int, ...]]] = {}
        # The blocks last written down the chain (at most WRITTEN_KEYS), with their salts.
        self._written: OrderedDict[BlockKey, bytes] = OrderedDict()

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
        """Whether writes, promotions or reads to try again wait for the next plan."""
        return bool(self.demotions or self.write_throughs or self._to_plan or self._unread)

    def wait_for(self, request_id: str, wanted: Sequence[bytes], hits: int, first: int) -> bool:
        """Whether a lookup that found ``hits`` of ``wanted`` (from the request's block
        ``first`` on) must be asked again later.

        A request's first host miss starts a promotion of the missing blocks (a
        probe, then a read of those found, as many as host slots can be reserved
        for) and the answer is "later" until every worker reported both; then the
        blocks found are host hits, kept for the request until it is allocated. One
        promotion per request: later lookups answer from the host tier. A request
        prefetched at its arrival waits as the prefetch policy says, then promotes
        what its prefetch had no room for.
        """
        waiting = self._promoting.get(request_id)
        if waiting is None:
            return hits < len(wanted) and bool(self._promote(request_id, wanted, hits))
        missing = hits < len(wanted)
        prefetches = self.prefetches
        if request_id in prefetches.waiting:
            if prefetches.waits(request_id, missing and bool(waiting)):
                return True
            waiting.clear()  # reads it stopped waiting for land as ordinary blocks
            self._unread.pop(request_id, None)
            if missing and prefetches.rest_wanted(request_id, first + hits):
                return bool(self._promote(request_id, wanted, hits))
        return missing and bool(waiting)

    def prefetch(self, request_id: str, wanted: Sequence[bytes], hits: int, first: int) -> None:
        """The request arrived and the host tier holds ``hits`` of its ``wanted`` blocks (from
        its block ``first`` on): start promoting the rest, within the prefetches' share of the
        host tier."""
        prefetches = self.prefetches
        room = prefetches.room // self.setup.num_groups
        if room <= 0 or hits >= len(wanted) or request_id in self._promoting:
            return
        count = self._promote(request_id, wanted, hits, limit=room)
        if count is None:
            return  # the cost guard decided for the request: its lookups answer from the host
        if count == 0:
            del self._promoting[request_id]  # its first lookup promotes as without prefetch
            return
        prefetches.started(
            request_id, self._promoting[request_id], count * self.setup.num_groups, first + hits
        )

    def forget(self, request_id: str, *, finished: bool = False) -> None:
        """The request was allocated, preempted or ``finished``: its next lookup may promote
        again; its prefetch ends (one that finished first is cancelled)."""
        self._promoting.pop(request_id, None)
        self._unread.pop(request_id, None)
        pinned = self._pinned.pop(request_id, None)
        if pinned:
            self.setup.index.unpin(pinned)
        if self.prefetches.release(request_id, cancelled=finished) and finished:
            self._unplan(request_id)

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
        self, request_id: str, wanted: Sequence[bytes], hits: int, limit: int | None = None
    ) -> int | None:
        """Probe the lower tiers for ``wanted[hits:]`` (at most ``limit`` blocks, for a
        prefetch): once every worker said how many leading blocks they hold, host slots are
        reserved for those and their read planned (:meth:`_read`). A block no tier holds
        takes no slot and evicts nothing. How many blocks were asked about (``None``: the
        cost guard found no tier worth reading)."""
        setup = self.setup
        self._promoting[request_id] = set()
        if setup.windowed:
            return 0  # a windowed group's hit needs other blocks than the prefix's
        missing = wanted[hits:] if limit is None else wanted[hits : hits + limit]
        skip = self.guard.skipped_tiers(len(missing))
        if skip and len(skip) == len(self.guard.tier_names):
            return None
        salt = self.ledger.requests.salts.get(request_id)
        if self._written_down(missing, salt):
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

    def _written_down(self, block_hashes: Sequence[bytes], salt: bytes | None) -> bool:
        """Whether this engine wrote every one of the blocks down the chain lately, for the
        tenant of ``salt``: their promotion reads them at once instead of probing first (a
        tier that dropped or evicted one since answers a read finding fewer)."""
        written, salt = self._written, salt or b""
        return bool(written) and all(
            written.get(key) == salt for key in self.setup.namespace.keys(block_hashes, 0)
        )

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
        self._unread[request_id] = probe
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
        del self._unread[request_id]
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

    def take_demotions(self) -> tuple[Demotion, ...]:
        """Blocks evicted since the last plan, per group and tiers, with the slots that still
        hold them."""
        if not self.demotions:
            return ()
        self.counters.add("demoted_blocks", sum(bool(t) for _, t in self.demotions.values()))
        return self._messages(self.demotions, evicted=True)

    def take_write_throughs(self) -> tuple[Demotion, ...]:
        """Blocks to write through since the last plan, per group and tiers, with their slots."""
        if not self.write_throughs:
            return ()
        self.counters.add("written_through_blocks", len(self.write_throughs))
        return self._messages(self.write_throughs, evicted=False)

    def _messages(
        self, writes: dict[BlockKey, tuple[int, tuple[int, ...]]], *, evicted: bool
    ) -> tuple[Demotion, ...]:
        """``writes`` as one message per group, tiers and tenant salt; empties ``writes``.
        The salts of ``evicted`` blocks are forgotten."""
        batches: dict[tuple[int, tuple[int, ...], bytes], tuple[list[bytes], list[int]]] = {}
        block_salts = self.ledger.requests.block_salts
        salt_of = block_salts.pop if evicted else block_salts.get
        written = self._written
        for key, (slot, tiers) in writes.items():
            group, block_hash = self.setup.namespace.split(key)
            salt = salt_of(key, b"") if block_salts else b""
            hashes, slots = batches.setdefault((group, tiers, salt), ([], []))
            hashes.append(block_hash)
            slots.append(slot)
            if tiers:
                written[key] = salt
                written.move_to_end(key)
        while len(written) > WRITTEN_KEYS:
            written.popitem(last=False)
        writes.clear()
        return tuple(
            Demotion(group, tuple(hashes), tuple(slots), tiers, salt or None)
            for (group, tiers, salt), (hashes, slots) in sorted(batches.items())
        )

    def settle(self, committed: Iterable[tuple[Sequence[BlockKey], Sequence[int]]]) -> None:
        """After the ledger settled the reports: remember the slots of the stores made
        readable (``committed``), to write them down the chain; expire late promotions."""
        setup = self.setup
        if setup.lower_tiers:
            through = setup.through_tiers
            for keys, slots in committed:
                self._slots.update(zip(keys, slots, strict=True))
                if through:
                    self.write_throughs.update(
                        (key, (slot, through)) for key, slot in zip(keys, slots, strict=True)
                    )
        self._expire()

    def reused(self, keys: Iterable[BlockKey]) -> None:
        """The engine loads these readable blocks from the host tier: write the ones not
        written yet through to the ``write_through_admitted`` tiers."""
        if self.prefetches.unused:
            self.prefetches.used(keys)
        tiers = self.setup.reuse_tiers
        if not tiers:
            return
        for key in keys:
            slot = self._slots.get(key)
            if slot is None or key in self._reused:
                continue
            self._reused.add(key)
            planned = self.write_throughs.get(key)
            self.write_throughs[key] = (slot, tiers if planned is None else planned[1] + tiers)

    def evicted(self, keys: Sequence[BlockKey]) -> None:
        """The index's eviction sink: ``keys`` left the host tier. The ledger counts them;
        those whose slots are known are demoted by the next plan."""
        self.ledger.count_evicted(keys)
        if self.prefetches.unused:
            self.prefetches.evicted(keys)
        if not self.setup.lower_tiers:
            return
        slots, reused, demotions = self._slots, self._reused, self.demotions
        back, block_salts = self.setup.back_tiers, self.ledger.requests.block_salts
        for key in keys:
            slot = slots.pop(key, None)
            if slot is not None:
                reused.discard(key)
                if back:
                    demotions[key] = (slot, back)
                    continue  # its salt goes with its demotion
            if block_salts:
                block_salts.pop(key, None)

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
            self._slots.update(zip(found, message.host_slots, strict=False))
            if self.setup.reuse_tiers:
                self._reused.update(found)
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
        """A reset forgets blocks; it does not move them down the chain.

        With ``write_back`` or ``write_through`` tiers, every block the workers may still
        write on closing leaves as a demotion to no tier, so that none of them is written.
        """
        self.prefetches.reset()
        self._unread.clear()
        self._written.clear()
        pinned = [key for keys in self._pinned.values() for key in keys]
        if pinned:  # they leave the tier as their requests' pins end
            self.setup.index.discard(pinned)
        forgotten = {key: slot for key, (slot, _) in self.demotions.items()}
        forgotten.update(self._slots)
        self.demotions.clear()
        if self.setup.back_tiers or self.setup.through_tiers:
            self.demotions.update((key, (slot, ())) for key, slot in forgotten.items())
        self._slots.clear()
        self._reused.clear()
        self.write_throughs.clear()
        self.ledger.requests.block_salts.clear()  # what is demoted now goes to no tier
