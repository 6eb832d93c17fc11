"""Moves blocks between the host tier and the tiers below it, and keeps what a close owes them.

A :class:`TierMover` is the part of an :class:`~kvtier.offload.OffloadWorker`
that talks to the rank's :class:`~kvtier.tiers.chain.TierChain`. Each step, in
this order:

1. :meth:`TierMover.check` — before a plan is accepted: its lower-tier moves
   name host slots that exist.
2. :meth:`TierMover.write_down` — copy the plan's demotions and write-throughs
   out of their slots (the plan's stores and promotions may reuse them) and
   queue them to the tiers named.
3. :meth:`TierMover.promote` — start reading the plan's promotions down the chain
   (and asking the tiers what they hold, for its probes).
4. :meth:`TierMover.poll` — write the records of each read that ended into its
   slots; note what each probe that ended found.
5. :meth:`TierMover.take_outcomes` — the promotions that ended and what the
   tiers counted, stored and removed since the last call, for the worker's report.

The write-back ledger: with ``write_back`` or ``write_through`` tiers, the mover
keeps, per host slot, the block it holds and the tiers that lack it (see
:mod:`~kvtier.offload.moves` for which). A completed store owes its blocks
(:meth:`TierMover.owe_stored`), a write-through or a demotion pays them, and a
new copy into a slot forgets them (:meth:`TierMover.forget`).
:meth:`TierMover.close` writes what is still owed, for at most
``flush_deadline_s``, then closes the chain.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

from kvtier.offload.copies import check_slots
from kvtier.offload.messages import Demotion, Promotion, Transfer, TransferPlan
from kvtier.offload.stats import FLUSH_COUNTERS
from kvtier.tiers.base import PutResult
from kvtier.tiers.chain import Fetch, Presence, TierBlock, TierChain
from kvtier.tiers.host import HostTier

logger = logging.getLogger(__name__)

IDLE_FETCH_WAIT_S = 0.002
"""Longest wait for a lower-tier read in flight in a step the engine computes nothing in
(:attr:`TransferPlan.idle`). Such steps follow each other at once, and on a loop of them
the tiers' threads got the interpreter once per switch interval (5 ms): reading 128 disk
records back took 0.26 to 0.58 s instead of 10 to 20 ms."""

FLUSH_BATCH_BLOCKS = 64
"""Blocks per put of a graceful close's flush; ``flush_deadline_s`` is checked between puts."""


class TierOutcomes(NamedTuple):
    """What the lower tiers did since the last :meth:`TierMover.take_outcomes` (the fields
    of a :class:`~kvtier.offload.messages.WorkerReport` they fill)."""

    promoted: dict[int, tuple[int, int]]
    tier_counts: dict[str, dict[str, int]]
    tier_stored: dict[TierBlock, int]
    tier_removed: dict[TierBlock, int]
    read_times: dict[str, tuple[tuple[int, float], ...]]
    tier_gauges: dict[str, dict[str, int]]


class TierMover:
    """One rank's promotions, demotions and write-throughs, and its write-back ledger."""

    def __init__(self, chain: TierChain, tier: HostTier, *, clock: Callable[[], float]) -> None:
        """Move blocks between ``tier``'s slots and ``chain`` (closed with the mover).

        ``clock`` (monotonic seconds) bounds the flush of :meth:`close`.
        """
        self.chain = chain
        self._num_slots = tier.num_slots
        self._host_bytes = tier.buffer.numpy()
        self._clock = clock
        self._fetches: dict[int, tuple[Promotion, Fetch]] = {}
        self._probes: dict[int, Presence] = {}
        self._promoted: dict[int, tuple[int, int]] = {}
        # Per host slot, the block it holds, the tiers that lack it (by position), and the
        # salt of its tenant (empty for none).
        self._owed: dict[int, tuple[int, bytes, tuple[int, ...], bytes]] = {}
        self._sent_gauges = {name: dict(each) for name, each in chain.gauges.items()}
        self.flush_counts: dict[str, dict[str, int]] = {}
        """Per write_back or write_through tier, what :meth:`close` wrote of the blocks it
        lacked (``FLUSH_COUNTERS`` names the counts)."""

    @property
    def idle(self) -> bool:
        """Whether no promotion or probe is running or waiting to be reported.

        The tiers' own threads are not part of it: they finish writes and count
        on their own, so a worker with lower tiers asks them every step."""
        return not (self._fetches or self._probes or self._promoted)

    def check(self, plan: TransferPlan) -> None:
        """Raise ``ValueError`` if one of the plan's lower-tier moves names a missing slot."""
        for message in (*plan.promotions, *plan.demotions, *plan.write_throughs):
            check_slots(message.host_slots, self._num_slots, "promotion or lower-tier write")

    def write_down(self, plan: TransferPlan) -> None:
        """Copy the blocks to write down the chain out of their slots and queue them; evicted
        blocks are no longer owed to any tier."""
        for write in plan.write_throughs:
            self._write_down(write)
            if self._owed:
                self._written(write)
        for demotion in plan.demotions:
            self._write_down(demotion)
            self.forget(demotion.host_slots)

    def forget(self, slots: Sequence[int]) -> None:
        """The blocks in ``slots`` are about to be replaced: they are owed to no tier."""
        if self._owed:
            for slot in slots:
                self._owed.pop(slot, None)

    def owe_stored(self, transfer: Transfer) -> None:
        """Owe the blocks a completed store wrote to the write_back and write_through tiers
        (a store carries its hashes only when there are such tiers)."""
        tiers = self.chain.flushed_tiers
        if not (tiers and transfer.block_hashes):
            return
        group = transfer.group
        salts = transfer.salts or (None,) * len(transfer.block_hashes)
        for slot, block_hash, salt in zip(
            transfer.host_slots, transfer.block_hashes, salts, strict=True
        ):
            self._owed[slot] = (group, block_hash, tiers, salt or b"")

    def promote(self, promotions: Sequence[Promotion]) -> None:
        """Start reading each promotion's blocks down the chain, for its slots, or asking the
        tiers which of a probe's blocks they hold."""
        for promotion in promotions:
            if not promotion.host_slots:
                self._probes[promotion.batch_id] = self.chain.probe(
                    promotion.group, promotion.block_hashes, promotion.skip_tiers, promotion.salt
                )
                continue
            self.forget(promotion.host_slots)
            fetch = self.chain.fetch(
                promotion.group, promotion.block_hashes, promotion.skip_tiers, promotion.salt
            )
            self._fetches[promotion.batch_id] = (promotion, fetch)

    def poll(self, idle_step: bool) -> None:
        """Write the leading blocks of each read that ended into its slots; keep what each
        probe that ended found.

        In an ``idle_step`` (the engine computes nothing), first wait up to
        :data:`IDLE_FETCH_WAIT_S` for the oldest read (or probe), so that the tiers' threads
        run.
        """
        if not (self._fetches or self._probes):  # most steps
            return
        if idle_step:
            oldest = (
                next(iter(self._fetches.values()))[1]
                if self._fetches
                else next(iter(self._probes.values()))
            )
            oldest.wait(IDLE_FETCH_WAIT_S)
        for batch_id, presence in list(self._probes.items()):
            if presence.done:
                del self._probes[batch_id]
                self._promoted[batch_id] = (1, presence.held)
        for batch_id, (promotion, fetch) in list(self._fetches.items()):
            if not fetch.done:
                continue
            del self._fetches[batch_id]
            for slot, record in zip(promotion.host_slots, fetch.records, strict=False):
                self._host_bytes[slot] = memoryview(record).cast("B")
            self._promoted[batch_id] = (1, len(fetch.records))
            self._owe_promoted(promotion, fetch)

    def take_outcomes(self) -> TierOutcomes | None:
        """The promotions that ended and the tiers' counts, stores, removals and read times
        since the last call, or ``None`` when there are none; the tiers' gauges when they
        changed since they were last handed out or are not all 0 (a tier still running
        requests keeps the scheduler stepping until their counts are reported)."""
        chain = self.chain
        counts = chain.take_counts()
        gauges = {name: dict(each) for name, each in chain.gauges.items()}
        if gauges == self._sent_gauges and not any(any(each.values()) for each in gauges.values()):
            gauges = {}
        else:
            self._sent_gauges = gauges
        stored, removed = chain.take_blocks()
        read_times = chain.take_read_times() if chain.read_times else {}
        promoted = self._promoted
        if not (promoted or counts or stored or removed or read_times or gauges):
            return None
        self._promoted = {}
        return TierOutcomes(promoted, counts, stored, removed, read_times, gauges)

    def close(self, flush_deadline_s: float) -> None:
        """Write the owed blocks to the tiers lacking them for at most ``flush_deadline_s``,
        then close the chain; promotions still reading are dropped.

        The flush writes in puts of :data:`FLUSH_BATCH_BLOCKS`, each waited for;
        once the deadline passed, the rest are skipped. Both are counted in
        :attr:`flush_counts` and logged.
        """
        started = self._clock()
        puts = self._flush_owed(started + flush_deadline_s) if self._owed else []
        self._fetches.clear()  # their slots are never read again
        self._probes.clear()
        self.chain.close()
        if not self.flush_counts:
            return
        for name, put in puts:  # every put ended: the tiers finished their queues
            self.flush_counts[name]["flushed_blocks"] += sum(put.result().stored)
        logger.info(
            "wrote the host tier's blocks to the lower tiers lacking them in %.2f s: %s",
            self._clock() - started,
            "; ".join(
                f"{name}: {row['flushed_blocks']} written, {row['flush_skipped_blocks']} "
                f"skipped at flush_deadline_s={flush_deadline_s:g}"
                for name, row in self.flush_counts.items()
            ),
        )

    def _write_down(self, write: Demotion) -> None:
        if not write.tiers:
            return  # an evicted block no tier writes back
        records = [self._host_bytes[slot].tobytes() for slot in write.host_slots]
        self.chain.store(write.group, write.block_hashes, records, write.tiers, write.salt)

    def _written(self, write: Demotion) -> None:
        """The blocks of ``write`` are no longer owed to its tiers."""
        for slot in write.host_slots:
            owed = self._owed.get(slot)
            if owed is None:
                continue
            group, block_hash, tiers, salt = owed
            lacking = tuple(p for p in tiers if p not in write.tiers)
            if lacking:
                self._owed[slot] = (group, block_hash, lacking, salt)
            else:
                del self._owed[slot]

    def _owe_promoted(self, promotion: Promotion, fetch: Fetch) -> None:
        """Owe the promoted blocks to the write_back tiers searched before the one that had
        each (they lacked it)."""
        policies = self.chain.write_policies
        back = [p for p in self.chain.flushed_tiers if policies[p] == "write_back"]
        if not back:
            return
        positions = {name: position for position, (name, _) in enumerate(self.chain.tiers)}
        for slot, block_hash, source in zip(
            promotion.host_slots, promotion.block_hashes, fetch.sources, strict=False
        ):
            lacking = tuple(p for p in back if p < positions[source])
            if lacking:
                self._owed[slot] = (promotion.group, block_hash, lacking, promotion.salt or b"")

    def _flush_owed(self, until: float) -> list[tuple[str, Future[PutResult]]]:
        """Write the owed blocks down the chain until ``until``; count the skipped ones in
        :attr:`flush_counts` and return the puts, per tier name."""
        batches: dict[tuple[int, tuple[int, ...], bytes], list[tuple[bytes, int]]] = {}
        for slot, (group, block_hash, tiers, salt) in self._owed.items():
            batches.setdefault((group, tiers, salt), []).append((block_hash, slot))
        self._owed = {}
        counts = {
            self.chain.tiers[p][0]: {counter.name: 0 for counter in FLUSH_COUNTERS}
            for p in self.chain.flushed_tiers
        }
        puts: list[tuple[str, Future[PutResult]]] = []
        for (group, tiers, salt), blocks in sorted(batches.items()):
            names = [self.chain.tiers[p][0] for p in tiers]
            for start in range(0, len(blocks), FLUSH_BATCH_BLOCKS):
                batch = blocks[start : start + FLUSH_BATCH_BLOCKS]
                left = until - self._clock()
                if left <= 0:
                    for name in names:
                        counts[name]["flush_skipped_blocks"] += len(batch)
                    continue
                records = [self._host_bytes[slot].tobytes() for _, slot in batch]
                hashes = [block_hash for block_hash, _ in batch]
                futures = self.chain.store(group, hashes, records, tiers, salt or None)
                # a put still running at the deadline ends while the tier closes
                concurrent.futures.wait(futures, timeout=left)
                puts.extend(zip(names, futures, strict=True))
        self.flush_counts = counts
        return puts
