"""The worker half of the vLLM connector: vLLM's KV tensors and step hooks onto an OffloadWorker.

Call sequence in one engine step, inside ``GPUModelRunner.execute_model``
(the CPU runner inherits it):

1. :meth:`KVTierWorker.handle_preemptions` — before the step's inputs are
   prepared: if requests were preempted, wait for copies still reading their
   blocks.
2. :meth:`KVTierWorker.bind` — the plan for this step.
3. :meth:`KVTierWorker.load_same_step` — before the forward, on steps that
   run a request in the step that loads its tier hit: copy those loads and
   wait for them.
4. (the forward pass; other loads run between steps while their requests
   wait, and stores copy whole blocks after it, so nothing happens per layer)
5. :meth:`KVTierWorker.get_transfer_results` — submits the plan's stores and
   loads (behind the forward on the device) and names finished loads and
   finished requests whose blocks may be freed; with several kv-cache groups,
   requests whose load failed.
6. :meth:`KVTierWorker.get_block_ids_with_load_errors` — with one group, the
   device blocks whose loads failed (same-step loads included), so vLLM
   recomputes them.
7. :meth:`KVTierWorker.stats` — the worker's failures by cause, for vLLM's metrics.
8. :meth:`KVTierWorker.take_report` — the worker's report for the scheduler.

With sleep mode (vLLM 0.33), :meth:`KVTierWorker.suspend` runs before the KV
cache is unmapped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.stats import KVTierStats
from kvtier.kinds import LAYOUT_RESOLVER
from kvtier.layout.base import KVCaches, KVLayout
from kvtier.offload import OffloadWorker, TransferPlan, WorkerReport
from kvtier.plugins import default_registry

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

_VLLM_VIEW_DIMS = 4
"""vLLM hands connectors one ``[blocks, heads, tokens, bytes-or-elements]`` view per layer."""


def manager_block_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVCaches:
    """vLLM's per-layer views with one entry of dimension 0 per scheduler block.

    When attention kernels need smaller blocks than the scheduler's, vLLM
    views each layer in kernel blocks: ``[num_blocks * k, H, N / k, C]``.
    Those views become ``[num_blocks, k, H, N / k, C]``, so block ``i`` is the
    block the scheduler names ``i``.
    """
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    views: KVCaches = {}
    for name, tensor in kv_caches.items():
        kernel_blocks = tensor.dim() == _VLLM_VIEW_DIMS and tensor.shape[0] != num_blocks
        views[name] = group_kernel_blocks(tensor, num_blocks) if kernel_blocks else tensor
    return views


class KVTierWorker:
    """The worker-side connector: wraps an :class:`~kvtier.offload.OffloadWorker`."""

    def __init__(
        self,
        config: KVTierConfig,
        kv_cache_config: KVCacheConfig,
        *,
        world_size: int,
        record_bytes: int,
        model: str = "",
        report_blocks: bool = False,
    ) -> None:
        """``report_blocks``: vLLM publishes KV-cache events, so reports name the blocks the
        lower tiers stored and removed (see :meth:`kvtier.offload.OffloadWorker.from_config`)."""
        self.config = config
        self.report_blocks = report_blocks
        self.model = model
        self.kv_cache_config = kv_cache_config
        self.world_size = world_size
        self.record_bytes = record_bytes
        # Built in register_kv_caches, once vLLM allocated the tensors.
        self.offload: OffloadWorker | None = None
        self._failed_blocks: frozenset[int] = frozenset()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Resolve vLLM's KV tensors, per kv-cache group, and build the offload worker.

        Raises:
            ValueError: A group resolves to blocks of another size than vLLM's KV-cache config.
        """
        registry = default_registry()
        resolver = registry.build(LAYOUT_RESOLVER, self.config.layout)
        views = manager_block_views(kv_caches, self.kv_cache_config.num_blocks)
        groups = self.kv_cache_config.kv_cache_groups
        layouts: list[KVLayout]
        if len(groups) <= 1:
            layouts = [resolver.resolve(views)]
        else:
            layouts = [
                resolver.resolve({name: views[name] for name in group.layer_names})
                for group in groups
            ]
        for group, layout in enumerate(layouts):
            if layout.record_bytes != self.record_bytes:
                raise ValueError(
                    f"kv-cache group {group} resolved to {layout.record_bytes}-byte blocks, but "
                    f"vLLM's KV-cache config says {self.record_bytes}; set the layout type "
                    "explicitly in kv_connector_extra_config (e.g. block_first)"
                )
        self.offload = OffloadWorker.from_config(
            self.config,
            layouts,
            world_size=self.world_size,
            registry=registry,
            rank=self._rank(),
            model=self.model,
            report_blocks=self.report_blocks,
        )

    def _rank(self) -> int:
        """This worker's rank among the engine's ``world_size`` workers (0 outside a group)."""
        from vllm.distributed.parallel_state import get_world_group, model_parallel_is_initialized

        return get_world_group().rank_in_group if model_parallel_is_initialized() else 0

    @property
    def quiet(self) -> bool:
        """Whether the worker has nothing in flight, waiting or left to report
        (:attr:`kvtier.offload.OffloadWorker.quiet`) and no failed load to hand vLLM: an
        empty plan then leaves every call of the step with nothing to do."""
        offload = self.offload
        return offload is not None and offload.quiet and not self._failed_blocks

    def handle_preemptions(self, plan: TransferPlan) -> None:
        """Before vLLM reuses preempted requests' blocks: wait for copies still reading them."""
        if self.offload is not None and plan.flush:
            self.offload.flush()

    def bind(self, plan: TransferPlan) -> None:
        """Take this step's plan (submitted in :meth:`get_transfer_results`)."""
        if self.offload is not None:
            self.offload.bind(plan)

    def load_same_step(self) -> None:
        """Before the forward: copy the loads of requests this step runs, and wait for them."""
        if self.offload is not None:
            self.offload.load_same_step()

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """Submit the plan; return finished sending, finished receiving and failed receiving.

        ``finished_sending`` names finished requests whose held blocks may be
        freed; ``finished_recving`` requests whose loads ended; ``failed_recving``
        those of them that must be recomputed (several kv-cache groups only;
        with one, failed blocks go to :meth:`get_block_ids_with_load_errors`).
        """
        offload = self.offload
        if offload is None:
            return set(), set(), set()
        released, loaded = offload.get_finished()
        if offload.quiet:
            return released, loaded, set()  # most decode steps
        failures = offload.take_load_failures(loaded)
        if failures.blocks:
            self._failed_blocks |= failures.blocks
        return released, loaded, set(failures.requests)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose loads failed since the last call: vLLM recomputes them."""
        failed, self._failed_blocks = self._failed_blocks, frozenset()
        return set(failed)

    def stats(self) -> KVTierStats | None:
        """This rank's failures since the last call, by cause, or ``None`` if there were none."""
        new = self.offload.take_stats() if self.offload is not None else None
        if not new:
            return None  # most steps
        stats = KVTierStats()
        for cause, count in new.items():
            stats.record("failures", count, label=cause.value)
        return stats

    def take_report(self) -> WorkerReport | None:
        """This worker's completions since the last call, for the scheduler."""
        return self.offload.take_report() if self.offload is not None else None

    def suspend(self) -> None:
        """Before sleep mode unmaps the KV cache: wait until no copy touches it.

        Nothing is needed on wake-up: vLLM maps the KV cache back at the same
        addresses, so the resolved layouts stay valid.
        """
        if self.offload is not None:
            self.offload.flush()

    def shutdown(self) -> None:
        """Close the offload worker (waits a bounded time for copies in flight)."""
        if self.offload is not None:
            self.offload.close()
            self.offload = None
