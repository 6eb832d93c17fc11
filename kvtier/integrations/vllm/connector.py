"""KVTierConnector: vLLM's KV-connector API (v1, vLLM 0.32) mapped onto ``kvtier.offload``.

vLLM builds one connector per process: a *scheduler* connector next to the
scheduler (in the engine-core process) and a *worker* connector in every
worker (``world_size`` of them under tensor or pipeline parallelism). The
scheduler side wraps an :class:`~kvtier.offload.OffloadManager`, the worker
side an :class:`~kvtier.offload.OffloadWorker`. This module only translates
vLLM objects into manager and worker calls; the decisions live in
``kvtier.offload``.

Call sequence in vLLM 0.32, one engine step (``EngineCore.step``):

Scheduler process, inside ``Scheduler.schedule()``:

1. ``get_num_new_matched_tokens(request, n)`` — for a waiting request whose
   ``num_computed_tokens`` is 0 (new, or preempted and restarting), after
   vLLM's own prefix-cache lookup; ``n`` is the block-aligned local hit. We
   answer with :meth:`OffloadManager.lookup` and ask for an asynchronous load.
   May be called again for the same request if allocation fails.
2. ``update_state_after_alloc(request, blocks, num_external_tokens)`` — after
   vLLM allocated device blocks for the request; a request that loads
   asynchronously gets a second call when it is scheduled after its load.
   We call :meth:`OffloadManager.allocated`; the request then waits in
   ``WAITING_FOR_REMOTE_KVS`` until every worker reported its load.
3. ``build_connector_meta(scheduler_output)`` — once per step, after
   scheduling: preempted requests (:meth:`OffloadManager.preempted`), every
   scheduled request's new block ids and computed-token count
   (:meth:`OffloadManager.scheduled`), lazy-mode candidates from vLLM's free
   block queue, then :meth:`OffloadManager.build_plan`. The plan travels to
   the workers inside :class:`KVTierMetadata`.

Worker process(es), inside ``GPUModelRunner.execute_model`` (the CPU runner
inherits it):

4. ``handle_preemptions(metadata)`` — before the step's inputs are prepared:
   if requests were preempted, wait for copies still reading their blocks.
5. ``bind_connector_metadata(metadata)`` — the plan for this step.
6. ``start_load_kv`` / ``wait_for_layer_load`` / ``save_kv_layer`` — nothing
   to do: loads are asynchronous (requests wait for them outside the forward)
   and stores copy whole blocks after it.
7. (the forward pass)
8. ``wait_for_save()`` then ``get_transfer_results(finished_req_ids)`` — we
   submit the plan's stores and loads (after the forward, so stores read
   finished blocks) and report finished loads (``finished_recving``) and
   finished requests whose blocks may be freed (``finished_sending``).
9. ``get_block_ids_with_load_errors()`` — device blocks whose loads failed,
   so vLLM recomputes them (with several kv-cache groups, block ids are not
   unique and the requests go to ``failed_recving`` instead).
10. ``build_connector_worker_meta()`` — the worker's
    :class:`~kvtier.offload.WorkerReport` for the scheduler.

Back in the scheduler process, ``Scheduler.update_from_output()``:

11. ``request_finished_all_groups(request, block_ids)`` (``request_finished``
    without the hybrid allocator) — for each request that finished this step,
    before its blocks are freed: :meth:`OffloadManager.finished` says whether
    vLLM must keep them until copies reading them (the last blocks of the
    request among them) complete.
12. ``update_connector_output(output)`` — the reports of all workers, merged:
    :meth:`OffloadManager.process`. vLLM itself counts ``finished_sending``
    and ``finished_recving`` until all ``world_size`` workers named a request.
13. ``get_kv_connector_stats()`` then ``take_events()`` — metrics and KV-cache
    events for this step.

Any time: ``reset_cache()`` (from ``LLM.reset_prefix_cache(reset_connector=True)``)
empties the tier at once (:meth:`OffloadManager.reset`); it answers ``False``
while copies in flight still hold slots, which they free as they complete:
vLLM does not call again and need not. ``has_pending_push_work()`` keeps a
served engine stepping until in-flight copies are reported (or, for a rank
that never reports, until ``report_deadline_s`` fails them).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
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
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvtier.config import KVTierConfig, load_config
from kvtier.index.base import EventKind
from kvtier.integrations.vllm.stats import OFFLOAD_COUNTERS, KVTierPromMetrics, KVTierStats
from kvtier.keys import KeyNamespace
from kvtier.kinds import LAYOUT_RESOLVER
from kvtier.offload import (
    LazyCandidate,
    OffloadManager,
    OffloadStats,
    OffloadWorker,
    TransferPlan,
    WorkerReport,
)
from kvtier.plugins import default_registry

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

EVENT_MEDIUM = "CPU"
"""The ``medium`` of the KV-cache events the host tier publishes."""

LAZY_HEADROOM = 2
"""Lazy mode keeps the first this-many steps' worth of blocks of vLLM's free queue stored."""


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


def connector_config(vllm_config: VllmConfig) -> KVTierConfig:
    """Validate ``kv_connector_extra_config`` (plus ``KVTIER_*`` variables and files) as kvtier's.

    Raises:
        kvtier.config.ConfigError: One line per problem; the lines are also logged.
    """
    from kvtier.config import ConfigError

    transfer_config = vllm_config.kv_transfer_config
    extra = dict(transfer_config.kv_connector_extra_config) if transfer_config else {}
    try:
        return load_config(extra)
    except ConfigError as exc:
        for line in exc.lines:
            logger.error("kv_connector_extra_config: %s", line)
        raise


def group_windows_of(kv_cache_config: KVCacheConfig, block_tokens: int) -> list[int | None]:
    """Blocks a prefix hit needs per kv-cache group: all (``None``) or only the last few.

    A sliding-window group needs the blocks its window spans; a Mamba group
    needs only its last state block.
    """
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    windows: list[int | None] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windows.append(-(-spec.sliding_window // block_tokens) + 1)
        elif isinstance(spec, MambaSpec):
            windows.append(1)
        else:
            windows.append(None)
    return windows


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
        """Validate the kvtier config and build the scheduler or worker half.

        Raises:
            kvtier.config.ConfigError: ``kv_connector_extra_config`` is invalid.
            ValueError: The engine's KV cache has a shape kvtier cannot store.
        """
        self.config = connector_config(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self.world_size = vllm_config.parallel_config.world_size
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.record_bytes = record_bytes_of(kv_cache_config)
        self.manager: OffloadManager | None = None
        # The worker half is built in register_kv_caches, once the tensors exist.
        self.worker: OffloadWorker | None = None
        self._bound_loads: dict[int, str] = {}
        self._unavailable_requests: set[str] = set()
        self._report: WorkerReport | None = None
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()
        self._enabled = vllm_config.cache_config.enable_prefix_caching
        if not self._enabled:
            logger.warning(
                "kvtier is disabled: vLLM's prefix caching is off, and kvtier finds blocks "
                "by vLLM's prefix hashes; remove --no-enable-prefix-caching to use it"
            )
        elif role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, kv_cache_config)

    # ------------------------------------------------------------------ scheduler

    def _init_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_tokens, hash_block_tokens = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if block_tokens != hash_block_tokens:
            raise ValueError(
                f"kvtier needs vLLM's prefix hashes per block, but blocks hold {block_tokens} "
                f"tokens and hashes cover {hash_block_tokens}; unset prefix_match_unit"
            )
        self.config.host_slots(self.record_bytes, self.world_size)
        transfer_config = vllm_config.kv_transfer_config
        if transfer_config is not None and transfer_config.kv_load_failure_policy != "recompute":
            # A tier miss is always recoverable: recompute instead of failing the request.
            logger.info("kvtier sets kv_load_failure_policy to 'recompute'")
            transfer_config.kv_load_failure_policy = "recompute"
        events = vllm_config.kv_events_config
        self._record_events = bool(events is not None and events.enable_kv_cache_events)
        self.block_tokens = block_tokens
        self.manager = OffloadManager.from_config(
            self.config,
            block_tokens=block_tokens,
            record_bytes=self.record_bytes,
            world_size=self.world_size,
            num_groups=self.num_groups,
            namespace=KeyNamespace(model=vllm_config.model_config.model),
            null_block_id=0,
            record_events=self._record_events,
            group_windows=group_windows_of(kv_cache_config, block_tokens),
        )
        self._block_pool: BlockPool | None = None
        self._requests: dict[str, Request] = {}
        self._lookup_base: dict[str, int] = {}
        self._waiting_finished: set[str] = set()
        # Requests whose tier load failed recompute instead: a retry must not load again.
        self._load_failed: set[str] = set()
        # Finished requests stay in _requests until their blocks' events are published.
        self._forget_after_events: list[str] = []
        self._lazy_protected: set[int] = set()
        self._lazy_target = LAZY_HEADROOM * -(
            -vllm_config.scheduler_config.max_num_batched_tokens // block_tokens
        )
        self._reported = OffloadStats()
        logger.info(
            "kvtier: %s mode, %d host slots of %d bytes per rank, world size %d, %d group(s)",
            self.config.store_mode,
            self.manager.index.num_slots,
            self.record_bytes,
            self.world_size,
            self.num_groups,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped store is only a future miss: never make vLLM recompute for it.
        return False

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._block_pool = gpu_block_pool

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.manager is None or request.request_id in self._load_failed:
            return 0, False
        self._lookup_base[request.request_id] = num_computed_tokens
        # The manager leaves the last token to the engine. vLLM recomputes the last token of
        # a fully loaded request itself (it rewinds num_computed_tokens by one after an
        # asynchronous load), so the tier may also serve the block holding that token.
        hit_tokens = self.manager.lookup(
            request.request_id, request.block_hashes, num_computed_tokens, request.num_tokens + 1
        )
        return hit_tokens, hit_tokens > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.manager is None:
            return
        self._requests[request.request_id] = request
        base = self._lookup_base.pop(request.request_id, request.num_computed_tokens)
        self.manager.allocated(
            request.request_id,
            request.block_hashes,
            blocks.get_block_ids(),
            num_computed_tokens=base,
            num_external_tokens=num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        if self.manager is None:
            return KVTierMetadata(TransferPlan())
        manager = self.manager
        if scheduler_output.preempted_req_ids:
            manager.preempted(scheduler_output.preempted_req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            manager.scheduled(
                new.req_id,
                num_computed_tokens=new.num_computed_tokens + scheduled.get(new.req_id, 0),
                new_block_ids=new.block_ids,
                block_hashes=request.block_hashes if request is not None else None,
                resumed=True,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._requests.get(req_id)
            manager.scheduled(
                req_id,
                num_computed_tokens=cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                new_block_ids=cached.new_block_ids[i],
                block_hashes=request.block_hashes if request is not None else None,
                resumed=req_id in cached.resumed_req_ids,
            )
        plan = manager.build_plan(self._lazy_candidates())
        if self.config.store_mode == "lazy" and plan.stores and self._block_pool is not None:
            # Keep vLLM from reusing the blocks until their stores completed.
            protect = [b for transfer in plan.stores for b in transfer.device_blocks]
            self._block_pool.touch([self._block_pool.blocks[b] for b in protect])
            self._lazy_protected.update(protect)
        stale = self._waiting_finished & plan.holds.keys()
        if stale:
            # vLLM frees these when their loads report in; a hold would free them twice.
            self._waiting_finished -= stale
            plan = dataclasses.replace(
                plan, holds={r: b for r, b in plan.holds.items() if r not in stale}
            )
        return KVTierMetadata(plan)

    def _lazy_candidates(self) -> list[LazyCandidate]:
        if self.config.store_mode != "lazy" or self._block_pool is None:
            return []
        candidates = []
        frontier = self._block_pool.free_block_queue.iter_blocks_after(None)
        for block in itertools.islice(frontier, self._lazy_target):
            if block.block_hash is None or block.is_null:
                continue
            candidates.append(
                LazyCandidate(
                    get_block_hash(block.block_hash), get_group_id(block.block_hash), block.block_id
                )
            )
        return candidates

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.manager is None:
            return
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, KVTierWorkerMetadata) else None
        progress = self.manager.process(report)
        self._forget_after_events.extend(progress.released_requests)
        self._load_failed.update(progress.failed_loads)
        if self._lazy_protected and progress.stored_blocks and self._block_pool is not None:
            protected = self._lazy_protected
            done = [b.block_id for b in progress.stored_blocks if b.block_id in protected]
            self._lazy_protected.difference_update(done)
            self._block_pool.free_blocks(self._block_pool.blocks[b] for b in done)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.manager is None:
            return False, None
        request_id = request.request_id
        self._lookup_base.pop(request_id, None)
        self._load_failed.discard(request_id)
        hold = self.manager.finished(request_id, request.num_computed_tokens)
        if not hold:
            self._forget_after_events.append(request_id)
        if hold and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._waiting_finished.add(request_id)
            return False, None
        return hold, None

    def has_pending_push_work(self) -> bool:
        return self.manager is not None and self.manager.num_inflight_batches > 0

    def reset_cache(self) -> bool | None:
        """Empty the tier now; see :meth:`OffloadManager.reset`.

        vLLM calls this once per ``reset_prefix_cache(reset_connector=True)``
        and never retries. ``True``: every slot is free. ``False``: nothing
        stored before the reset will be served, but copies in flight still hold
        some slots and free them as they complete; vLLM then returns ``False``
        from ``reset_prefix_cache`` and does not mark its connector prefix-cache
        stats as reset, and nobody needs to call again.
        """
        if self.manager is None:
            return None
        return self.manager.reset()

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.manager is None:
            return ()
        events = self._convert_events() if self._record_events else []
        for request_id in self._forget_after_events:
            self._requests.pop(request_id, None)
        self._forget_after_events.clear()
        return events

    def _convert_events(self) -> list[KVCacheEvent]:
        assert self.manager is not None
        events = self.manager.take_events()
        if not events:
            return []
        prefix_bytes = len(self.manager.namespace.prefix(0))
        tokens = self._tokens_by_hash(
            {event.key[prefix_bytes:] for event in events if event.kind is EventKind.STORED}
        )
        out: list[KVCacheEvent] = []
        for event in events:
            block_hash = event.key[prefix_bytes:]
            group = int.from_bytes(event.key[prefix_bytes - 2 : prefix_bytes], "little")
            if event.kind is EventKind.STORED:
                parent, token_ids = tokens.get(block_hash, (None, []))
                out.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(block_hash)],
                        parent_block_hash=parent,
                        token_ids=token_ids,
                        block_size=self.block_tokens,
                        lora_id=None,
                        medium=EVENT_MEDIUM,
                        lora_name=None,
                        group_idx=group,
                    )
                )
            else:
                out.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(block_hash)],
                        medium=EVENT_MEDIUM,
                        group_idx=group,
                    )
                )
        return out

    def _tokens_by_hash(self, wanted: set[bytes]) -> dict[bytes, tuple[Any, list[int]]]:
        """Parent hash and token ids of the live requests' full blocks whose hash is ``wanted``."""
        found: dict[bytes, tuple[Any, list[int]]] = {}
        if not wanted:
            return found
        for request in self._requests.values():
            hashes = request.block_hashes
            tokens = request.all_token_ids
            for i in range(len(hashes)):
                if hashes[i] not in wanted:
                    continue
                parent = maybe_convert_block_hash(hashes[i - 1]) if i else None
                start = i * self.block_tokens
                found[hashes[i]] = (parent, list(tokens[start : start + self.block_tokens]))
        return found

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.manager is None:
            return None
        now = self.manager.stats()
        last, self._reported = self._reported, now
        stats = KVTierStats()
        for name, field in OFFLOAD_COUNTERS.items():
            value = getattr(now, field) - getattr(last, field)
            if value:
                stats.record(name, value)
        if now.used_slots != last.used_slots or now.num_slots != last.num_slots:
            stats.record("used_blocks", now.used_slots)
            stats.record("capacity_blocks", now.num_slots)
            stats.record("used_bytes", now.used_slots * self.record_bytes)
            stats.record("capacity_bytes", now.num_slots * self.record_bytes)
        if now.quarantined_slots != last.quarantined_slots:
            stats.record("quarantined_blocks", now.quarantined_slots)
        return stats

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
        if not self._enabled:
            return
        registry = default_registry()
        resolver = registry.build(LAYOUT_RESOLVER, self.config.layout)
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) <= 1:
            layouts = [resolver.resolve(kv_caches)]
        else:
            layouts = [
                resolver.resolve({name: kv_caches[name] for name in group.layer_names})
                for group in groups
            ]
        for group, layout in enumerate(layouts):
            if layout.record_bytes != self.record_bytes:
                raise ValueError(
                    f"kv-cache group {group} resolved to {layout.record_bytes}-byte blocks, but "
                    f"vLLM's KV-cache config says {self.record_bytes}; set the layout type "
                    "explicitly in kv_connector_extra_config (e.g. block_first)"
                )
        self.worker = OffloadWorker.from_config(
            self.config, layouts, world_size=self.world_size, registry=registry
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, KVTierMetadata):
            if kv_connector_metadata.plan.flush:
                self.worker.flush()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is None or not isinstance(connector_metadata, KVTierMetadata):
            return
        plan = connector_metadata.plan
        self.worker.bind(plan)
        for transfer in plan.loads:
            assert transfer.request_id is not None
            self._bound_loads[transfer.batch_id] = transfer.request_id
        self._unavailable_requests.update(plan.unavailable)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: loads run between steps while their requests wait."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: no load targets a block the running forward reads."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: whole blocks are stored after the forward."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: stores are submitted in :meth:`get_transfer_results`."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        released, loaded = self.worker.get_finished()
        report = self.worker.take_report()
        if report is not None:
            self._report = report if self._report is None else self._report.merge(report)
            # An abandoned load is a failed one for vLLM: it recomputes the blocks.
            unfinished = (*report.failed, *report.abandoned)
            failed = {self._bound_loads[b] for b in unfinished if b in self._bound_loads}
            for batch_id in (*report.done, *unfinished):
                self._bound_loads.pop(batch_id, None)
        else:
            failed = set()
        self._failed_blocks |= self.worker.take_failed_load_blocks()
        if self.num_groups > 1:
            # Block ids repeat across groups, so vLLM takes failures per request.
            self._failed_requests |= failed | (self._unavailable_requests & loaded)
            self._failed_blocks.clear()
        self._unavailable_requests -= loaded
        failed_recving = self._failed_requests & loaded
        self._failed_requests -= failed_recving
        return KVConnectorTransferResults(
            finished_sending=released, finished_recving=loaded, failed_recving=failed_recving
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        report, self._report = self._report, None
        return KVTierWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
