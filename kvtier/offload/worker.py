"""Worker-side offload executor: runs each step's plan with a copy backend and reports back.

The worker owns all bytes (the engine's KV tensors through their
:class:`~kvtier.layout.KVLayout`, the :class:`~kvtier.tiers.HostTier` buffer,
the copy backend) and knows nothing of policies. Every worker of an engine
runs the same plan on its own shard. An engine integration calls it in this
order each step:

1. :meth:`OffloadWorker.bind` — this step's :class:`TransferPlan`.
2. :meth:`OffloadWorker.handle_preemptions` — before the engine reuses any
   device block: if the plan asks for a flush, wait for every copy in flight.
3. :meth:`OffloadWorker.load_same_step` — before the model runs: copy the
   loads of the plan's ``same_step`` requests, whose tokens this step
   computes on the loaded blocks, and wait for them.
4. (the engine runs its model)
5. :meth:`OffloadWorker.get_finished` — hands the plan's demotions and
   write-throughs to the lower tiers (copies of their slots), submits the
   plan's stores and loads (behind the model's work on the current stream) and
   promotions (reads from the lower tiers, on their threads), polls copies and
   promotions in flight, and returns the finished requests whose held blocks may be freed and the
   requests whose loads completed.
6. :meth:`OffloadWorker.take_load_failures` — what of those loads failed, for
   the engine to recompute: device blocks with one kv-cache group, whole
   requests with several (block ids repeat across groups, so a block id alone
   does not say which block failed).
7. :meth:`OffloadWorker.take_report` — the :class:`WorkerReport` for the
   scheduler-side :class:`~kvtier.offload.OffloadManager`.

Most steps of a serving engine ask nothing of the workers. :attr:`OffloadWorker.quiet`
says so in one attribute: :meth:`~OffloadWorker.take_report` sets it when nothing is in
flight, waiting or left to report (and there are no lower tiers, whose threads count on
their own), and a plan that asks for anything clears it. While it is set, the calls after
an empty plan's :meth:`~OffloadWorker.bind` answer from it alone.

No wait is unbounded. A copy still running ``copy_deadline_s`` after its
submission is abandoned: the worker stops waiting for it, a load becomes a
recompute (its device blocks are reported failed) and the batch is reported
``abandoned``, so the manager keeps the copy's host slots out of use until a
later report says the copy is over (``settled``). An exception other than
:class:`~kvtier.copy.CopyError` from a backend never escapes the worker: from
``submit`` it fails the batch, from a poll it abandons the copy.
:meth:`OffloadWorker.close` waits at most ``close_timeout_s`` for copies still
running, then abandons them, leaving the host tier and their backends open so
that no late copy writes freed memory. Before it closes the lower tiers, it
writes the blocks still in the host tier to the ``write_back`` and
``write_through`` tiers that lack them, for at most ``flush_deadline_s`` (see
:mod:`~kvtier.offload.moves`).

A load abandoned while its copy still runs may still write the engine's device
blocks, which the engine has started to recompute into: only a copy that
finishes (or fails) makes those blocks safe. A deadline well above the longest
normal copy keeps that to hung hardware.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.config.model import (
    DEFAULT_CLOSE_TIMEOUT_S,
    DEFAULT_COPY_DEADLINE_S,
    DEFAULT_FLUSH_DEADLINE_S,
)
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.keys import KeyNamespace
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout, LayoutError
from kvtier.offload.failures import FailureCause, FailureLog
from kvtier.offload.messages import Demotion, Promotion, Transfer, TransferPlan, WorkerReport
from kvtier.offload.stats import FLUSH_COUNTERS
from kvtier.tiers.base import PutResult
from kvtier.tiers.chain import Fetch, TierChain
from kvtier.tiers.host import HostTier

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

BackendFactory = Callable[[KVLayout, torch.Tensor], CopyBackend]
"""Builds a copy backend for one layout over the host buffer."""

IDLE_FETCH_WAIT_S = 0.002
"""Longest wait for a lower-tier read in flight in a step the engine computes nothing in
(:attr:`TransferPlan.idle`). Such steps follow each other at once, and on a loop of them
the tiers' threads got the interpreter once per switch interval (5 ms): reading 128 disk
records back took 0.26 to 0.58 s instead of 10 to 20 ms."""

FLUSH_BATCH_BLOCKS = 64
"""Blocks per put of a graceful close's flush; ``flush_deadline_s`` is checked between puts."""

_FIRST_PAUSE_S = 1e-4
_LONGEST_PAUSE_S = 1e-2
"""Bounds of the pause between polls while a flush or close waits for copies."""


@dataclass(frozen=True)
class LoadFailures:
    """Failed loads the engine must recompute, as blocks or as whole requests."""

    blocks: frozenset[int] = frozenset()
    """Device block ids whose loads failed (one kv-cache group only)."""
    requests: frozenset[str] = frozenset()
    """Requests whose loads finished with some block failed (several kv-cache groups)."""


_NO_LOAD_FAILURES = LoadFailures()


@dataclass(frozen=True)
class _Copy:
    backend: CopyBackend
    handle: CopyHandle
    transfer: Transfer
    deadline: float
    """Clock time after which the worker stops waiting for the copy."""


class OffloadWorker:
    """Executes transfer plans on one rank and tracks their completion."""

    def __init__(
        self,
        layouts: KVLayout | Sequence[KVLayout],
        tier: HostTier,
        backend_factory: BackendFactory,
        *,
        copy_deadline_s: float = DEFAULT_COPY_DEADLINE_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        flush_deadline_s: float = DEFAULT_FLUSH_DEADLINE_S,
        chain: TierChain | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Bind a worker to the engine's layouts and a host tier.

        Args:
            layouts: The resolved layout, or one per kv-cache group (groups may
                share one layout object; they then share one backend). Every
                layout's ``record_bytes`` must equal the tier's.
            tier: The host tier of this rank.
            backend_factory: ``factory(layout, host_buffer)`` returning a copy backend.
            copy_deadline_s: Seconds after its submission at which the worker
                abandons a copy that is still running.
            close_timeout_s: Seconds :meth:`close` waits for copies still running.
            flush_deadline_s: Seconds :meth:`close` may spend writing the host tier's
                blocks to the tiers that lack them.
            chain: This rank's tiers below the host tier, if any (closed with the worker).
            clock: Monotonic time in seconds (tests pass a manual clock).
            sleep: Pauses the caller between polls while a flush or close waits.

        Raises:
            LayoutError: If a layout's record size differs from the tier's.
            ValueError: If the deadline is not positive or a timeout is negative.
        """
        if copy_deadline_s <= 0 or close_timeout_s < 0 or flush_deadline_s < 0:
            raise ValueError(
                f"copy_deadline_s must be positive, close_timeout_s and flush_deadline_s not "
                f"negative, got {copy_deadline_s}, {close_timeout_s} and {flush_deadline_s}"
            )
        self.layouts: tuple[KVLayout, ...] = (
            (layouts,) if isinstance(layouts, KVLayout) else tuple(layouts)
        )
        if not self.layouts:
            raise LayoutError("an offload worker needs at least one layout")
        self.tier = tier
        backends: dict[int, CopyBackend] = {}
        self._group_backends: list[CopyBackend] = []
        for group, layout in enumerate(self.layouts):
            if layout.record_bytes != tier.record_bytes:
                raise LayoutError(
                    f"kv-cache group {group}'s layout has {layout.record_bytes}-byte records, "
                    f"but the host tier's slots hold {tier.record_bytes} bytes; every group "
                    "must share one record size"
                )
            if id(layout) not in backends:
                backends[id(layout)] = backend_factory(layout, tier.buffer)
            self._group_backends.append(backends[id(layout)])
        self._backends = list(backends.values())
        self.copy_deadline_s = copy_deadline_s
        self.close_timeout_s = close_timeout_s
        self.flush_deadline_s = flush_deadline_s
        self._clock = clock
        self._sleep = sleep
        self._failures = FailureLog(logger)
        self._plan: TransferPlan | None = None
        self._flush_pending = False
        self._inflight: dict[int, _Copy] = {}
        # Copies the worker stopped waiting for; polled until they are over.
        self._abandoned: dict[int, _Copy] = {}
        self._done: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._abandoned_report: dict[int, int] = {}
        self._settled: dict[int, int] = {}
        self._loads_by_request: dict[str, set[int]] = {}
        self._holds: dict[str, set[int]] = {}
        self._failed_load_blocks: set[int] = set()
        self._failed_load_requests: set[str] = set()
        # Same-step loads of the bound plan, copied by load_same_step(); and the batch ids
        # of such loads until they are recorded, whose requests are never named as loaded.
        self._same_step: list[Transfer] = []
        self._same_step_batches: set[int] = set()
        self.chain = chain
        self._host_bytes = tier.buffer.numpy()
        self._fetches: dict[int, tuple[Promotion, Fetch]] = {}
        self._promoted: dict[int, tuple[int, int]] = {}
        # Per host slot, the block it holds and the tiers that lack it, by position: the
        # write_back ones, and write_through ones no plan wrote it to yet (see moves.py);
        # written to them on a graceful close.
        self._owed: dict[int, tuple[int, bytes, tuple[int, ...]]] = {}
        self.flush_counts: dict[str, dict[str, int]] = {}
        """Per write_back or write_through tier, what :meth:`close` wrote of the blocks it
        lacked (``FLUSH_COUNTERS`` names the counts)."""
        # (blocks, seconds from submission until seen done) of each load that completed
        self._load_times: list[tuple[int, float]] = []
        self._closed = False
        self.quiet = False
        """Nothing is in flight, waiting or left to report, and there are no lower tiers:
        set by :meth:`take_report`, cleared by a plan that asks for anything."""

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        layouts: KVLayout | Sequence[KVLayout],
        *,
        world_size: int = 1,
        registry: Registry | None = None,
        rank: int = 0,
        model: str = "",
        report_blocks: bool = False,
    ) -> OffloadWorker:
        """Build a worker, its host tier, copy backends and lower tiers from a validated config.

        The tier holds :meth:`config.host_slots
        <kvtier.config.KVTierConfig.host_slots>` slots (what
        :meth:`OffloadManager.from_config
        <kvtier.offload.manager.OffloadManager.from_config>` assumes) and is
        pinned when the layout lives on a CUDA device. The tiers of
        ``config.tiers`` key this rank's records by ``model``, the layout's
        fingerprint, ``rank`` and ``world_size`` (and the config's namespace).
        With ``report_blocks`` (the engine publishes KV-cache events), reports name
        the blocks the lower tiers stored and removed.

        Raises:
            kvtier.config.ConfigError: The tier does not fit in the memory
                available (checked before it is allocated) or holds no block.
            kvtier.tiers.TierError: A lower tier cannot start.
        """
        from kvtier.plugins import default_registry

        registry = registry if registry is not None else default_registry()
        first = layouts if isinstance(layouts, KVLayout) else layouts[0]
        tier = HostTier.from_config(config, first.record_bytes, first.device, world_size=world_size)

        def build_backend(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
            return registry.build(COPY_BACKEND, config.copy, layout, host_buffer)

        chain = None
        if config.tiers:
            keys = KeyNamespace(model, first.fingerprint, rank, world_size)
            chain = TierChain.from_config(
                config,
                record_bytes=first.record_bytes,
                keys=keys,
                registry=registry,
                report_blocks=report_blocks,
            )
        return cls(
            layouts,
            tier,
            build_backend,
            copy_deadline_s=config.copy_deadline_s,
            close_timeout_s=config.close_timeout_s,
            flush_deadline_s=config.flush_deadline_s,
            chain=chain,
        )

    def bind(self, plan: TransferPlan) -> None:
        """Take this step's plan; nothing is submitted until :meth:`get_finished`.

        Raises:
            RuntimeError: If the previous plan was never submitted.
            ValueError: If the plan names a group, slot or block this worker does not have.
        """
        if self._plan is not None:
            raise RuntimeError(
                "bind() was called twice without get_finished(); call get_finished() once "
                "per step so the previous plan is submitted"
            )
        if plan.empty:  # most decode steps
            self._plan = plan
            self._flush_pending = False
            return
        self.quiet = False
        for transfer in (*plan.stores, *plan.loads):
            self._check(transfer)
        for message in (*plan.promotions, *plan.demotions, *plan.write_throughs):
            self._check_slots(message.host_slots, "promotion or lower-tier write")
        if (plan.promotions or plan.demotions or plan.write_throughs) and self.chain is None:
            raise ValueError(
                "the plan moves blocks to or from lower tiers, but this worker has none; build "
                "the manager and the workers from the same config"
            )
        self._plan = plan
        self._flush_pending = plan.flush
        for transfer in plan.loads:
            assert transfer.request_id is not None
            if transfer.request_id in plan.same_step:
                self._same_step.append(transfer)
                self._same_step_batches.add(transfer.batch_id)
            else:
                self._loads_by_request.setdefault(transfer.request_id, set()).add(transfer.batch_id)
        for request_id, blocks in plan.unavailable.items():
            self._failed_load_blocks.update(blocks)
            if request_id not in plan.same_step:
                self._failed_load_requests.add(request_id)
                self._loads_by_request.setdefault(request_id, set())
        for request_id, batch_ids in plan.holds.items():
            self._holds[request_id] = set(batch_ids)

    def handle_preemptions(self) -> None:
        """If the bound plan asks for a flush, wait for every copy in flight."""
        if self._flush_pending:
            self.flush()

    def flush(self) -> None:
        """Wait for every submitted copy, each at most until its deadline, and record outcomes."""
        self._flush_pending = False
        self._wait(until=None)

    def load_same_step(self) -> None:
        """Copy the bound plan's same-step loads and wait for them, before the model runs.

        The step's forward reads the blocks they write. Each copy is waited for
        until its deadline at most; the blocks of one that failed or was
        abandoned are in :meth:`take_failed_load_blocks` for the engine to
        recompute. Other copies in flight are polled but not waited for.
        """
        if self._flush_pending:
            self.flush()
        if not self._same_step:  # most steps
            return
        transfers, self._same_step = self._same_step, []
        for transfer in transfers:
            self._submit(transfer)
        batch_ids = {transfer.batch_id for transfer in transfers}
        while batch_ids & self._inflight.keys():
            self._poll()
            if batch_ids & self._inflight.keys():
                self._sleep(_FIRST_PAUSE_S)  # the forward waits: poll at the shortest pause

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Submit the bound plan, poll copies in flight, and say which requests are done.

        Returns:
            ``(released, loaded)``: finished requests whose held device blocks
            may be freed as far as this worker is concerned, and requests whose
            loads completed on this worker (failed blocks are in
            :meth:`take_failed_load_blocks`).
        """
        if self.quiet:
            self._plan = None
            return set(), set()  # most decode steps
        if self._flush_pending:
            self.flush()
        plan, self._plan = self._plan, None
        for transfer in self._same_step:  # the model ran before load_same_step() was called
            self._fail(
                transfer,
                FailureCause.LOAD_NOT_STARTED,
                "the step's forward ran before its same-step load was copied",
            )
        self._same_step = []
        if plan is not None and not plan.empty:
            self._demote(plan)
            for transfer in (*plan.stores, *plan.loads):
                if transfer.request_id not in plan.same_step:
                    self._submit(transfer)
            for promotion in plan.promotions:
                assert self.chain is not None
                if self._owed:
                    for slot in promotion.host_slots:
                        self._owed.pop(slot, None)
                fetch = self.chain.fetch(
                    promotion.group, promotion.block_hashes, promotion.skip_tiers
                )
                self._fetches[promotion.batch_id] = (promotion, fetch)
        # Most decode steps have nothing in flight and nobody waiting: skip the polls.
        if self._inflight or self._abandoned:
            self._poll()
        if self._fetches:
            if plan is not None and plan.idle:
                _, oldest = next(iter(self._fetches.values()))
                oldest.wait(IDLE_FETCH_WAIT_S)
            self._poll_fetches()
        loaded = self._pop_settled(self._loads_by_request) if self._loads_by_request else set()
        released = self._pop_settled(self._holds) if self._holds else set()
        return released, loaded

    def _demote(self, plan: TransferPlan) -> None:
        """Copy the blocks to write down the chain out of their slots (the plan may reuse
        them) and queue them; evicted blocks are no longer owed to any tier."""
        for write in plan.write_throughs:
            self._write_down(write)
            if self._owed:
                self._written(write)
        for demotion in plan.demotions:
            self._write_down(demotion)
            if self._owed:
                for slot in demotion.host_slots:
                    self._owed.pop(slot, None)

    def _written(self, write: Demotion) -> None:
        """The blocks of ``write`` are no longer owed to its tiers."""
        for slot in write.host_slots:
            owed = self._owed.get(slot)
            if owed is None:
                continue
            group, block_hash, tiers = owed
            lacking = tuple(p for p in tiers if p not in write.tiers)
            if lacking:
                self._owed[slot] = (group, block_hash, lacking)
            else:
                del self._owed[slot]

    def _write_down(self, write: Demotion) -> None:
        if not write.tiers:
            return  # an evicted block no tier writes back
        assert self.chain is not None
        records = [self._host_bytes[slot].tobytes() for slot in write.host_slots]
        self.chain.store(write.group, write.block_hashes, records, write.tiers)

    def _poll_fetches(self) -> None:
        """Write the leading blocks of each finished fetch into its slots and report them."""
        for batch_id, (promotion, fetch) in list(self._fetches.items()):
            if not fetch.done:
                continue
            del self._fetches[batch_id]
            for slot, record in zip(promotion.host_slots, fetch.records, strict=False):
                self._host_bytes[slot] = memoryview(record).cast("B")
            self._promoted[batch_id] = (1, len(fetch.records))
            self._owe_promoted(promotion, fetch)

    def _owe_promoted(self, promotion: Promotion, fetch: Fetch) -> None:
        """Owe the promoted blocks to the write_back tiers searched before the one that had
        each (they lacked it)."""
        assert self.chain is not None
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
                self._owed[slot] = (promotion.group, block_hash, lacking)

    def _pop_settled(self, waiting: dict[str, set[int]]) -> set[str]:
        """Remove and return the requests in ``waiting`` none of whose batches is in flight."""
        settled = {
            request_id
            for request_id, batch_ids in waiting.items()
            if not batch_ids & self._inflight.keys()
        }
        for request_id in settled:
            del waiting[request_id]
        return settled

    def take_failed_load_blocks(self) -> set[int]:
        """Device block ids whose loads failed since the last call: recompute them."""
        failed, self._failed_load_blocks = self._failed_load_blocks, set()
        return failed

    def take_load_failures(self, loaded: Iterable[str]) -> LoadFailures:
        """The failed loads to report with ``loaded`` (from :meth:`get_finished`).

        With one kv-cache group, every device block whose load failed since the
        last call. With several, block ids repeat across groups, so the
        requests of ``loaded`` with a failed block are named instead (the
        engine recomputes them from their first loaded block).
        """
        if not (self._failed_load_blocks or self._failed_load_requests):
            return _NO_LOAD_FAILURES
        blocks = self.take_failed_load_blocks()
        failed = self._failed_load_requests.intersection(loaded)
        self._failed_load_requests -= failed
        if len(self.layouts) == 1:
            return LoadFailures(blocks=frozenset(blocks))
        return LoadFailures(requests=frozenset(failed))

    def take_report(self) -> WorkerReport | None:
        """This worker's completions since the last call, or ``None`` if there are none.

        Sets :attr:`quiet` when nothing is left to do or to report."""
        if self.quiet:
            return None  # most steps
        completed = bool(
            self._done or self._failed or self._abandoned_report or self._settled or self._promoted
        )
        chain = self.chain
        if chain is None:
            if not completed:
                self.quiet = self._idle()
                return None
            tier_counts, stored, removed, read_times = {}, {}, {}, {}
        else:
            tier_counts = chain.take_counts()
            stored, removed = chain.take_blocks()
            read_times = chain.take_read_times() if chain.read_times else {}
            if not (completed or tier_counts or stored or removed or read_times):
                return None
        report = WorkerReport(
            self._done,
            self._failed,
            self._abandoned_report,
            self._settled,
            self._promoted,
            tier_counts,
            stored,
            removed,
            tuple(self._load_times),
            read_times,
        )
        self._done, self._failed, self._abandoned_report, self._settled = {}, {}, {}, {}
        self._promoted, self._load_times = {}, []
        self.quiet = chain is None and self._idle()
        return report

    def _idle(self) -> bool:
        """Whether nothing is bound, in flight, waiting or left to report (the reported
        completions aside), and the worker is open."""
        return not (
            self._plan is not None
            or self._flush_pending
            or self._inflight
            or self._abandoned
            or self._fetches
            or self._same_step
            or self._same_step_batches
            or self._loads_by_request
            or self._holds
            or self._failed_load_blocks
            or self._failed_load_requests
            or self._load_times
            or self._failures.has_new
            or self._closed
        )

    @property
    def num_inflight(self) -> int:
        """Batches submitted and not finished (abandoned ones not included)."""
        return len(self._inflight)

    @property
    def failure_counts(self) -> Mapping[FailureCause, int]:
        """This worker's failures so far, by cause."""
        return self._failures.counts

    def take_stats(self) -> dict[FailureCause, int]:
        """This worker's failures since the last call, by cause (empty when there were none)."""
        if self.quiet:
            return {}
        return self._failures.take_new()

    @property
    def num_abandoned(self) -> int:
        """Abandoned copies that may still be running."""
        return len(self._abandoned)

    def close(self) -> None:
        """Wait at most ``close_timeout_s`` for copies, flush, then close the backends and tiers.

        Copies still running after that are abandoned; their backends and the
        host tier are then left open (their memory deliberately not freed) so
        that a late copy writes nothing freed. The flush writes the blocks still
        in the host tier to the ``write_back`` and ``write_through`` tiers that lack them
        (:mod:`~kvtier.offload.moves` says which), in puts of
        :data:`FLUSH_BATCH_BLOCKS`, each waited for; once ``flush_deadline_s``
        passed, the rest are skipped. Both are counted in :attr:`flush_counts`
        and logged. Idempotent.
        """
        if self._closed:
            return
        self.quiet = False
        self._flush_pending = False
        self._wait(until=self._clock() + self.close_timeout_s)
        for batch_id in list(self._inflight):
            self._abandon(
                batch_id, FailureCause.CLOSE_TIMEOUT, "still running when the worker closed"
            )
        started = self._clock()
        puts = self._flush_owed() if self._owed else []
        live = {id(copy.backend) for copy in self._abandoned.values()}
        for backend in self._backends:
            if id(backend) not in live:
                backend.close()
        if self._abandoned:
            logger.warning(
                "closing with %d copies still running after close_timeout_s=%s (batches %s); "
                "their copy backends and the host tier's %d bytes are left open, not freed, so "
                "that the copies cannot write freed memory",
                len(self._abandoned),
                self.close_timeout_s,
                sorted(self._abandoned),
                self.tier.num_slots * self.tier.record_bytes,
            )
        else:
            self.tier.close()
        if self.chain is not None:
            # Promotions still reading are abandoned: their slots are never read again.
            self._fetches.clear()
            self.chain.close()
        if self.flush_counts:
            for name, put in puts:  # every put ended: the tiers finished their queues
                self.flush_counts[name]["flushed_blocks"] += sum(put.result().stored)
            logger.info(
                "wrote the host tier's blocks to the lower tiers lacking them in %.2f s: %s",
                self._clock() - started,
                "; ".join(
                    f"{name}: {row['flushed_blocks']} written, {row['flush_skipped_blocks']} "
                    f"skipped at flush_deadline_s={self.flush_deadline_s:g}"
                    for name, row in self.flush_counts.items()
                ),
            )
        self._closed = True

    def _flush_owed(self) -> list[tuple[str, Future[PutResult]]]:
        """Write the owed blocks down the chain until ``flush_deadline_s`` passed; count the
        skipped ones in :attr:`flush_counts` and return the puts, per tier name."""
        assert self.chain is not None
        until = self._clock() + self.flush_deadline_s
        batches: dict[tuple[int, tuple[int, ...]], list[tuple[bytes, int]]] = {}
        for slot, (group, block_hash, tiers) in self._owed.items():
            batches.setdefault((group, tiers), []).append((block_hash, slot))
        self._owed = {}
        counts = {
            self.chain.tiers[p][0]: {counter.name: 0 for counter in FLUSH_COUNTERS}
            for p in self.chain.flushed_tiers
        }
        puts: list[tuple[str, Future[PutResult]]] = []
        for (group, tiers), blocks in sorted(batches.items()):
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
                futures = self.chain.store(group, hashes, records, tiers)
                # a put still running at the deadline ends while the tier closes
                concurrent.futures.wait(futures, timeout=left)
                puts.extend(zip(names, futures, strict=True))
        self.flush_counts = counts
        return puts

    def _check(self, transfer: Transfer) -> None:
        if not 0 <= transfer.group < len(self.layouts):
            raise ValueError(
                f"transfer {transfer.batch_id} is for kv-cache group {transfer.group}, but this "
                f"worker has layouts for {len(self.layouts)} groups"
            )
        self._check_slots(transfer.host_slots, f"transfer {transfer.batch_id}")
        num_blocks = self.layouts[transfer.group].num_blocks
        block = _out_of_range(transfer.device_blocks, num_blocks)
        if block is not None:
            raise ValueError(
                f"transfer {transfer.batch_id} names device block {block}, but group "
                f"{transfer.group}'s layout has {num_blocks} blocks"
            )

    def _check_slots(self, slots: Sequence[int], what: str) -> None:
        num_slots = self.tier.num_slots
        slot = _out_of_range(slots, num_slots)
        if slot is not None:
            raise ValueError(
                f"{what} names host slot {slot}, but this worker's tier has "
                f"{num_slots} slots; size the manager and the workers from the "
                "same config and record size"
            )

    def _submit(self, transfer: Transfer) -> None:
        if self._owed and transfer.direction is Direction.STORE:
            for slot in transfer.host_slots:
                self._owed.pop(slot, None)
        backend = self._group_backends[transfer.group]
        batch = CopyBatch(transfer.direction, transfer.device_blocks, transfer.host_slots)
        try:
            handle = backend.submit(batch)
        except CopyError as exc:
            self._fail(transfer, FailureCause.COPY_ERROR, str(exc))
            return
        except Exception as exc:  # a backend's bug fails its batch, never the engine
            self._fail(
                transfer,
                FailureCause.BACKEND_ERROR,
                f"{type(backend).__name__} raised {type(exc).__name__} submitting it (a copy "
                f"backend must raise CopyError): {exc}",
                exc_info=True,
            )
            return
        deadline = self._clock() + self.copy_deadline_s
        self._inflight[transfer.batch_id] = _Copy(backend, handle, transfer, deadline)

    def _poll(self) -> None:
        """Poll every copy once; abandon those past their deadline."""
        now = self._clock()
        for batch_id, copy in list(self._inflight.items()):
            try:
                finished = copy.backend.done(copy.handle)
            except CopyError as exc:
                del self._inflight[batch_id]
                self._fail(copy.transfer, FailureCause.COPY_ERROR, str(exc))
                continue
            except Exception as exc:  # a backend's bug: the copy's state is unknown
                self._abandon(
                    batch_id,
                    FailureCause.BACKEND_ERROR,
                    f"{type(copy.backend).__name__} raised {type(exc).__name__} polling it "
                    f"(a copy backend must raise CopyError): {exc}",
                )
                continue
            if finished:
                del self._inflight[batch_id]
                self._record(copy.transfer, ok=True)
                if copy.transfer.direction is Direction.LOAD:
                    submitted = copy.deadline - self.copy_deadline_s
                    self._load_times.append((len(copy.transfer), now - submitted))
            elif now >= copy.deadline:
                self._abandon(
                    batch_id,
                    FailureCause.COPY_DEADLINE,
                    f"still running after {self.copy_deadline_s} s",
                )
        for batch_id, copy in list(self._abandoned.items()):
            try:
                over = copy.backend.done(copy.handle)
            except CopyError:
                over = True
            except Exception:  # still unknown: keep the slots held
                logger.debug("polling abandoned batch %d raised", batch_id, exc_info=True)
                continue
            if over:
                del self._abandoned[batch_id]
                self._settled[batch_id] = self._settled.get(batch_id, 0) + 1

    def _wait(self, until: float | None) -> None:
        """Poll until no copy is in flight; with ``until``, also until abandoned ones are over.

        A copy still running at its deadline is abandoned, so this returns
        within ``copy_deadline_s``; with ``until``, by ``until`` at the latest.
        """
        pause = _FIRST_PAUSE_S
        while True:
            self._poll()
            if not self._inflight and (until is None or not self._abandoned):
                return
            if until is not None and self._clock() >= until:
                return
            self._sleep(pause)
            pause = min(2 * pause, _LONGEST_PAUSE_S)

    def _abandon(self, batch_id: int, cause: FailureCause, why: str) -> None:
        copy = self._inflight.pop(batch_id)
        self._abandoned[batch_id] = copy
        self._abandoned_report[batch_id] = self._abandoned_report.get(batch_id, 0) + 1
        transfer = copy.transfer
        self._failures.failed(
            cause,
            "stopped waiting for %s batch %d of %d blocks: %s; it counts as failed (a load is "
            "recomputed, a store dropped) and its host slots stay out of use until it ends",
            transfer.direction.value,
            batch_id,
            len(transfer),
            why,
        )
        if transfer.direction is Direction.LOAD:
            self._load_failed(transfer)

    def _fail(
        self, transfer: Transfer, cause: FailureCause, why: str, *, exc_info: bool = False
    ) -> None:
        self._failures.failed(
            cause,
            "%s batch %d of %d blocks failed: %s",
            transfer.direction.value,
            transfer.batch_id,
            len(transfer),
            why,
            exc_info=exc_info,
        )
        self._record(transfer, ok=False)

    def _record(self, transfer: Transfer, *, ok: bool) -> None:
        counts = self._done if ok else self._failed
        counts[transfer.batch_id] = counts.get(transfer.batch_id, 0) + 1
        if ok and transfer.block_hashes and self.chain is not None and self.chain.flushed_tiers:
            tiers, group = self.chain.flushed_tiers, transfer.group
            for slot, block_hash in zip(transfer.host_slots, transfer.block_hashes, strict=True):
                self._owed[slot] = (group, block_hash, tiers)
        if not ok and transfer.direction is Direction.LOAD:
            self._load_failed(transfer)
        self._same_step_batches.discard(transfer.batch_id)

    def _load_failed(self, transfer: Transfer) -> None:
        self._failed_load_blocks.update(transfer.device_blocks)
        if transfer.batch_id in self._same_step_batches:
            # the engine runs the request already: it learns of the blocks alone
            self._same_step_batches.discard(transfer.batch_id)
        elif transfer.request_id is not None:
            self._failed_load_requests.add(transfer.request_id)


def _out_of_range(ids: Sequence[int], limit: int) -> int | None:
    """The first of ``ids`` outside ``[0, limit)``, or ``None``; all in range costs two C
    calls (``min``, ``max``) instead of a Python loop over a plan's blocks."""
    if not ids or (0 <= min(ids) and max(ids) < limit):
        return None
    return next(i for i in ids if not 0 <= i < limit)
