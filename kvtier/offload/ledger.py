"""Owns the batch ledger: copies in flight, their completion, expiry and quarantined slots.

Every store and load the manager plans is a batch that each of the
``world_size`` workers reports once (done, failed or abandoned). The ledger
counts those reports, rejects impossible ones, and applies a batch's outcome
once every worker reported it or its report deadline passed: a store becomes
readable or is dropped, a load unpins its slots or becomes a recompute. A
failed batch whose copy may still run on some worker keeps its slots in
quarantine until every such worker said its copy is over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.copy.base import Direction
from kvtier.index.base import BlockKey, IndexEvent
from kvtier.offload.failures import FailureCause
from kvtier.offload.messages import DeviceBlock, Transfer, WorkerReport
from kvtier.offload.requests import RequestState, RequestTable
from kvtier.offload.setup import ManagerSetup
from kvtier.offload.stats import Counters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """What completed on every worker, as learnt from one :meth:`OffloadManager.process` call."""

    released_requests: tuple[str, ...] = ()
    """Finished requests whose device blocks the engine may free now."""
    loaded_requests: tuple[str, ...] = ()
    """Requests whose loads all completed (successfully or not) on every worker."""
    failed_loads: Mapping[str, tuple[DeviceBlock, ...]] = field(default_factory=dict)
    """Per request, device blocks whose load failed: recompute them."""
    stores_over: tuple[Transfer, ...] = ()
    """Store batches that completed (or failed) everywhere: their device blocks are no longer
    protected."""

    @property
    def stored_blocks(self) -> tuple[DeviceBlock, ...]:
        """The device blocks of :attr:`stores_over`, batch by batch."""
        return tuple(
            DeviceBlock(transfer.group, block)
            for transfer in self.stores_over
            for block in transfer.device_blocks
        )


@dataclass
class Batch:
    transfer: Transfer
    keys: tuple[BlockKey, ...]
    requests: tuple[str, ...]
    planned_at: float
    done: int = 0
    failed: int = 0
    abandoned: int = 0
    settled: int = 0
    reset: bool = False
    """A reset came while the batch was in flight: its store is never committed."""
    same_step: bool = False
    """A load copied before the forward of the step that runs its request."""

    @property
    def reported(self) -> int:
        """Workers that reported the batch (done, failed or abandoned)."""
        return self.done + self.failed + self.abandoned

    def copies_running(self, world_size: int) -> int:
        """Workers whose copy of the batch may still be running."""
        return world_size - self.reported + self.abandoned - self.settled


@dataclass
class Collected:
    """What one :meth:`OffloadManager.process` call learnt, to become its :class:`Progress`."""

    loaded: list[str] = field(default_factory=list)
    failed_loads: dict[str, list[DeviceBlock]] = field(default_factory=dict)
    stores_over: list[Transfer] = field(default_factory=list)
    committed: list[tuple[tuple[BlockKey, ...], tuple[int, ...]]] = field(default_factory=list)
    """Stores made readable: their keys and host slots."""

    def progress(self, released: tuple[str, ...]) -> Progress:
        return Progress(
            released_requests=released,
            loaded_requests=tuple(self.loaded),
            failed_loads={rid: tuple(blocks) for rid, blocks in self.failed_loads.items()},
            stores_over=tuple(self.stores_over),
        )


class BatchLedger:
    """The batches in flight and in quarantine, and the keys being written."""

    def __init__(self, setup: ManagerSetup, requests: RequestTable, counters: Counters) -> None:
        self.setup = setup
        self.requests = requests
        self.counters = counters
        self.batches: dict[int, Batch] = {}
        # Failed batches whose copies may still run on some worker: their slots stay held.
        self.quarantine: dict[int, Batch] = {}
        self.writing: dict[BlockKey, int] = {}
        self.num_planned = 0
        """Batches and promotions planned so far (the next one's id)."""
        # Per request, device blocks found unreadable at allocation, to announce as failed loads.
        self.unavailable: dict[str, tuple[DeviceBlock, ...]] = {}
        self._bytes_per_block = setup.record_bytes * setup.world_size
        self.events_pending = False
        """Whether the index may keep events :meth:`take_events` has not returned yet."""
        self._departed: list[BlockKey] = []
        # Only lazy mode's frontier memory reads departures; eager mode keeps none.
        self._keep_departed = setup.store_mode == "lazy"

    def count_evicted(self, keys: Sequence[BlockKey]) -> None:
        """Count keys that left the tier (the index evicted, discarded or cleared them)."""
        self.counters.add("evicted_blocks", len(keys))
        self.note_departed(keys)
        self.events_pending = self.setup.record_events

    def commit(self, keys: Sequence[BlockKey]) -> None:
        """Make stored (or promoted) ``keys`` readable in the index."""
        self.setup.index.commit(keys)
        self.events_pending = self.setup.record_events

    def note_departed(self, keys: Sequence[BlockKey]) -> None:
        """These keys stopped being held or written (evicted, discarded, or their store or
        promotion given up)."""
        if self._keep_departed:
            self._departed.extend(keys)

    @property
    def idle(self) -> bool:
        """Whether no batch is in flight or quarantined, and no event or departed key waits."""
        return not (
            self.batches
            or self.quarantine
            or self.unavailable
            or self.events_pending
            or self._departed
        )

    def take_departed(self) -> list[BlockKey]:
        """Return and forget the keys that departed since the last call (lazy mode only)."""
        departed, self._departed = self._departed, []
        return departed

    def take_events(self) -> list[IndexEvent]:
        """Return and forget the index's events since the last call (with ``record_events``;
        else none are kept)."""
        if not self.events_pending:
            return []
        self.events_pending = False
        return self.setup.index.take_events()

    def new_batch_id(self) -> int:
        batch_id = self.num_planned
        self.num_planned += 1
        return batch_id

    def present(self, key: BlockKey) -> bool:
        """Whether the tier holds the block, or is writing it."""
        return key in self.writing or self.setup.index.slot_of(key) is not None

    @property
    def quarantined_slots(self) -> int:
        return len({slot for b in self.quarantine.values() for slot in b.transfer.host_slots})

    def add_load(
        self, transfer: Transfer, keys: tuple[BlockKey, ...], state: RequestState, now: float
    ) -> None:
        self.batches[transfer.batch_id] = Batch(
            transfer, keys, (state.request_id,), now, same_step=state.same_step
        )
        state.batches.add(transfer.batch_id)
        state.load_batches.add(transfer.batch_id)

    def add_store(
        self, transfer: Transfer, keys: tuple[BlockKey, ...], requests: set[str], now: float
    ) -> None:
        self.batches[transfer.batch_id] = Batch(transfer, keys, tuple(sorted(requests)), now)
        self.writing.update(dict.fromkeys(keys, transfer.batch_id))
        for request_id in requests:
            self.requests.requests[request_id].batches.add(transfer.batch_id)

    def process(self, reports: Sequence[WorkerReport]) -> Collected:
        """Count the reports; complete the batches every worker reported, expire late ones."""
        collected = Collected()
        self.announce_unavailable(collected)
        touched: set[int] = set()
        for report in reports:
            touched |= self.count(report)
            self.counters.add_tier_counts(report.tier_counts)
        self.counters.set_tier_gauges(reports)
        self.settle(touched, collected)
        self.expire(collected)
        return collected

    def announce_unavailable(self, collected: Collected) -> None:
        """Report the blocks found unreadable at allocation as failed loads."""
        for request_id, blocks in self.unavailable.items():
            self.requests.refuse_reload(request_id)
            collected.failed_loads[request_id] = list(blocks)
            state = self.requests.get(request_id)
            if state is not None and not state.load_batches:
                collected.loaded.append(request_id)
        self.unavailable.clear()

    def count(self, report: WorkerReport) -> set[int]:
        """Add one report's counts to its batches; return the batches it changed.

        Entries that cannot be right (negative counts, a batch that is not in
        flight, more workers than ``world_size``, more settled copies than
        abandoned ones) are logged, counted in ``rejected_reports`` and ignored:
        a wrong report never changes the tier.
        """
        touched: set[int] = set()
        for batch_id in report.batch_ids:
            counts = (
                report.done.get(batch_id, 0),
                report.failed.get(batch_id, 0),
                report.abandoned.get(batch_id, 0),
                report.settled.get(batch_id, 0),
            )
            batch = self.batches.get(batch_id) or self.quarantine.get(batch_id)
            problem = self._impossible(batch, counts)
            if problem is not None:
                self.counters.add("rejected_reports", 1)
                self.counters.failures.failed(
                    FailureCause.REJECTED_REPORT,
                    "ignored a worker report for batch %s (done=%s, failed=%s, abandoned=%s, "
                    "settled=%s): %s; reports must come from this manager's plans, each worker "
                    "reporting a batch once",
                    batch_id,
                    *counts,
                    problem,
                )
                continue
            assert batch is not None
            done, failed, abandoned, settled = counts
            batch.done += done
            batch.failed += failed
            batch.abandoned += abandoned
            batch.settled += settled
            self.counters.add("abandoned_copies", abandoned)
            touched.add(batch_id)
        return touched

    def _impossible(self, batch: Batch | None, counts: tuple[int, int, int, int]) -> str | None:
        """Why these counts cannot be a worker's report of ``batch``, or ``None`` if they can."""
        if not all(isinstance(count, int) and count >= 0 for count in counts):
            return "counts are numbers of workers and cannot be negative or fractional"
        if batch is None:
            return "the batch is not in flight"
        world_size = self.setup.world_size
        done, failed, abandoned, settled = counts
        reported = batch.reported + done + failed + abandoned
        if reported > world_size:
            return f"{reported} workers would have reported it, but world_size is {world_size}"
        if batch.settled + settled > batch.abandoned + abandoned:
            return (
                f"{batch.settled + settled} workers would have settled its copy, but only "
                f"{batch.abandoned + abandoned} abandoned it"
            )
        return None

    def settle(self, touched: set[int], collected: Collected) -> None:
        """Complete the touched batches every worker reported; free quarantine that is over."""
        for batch_id in sorted(touched):
            batch = self.batches.get(batch_id)
            if batch is not None:
                if batch.reported == self.setup.world_size:
                    self._complete(batch, collected)
            elif batch_id in self.quarantine:
                self._release_quarantined(self.quarantine[batch_id])

    def _complete(self, batch: Batch, collected: Collected) -> None:
        """Apply a batch's outcome; keep its slots quarantined while a copy may still run."""
        setup, counters = self.setup, self.counters
        transfer = batch.transfer
        del self.batches[transfer.batch_id]
        ok = batch.done == setup.world_size
        running = batch.copies_running(setup.world_size) > 0
        store = transfer.direction is Direction.STORE
        if ok:
            observations = counters.observations
            counters.observe(
                observations.store_seconds if store else observations.load_seconds,
                setup.clock() - batch.planned_at,
            )
        if store:
            if ok and not batch.reset:
                for key in batch.keys:
                    del self.writing[key]
                self.commit(batch.keys)
                collected.committed.append((batch.keys, transfer.host_slots))
                counters.add("stored_blocks", len(batch.keys))
                counters.add("stored_bytes", len(batch.keys) * self._bytes_per_block)
            elif not running:
                self.abort_store(batch)
            if not ok:
                counters.add("store_failures", len(batch.keys))
                self.counters.failures.failed(
                    FailureCause.STORE_DROPPED,
                    "store batch %d of %d blocks did not complete on %d of %d workers; the "
                    "blocks were dropped",
                    transfer.batch_id,
                    len(batch.keys),
                    setup.world_size - batch.done,
                    setup.world_size,
                )
            collected.stores_over.append(transfer)
        else:
            if ok:
                counters.add("loaded_blocks", len(transfer))
                counters.add("loaded_bytes", len(transfer) * self._bytes_per_block)
                if batch.same_step:
                    counters.add("same_step_loaded_blocks", len(transfer))
            else:
                # What could not be read once is not offered as a hit again.
                setup.index.discard(batch.keys)
                counters.add("load_failures", len(transfer))
                assert transfer.request_id is not None
                self.requests.refuse_reload(transfer.request_id)
                collected.failed_loads.setdefault(transfer.request_id, []).extend(
                    DeviceBlock(transfer.group, b) for b in transfer.device_blocks
                )
            if not running:
                setup.index.unpin(batch.keys)
        if running:
            self.quarantine[transfer.batch_id] = batch
        for request_id in batch.requests:
            state = self.requests.get(request_id)
            if state is None:
                continue
            state.batches.discard(transfer.batch_id)
            if transfer.batch_id in state.load_batches:
                state.load_batches.discard(transfer.batch_id)
                if not state.load_batches:
                    collected.loaded.append(request_id)
            if state.finished and state.hold_announced and not state.batches:
                self.requests.release(request_id)

    def _release_quarantined(self, batch: Batch) -> None:
        """Free a failed batch's slots once no worker's copy of it may still run."""
        if batch.copies_running(self.setup.world_size) > 0:
            return
        del self.quarantine[batch.transfer.batch_id]
        if batch.transfer.direction is Direction.STORE:
            self.abort_store(batch)
        else:
            self.setup.index.unpin(batch.keys)
        logger.debug(
            "batch %d's copies are over on every worker; its %d host slots are free again",
            batch.transfer.batch_id,
            len(batch.transfer),
        )

    def abort_store(self, batch: Batch) -> None:
        for key in batch.keys:
            del self.writing[key]
        self.give_up(batch.keys)

    def give_up(self, keys: Sequence[BlockKey]) -> None:
        """The store or promotion of these reserved keys was given up: free their host slots,
        note them departed and forget their tenants' salts."""
        self.setup.index.abort(keys)
        self.note_departed(keys)
        self.requests.forget_salts(keys)

    def expire(self, collected: Collected) -> None:
        """Fail the batches some worker did not report within ``report_deadline_s``."""
        setup = self.setup
        late = setup.clock() - setup.report_deadline_s
        for batch in list(self.batches.values()):
            if batch.planned_at > late:
                break  # batches are kept in planning order
            self.counters.add("expired_batches", 1)
            self.counters.failures.failed(
                FailureCause.REPORT_DEADLINE,
                "%s batch %d of %d blocks was not reported by %d of %d workers within "
                "report_deadline_s=%s; it failed (a load is recomputed, a store dropped) and its "
                "host slots stay out of use until those workers report it",
                batch.transfer.direction.value,
                batch.transfer.batch_id,
                len(batch.transfer),
                setup.world_size - batch.reported,
                setup.world_size,
                setup.report_deadline_s,
            )
            self._complete(batch, collected)

    def reset(self) -> bool:
        """Empty the tier: stores in flight are never committed, every readable key goes.

        Returns whether every slot is free now (copies in flight free theirs as they end).
        """
        index = self.setup.index
        for batch in self.batches.values():
            if batch.transfer.direction is Direction.STORE:
                batch.reset = True
            else:
                index.discard(batch.keys)
        empty = index.clear()
        if empty:
            logger.info("host tier reset: empty")
        else:
            logger.info(
                "host tier reset: nothing stored before it will be served; %d slot(s) are "
                "freed as the copies still using them complete",
                index.num_slots - index.stats().free,
            )
        return empty
