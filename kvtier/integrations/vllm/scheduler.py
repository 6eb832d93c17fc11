"""The scheduler half of the vLLM connector: vLLM's requests and blocks in, manager calls out.

When vLLM adds a request to its queue, :meth:`KVTierScheduler.on_new_request`
starts reading its blocks held below the host tier (a prefetch,
:mod:`kvtier.offload.prefetch`), while it waits to be scheduled.

Call sequence in one engine step, inside ``Scheduler.schedule()``:

1. :meth:`KVTierScheduler.get_num_new_matched_tokens` — for a waiting request
   whose ``num_computed_tokens`` is 0 (new, or preempted and restarting), after
   vLLM's own prefix-cache lookup. The request's ``kv_transfer_params`` are read
   here, once (:mod:`kvtier.offload.control`); an invalid kvtier entry is logged
   and the request served as if it had none. A hit within this step's same-step budget
   is loaded at the start of this step and the request runs in it; a larger
   one is loaded asynchronously. vLLM may ask again for the same request if
   allocation fails.
2. :meth:`KVTierScheduler.update_state_after_alloc` — after vLLM allocated
   device blocks; a request that loads asynchronously gets a second call once
   its load finished and it is scheduled. It waits in
   ``WAITING_FOR_REMOTE_KVS`` until every worker reported its load.
3. :meth:`KVTierScheduler.build_plan` — once per step, after scheduling:
   preemptions, every scheduled request's new blocks and computed tokens,
   lazy-mode candidates from vLLM's free block queue, then the plan.

Then, in ``Scheduler.update_from_output()``:

4. :meth:`KVTierScheduler.request_finished` — for each finished request, before
   its blocks are freed: whether vLLM must keep them until copies reading them
   complete.
5. :meth:`KVTierScheduler.update_connector_output` — the merged reports of all
   workers (vLLM counts ``finished_sending`` / ``finished_recving`` until all
   ``world_size`` workers named a request).
6. :meth:`KVTierScheduler.stats` then :meth:`KVTierScheduler.take_events`.
   vLLM asks for the stats once for every step it scheduled, in the order it
   scheduled them, so this call ends the oldest step being timed: the cost
   guard's prefill speed is each step's scheduled tokens over the time from
   its plan to its stats.

Any time: :meth:`KVTierScheduler.reset_cache`.

The decisions (what to store and load, which hits load in the step that runs
them, lazy-store protection, which requests may not load again, which tokens an
event names) are :mod:`kvtier.offload`'s: this class drives an
:class:`~kvtier.offload.session.OffloadSession` in its order and only translates.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, cast

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
)

from kvtier.config import KVTierConfig
from kvtier.index.base import EventKind
from kvtier.integrations.vllm.running import RunningScan
from kvtier.integrations.vllm.stats import KVTierStats
from kvtier.keys import KeyNamespace
from kvtier.offload import (
    LazyCandidate,
    OffloadManager,
    TransferPlan,
    WorkerReport,
)
from kvtier.offload.control import RequestControl, RequestControlError, request_control
from kvtier.offload.events import Adapter, BlockEvent
from kvtier.offload.protection import LazyStoreGuard
from kvtier.offload.session import OffloadSession
from kvtier.offload.stats import OFFLOAD_HISTOGRAMS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LOCAL = "LOCAL"
REMOTE = "REMOTE"
"""The ``locality`` of an event: a store of this host, or one every engine of the fleet reaches."""


def event_place(event: BlockEvent) -> tuple[str, str, str | None]:
    """Where an event's block is, in vLLM's event fields: ``medium``, ``locality`` and
    ``ownership`` (the lower tier's name; ``None`` for the host tier)."""
    if event.tier is None:
        return MEDIUM_CPU, LOCAL, None
    return MEDIUM_STORAGE, REMOTE if event.shared else LOCAL, event.tier


def adapter_of(request: Request) -> Adapter | None:
    """The LoRA adapter ``request`` runs under, for its blocks' events (``None``: none)."""
    lora = request.lora_request
    return Adapter(lora.lora_int_id, lora.lora_name) if lora is not None else None


def publishes_kv_events(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV-cache events (``kv_events_config.enable_kv_cache_events``)."""
    events = vllm_config.kv_events_config
    return bool(events is not None and events.enable_kv_cache_events)


def publisher_connects(endpoint: str) -> bool:
    """Whether vLLM's ZMQ event publisher connects to ``endpoint`` rather than binding it:
    it binds a wildcard host (``tcp://*:5557``, ``tcp://[::]:5557``) and ``ipc://`` or
    ``inproc://`` addresses, and connects to every other (``tcp://10.0.0.5:5557``)."""
    wildcard = "*" in endpoint or "::" in endpoint
    return not wildcard and not endpoint.startswith(("ipc://", "inproc://"))


def warn_if_publisher_connects(vllm_config: VllmConfig) -> None:
    """Log a warning when vLLM's KV-event publisher will connect to its endpoint, where
    a subscriber that connects too hears nothing and no error says why."""
    events = vllm_config.kv_events_config
    if events is None or events.publisher != "zmq" or not publisher_connects(events.endpoint):
        return
    logger.warning(
        "KV events: vLLM's publisher connects to %s (an address with a host) instead of "
        "binding it, so the subscriber must bind that address; for the engine to bind, "
        "use a wildcard host such as tcp://*:<port>",
        events.endpoint,
    )


LAZY_HEADROOM = 2
"""Lazy mode keeps the first this-many steps' worth of blocks of vLLM's free queue stored."""


def group_windows_of(kv_cache_config: KVCacheConfig, block_tokens: int) -> list[int | None]:
    """Blocks a prefix hit needs per kv-cache group: all (``None``) or only the last few.

    A hit of ``k`` blocks starts computing at token ``k * block_tokens``, or one
    token earlier when vLLM recomputes the last token of a fully loaded
    prompt. A sliding-window layer then reads the ``sliding_window`` tokens
    before it at most: ``ceil(sliding_window / block_tokens)`` whole blocks
    before the hit point (vLLM itself keeps ``ceil((sliding_window - 1) /
    block_tokens)`` for its own hits and frees the rest). A Mamba group needs
    only its last state block.
    """
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    windows: list[int | None] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windows.append(-(-spec.sliding_window // block_tokens))
        elif isinstance(spec, MambaSpec):
            windows.append(1)
        else:
            windows.append(None)
    return windows


def tenant_salt(request: Request) -> bytes | None:
    """The request's ``cache_salt`` as the tiers take it (``None`` without one): their records
    of its blocks are sealed for the tenant that names it."""
    salt = request.cache_salt
    return salt.encode() if salt else None


def lazy_frontier_blocks(num_groups: int, max_num_batched_tokens: int, block_tokens: int) -> int:
    """How far down vLLM's free block queue lazy mode stores: :data:`LAZY_HEADROOM` steps' worth.

    One step may allocate a block in every kv-cache group for each block's
    worth of scheduled tokens; a block reused before lazy mode saw it at the
    frontier is lost to the tier, and in a hybrid model a lost full-attention
    block cuts every later hit short.
    """
    return LAZY_HEADROOM * num_groups * -(-max_num_batched_tokens // block_tokens)


class FreeQueueFrontier:
    """vLLM's free block queue as the tier's eviction frontier: its first ``count`` blocks."""

    def __init__(self, pool: BlockPool, count: int) -> None:
        self.pool = pool
        self.count = count

    def signature(self) -> tuple[int, int]:
        queue = self.pool.free_block_queue
        first = next(queue.iter_blocks_after(None), None)
        return queue.num_free_blocks, first.block_id if first is not None else -1

    def blocks(self) -> Iterator[tuple[int, BlockHashWithGroupId]]:
        frontier = self.pool.free_block_queue.iter_blocks_after(None)
        for block in itertools.islice(frontier, self.count):
            if block.block_hash is not None and not block.is_null:
                yield block.block_id, block.block_hash

    def candidate(self, block_id: int, contents: Hashable) -> LazyCandidate:
        block_hash = cast(BlockHashWithGroupId, contents)
        return LazyCandidate(get_block_hash(block_hash), get_group_id(block_hash), block_id)


class KVTierScheduler:
    """The scheduler-side connector: wraps an :class:`~kvtier.offload.OffloadManager`."""

    def __init__(
        self,
        config: KVTierConfig,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        record_bytes: int,
    ) -> None:
        """Build the manager and its index for vLLM's KV-cache shape.

        Raises:
            ValueError: vLLM's block hashes do not cover exactly one block.
        """
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_tokens, hash_block_tokens = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if block_tokens != hash_block_tokens:
            raise ValueError(
                f"kvtier needs vLLM's prefix hashes per block, but blocks hold {block_tokens} "
                f"tokens and hashes cover {hash_block_tokens}; unset prefix_match_unit"
            )
        world_size = vllm_config.parallel_config.world_size
        config.host_slots(record_bytes, world_size)
        transfer_config = vllm_config.kv_transfer_config
        if transfer_config is not None and transfer_config.kv_load_failure_policy != "recompute":
            # A tier miss is always recoverable: recompute instead of failing the request.
            logger.info("kvtier sets kv_load_failure_policy to 'recompute'")
            transfer_config.kv_load_failure_policy = "recompute"
        self.record_events = publishes_kv_events(vllm_config)
        if self.record_events:
            warn_if_publisher_connects(vllm_config)
        self.config = config
        self.block_tokens = block_tokens
        self.record_bytes = record_bytes
        num_groups = len(kv_cache_config.kv_cache_groups)
        self._group_ids = list(range(num_groups))
        self.manager = OffloadManager.from_config(
            config,
            block_tokens=block_tokens,
            record_bytes=record_bytes,
            world_size=world_size,
            num_groups=num_groups,
            namespace=KeyNamespace(model=vllm_config.model_config.model),
            null_block_id=0,
            record_events=self.record_events,
            record_observations=True,
            group_windows=group_windows_of(kv_cache_config, block_tokens),
        )
        self.guard = LazyStoreGuard(self.manager)
        # vLLM recomputes the last token of a fully loaded request itself (it rewinds
        # num_computed_tokens by one after an asynchronous load).
        self.session = OffloadSession(
            self.manager, same_step_bytes=config.same_step_load_bytes, last_block=True
        )
        self._running = RunningScan(block_tokens)
        self._tracked = self.session.tracked_requests  # a live view: read once, not every step
        self._block_pool: BlockPool | None = None
        self._frontier: FreeQueueFrontier | None = None
        self._frontier_blocks = lazy_frontier_blocks(
            num_groups, vllm_config.scheduler_config.max_num_batched_tokens, block_tokens
        )
        self._capacity_bytes = config.host_bytes_per_rank(world_size)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Keep vLLM's block pool: lazy mode reads its free queue and protects blocks in it."""
        self._block_pool = gpu_block_pool
        if self.config.store_mode == "lazy":
            self._frontier = FreeQueueFrontier(gpu_block_pool, self._frontier_blocks)

    def on_new_request(self, request: Request) -> None:
        """vLLM added the request to its queue: read ahead its blocks held below the host tier
        past those vLLM's own prefix cache holds now."""
        control = self._control(request) if request.kv_transfer_params else None
        self.session.arrived(
            request.request_id,
            request.block_hashes,
            request.num_tokens,
            control,
            num_computed_tokens=self._device_blocks(request.block_hashes) * self.block_tokens,
            salt=tenant_salt(request),
        )

    def _device_blocks(self, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks vLLM's prefix cache holds in every kv-cache group."""
        pool = self._block_pool
        if pool is None:
            return 0
        count = 0
        for block_hash in block_hashes:
            if pool.get_cached_block(block_hash, self._group_ids) is None:
                break
            count += 1
        return count

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens past vLLM's own hit that the tier loads, and whether asynchronously
        (:meth:`OffloadSession.lookup <kvtier.offload.session.OffloadSession.lookup>`).

        ``(None, False)`` while the lower tiers are searched for the request's blocks. A
        hit within this step's ``same_step_load_bytes`` loads before this step's forward.
        """
        control = self._control(request) if request.kv_transfer_params else None
        return self.session.lookup(
            request.request_id,
            request.block_hashes,
            num_computed_tokens,
            request.num_tokens,
            control,
            salt=tenant_salt(request),
        )

    def _control(self, request: Request) -> RequestControl | None:
        """The request's control, read from its ``kv_transfer_params`` on the first call.

        An invalid kvtier entry never reaches vLLM's scheduler as an error: it is
        logged, one line, and the request is served without control.
        """
        request_id = request.request_id
        known = self.session.requests.get(request_id)
        if known is not None:
            return known.control
        try:
            control = request_control(request.kv_transfer_params)
        except RequestControlError as exc:
            logger.warning("request %s: %s; served without kvtier control", request_id, exc)
            control = None
        return control

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record vLLM's allocation; queue the load of the accepted tier hit."""
        self.session.allocated(
            request.request_id,
            request.block_hashes,
            blocks.get_block_ids(),
            num_external_tokens,
            num_computed_tokens=request.num_computed_tokens,
            token_ids=request.all_token_ids,
            adapter=adapter_of(request),
        )

    def build_plan(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        """This step's plan for every worker."""
        session = self.session
        if scheduler_output.preempted_req_ids:
            session.preempted(scheduler_output.preempted_req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        tokens = session.tokens
        for new in scheduler_output.scheduled_new_reqs:
            session.scheduled(
                new.req_id,
                num_computed_tokens=new.num_computed_tokens + scheduled.get(new.req_id, 0),
                new_block_ids=new.block_ids,
                block_hashes=tokens.block_hashes(new.req_id),
                resumed=True,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i in self._running.positions(scheduler_output, self._tracked):
            req_id = cached.req_ids[i]
            session.scheduled(
                req_id,
                num_computed_tokens=cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                new_block_ids=cached.new_block_ids[i],
                block_hashes=tokens.block_hashes(req_id),
                resumed=req_id in cached.resumed_req_ids,
            )
        plan = session.plan(
            frontier=self._frontier,
            scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
        )
        if plan.empty:
            return plan
        protect = self.guard.protect(plan)
        if protect:
            # Keep vLLM from reusing the blocks until their stores are over.
            pool = self._bound_pool()
            pool.touch([pool.blocks[ref.block_id] for ref in protect])
        return plan

    def _bound_pool(self) -> BlockPool:
        if self._block_pool is None:
            raise RuntimeError(
                "lazy mode planned stores before vLLM bound its block pool "
                "(bind_gpu_block_pool); the connector needs vLLM's scheduler to call it"
            )
        return self._block_pool

    @property
    def quiet(self) -> bool:
        """Whether the manager has nothing in flight, pending or to announce
        (:attr:`kvtier.offload.OffloadManager.quiet`): a step without a report changes nothing."""
        return self.manager.quiet

    def update_connector_output(
        self, report: WorkerReport | None, loaded: Iterable[str] | None
    ) -> None:
        """Count the workers' merged report; let vLLM reuse blocks whose lazy stores are over.

        ``loaded`` names the requests whose loads vLLM now knows have ended on every worker.
        """
        progress = self.session.process(report, loaded if loaded is not None else ())
        if not progress.stores_over:
            return
        released = self.guard.release(progress)
        if released:
            pool = self._bound_pool()
            pool.free_blocks(pool.blocks[ref.block_id] for ref in released)

    def request_finished(self, request: Request) -> bool:
        """Whether vLLM must keep the finished request's blocks until the workers release them."""
        return self.session.finished(request.request_id, request.num_computed_tokens)

    def has_pending_push_work(self) -> bool:
        """Whether copies are in flight or lower-tier work waits for the next plan.

        A served engine keeps stepping until they are reported (or handed to the workers).
        """
        return self.session.has_pending_work

    def reset_cache(self) -> bool:
        """Empty the tier now (:meth:`kvtier.offload.OffloadManager.reset`); always ``True``.

        The reset takes effect in this call: nothing stored before it is served
        after it. Copies still in flight keep their host slots until they
        complete, but vLLM must not hear ``False`` for that: it treats
        ``False`` as a failed reset, and pausing or putting the engine to
        sleep (``pause_scheduler(clear_cache=True)``) then raises.
        """
        self.manager.reset()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """This step's KV-cache events of every tier (none unless vLLM publishes events)."""
        if not self.record_events:
            return []  # vLLM asks every step
        return [self._vllm_event(event) for event in self.session.take_events()]

    def _vllm_event(self, event: BlockEvent) -> KVCacheEvent:
        block_hash = maybe_convert_block_hash(event.block_hash)
        medium, locality, ownership = event_place(event)
        if event.kind is EventKind.STORED:
            parent, adapter = event.parent_hash, event.adapter
            return BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
                token_ids=list(event.token_ids),
                block_size=self.block_tokens,
                lora_id=adapter.adapter_id if adapter is not None else None,
                medium=medium,
                lora_name=adapter.name if adapter is not None else None,
                group_idx=event.group,
                locality=locality,
                ownership=ownership,
            )
        return BlockRemoved(
            block_hashes=[block_hash],
            medium=medium,
            group_idx=event.group,
            locality=locality,
            ownership=ownership,
        )

    def stats(self) -> KVTierStats | None:
        """What changed in the tier's counters and usage since the last call, and the
        latencies, batch sizes and per-request hits measured since then; ``None`` when
        nothing did (vLLM asks every step, and most steps change nothing in the tier)."""
        self.session.step_ended()
        manager = self.manager
        if manager.quiet:
            return None  # most steps
        grown = manager.take_stats()
        if grown is None and not manager.has_observations:
            return None  # most steps
        stats = KVTierStats()
        if grown is not None:
            stats.record_offload(
                grown, record_bytes=self.record_bytes, capacity_bytes=self._capacity_bytes
            )
        observations = manager.take_observations()
        for histogram in OFFLOAD_HISTOGRAMS:
            stats.observe(histogram.name, getattr(observations, histogram.field))
        return stats
