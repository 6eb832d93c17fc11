"""KVTierConnector: vLLM's KV-connector API (v1; vLLM 0.32 and 0.33) mapped onto ``kvtier.offload``.

vLLM builds one connector per process: a *scheduler* connector next to the
scheduler (in the engine-core process) and a *worker* connector in every
worker (``world_size`` of them under tensor or pipeline parallelism). The
connector only delegates: the scheduler role to a
:class:`~kvtier.integrations.vllm.scheduler.KVTierScheduler` (which wraps an
:class:`~kvtier.offload.OffloadManager`), the worker role to a
:class:`~kvtier.integrations.vllm.worker.KVTierWorker` (which wraps an
:class:`~kvtier.offload.OffloadWorker`). Those modules list the call sequence
of one engine step. What differs between vLLM releases is named by the
:class:`~kvtier.integrations.vllm.adapters.VllmAdapter` of the installed one.

One message goes down each step (:class:`KVTierMetadata`, the plan) and one
comes back from every worker (:class:`KVTierWorkerMetadata`, its report),
which vLLM merges before the scheduler sees it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from kvtier.config import ConfigError, KVTierConfig, Problem, load_config
from kvtier.integrations.lifeline import stop_with_parent
from kvtier.integrations.vllm.adapters import VllmAdapter, adapter_for
from kvtier.integrations.vllm.logs import join_vllm_logging, startup_summary
from kvtier.integrations.vllm.scheduler import KVTierScheduler, publishes_kv_events
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.offload import OffloadManager, TransferPlan, WorkerReport
from kvtier.offload.messages import NO_PLAN

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

VLLM: VllmAdapter = adapter_for()
"""The adapter of the installed vLLM release."""


@dataclasses.dataclass
class KVTierMetadata(KVConnectorMetadata):
    """What the scheduler connector sends every worker connector each step."""

    plan: TransferPlan


@dataclasses.dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker connector sends back each step; vLLM merges all workers' with ``aggregate``."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot merge {type(other).__name__} into KVTierWorkerMetadata")
        return KVTierWorkerMetadata(self.report.merge(other.report))


class ConfigRefused(ConfigError):
    """kvtier refused to start in vLLM; its problems were logged, one line each, just before.

    vLLM prints the traceback of a connector's start-up error in every process
    it passes through, so the message names the problems' count only and the
    lines themselves appear once, in vLLM's log. :attr:`lines` still holds them.
    """

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems)
        count = len(self.problems)
        self.args = (
            f"invalid kvtier configuration: {count} problem{'s' if count != 1 else ''}, logged "
            "above as 'kv_connector_extra_config: ...'; fix kv_connector_extra_config (or the "
            "KVTIER_* variables or the file it draws on)",
        )


def refuse(error: ConfigError) -> ConfigRefused:
    """Log ``error``'s lines once, as vLLM log records, and return the error to raise instead."""
    for line in error.lines:
        logger.error("kv_connector_extra_config: %s", line)
    return ConfigRefused(list(error.problems))


def connector_config(vllm_config: VllmConfig) -> KVTierConfig:
    """Validate ``kv_connector_extra_config`` (plus ``KVTIER_*`` variables and files) as kvtier's.

    Raises:
        ConfigRefused: One line per problem, logged before it is raised.
    """
    transfer_config = vllm_config.kv_transfer_config
    extra = dict(transfer_config.kv_connector_extra_config) if transfer_config else {}
    try:
        return load_config(extra)
    except ConfigError as exc:
        raise refuse(exc) from None


def record_bytes_of(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block across the layers of a kv-cache group: one host-tier record.

    Raises:
        ValueError: Groups differ in record size, which one host tier cannot hold.
    """
    sizes = {
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    }
    if len(sizes) != 1:
        raise ValueError(
            f"kv-cache groups have different bytes per block ({sorted(sizes)}); kvtier's host "
            "tier needs one record size for every group"
        )
    return sizes.pop()


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps prefix blocks evicted from vLLM's KV cache in kvtier's host tier and loads them back.

    Load it with ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
    "kv_connector_extra_config": {...}}'``; the extra config is a
    :class:`~kvtier.config.KVTierConfig`.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        """Validate the kvtier config and build the scheduler or the worker half.

        Raises:
            ConfigRefused: ``kv_connector_extra_config`` is invalid, or the host tier is
                smaller than one block or larger than the memory available (workers only).
            ValueError: The engine's KV cache has a shape kvtier cannot store, or an engine
                setting is one kvtier cannot serve on the installed vLLM.
        """
        join_vllm_logging()
        self.config = connector_config(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        VLLM.check(vllm_config)
        self.scheduler: KVTierScheduler | None = None
        self.worker: KVTierWorker | None = None
        self._idle_step = False
        """Worker role: the bound plan asks nothing and the worker had nothing left to do or
        to report (:attr:`KVTierWorker.quiet`), so this step's later calls answer at once."""
        if not vllm_config.cache_config.enable_prefix_caching:
            logger.warning(
                "kvtier is disabled: vLLM's prefix caching is off, and kvtier finds blocks "
                "by vLLM's prefix hashes; remove --no-enable-prefix-caching to use it"
            )
            return
        record_bytes = record_bytes_of(kv_cache_config)
        world_size = vllm_config.parallel_config.world_size
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        try:
            if role != KVConnectorRole.SCHEDULER:
                # This worker is about to allocate its rank's host tier.
                self.config.check_host_memory(world_size)
            summary = startup_summary(
                self.config, role=role_name, record_bytes=record_bytes, world_size=world_size
            )
        except ConfigError as exc:
            raise refuse(exc) from None
        logger.info("%s", summary)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KVTierScheduler(
                self.config, vllm_config, kv_cache_config, record_bytes=record_bytes
            )
            # A killed API server leaves vLLM's engine core running, its workers holding
            # the disk tier's files: stop it, so that the next engine can start.
            stop_with_parent("vLLM's engine core")
        else:
            self.worker = KVTierWorker(
                self.config,
                kv_cache_config,
                world_size=world_size,
                record_bytes=record_bytes,
                model=vllm_config.model_config.model,
                report_blocks=publishes_kv_events(vllm_config),
            )

    @property
    def manager(self) -> OffloadManager | None:
        """The scheduler connector's offload manager (``None`` in workers or when disabled)."""
        return self.scheduler.manager if self.scheduler is not None else None

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped store is only a future miss: never make vLLM recompute for it.
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks this before it lets sleep mode run with the connector."""
        return VLLM.sleep_hooks

    # ------------------------------------------------------------------ scheduler

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self.scheduler is not None:
            self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        if self.scheduler is None:
            return KVTierMetadata(TransferPlan())
        return KVTierMetadata(self.scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is None:
            return
        meta = connector_output.kv_connector_worker_meta
        if meta is None and not connector_output.finished_recving and self.scheduler.quiet:
            return  # most decode steps: nothing reported, nothing in flight
        self.scheduler.update_connector_output(
            meta.report if isinstance(meta, KVTierWorkerMetadata) else None,
            connector_output.finished_recving,
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request), None

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def reset_cache(self) -> bool | None:
        """Empty the tier now; see :meth:`KVTierScheduler.reset_cache`."""
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is not None:
            return self.scheduler.stats()
        if self.worker is None or self._idle_step:
            return None
        return self.worker.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --------------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 calls this before sleep mode unmaps the KV cache (see the adapters)."""
        if self.worker is not None:
            self.worker.suspend()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if (
            self.worker is not None
            and isinstance(kv_connector_metadata, KVTierMetadata)
            and kv_connector_metadata.plan.flush
        ):
            self.worker.handle_preemptions(kv_connector_metadata.plan)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Hand the step's plan to the worker half (see :meth:`has_connector_metadata`).

        Most decode steps plan nothing for a worker that has nothing in flight: the
        step's other calls then answer at once, without a visit to the worker half
        (each layer is code that the step's forward pushed out of the CPU's caches).
        """
        worker = self.worker
        if worker is None or not isinstance(connector_metadata, KVTierMetadata):
            return
        plan = connector_metadata.plan
        self._idle_step = (plan is NO_PLAN or plan.empty) and worker.quiet
        if not self._idle_step:
            worker.bind(plan)

    def has_connector_metadata(self) -> bool:
        """Always ``False``: nothing of the plan is for the attention layers.

        vLLM asks this in every attention layer's forward and, on ``True``, calls
        :meth:`wait_for_layer_load` before the layer and :meth:`save_kv_layer`
        after it; kvtier copies whole blocks between steps, so the step's plan
        stays with the worker half and vLLM skips both calls.
        """
        return False

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's same-step loads and wait for them; other loads run after the
        forward, while their requests wait."""
        if self.worker is not None and not self._idle_step:
            self.worker.load_same_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Not called (see :meth:`has_connector_metadata`): same-step loads completed in
        :meth:`start_load_kv`."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Not called (see :meth:`has_connector_metadata`): whole blocks are stored after
        the forward."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: stores are submitted in :meth:`get_transfer_results`."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None or self._idle_step:
            return KVConnectorTransferResults()
        sending, recving, failed_recving = self.worker.get_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed_recving
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None or self._idle_step:
            return set()
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        if self.worker is None or self._idle_step:
            return None
        report = self.worker.take_report()
        return KVTierWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
