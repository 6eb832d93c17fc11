"""Scheduler-side offload manager: decides what to store, what to load and when blocks are free.

The manager owns all bookkeeping (the host tier's :class:`~kvtier.index.BlockIndex`,
request states, batch numbering) and no bytes. It speaks engine-neutral data:
request ids, engine block hashes (namespaced here by kv-cache group), device
block ids per group and token counts. An engine integration calls it in this
order:

Per request:

1. :meth:`OffloadManager.lookup` — how many tokens past the engine's own
   prefix hits the tier can supply (whole blocks; never the last token). It
   may be asked again. With lower tiers, a lookup that misses in the host tier
   reserves host slots and plans a promotion (workers read the blocks from the
   lower tiers into them) and answers ``None`` until the workers reported it;
   the blocks they found are then host hits like any other.
2. :meth:`OffloadManager.allocated` — the engine allocated device blocks and
   accepted ``num_external_tokens`` from the tier: their host slots are pinned
   and a load is queued into those device blocks. The request must wait until
   its load finished (:attr:`Progress.loaded_requests`, or the worker's report).
3. :meth:`OffloadManager.scheduled` — every step the request runs: new device
   blocks and how many tokens have their KV written (eager mode stores the full
   blocks among them).
4. :meth:`OffloadManager.preempted` — the engine took the request's blocks back;
   the next plan makes workers flush in-flight copies first.
5. :meth:`OffloadManager.finished` — returns ``True`` when the engine must keep
   the request's device blocks until :attr:`Progress.released_requests` names it
   (loads or stores that read or write them are still in flight).

Per step:

6. :meth:`OffloadManager.build_plan` — the :class:`TransferPlan` for every
   worker (in lazy mode, given the engine's eviction-frontier candidates; the
   device blocks in ``plan.stores`` must stay untouched until
   :attr:`Progress.stored_blocks` names them).
7. :meth:`OffloadManager.process` — the merged :class:`WorkerReport` of the
   workers; a batch completes once all ``world_size`` workers reported it.
   Stores then become readable (or are dropped if any worker failed), loads
   unpin their slots (a failed load is a recompute, never a hit). A batch
   not reported by every worker within ``report_deadline_s`` fails.

At any time: :meth:`take_events`, :meth:`stats`, :meth:`take_observations`, :meth:`reset`.

With lower tiers, a block the host tier evicts is demoted: the next plan has
workers copy it out of its slot, before anything reuses the slot, and write it
to every lower tier.

Slots are never reused while a copy might still write them: when a worker
abandons a copy (past its deadline, or after a backend error) or a worker
never reports a batch, the batch fails at once for the engine, but its host
slots stay quarantined until every worker said its copy is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from kvtier.config.model import DEFAULT_REPORT_DEADLINE_S
from kvtier.copy.base import Direction
from kvtier.index.base import BlockIndex, BlockKey, EventKind, IndexEvent
from kvtier.keys import KeyNamespace
from kvtier.kinds import BLOCK_INDEX
from kvtier.offload.failures import FailureCause, FailureLog
from kvtier.offload.messages import (
    Demotion,
    DeviceBlock,
    LazyCandidate,
    Promotion,
    Transfer,
    TransferPlan,
    WorkerReport,
)

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

StoreMode = Literal["eager", "lazy"]
GroupBlockIds = Sequence[Sequence[int]]
"""Device block ids per kv-cache group: ``block_ids[group][position]``."""


@dataclass(frozen=True)
class OffloadStats:
    """Cumulative counters and current usage of the host tier, for metrics.

    Byte counters count every rank's shard (``blocks * record_bytes * world_size``).
    Every field defaults to 0: ``OffloadStats()`` is "nothing yet".
    """

    num_slots: int = 0
    """Slots in the host tier (per rank; every rank has the same slots)."""
    used_slots: int = 0
    """Slots holding a readable block or one being written."""
    hit_tokens: int = 0
    """Tokens the engine accepted from the tier (loads planned)."""
    stored_blocks: int = 0
    """Blocks whose stores completed on every worker."""
    stored_bytes: int = 0
    """Bytes of those blocks, all ranks together."""
    loaded_blocks: int = 0
    """Blocks whose loads completed on every worker."""
    same_step_loaded_blocks: int = 0
    """Of ``loaded_blocks``, those loaded in the step that ran their request."""
    loaded_bytes: int = 0
    """Bytes of those blocks, all ranks together."""
    evicted_blocks: int = 0
    """Blocks evicted from the tier to make room (or by :meth:`OffloadManager.reset`)."""
    failed_stores: int = 0
    """Blocks whose store failed, timed out or was abandoned on some worker (they were dropped)."""
    failed_loads: int = 0
    """Blocks whose load failed, timed out or could not be started (recomputed)."""
    abandoned_copies: int = 0
    """Copies a worker stopped waiting for (past its copy deadline, or after a backend error)."""
    expired_batches: int = 0
    """Batches failed because some worker did not report them within the report deadline."""
    rejected_reports: int = 0
    """Worker report entries rejected as impossible (and ignored)."""
    quarantined_slots: int = 0
    """Slots kept out of use because an abandoned or unreported copy may still write them."""
    promoted_blocks: int = 0
    """Blocks read from the lower tiers into the host tier on every worker."""
    demoted_blocks: int = 0
    """Blocks evicted from the host tier and handed to workers to write to the lower tiers."""
    expired_promotions: int = 0
    """Promotions some worker did not report within the report deadline (their lookups missed)."""
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per lower tier, the workers' counters added up (``TierStats`` field names, and
    ``errors.<cause>`` per fault); empty without lower tiers."""
    failures: Mapping[FailureCause, int] = field(default_factory=dict)
    """Failures the manager detected, by cause (the workers count theirs)."""


@dataclass
class Observations:
    """Measurements of single events since the last :meth:`OffloadManager.take_observations`.

    Only kept with ``record_observations``; an engine integration turns them into histograms.
    """

    load_seconds: list[float] = field(default_factory=list)
    """Per load batch that completed on every worker: seconds from its planning to then."""
    store_seconds: list[float] = field(default_factory=list)
    """Per store batch that completed on every worker: seconds from its planning to then."""
    load_blocks: list[int] = field(default_factory=list)
    """Blocks of each load batch planned."""
    store_blocks: list[int] = field(default_factory=list)
    """Blocks of each store batch planned."""
    request_hit_tokens: list[int] = field(default_factory=list)
    """Per request, at its first allocation: the tokens it accepted from the tier (0 for
    none). A preempted request that starts over is counted again."""


@dataclass(frozen=True)
class Progress:
    """What completed on every worker, as learnt from one :meth:`OffloadManager.process` call."""

    released_requests: tuple[str, ...] = ()
    """Finished requests whose device blocks the engine may free now."""
    loaded_requests: tuple[str, ...] = ()
    """Requests whose loads all completed (successfully or not) on every worker."""
    failed_loads: Mapping[str, tuple[DeviceBlock, ...]] = field(default_factory=dict)
    """Per request, device blocks whose load failed: recompute them."""
    stored_blocks: tuple[DeviceBlock, ...] = ()
    """Device blocks whose stores completed (or failed) everywhere: no longer protected."""


_NO_PROGRESS = Progress()

_NO_PLAN = TransferPlan()
"""The plan of a step that asks nothing of the workers (shared: plans are never changed)."""


@dataclass
class _Batch:
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
class _PromotionBatch:
    """A promotion in flight: one request's blocks of one group, read into reserved slots."""

    message: Promotion
    keys: tuple[BlockKey, ...]
    request_id: str
    planned_at: float
    reported: int = 0
    found: int = 0
    expired: bool = False


@dataclass(frozen=True)
class _PendingLoad:
    group: int
    keys: tuple[BlockKey, ...]
    blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass
class _Collected:
    """What one :meth:`OffloadManager.process` call learnt, to become its :class:`Progress`."""

    loaded: list[str] = field(default_factory=list)
    failed_loads: dict[str, list[DeviceBlock]] = field(default_factory=dict)
    stored: list[DeviceBlock] = field(default_factory=list)


@dataclass
class _Request:
    request_id: str
    num_groups: int
    block_hashes: Sequence[bytes] = ()
    block_ids: list[list[int]] = field(default_factory=list)
    store_cursor: list[int] = field(default_factory=list)
    computed_tokens: int = 0
    pending_loads: list[_PendingLoad] = field(default_factory=list)
    unavailable: list[DeviceBlock] = field(default_factory=list)
    batches: set[int] = field(default_factory=set)
    load_batches: set[int] = field(default_factory=set)
    finished: bool = False
    hold_announced: bool = False
    load_end: int = 0
    """Block position after the last one loaded from the tier."""
    admitted: bool = False
    """Whether its tier hit since it (re)started was counted in the observations."""
    same_step: bool = False
    """Its pending loads are for the step that runs it (:meth:`OffloadManager.allocated`)."""
    seq: int = 0
    """Order of arrival: plans take requests' loads and stores in this order."""
    seen: tuple[int, int] = (-1, -1)
    """Full blocks computed and block hashes known when a step last gave it work to check."""

    def __post_init__(self) -> None:
        if not self.block_ids:
            self.clear_blocks()

    def clear_blocks(self) -> None:
        """Forget the request's device blocks and restart store progress in every group."""
        self.block_ids = [[] for _ in range(self.num_groups)]
        self.store_cursor = [0] * self.num_groups
        self.seen = (-1, -1)


class OffloadManager:
    """Plans stores and loads between an engine's device KV cache and the host tier."""

    def __init__(
        self,
        index: BlockIndex,
        *,
        block_tokens: int,
        record_bytes: int,
        world_size: int = 1,
        store_mode: StoreMode = "eager",
        num_groups: int = 1,
        namespace: KeyNamespace | None = None,
        null_block_id: int | None = None,
        record_events: bool = False,
        record_observations: bool = False,
        group_windows: Sequence[int | None] | None = None,
        report_deadline_s: float = DEFAULT_REPORT_DEADLINE_S,
        lower_tiers: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create a manager over ``index``, the directory of the host tier.

        Args:
            index: The host tier's block index (its ``num_slots`` are the tier's slots).
            block_tokens: Tokens per block (the engine's block size).
            record_bytes: Bytes of one block's record on one rank, for the byte counters.
            world_size: Number of workers that each execute every plan; a batch
                completes when all of them reported it.
            store_mode: ``"eager"`` stores newly computed full blocks of running
                requests; ``"lazy"`` stores only blocks the engine offers from
                its eviction frontier.
            num_groups: Number of kv-cache groups (several for hybrid models).
            namespace: Namespaces engine hashes into keys; a default one if ``None``.
            null_block_id: A device block id that stands for "no block" (skipped
                by stores and loads), if the engine has one.
            record_events: Keep the index's stored/evicted events for
                :meth:`take_events`; otherwise they are only counted.
            record_observations: Keep latencies, batch sizes and per-request hits for
                :meth:`take_observations` (whoever sets it must take them regularly).
            group_windows: Per kv-cache group, ``None`` when a prefix needs all
                its blocks (full attention), or ``w`` when only its last ``w``
                blocks matter (sliding window: the blocks the window spans;
                Mamba state: 1). Such a group loads and requires for a hit only
                those blocks, and stores, in either mode, only blocks that were
                among a request's last ``w`` at the end of a step (where a hit
                can start). ``None`` means full attention everywhere.
            report_deadline_s: Seconds after planning by which every worker must
                have reported a batch; later, the batch fails (see :meth:`process`).
            lower_tiers: Workers have storage tiers below the host tier: host
                misses are looked up there (promotions) and evicted blocks are
                written there (demotions).
            clock: Monotonic time in seconds (tests pass a manual clock).

        Raises:
            ValueError: If a size or the deadline is not positive, ``store_mode``
                is unknown or ``group_windows`` does not give one entry per group.
        """
        for name, value in (
            ("block_tokens", block_tokens),
            ("record_bytes", record_bytes),
            ("world_size", world_size),
            ("num_groups", num_groups),
            ("report_deadline_s", report_deadline_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if store_mode not in ("eager", "lazy"):
            raise ValueError(f"store_mode must be 'eager' or 'lazy', got {store_mode!r}")
        self.index = index
        self.block_tokens = block_tokens
        self.record_bytes = record_bytes
        self.world_size = world_size
        self.store_mode: StoreMode = store_mode
        self.num_groups = num_groups
        self.namespace = namespace if namespace is not None else KeyNamespace()
        self.null_block_id = null_block_id
        windows = [None] * num_groups if group_windows is None else list(group_windows)
        if len(windows) != num_groups or any(w is not None and w <= 0 for w in windows):
            raise ValueError(
                f"group_windows needs one entry per kv-cache group ({num_groups}), each None "
                f"or a positive block count; got {group_windows!r}"
            )
        self.group_windows: tuple[int | None, ...] = tuple(windows)
        self.record_events = record_events
        self.record_observations = record_observations
        self._observations = Observations()
        self.report_deadline_s = report_deadline_s
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        # Requests that may give the next plan work (loads to queue, blocks to store, a
        # hold to announce); a plan looks at these only, so a decode step in which no
        # request filled a block costs the same whatever the number of running requests.
        self._due: set[str] = set()
        self._next_seq = 0
        self._batches: dict[int, _Batch] = {}
        # Failed batches whose copies may still run on some worker: their slots stay held.
        self._quarantine: dict[int, _Batch] = {}
        self._writing: dict[BlockKey, int] = {}
        self._next_batch_id = 0
        self._flush = False
        self._released: list[str] = []
        self._unavailable: dict[str, tuple[DeviceBlock, ...]] = {}
        # Lazy mode, per windowed group: device block -> the key it held while inside the
        # window at the end of a step (where a later hit may start); other blocks are not stored.
        self._window_blocks: list[dict[int, BlockKey]] = [{} for _ in range(num_groups)]
        # Requests whose load failed recompute instead: asked again, they get no tier hit.
        self._load_failed: set[str] = set()
        # The keys the last lookup() made, per group without a window, for allocated() to
        # reuse when it is given the same hashes (the same sequence) and first block:
        # (hashes, first, keys).
        self._looked_up: tuple[Sequence[bytes], int, dict[int, list[BlockKey]]] | None = None
        self._events: list[IndexEvent] = []
        self._failures = FailureLog(logger)
        self._hit_tokens = 0
        self._stored_blocks = 0
        self._loaded_blocks = 0
        self._same_step_loaded_blocks = 0
        self._evicted_blocks = 0
        self._failed_stores = 0
        self._failed_loads = 0
        self._abandoned_copies = 0
        self._expired_batches = 0
        self._rejected_reports = 0
        self.lower_tiers = lower_tiers
        self._promotions: dict[int, _PromotionBatch] = {}
        self._promotions_to_plan: list[Promotion] = []
        # Requests whose lookup waits for promotions (batch ids), or got its answer (empty set).
        self._promoting: dict[str, set[int]] = {}
        # Slots of readable blocks, to find an evicted block's bytes (only with lower tiers).
        self._slots: dict[BlockKey, int] = {}
        # Evicted blocks to demote in the next plan, with the slot that still holds each.
        self._demotions: dict[BlockKey, int] = {}
        self._promoted_blocks = 0
        self._demoted_blocks = 0
        self._expired_promotions = 0
        self._departures = 0
        self._tier_counts: dict[str, dict[str, int]] = {}

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        *,
        block_tokens: int,
        record_bytes: int,
        world_size: int = 1,
        num_groups: int = 1,
        namespace: KeyNamespace | None = None,
        null_block_id: int | None = None,
        record_events: bool = False,
        record_observations: bool = False,
        group_windows: Sequence[int | None] | None = None,
        registry: Registry | None = None,
    ) -> OffloadManager:
        """Build a manager, and its index, from a validated :class:`~kvtier.config.KVTierConfig`.

        The tier gets :meth:`config.host_slots <kvtier.config.KVTierConfig.host_slots>`
        slots, the same count :meth:`OffloadWorker.from_config
        <kvtier.offload.worker.OffloadWorker.from_config>` allocates (after it
        checked the memory available: vLLM builds the scheduler once the workers
        hold their buffers, so the memory left then says nothing about the tier).
        """
        from kvtier.plugins import default_registry

        num_slots = config.host_slots(record_bytes, world_size)
        registry = registry if registry is not None else default_registry()
        index = registry.build(BLOCK_INDEX, config.index, num_slots)
        return cls(
            index,
            block_tokens=block_tokens,
            record_bytes=record_bytes,
            world_size=world_size,
            store_mode=config.store_mode,
            num_groups=num_groups,
            namespace=namespace,
            null_block_id=null_block_id,
            record_events=record_events,
            record_observations=record_observations,
            group_windows=group_windows,
            report_deadline_s=config.report_deadline_s,
            lower_tiers=bool(config.tiers),
        )

    # ------------------------------------------------------------------ requests

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        num_tokens: int,
    ) -> int | None:
        """Return how many tokens past ``num_computed_tokens`` the tier can load.

        Counts whole blocks readable in every kv-cache group (for a group
        with a window, the last ``window`` blocks of the hit), starting at the
        first block the engine does not hold, and never covers the request's
        last token (the engine must compute at least one). A request whose
        load failed gets no hit until it finished: it recomputes instead of
        retrying the tier.

        With lower tiers, a host miss starts a promotion of the missing blocks
        (as many as host slots can be reserved for) and the answer is ``None``
        (ask again later) until every worker reported it; then the blocks
        found are host hits. One promotion per request: later lookups answer
        from the host tier. Without lower tiers, it changes nothing.

        Args:
            request_id: The request.
            block_hashes: The engine's hash of each full block of the request.
            num_computed_tokens: Tokens the engine already holds (its own prefix hits);
                a multiple of ``block_tokens``.
            num_tokens: Tokens of the request so far.
        """
        if request_id in self._load_failed:
            return 0
        first = num_computed_tokens // self.block_tokens
        limit = max(0, num_tokens - 1 - num_computed_tokens) // self.block_tokens
        wanted = block_hashes[first : first + limit]
        if not wanted:
            return 0
        hits = len(wanted)
        looked_up: dict[int, list[BlockKey]] = {}
        for group, window in enumerate(self.group_windows):
            if window is None and hits:
                keys = looked_up[group] = self.namespace.keys(wanted[:hits], group)
                hits = min(hits, self.index.lookup(keys))
        self._looked_up = (block_hashes, first, looked_up)
        for group, window in enumerate(self.group_windows):
            if window is not None:
                hits = self._windowed_hits(wanted, hits, group, window)
        if self.lower_tiers and hits < len(wanted):
            waiting = self._promoting.get(request_id)
            if waiting is None and self._promote(request_id, wanted, hits):
                return None
            if waiting:
                return None
        logger.debug("request %s: %d tier hit blocks after %d", request_id, hits, first)
        return hits * self.block_tokens

    def _promote(self, request_id: str, wanted: Sequence[bytes], hits: int) -> bool:
        """Reserve host slots for ``wanted[hits:]`` and plan their promotion; whether any was."""
        self._promoting[request_id] = set()
        if any(window is not None for window in self.group_windows):
            return False  # a windowed group's hit needs other blocks than the prefix's
        missing = wanted[hits:]
        reserved: list[tuple[int, list[BlockKey], list[int | None]]] = []
        count = len(missing)
        for group in range(self.num_groups):
            # blocks of this prefix still in the host tier, before the missing ones or among
            # them, are not the ones to make room with
            self.index.touch(self.namespace.keys(wanted, group))
        for group in range(self.num_groups):
            keys = self.namespace.keys(missing, group)
            parent = self.namespace.key(wanted[hits - 1], group) if hits else None
            slots = self.index.reserve(keys, parent)
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
                self.index.abort(extra)
        if count == 0:
            return False
        now = self._clock()
        for group, keys, slots in reserved:
            message = Promotion(
                self._new_batch_id(),
                group,
                tuple(missing[:count]),
                tuple(slot for slot in slots[:count] if slot is not None),
            )
            self._promotions[message.batch_id] = _PromotionBatch(
                message, tuple(keys[:count]), request_id, now, found=count
            )
            for key in keys[:count]:
                self._writing[key] = message.batch_id
            self._promotions_to_plan.append(message)
            self._promoting[request_id].add(message.batch_id)
        return True

    def allocated(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: GroupBlockIds,
        num_computed_tokens: int,
        num_external_tokens: int,
        *,
        same_step: bool = False,
    ) -> None:
        """Record the engine's allocation; queue a load of ``num_external_tokens`` from the tier.

        The blocks at positions ``num_computed_tokens // block_tokens`` onwards
        (``num_external_tokens / block_tokens`` of them, rounded up: a same-step
        hit may end one token short of a block, whose last token the engine
        computes again) are loaded into
        ``block_ids[group][position]`` in every group. Their host slots are
        pinned now, so no store can evict them before the load ran; a block
        that is no longer readable is reported to the engine as a failed load
        (recompute) by the next plan. The engine's own hits are touched in the
        tier's policy.

        With ``same_step`` the engine runs the request in the step whose plan
        carries the load, so the load must be copied before that step's
        forward (:attr:`TransferPlan.same_step`); the engine then learns of a
        failed block from that step's output, not from a finished load. Only
        with one kv-cache group: block ids name blocks of one group alone.

        Args:
            request_id: The request.
            block_hashes: The engine's hash of each full block of the request.
            block_ids: The request's device block ids per group, from position 0.
            num_computed_tokens: Tokens the engine held before the tier's hits.
            num_external_tokens: Tokens accepted from :meth:`lookup` (0 for none).
            same_step: The engine runs the request in the step of the next plan.

        Raises:
            ValueError: ``same_step`` with several kv-cache groups, or ``block_ids``
                that do not cover the accepted blocks.
        """
        if same_step and self.num_groups > 1:
            raise ValueError(
                f"request {request_id}: a same-step load needs one kv-cache group, but there "
                f"are {self.num_groups}; load it a step ahead"
            )
        self._promoting.pop(request_id, None)
        state = self._state(request_id)
        state.block_hashes = block_hashes
        first = num_computed_tokens // self.block_tokens
        looked_up: dict[int, list[BlockKey]] = {}
        last = self._looked_up
        if last is not None and last[0] is block_hashes and last[1] == first:
            looked_up = last[2]
        self._looked_up = None
        count = -(-num_external_tokens // self.block_tokens)
        for group in range(self.num_groups):
            self.index.touch(self.namespace.keys(block_hashes[:first], group))
        if not state.admitted:
            state.admitted = True
            self._observe(self._observations.request_hit_tokens, count * self.block_tokens)
        if count == 0:
            return
        self._hit_tokens += count * self.block_tokens
        state.load_end = first + count
        state.same_step = same_step
        self._due.add(request_id)
        hashes = block_hashes[first : first + count]
        for group in range(self.num_groups):
            group_ids = block_ids[group][first : first + count] if group < len(block_ids) else []
            if len(group_ids) != len(hashes):
                raise ValueError(
                    f"request {request_id}: group {group} has {len(group_ids)} device blocks at "
                    f"positions {first}..{first + count - 1}, but {len(hashes)} tier blocks were "
                    "accepted; pass the request's block ids from position 0 for every group"
                )
            window = self.group_windows[group]
            skip = 0 if window is None else max(0, count - window)
            blocks = list(group_ids[skip:])
            keys = looked_up.get(group, [])[:count] if window is None else []
            if len(keys) < count:
                keys = self.namespace.keys(hashes[skip:], group)
            if self.null_block_id in blocks:
                kept = [i for i, block_id in enumerate(blocks) if block_id != self.null_block_id]
                keys, blocks = [keys[i] for i in kept], [blocks[i] for i in kept]
            readable = self.index.lookup(keys)
            if readable:
                pinned = tuple(keys[:readable])
                slots = tuple(self.index.pin(pinned))
                state.pending_loads.append(
                    _PendingLoad(group, pinned, tuple(blocks[:readable]), slots)
                )
            if readable < len(keys):
                logger.warning(
                    "request %s: %d of %d tier blocks of group %d are no longer readable; "
                    "they will be recomputed",
                    request_id,
                    len(keys) - readable,
                    len(keys),
                    group,
                )
                state.unavailable.extend(DeviceBlock(group, b) for b in blocks[readable:])
                self._failed_loads += len(keys) - readable

    def scheduled(
        self,
        request_id: str,
        *,
        num_computed_tokens: int,
        new_block_ids: GroupBlockIds | None = None,
        block_hashes: Sequence[bytes] | None = None,
        resumed: bool = False,
    ) -> None:
        """Record a step of a running request (eager mode stores from this).

        Args:
            request_id: The request.
            num_computed_tokens: Tokens whose KV is in device memory by the
                time workers submit this step's plan (they submit in
                ``get_finished``, after the model ran, ordered behind its work);
                full blocks among them become store candidates.
            new_block_ids: Device block ids appended to the request this step,
                per group; with ``resumed``, all of its block ids.
            block_hashes: The engine's hash of each full block so far (the
                engine may pass the same growing list every time).
            resumed: The request resumes after a preemption: ``new_block_ids``
                replace its block ids.
        """
        state = self._requests.get(request_id)
        if (
            state is not None
            and not resumed
            and not state.finished
            and (new_block_ids is None or not any(new_block_ids))
            and (block_hashes is None or block_hashes is state.block_hashes)
            and (num_computed_tokens // self.block_tokens, len(state.block_hashes)) == state.seen
        ):
            # Most decode steps: no block filled, no hash or block came, so nothing read
            # below can have changed but the exact token count.
            state.computed_tokens = num_computed_tokens
            return
        state = self._state(request_id)
        if block_hashes is not None:
            state.block_hashes = block_hashes
        if resumed:
            state.clear_blocks()
        if new_block_ids is not None:
            for group, ids in enumerate(new_block_ids[: self.num_groups]):
                if ids:
                    state.block_ids[group].extend(ids)
        state.computed_tokens = num_computed_tokens
        state.seen = (num_computed_tokens // self.block_tokens, len(state.block_hashes))
        self._note_window_blocks(state)
        if self._has_unstored_blocks(state):
            self._due.add(request_id)

    def preempted(self, request_ids: Iterable[str]) -> None:
        """The engine took these requests' device blocks back.

        The next plan makes every worker wait for in-flight copies before the
        blocks are reused; queued loads are dropped (the request starts over)
        and store progress restarts from the request's next blocks.
        """
        for request_id in request_ids:
            self._flush = True
            self._promoting.pop(request_id, None)
            state = self._requests.get(request_id)
            if state is None:
                continue
            self._cancel_pending_loads(state)
            state.unavailable.clear()
            state.clear_blocks()
            state.computed_tokens = 0
            state.load_end = 0
            state.admitted = False

    def finished(self, request_id: str, num_computed_tokens: int | None = None) -> bool:
        """The request finished; return whether the engine must keep its device blocks.

        When ``True``, the engine frees the blocks once
        :attr:`Progress.released_requests` names the request (or, for engines
        that count worker reports themselves, once every worker's
        :meth:`~kvtier.offload.worker.OffloadWorker.get_finished` named it).

        Args:
            request_id: The request.
            num_computed_tokens: Tokens whose KV is written at the end; in
                eager mode, full blocks not stored yet are stored before release.
        """
        self._load_failed.discard(request_id)
        self._promoting.pop(request_id, None)
        state = self._requests.get(request_id)
        if state is None:
            return False
        self.index.request_finished(request_id)
        self._cancel_pending_loads(state)
        state.unavailable.clear()
        if num_computed_tokens is not None:
            state.computed_tokens = max(state.computed_tokens, num_computed_tokens)
            self._note_window_blocks(state)
        state.finished = True
        if state.batches or self._has_unstored_blocks(state):
            self._due.add(request_id)  # its hold is announced by the next plan
            return True
        del self._requests[request_id]
        return False

    # ---------------------------------------------------------------------- steps

    def build_plan(
        self, lazy_candidates: Sequence[LazyCandidate] = (), *, idle: bool = False
    ) -> TransferPlan:
        """Return this step's plan for every worker.

        Args:
            lazy_candidates: In lazy mode, cached device blocks near the
                engine's eviction frontier, in eviction order; those not yet in
                the tier are stored while slots last. Ignored in eager mode.
            idle: The engine computes nothing this step (see :attr:`TransferPlan.idle`).
        """
        self._drain_index_events()
        if not (
            self._due
            or self._flush
            or lazy_candidates
            or self._promotions_to_plan
            or self._demotions
            or (idle and self._promotions)
        ):
            return _NO_PLAN  # most decode steps
        now = self._clock()
        due = self._take_due()
        loads: list[Transfer] = []
        unavailable: dict[str, tuple[int, ...]] = {}
        same_step: set[str] = set()
        for state in due:
            if state.same_step:
                state.same_step = False
                same_step.add(state.request_id)
            for pending in state.pending_loads:
                transfer = Transfer(
                    self._new_batch_id(),
                    Direction.LOAD,
                    pending.group,
                    pending.blocks,
                    pending.slots,
                    state.request_id,
                )
                self._batches[transfer.batch_id] = _Batch(
                    transfer,
                    pending.keys,
                    (state.request_id,),
                    now,
                    same_step=state.request_id in same_step,
                )
                state.batches.add(transfer.batch_id)
                state.load_batches.add(transfer.batch_id)
                loads.append(transfer)
                self._observe(self._observations.load_blocks, len(transfer))
            state.pending_loads.clear()
            if state.unavailable:
                unavailable[state.request_id] = tuple(b.block_id for b in state.unavailable)
                self._unavailable[state.request_id] = tuple(state.unavailable)
                state.unavailable.clear()
        if self.store_mode == "eager":
            stores = self._plan_eager_stores(due, now)
        else:
            stores = self._plan_lazy_stores(lazy_candidates, now)
        self._drain_index_events()
        promotions, self._promotions_to_plan = tuple(self._promotions_to_plan), []
        holds: dict[str, tuple[int, ...]] = {}
        for state in due:
            if not state.finished or state.hold_announced:
                continue
            state.hold_announced = True
            holds[state.request_id] = tuple(sorted(state.batches))
            if not state.batches:
                self._release(state.request_id)
        plan = TransferPlan(
            stores=tuple(stores),
            loads=tuple(loads),
            flush=self._flush,
            holds=holds,
            unavailable=unavailable,
            promotions=promotions,
            demotions=self._take_demotions() if self._demotions else (),
            same_step=frozenset(same_step),
            idle=idle and bool(self._promotions),
        )
        self._flush = False
        return plan

    def _take_due(self) -> list[_Request]:
        """The requests marked as possibly having work, in order of arrival; unmarks them."""
        due = [self._requests[r] for r in self._due if r in self._requests]
        self._due.clear()
        due.sort(key=attrgetter("seq"))
        return due

    def _take_demotions(self) -> tuple[Demotion, ...]:
        """Blocks evicted since the last plan, per group, with the slots that still hold them."""
        per_group: dict[int, tuple[list[bytes], list[int]]] = {}
        for key, slot in self._demotions.items():
            group, block_hash = self.namespace.split(key)
            hashes, slots = per_group.setdefault(group, ([], []))
            hashes.append(block_hash)
            slots.append(slot)
        self._demoted_blocks += len(self._demotions)
        self._demotions.clear()
        return tuple(
            Demotion(group, tuple(hashes), tuple(slots))
            for group, (hashes, slots) in sorted(per_group.items())
        )

    def process(self, report: WorkerReport | Iterable[WorkerReport | None] | None) -> Progress:
        """Count worker completions; finish the batches every worker has reported.

        A batch that some worker has not reported within ``report_deadline_s``
        of its planning fails (a load becomes a recompute, a store is dropped).
        A batch that failed while a worker's copy of it may still run (that
        worker abandoned the copy or never reported) keeps its host slots
        until every such worker reported the copy over.

        Report entries that cannot be right (negative counts, a batch that is
        not in flight, more workers than ``world_size``, more settled copies
        than abandoned ones) are logged, counted in
        :attr:`OffloadStats.rejected_reports` and ignored: a wrong report never
        changes the tier.

        Args:
            report: One merged report, several (one per worker), or ``None``.
        """
        if report is None and self.settled:
            # Nothing reported, in flight or waiting to be announced: most decode steps.
            self._drain_index_events()
            return _NO_PROGRESS
        if report is None:
            reports: list[WorkerReport] = []
        elif isinstance(report, WorkerReport):
            reports = [report]
        else:
            reports = [one for one in report if one is not None]
        collected = _Collected()
        for request_id, blocks in self._unavailable.items():
            self._refuse_reload(request_id)
            collected.failed_loads[request_id] = list(blocks)
            state = self._requests.get(request_id)
            if state is not None and not state.load_batches:
                collected.loaded.append(request_id)
        self._unavailable.clear()
        touched: set[int] = set()
        for one in reports:
            touched |= self._count(one)
            self._count_promotions(one)
            for name, counts in one.tier_counts.items():
                totals = self._tier_counts.setdefault(name, {})
                for counter, value in counts.items():
                    totals[counter] = totals.get(counter, 0) + value
        for batch_id in sorted(touched):
            batch = self._batches.get(batch_id)
            if batch is not None:
                if batch.reported == self.world_size:
                    self._complete(batch, collected)
            elif batch_id in self._quarantine:
                self._release_quarantined(self._quarantine[batch_id])
        self._expire(collected)
        self._expire_promotions()
        self._drain_index_events()
        released, self._released = tuple(self._released), []
        return Progress(
            released_requests=released,
            loaded_requests=tuple(collected.loaded),
            failed_loads={rid: tuple(blocks) for rid, blocks in collected.failed_loads.items()},
            stored_blocks=tuple(collected.stored),
        )

    # ------------------------------------------------------------------- queries

    def take_events(self) -> list[IndexEvent]:
        """Return and forget the tier's stored/evicted events (kept only with ``record_events``)."""
        self._drain_index_events()
        events, self._events = self._events, []
        return events

    def reset(self) -> bool:
        """Empty the tier: no block stored before this call is served after it.

        Readable blocks are evicted at once, those being loaded included (the
        loads already promised still read them; their slots are freed when the
        loads end). Stores in flight are dropped when they complete, and blocks
        computed or being loaded before the reset are not stored later. Blocks
        computed afterwards are stored as usual: a reset never stops storing.
        Idempotent; calling it again changes nothing more.

        vLLM calls this once per ``reset_prefix_cache(reset_connector=True)``
        and does not retry. ``False`` makes vLLM's ``reset_prefix_cache``
        return ``False`` (and not count the reset in its connector prefix-cache
        stats), but the reset has taken effect all the same: nobody needs to
        call again.

        Returns:
            ``True`` if every slot is free now; ``False`` if some slots are
            still held by copies in flight, which free them as they complete.
        """
        for batch in self._batches.values():
            if batch.transfer.direction is Direction.STORE:
                batch.reset = True
            else:
                self.index.discard(batch.keys)
        for state in self._requests.values():
            for pending in state.pending_loads:
                self.index.discard(pending.keys)
            ready = min(len(state.block_hashes), state.computed_tokens // self.block_tokens)
            # a cursor past the request's known blocks just means "nothing to store yet"
            skip = max(ready, state.load_end)
            state.store_cursor = [max(cursor, skip) for cursor in state.store_cursor]
        empty = self.index.clear()
        # A reset forgets blocks; it does not move them down the chain.
        self._slots.clear()
        self._drain_index_events()
        self._demotions.clear()
        if empty:
            logger.info("host tier reset: empty")
        else:
            logger.info(
                "host tier reset: nothing stored before it will be served; %d slot(s) are "
                "freed as the copies still using them complete",
                self.index.num_slots - self.index.stats().free,
            )
        return empty

    def stats(self) -> OffloadStats:
        """Current counters and usage."""
        self._drain_index_events()
        index_stats = self.index.stats()
        bytes_per_block = self.record_bytes * self.world_size
        return OffloadStats(
            num_slots=index_stats.num_slots,
            used_slots=index_stats.readable + index_stats.writing,
            hit_tokens=self._hit_tokens,
            stored_blocks=self._stored_blocks,
            stored_bytes=self._stored_blocks * bytes_per_block,
            loaded_blocks=self._loaded_blocks,
            same_step_loaded_blocks=self._same_step_loaded_blocks,
            loaded_bytes=self._loaded_blocks * bytes_per_block,
            evicted_blocks=self._evicted_blocks,
            failed_stores=self._failed_stores,
            failed_loads=self._failed_loads,
            abandoned_copies=self._abandoned_copies,
            expired_batches=self._expired_batches,
            rejected_reports=self._rejected_reports,
            quarantined_slots=len(
                {slot for batch in self._quarantine.values() for slot in batch.transfer.host_slots}
            ),
            failures=self._failures.counts,
            promoted_blocks=self._promoted_blocks,
            demoted_blocks=self._demoted_blocks,
            expired_promotions=self._expired_promotions,
            tiers={name: dict(counts) for name, counts in self._tier_counts.items()},
        )

    def take_observations(self) -> Observations:
        """Return and forget the measurements since the last call (empty without
        ``record_observations``)."""
        observations, self._observations = self._observations, Observations()
        return observations

    @property
    def num_inflight_batches(self) -> int:
        """Batches planned and not yet reported by every worker (nor failed by the deadline)."""
        return len(self._batches)

    @property
    def departures(self) -> int:
        """Keys that stopped being held or written so far (evicted, discarded, or their store
        or promotion given up): what a caller remembers of the tier is stale once it grows."""
        self._drain_index_events()
        return self._departures

    def holds(self, block_hash: bytes, group: int = 0) -> bool:
        """Whether the tier holds the block, or is writing it."""
        return self._present(self.namespace.key(block_hash, group))

    @property
    def settled(self) -> bool:
        """Whether no batch or promotion is in flight and no outcome waits to be announced:
        then ``process(None)`` changes nothing."""
        return not (self._unavailable or self._batches or self._promotions or self._released)

    @property
    def has_tier_work(self) -> bool:
        """Whether demotions or promotions wait for the next plan."""
        return bool(self._demotions or self._promotions_to_plan)

    @property
    def num_quarantined_batches(self) -> int:
        """Failed batches whose copies may still run on some worker; their slots stay held."""
        return len(self._quarantine)

    @property
    def num_requests(self) -> int:
        """Requests the manager tracks (running, or finished and held)."""
        return len(self._requests)

    # ------------------------------------------------------------------ internals

    def _state(self, request_id: str) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            state = _Request(request_id, self.num_groups, seq=self._next_seq)
            self._next_seq += 1
            self._requests[request_id] = state
            self.index.request_started(request_id)
        elif state.finished:
            raise ValueError(f"request {request_id} already finished; request ids must be unique")
        return state

    def _windowed_hits(self, wanted: Sequence[bytes], hits: int, group: int, window: int) -> int:
        """The longest hit ``<= hits`` whose last ``window`` blocks ``group`` holds."""
        keys = self.namespace.keys(wanted[:hits], group)
        while hits > 0:
            start = max(0, hits - window)
            readable = self.index.lookup(keys[start:hits])
            if readable == hits - start:
                return hits
            # the first missing block rules out every hit whose window contains it
            hits = start + readable
        return 0

    def _note_window_blocks(self, state: _Request) -> None:
        """Lazy mode: remember the windowed groups' blocks a hit at the request's end needs.

        A hit can start where a step left the request (a finished, preempted or
        repeated request starts from there); a windowed group's block that was
        never among the last ``window`` blocks at such a point is never read
        back, so lazy mode does not store it when it reaches the eviction
        frontier (vLLM frees sliding-window blocks while their request runs).
        """
        if self.store_mode != "lazy":
            return
        ready = min(len(state.block_hashes), state.computed_tokens // self.block_tokens)
        for group, window in enumerate(self.group_windows):
            if window is None:
                continue
            group_ids = state.block_ids[group]
            stop = min(ready, len(group_ids))
            start = max(0, stop - window)
            keys = self.namespace.keys(state.block_hashes[start:stop], group)
            for block_id, key in zip(group_ids[start:stop], keys, strict=True):
                if block_id != self.null_block_id:
                    self._window_blocks[group][block_id] = key

    def _refuse_reload(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and not state.finished:
            self._load_failed.add(request_id)

    def _new_batch_id(self) -> int:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        return batch_id

    def _present(self, key: BlockKey) -> bool:
        return key in self._writing or self.index.slot_of(key) is not None

    def _cancel_pending_loads(self, state: _Request) -> None:
        for pending in state.pending_loads:
            self.index.unpin(pending.keys)
        state.pending_loads.clear()
        state.same_step = False

    def _has_unstored_blocks(self, state: _Request) -> bool:
        if self.store_mode != "eager":
            return False
        ready = min(len(state.block_hashes), state.computed_tokens // self.block_tokens)
        return any(
            state.store_cursor[group] < min(ready, len(state.block_ids[group]))
            for group in range(self.num_groups)
        )

    def _plan_eager_stores(self, due: Sequence[_Request], now: float) -> list[Transfer]:
        per_group: list[tuple[list[int], list[int], list[BlockKey], set[str]]] = []
        out_of_space = False
        reserved_now: set[BlockKey] = set()
        for state in due:
            if state.hold_announced:
                continue
            if out_of_space:
                self._due.add(state.request_id)  # retried next step
                continue
            ready = min(len(state.block_hashes), state.computed_tokens // self.block_tokens)
            for group in range(self.num_groups):
                group_ids = state.block_ids[group]
                start, stop = state.store_cursor[group], min(ready, len(group_ids))
                window = self.group_windows[group]
                if window is not None:
                    # blocks that left the window may already be back in the engine's pool
                    start = max(start, stop - window)
                if start >= stop:
                    state.store_cursor[group] = max(state.store_cursor[group], stop)
                    continue
                positions = [
                    pos for pos in range(start, stop) if group_ids[pos] != self.null_block_id
                ]
                keys = self.namespace.keys([state.block_hashes[pos] for pos in positions], group)
                parent = self.namespace.key(state.block_hashes[start - 1], group) if start else None
                slots = self.index.reserve(keys, parent) if keys else []
                cursor = stop
                if not per_group:  # the first request with blocks to store this step
                    per_group = [([], [], [], set()) for _ in range(self.num_groups)]
                blocks, slot_list, key_list, requests = per_group[group]
                for pos, key, slot in zip(positions, keys, slots, strict=True):
                    if slot is not None:
                        blocks.append(group_ids[pos])
                        slot_list.append(slot)
                        key_list.append(key)
                        requests.add(state.request_id)
                        reserved_now.add(key)
                    elif (
                        cursor == stop
                        and key not in reserved_now
                        and not self._present(key)
                        and self._no_space()
                    ):
                        # retry from here next step; later keys of the chain got no slot either
                        cursor = pos
                        out_of_space = True
                state.store_cursor[group] = cursor
                if out_of_space:
                    self._due.add(state.request_id)
                    break
        return self._store_transfers(per_group, now)

    def _plan_lazy_stores(self, candidates: Sequence[LazyCandidate], now: float) -> list[Transfer]:
        per_group: list[tuple[list[int], list[int], list[BlockKey], set[str]]] = [
            ([], [], [], set()) for _ in range(self.num_groups)
        ]
        wanted: dict[BlockKey, LazyCandidate] = {}
        for candidate in candidates:
            if candidate.block_id == self.null_block_id:
                continue
            if not 0 <= candidate.group < self.num_groups:
                raise ValueError(
                    f"lazy candidate names kv-cache group {candidate.group}, "
                    f"but the manager has {self.num_groups} groups"
                )
            key = self.namespace.key(candidate.block_hash, candidate.group)
            if key in wanted or self._present(key):
                continue
            if (
                self.group_windows[candidate.group] is not None
                and self._window_blocks[candidate.group].get(candidate.block_id) != key
            ):
                continue
            wanted[key] = candidate
        # With room for all, slots are taken in the prompt's order: the engine frees a
        # request's blocks last first, so candidates come in reverse. A later hit then
        # reads slots that count up along the prompt, as eager stores leave them, and
        # its load is a few runs in one direction. Without room, the candidates nearest
        # eviction go first.
        slots: dict[BlockKey, int] = {}
        backwards = len(wanted) <= self.index.stats().free
        for key in reversed(wanted) if backwards else wanted:
            (slot,) = self.index.reserve([key], lazy=True)
            if slot is not None:
                slots[key] = slot
            elif self._no_space():
                break
        for key, candidate in wanted.items():
            if key in slots:
                blocks, slot_list, key_list, _ = per_group[candidate.group]
                blocks.append(candidate.block_id)
                slot_list.append(slots[key])
                key_list.append(key)
        return self._store_transfers(per_group, now)

    def _no_space(self) -> bool:
        stats = self.index.stats()
        # discarded slots are pinned too, but hold no readable block
        return stats.free == 0 and stats.readable == stats.pinned - stats.discarded

    def _store_transfers(
        self, per_group: list[tuple[list[int], list[int], list[BlockKey], set[str]]], now: float
    ) -> list[Transfer]:
        transfers = []
        for group, (blocks, slots, keys, requests) in enumerate(per_group):
            if not blocks:
                continue
            transfer = Transfer(
                self._new_batch_id(), Direction.STORE, group, tuple(blocks), tuple(slots)
            )
            self._batches[transfer.batch_id] = _Batch(
                transfer, tuple(keys), tuple(sorted(requests)), now
            )
            for key in keys:
                self._writing[key] = transfer.batch_id
            for request_id in requests:
                self._requests[request_id].batches.add(transfer.batch_id)
            transfers.append(transfer)
            self._observe(self._observations.store_blocks, len(transfer))
        return transfers

    def _count(self, report: WorkerReport) -> set[int]:
        """Add one report's counts to its batches; return the batches it changed."""
        touched: set[int] = set()
        for batch_id in report.batch_ids:
            counts = (
                report.done.get(batch_id, 0),
                report.failed.get(batch_id, 0),
                report.abandoned.get(batch_id, 0),
                report.settled.get(batch_id, 0),
            )
            batch = self._batches.get(batch_id) or self._quarantine.get(batch_id)
            problem = self._impossible(batch, counts)
            if problem is not None:
                self._rejected_reports += 1
                self._failures.failed(
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
            self._abandoned_copies += abandoned
            touched.add(batch_id)
        return touched

    def _impossible(self, batch: _Batch | None, counts: tuple[int, int, int, int]) -> str | None:
        """Why these counts cannot be a worker's report of ``batch``, or ``None`` if they can."""
        if not all(isinstance(count, int) and count >= 0 for count in counts):
            return "counts are numbers of workers and cannot be negative or fractional"
        if batch is None:
            return "the batch is not in flight"
        done, failed, abandoned, settled = counts
        reported = batch.reported + done + failed + abandoned
        if reported > self.world_size:
            return f"{reported} workers would have reported it, but world_size is {self.world_size}"
        if batch.settled + settled > batch.abandoned + abandoned:
            return (
                f"{batch.settled + settled} workers would have settled its copy, but only "
                f"{batch.abandoned + abandoned} abandoned it"
            )
        return None

    def _complete(self, batch: _Batch, collected: _Collected) -> None:
        """Apply a batch's outcome; keep its slots quarantined while a copy may still run."""
        transfer = batch.transfer
        del self._batches[transfer.batch_id]
        ok = batch.done == self.world_size
        running = batch.copies_running(self.world_size) > 0
        if ok:
            seconds = self._clock() - batch.planned_at
            observations = self._observations
            store = transfer.direction is Direction.STORE
            self._observe(
                observations.store_seconds if store else observations.load_seconds, seconds
            )
        if transfer.direction is Direction.STORE:
            if ok and not batch.reset:
                for key in batch.keys:
                    del self._writing[key]
                self.index.commit(batch.keys)
                if self.lower_tiers:
                    self._slots.update(zip(batch.keys, transfer.host_slots, strict=True))
                self._stored_blocks += len(batch.keys)
            elif not running:
                self._abort_store(batch)
            if not ok:
                self._failed_stores += len(batch.keys)
                self._failures.failed(
                    FailureCause.STORE_DROPPED,
                    "store batch %d of %d blocks did not complete on %d of %d workers; the "
                    "blocks were dropped",
                    transfer.batch_id,
                    len(batch.keys),
                    self.world_size - batch.done,
                    self.world_size,
                )
            collected.stored.extend(DeviceBlock(transfer.group, b) for b in transfer.device_blocks)
        else:
            if ok:
                self._loaded_blocks += len(transfer)
                if batch.same_step:
                    self._same_step_loaded_blocks += len(transfer)
            else:
                # What could not be read once is not offered as a hit again.
                self.index.discard(batch.keys)
                self._failed_loads += len(transfer)
                assert transfer.request_id is not None
                self._refuse_reload(transfer.request_id)
                collected.failed_loads.setdefault(transfer.request_id, []).extend(
                    DeviceBlock(transfer.group, b) for b in transfer.device_blocks
                )
            if not running:
                self.index.unpin(batch.keys)
        if running:
            self._quarantine[transfer.batch_id] = batch
        for request_id in batch.requests:
            state = self._requests.get(request_id)
            if state is None:
                continue
            state.batches.discard(transfer.batch_id)
            if transfer.batch_id in state.load_batches:
                state.load_batches.discard(transfer.batch_id)
                if not state.load_batches:
                    collected.loaded.append(request_id)
            if state.finished and state.hold_announced and not state.batches:
                self._release(request_id)

    def _count_promotions(self, report: WorkerReport) -> None:
        """Add one report's promotion answers; commit what every worker found."""
        for batch_id, (workers, found) in report.promoted.items():
            promotion = self._promotions.get(batch_id)
            if (
                promotion is None
                or workers <= 0
                or promotion.reported + workers > self.world_size
                or not 0 <= found <= len(promotion.keys)
            ):
                self._rejected_reports += 1
                self._failures.failed(
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
            if promotion.reported == self.world_size:
                self._complete_promotion(promotion)

    def _complete_promotion(self, promotion: _PromotionBatch) -> None:
        message = promotion.message
        del self._promotions[message.batch_id]
        for key in promotion.keys:
            del self._writing[key]
        found = promotion.keys[: promotion.found]
        if found:
            self.index.commit(found)
            self._slots.update(zip(found, message.host_slots, strict=False))
        if promotion.found < len(promotion.keys):
            self.index.abort(promotion.keys[promotion.found :])
            self._departures += len(promotion.keys) - promotion.found
        self._promoted_blocks += promotion.found
        self._answer_promotion(promotion)
        logger.debug(
            "request %s: %d of %d blocks promoted from the lower tiers",
            promotion.request_id,
            promotion.found,
            len(promotion.keys),
        )

    def _answer_promotion(self, promotion: _PromotionBatch) -> None:
        waiting = self._promoting.get(promotion.request_id)
        if waiting is not None:
            waiting.discard(promotion.message.batch_id)

    def _expire_promotions(self) -> None:
        """Answer the lookups of promotions not reported in time; their slots stay reserved."""
        late = self._clock() - self.report_deadline_s
        for promotion in self._promotions.values():
            if promotion.expired or promotion.planned_at > late:
                continue
            promotion.expired = True
            self._expired_promotions += 1
            self._answer_promotion(promotion)
            self._failures.failed(
                FailureCause.REPORT_DEADLINE,
                "promotion %d of %d blocks was not reported by every worker within "
                "report_deadline_s=%s; request %s recomputes them, and their host slots stay "
                "reserved until every worker reported",
                promotion.message.batch_id,
                len(promotion.keys),
                self.report_deadline_s,
                promotion.request_id,
            )

    def _release_quarantined(self, batch: _Batch) -> None:
        """Free a failed batch's slots once no worker's copy of it may still run."""
        if batch.copies_running(self.world_size) > 0:
            return
        del self._quarantine[batch.transfer.batch_id]
        if batch.transfer.direction is Direction.STORE:
            self._abort_store(batch)
        else:
            self.index.unpin(batch.keys)
        logger.debug(
            "batch %d's copies are over on every worker; its %d host slots are free again",
            batch.transfer.batch_id,
            len(batch.transfer),
        )

    def _abort_store(self, batch: _Batch) -> None:
        for key in batch.keys:
            del self._writing[key]
        self.index.abort(batch.keys)
        self._departures += len(batch.keys)

    def _expire(self, collected: _Collected) -> None:
        """Fail the batches some worker did not report within ``report_deadline_s``."""
        late = self._clock() - self.report_deadline_s
        for batch in list(self._batches.values()):
            if batch.planned_at > late:
                break  # batches are kept in planning order
            self._expired_batches += 1
            self._failures.failed(
                FailureCause.REPORT_DEADLINE,
                "%s batch %d of %d blocks was not reported by %d of %d workers within "
                "report_deadline_s=%s; it failed (a load is recomputed, a store dropped) and its "
                "host slots stay out of use until those workers report it",
                batch.transfer.direction.value,
                batch.transfer.batch_id,
                len(batch.transfer),
                self.world_size - batch.reported,
                self.world_size,
                self.report_deadline_s,
            )
            self._complete(batch, collected)

    def _release(self, request_id: str) -> None:
        del self._requests[request_id]
        self._released.append(request_id)

    def _observe(self, into: list[Any], value: float) -> None:
        if self.record_observations:
            into.append(value)

    def _drain_index_events(self) -> None:
        events = self.index.take_events()
        if not events:
            return
        evicted = sum(1 for event in events if event.kind is EventKind.EVICTED)
        self._evicted_blocks += evicted
        self._departures += evicted
        if self.lower_tiers:
            for event in events:
                if event.kind is EventKind.EVICTED and event.key in self._slots:
                    self._demotions[event.key] = self._slots.pop(event.key)
        if self.record_events:
            self._events.extend(events)
