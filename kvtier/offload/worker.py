"""Worker-side offload executor: runs each step's plan with a copy backend and reports back.

The worker owns all bytes (the engine's KV tensors through their
:class:`~kvtier.layout.KVLayout`, the :class:`~kvtier.tiers.HostTier` buffer,
the copy backend) and knows nothing of policies. Every worker of an engine
runs the same plan on its own shard. An engine integration calls it in this
order each step:

1. :meth:`OffloadWorker.bind` — this step's :class:`TransferPlan`.
2. :meth:`OffloadWorker.handle_preemptions` — before the engine reuses any
   device block: if the plan asks for a flush, wait for every copy in flight.
3. (the engine runs its model)
4. :meth:`OffloadWorker.get_finished` — submits the plan's stores and loads
   (behind the model's work on the current stream), polls copies in flight,
   and returns the finished requests whose held blocks may be freed and the
   requests whose loads completed.
5. :meth:`OffloadWorker.take_failed_load_blocks` — device blocks whose loads
   failed since the last call: the engine recomputes them.
6. :meth:`OffloadWorker.take_report` — the :class:`WorkerReport` for the
   scheduler-side :class:`~kvtier.offload.OffloadManager`.

:meth:`OffloadWorker.close` waits for everything in flight and frees the tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout, LayoutError
from kvtier.offload.messages import Transfer, TransferPlan, WorkerReport
from kvtier.tiers.host import HostTier, capacity_per_rank

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

BackendFactory = Callable[[KVLayout, torch.Tensor], CopyBackend]
"""Builds a copy backend for one layout over the host buffer."""


class OffloadWorker:
    """Executes transfer plans on one rank and tracks their completion."""

    def __init__(
        self,
        layouts: KVLayout | Sequence[KVLayout],
        tier: HostTier,
        backend_factory: BackendFactory,
    ) -> None:
        """Bind a worker to the engine's layouts and a host tier.

        Args:
            layouts: The resolved layout, or one per kv-cache group (groups may
                share one layout object; they then share one backend). Every
                layout's ``record_bytes`` must equal the tier's.
            tier: The host tier of this rank.
            backend_factory: ``factory(layout, host_buffer)`` returning a copy backend.

        Raises:
            LayoutError: If a layout's record size differs from the tier's.
        """
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
        self._plan: TransferPlan | None = None
        self._flush_pending = False
        self._inflight: dict[int, tuple[CopyBackend, CopyHandle, Transfer]] = {}
        self._done: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._loads_by_request: dict[str, set[int]] = {}
        self._holds: dict[str, set[int]] = {}
        self._failed_load_blocks: set[int] = set()
        self._closed = False

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        layouts: KVLayout | Sequence[KVLayout],
        *,
        world_size: int = 1,
        registry: Registry | None = None,
    ) -> OffloadWorker:
        """Build a worker, its host tier and copy backends from a validated config.

        The tier holds ``capacity_per_rank(config, world_size) // record_bytes``
        slots (what :meth:`OffloadManager.from_config
        <kvtier.offload.manager.OffloadManager.from_config>` assumes) and is
        pinned when the layout lives on a CUDA device.
        """
        from kvtier.plugins import default_registry

        registry = registry if registry is not None else default_registry()
        first = layouts if isinstance(layouts, KVLayout) else layouts[0]
        tier = HostTier.for_device(
            capacity_per_rank(config, world_size), first.record_bytes, first.device
        )

        def build_backend(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
            return registry.build(COPY_BACKEND, config.copy, layout, host_buffer)

        return cls(layouts, tier, build_backend)

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
        for transfer in (*plan.stores, *plan.loads):
            self._check(transfer)
        self._plan = plan
        self._flush_pending = plan.flush
        for transfer in plan.loads:
            assert transfer.request_id is not None
            self._loads_by_request.setdefault(transfer.request_id, set()).add(transfer.batch_id)
        for request_id, blocks in plan.unavailable.items():
            self._failed_load_blocks.update(blocks)
            self._loads_by_request.setdefault(request_id, set())
        for request_id, batch_ids in plan.holds.items():
            self._holds[request_id] = set(batch_ids)

    def handle_preemptions(self) -> None:
        """If the bound plan asks for a flush, wait for every copy in flight."""
        if self._flush_pending:
            self.flush()

    def flush(self) -> None:
        """Wait for every submitted copy and record its outcome."""
        self._flush_pending = False
        for batch_id in list(self._inflight):
            backend, handle, transfer = self._inflight.pop(batch_id)
            try:
                backend.wait(handle)
            except CopyError as exc:
                self._record(transfer, ok=False, error=exc)
            else:
                self._record(transfer, ok=True)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Submit the bound plan, poll copies in flight, and say which requests are done.

        Returns:
            ``(released, loaded)``: finished requests whose held device blocks
            may be freed as far as this worker is concerned, and requests whose
            loads completed on this worker (failed blocks are in
            :meth:`take_failed_load_blocks`).
        """
        if self._flush_pending:
            self.flush()
        plan, self._plan = self._plan, None
        if plan is not None:
            for transfer in (*plan.stores, *plan.loads):
                self._submit(transfer)
        for batch_id in list(self._inflight):
            backend, handle, transfer = self._inflight[batch_id]
            try:
                finished = backend.done(handle)
            except CopyError as exc:
                del self._inflight[batch_id]
                self._record(transfer, ok=False, error=exc)
                continue
            if finished:
                del self._inflight[batch_id]
                self._record(transfer, ok=True)
        loaded = self._pop_settled(self._loads_by_request)
        released = self._pop_settled(self._holds)
        return released, loaded

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

    def take_report(self) -> WorkerReport | None:
        """This worker's completions since the last call, or ``None`` if there are none."""
        if not (self._done or self._failed):
            return None
        report = WorkerReport(done=self._done, failed=self._failed)
        self._done, self._failed = {}, {}
        return report

    @property
    def num_inflight(self) -> int:
        """Batches submitted and not finished."""
        return len(self._inflight)

    def close(self) -> None:
        """Wait for copies in flight, close the backends and the host tier. Idempotent."""
        if self._closed:
            return
        self.flush()
        for backend in self._backends:
            backend.close()
        self.tier.close()
        self._closed = True

    def _check(self, transfer: Transfer) -> None:
        if not 0 <= transfer.group < len(self.layouts):
            raise ValueError(
                f"transfer {transfer.batch_id} is for kv-cache group {transfer.group}, but this "
                f"worker has layouts for {len(self.layouts)} groups"
            )
        num_blocks = self.layouts[transfer.group].num_blocks
        for slot in transfer.host_slots:
            if not 0 <= slot < self.tier.num_slots:
                raise ValueError(
                    f"transfer {transfer.batch_id} names host slot {slot}, but this worker's tier "
                    f"has {self.tier.num_slots} slots; size the manager and the workers from "
                    "the same config and record size"
                )
        for block in transfer.device_blocks:
            if not 0 <= block < num_blocks:
                raise ValueError(
                    f"transfer {transfer.batch_id} names device block {block}, but group "
                    f"{transfer.group}'s layout has {num_blocks} blocks"
                )

    def _submit(self, transfer: Transfer) -> None:
        backend = self._group_backends[transfer.group]
        batch = CopyBatch(transfer.direction, transfer.device_blocks, transfer.host_slots)
        try:
            handle = backend.submit(batch)
        except CopyError as exc:
            self._record(transfer, ok=False, error=exc)
            return
        self._inflight[transfer.batch_id] = (backend, handle, transfer)

    def _record(self, transfer: Transfer, *, ok: bool, error: Exception | None = None) -> None:
        counts = self._done if ok else self._failed
        counts[transfer.batch_id] = counts.get(transfer.batch_id, 0) + 1
        if not ok:
            logger.warning(
                "%s batch %d of %d blocks failed: %s",
                transfer.direction.value,
                transfer.batch_id,
                len(transfer),
                error,
            )
            if transfer.direction is Direction.LOAD:
                self._failed_load_blocks.update(transfer.device_blocks)
