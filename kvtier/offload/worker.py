"""Worker side of offload: binds each step's plan, drives the parts that run it, reports back.

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

The worker is split as the media it moves between: a
:class:`~kvtier.offload.copies.CopyExecutor` copies between the device and the
host tier (with deadlines), a :class:`~kvtier.offload.tier_mover.TierMover`
moves blocks between the host tier and the lower tiers (with the write-back
ledger), and :class:`~kvtier.offload.completions.RequestCompletions` says which
requests are done; the worker binds the plan, drives them in the order above
and builds the reports.

Most steps of a serving engine ask nothing of the workers. :attr:`OffloadWorker.quiet`
says so in one attribute: :meth:`~OffloadWorker.take_report` sets it when every part
says it is idle (:attr:`OffloadWorker.idle`) and there are no lower tiers, whose threads
count on their own, and a plan that asks for anything clears it. While it is set, the
calls after an empty plan's :meth:`~OffloadWorker.bind` answer from it alone.

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

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.config.model import (
    DEFAULT_CLOSE_TIMEOUT_S,
    DEFAULT_COPY_DEADLINE_S,
    DEFAULT_FLUSH_DEADLINE_S,
)
from kvtier.copy.base import CopyBackend
from kvtier.keys import KeyNamespace
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout
from kvtier.offload.completions import LoadFailures, RequestCompletions
from kvtier.offload.copies import BackendFactory, CopyExecutor
from kvtier.offload.failures import FailureCause
from kvtier.offload.messages import Transfer, TransferPlan, WorkerReport
from kvtier.offload.tier_mover import TierMover
from kvtier.tiers.chain import TierChain
from kvtier.tiers.host import HostTier

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.plugins import Registry


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
        if close_timeout_s < 0 or flush_deadline_s < 0:
            raise ValueError(
                "close_timeout_s and flush_deadline_s must not be negative, got "
                f"{close_timeout_s} and {flush_deadline_s}"
            )
        self.layouts: tuple[KVLayout, ...] = (
            (layouts,) if isinstance(layouts, KVLayout) else tuple(layouts)
        )
        self.tier = tier
        self.close_timeout_s = close_timeout_s
        self.flush_deadline_s = flush_deadline_s
        self._copies = CopyExecutor(
            self.layouts,
            tier,
            backend_factory,
            copy_deadline_s=copy_deadline_s,
            clock=clock,
            sleep=sleep,
            on_end=self._ended,
        )
        self._mover = TierMover(chain, tier, clock=clock) if chain is not None else None
        self._requests = RequestCompletions(len(self.layouts))
        self._plan: TransferPlan | None = None
        self._flush_pending = False
        # Same-step loads of the bound plan, copied by load_same_step().
        self._same_step: list[Transfer] = []
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
            every = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
            # A record codec reads values only where every kv-cache group's records agree.
            same = all(layout.record_regions == first.record_regions for layout in every)
            chain = TierChain.from_config(
                config,
                record_bytes=first.record_bytes,
                keys=keys,
                registry=registry,
                report_blocks=report_blocks,
                regions=first.record_regions if same else (),
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
            self._copies.check(transfer)
        if plan.promotions or plan.demotions or plan.write_throughs:
            if self._mover is None:
                raise ValueError(
                    "the plan moves blocks to or from lower tiers, but this worker has none; "
                    "build the manager and the workers from the same config"
                )
            self._mover.check(plan)
        self._plan = plan
        self._flush_pending = plan.flush
        self._same_step = self._requests.bind(plan)

    def handle_preemptions(self) -> None:
        """If the bound plan asks for a flush, wait for every copy in flight."""
        if self._flush_pending:
            self.flush()

    def flush(self) -> None:
        """Wait for every submitted copy, each at most until its deadline, and record outcomes."""
        self._flush_pending = False
        self._copies.wait()

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
        self._copies.copy_now(transfers)

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
        copies, mover = self._copies, self._mover
        if self._same_step:  # the model ran before load_same_step() was called
            for transfer in self._same_step:
                copies.fail(
                    transfer,
                    FailureCause.LOAD_NOT_STARTED,
                    "the step's forward ran before its same-step load was copied",
                )
            self._same_step = []
        if plan is not None and not plan.empty:
            if mover is not None:
                mover.write_down(plan)
            for transfer in plan.stores:
                if mover is not None:
                    mover.forget(transfer.host_slots)
                copies.submit(transfer)
            for transfer in plan.loads:
                if transfer.request_id not in plan.same_step:
                    copies.submit(transfer)
            if plan.promotions:
                assert mover is not None
                mover.promote(plan.promotions)
        copies.poll()
        if mover is not None:
            mover.poll(idle_step=plan is not None and plan.idle)
        return self._requests.take_finished(copies.inflight)

    def take_failed_load_blocks(self) -> set[int]:
        """Device block ids whose loads failed since the last call: recompute them."""
        return self._requests.take_failed_load_blocks()

    def take_load_failures(self, loaded: Iterable[str]) -> LoadFailures:
        """The failed loads to report with ``loaded`` (from :meth:`get_finished`).

        With one kv-cache group, every device block whose load failed since the
        last call. With several, block ids repeat across groups, so the
        requests of ``loaded`` with a failed block are named instead (the
        engine recomputes them from their first loaded block).
        """
        return self._requests.take_load_failures(loaded)

    def take_report(self) -> WorkerReport | None:
        """This worker's completions since the last call, or ``None`` if there are none.

        Sets :attr:`quiet` when nothing is left to do or to report."""
        if self.quiet:
            return None  # most steps
        copies, mover = self._copies, self._mover
        if mover is None:
            if not copies.has_outcomes:
                self.quiet = self.idle
                return None
            report = WorkerReport(**copies.take_outcomes()._asdict())
            self.quiet = self.idle
            return report
        moved = mover.take_outcomes()  # the tiers' threads count on their own: never quiet
        if moved is None:
            if not copies.has_outcomes:
                return None
            return WorkerReport(**copies.take_outcomes()._asdict())
        return WorkerReport(**copies.take_outcomes()._asdict(), **moved._asdict())

    @property
    def idle(self) -> bool:
        """Whether nothing is bound, in flight, waiting or left to report, and the worker is
        open: each part says so of itself (the lower tiers' own threads aside)."""
        return (
            self._plan is None
            and not self._flush_pending
            and not self._same_step
            and not self._closed
            and self._copies.idle
            and self._requests.idle
            and (self._mover is None or self._mover.idle)
        )

    @property
    def chain(self) -> TierChain | None:
        """This rank's tiers below the host tier, if any."""
        return self._mover.chain if self._mover is not None else None

    @property
    def copy_deadline_s(self) -> float:
        """Seconds after its submission at which a copy still running is abandoned."""
        return self._copies.copy_deadline_s

    @property
    def flush_counts(self) -> Mapping[str, Mapping[str, int]]:
        """Per write_back or write_through tier, what :meth:`close` wrote of the blocks it
        lacked (``FLUSH_COUNTERS`` names the counts); empty before the close."""
        return self._mover.flush_counts if self._mover is not None else {}

    @property
    def num_inflight(self) -> int:
        """Batches submitted and not finished (abandoned ones not included)."""
        return len(self._copies.inflight)

    @property
    def num_abandoned(self) -> int:
        """Abandoned copies that may still be running."""
        return self._copies.num_abandoned

    @property
    def failure_counts(self) -> Mapping[FailureCause, int]:
        """This worker's failures so far, by cause."""
        return self._copies.failure_counts

    def take_stats(self) -> dict[FailureCause, int]:
        """This worker's failures since the last call, by cause (empty when there were none)."""
        if self.quiet:
            return {}
        return self._copies.take_failures()

    def close(self) -> None:
        """Wait at most ``close_timeout_s`` for copies, flush, then close the backends and tiers.

        Copies still running after that are abandoned; their backends and the
        host tier are then left open (their memory deliberately not freed) so
        that a late copy writes nothing freed. The flush writes the blocks still
        in the host tier to the ``write_back`` and ``write_through`` tiers that lack them
        (:mod:`~kvtier.offload.moves` says which), in puts of
        :data:`~kvtier.offload.tier_mover.FLUSH_BATCH_BLOCKS`, each waited for; once
        ``flush_deadline_s`` passed, the rest are skipped. Both are counted in
        :attr:`flush_counts` and logged. Idempotent.
        """
        if self._closed:
            return
        self.quiet = False
        self._flush_pending = False
        every_copy_over = self._copies.close(self.close_timeout_s)
        if self._mover is not None:
            self._mover.close(self.flush_deadline_s)
        if every_copy_over:
            self.tier.close()
        self._closed = True

    def _ended(self, transfer: Transfer, ok: bool) -> None:
        """A copy ended: a store's blocks are owed to the lower tiers, a load's request hears."""
        if ok and transfer.block_hashes and self._mover is not None:
            self._mover.owe_stored(transfer)
        self._requests.ended(transfer, ok)
