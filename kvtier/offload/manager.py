"""Scheduler-side offload manager: decides what to store, what to load and when blocks are free.

The manager owns all bookkeeping (the host tier's :class:`~kvtier.index.BlockIndex`,
request states, batch numbering) and no bytes. It speaks engine-neutral data:
request ids, engine block hashes (namespaced here by kv-cache group), device
block ids per group and token counts. An engine integration calls it in this
order:

Per request:

1. :meth:`OffloadManager.lookup` — how many tokens past the engine's own
   prefix hits the tier can supply (whole blocks; never the last token). No
   side effects, so it may be asked again.
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
   unpin their slots (a failed load is a recompute, never a hit).

At any time: :meth:`take_events`, :meth:`stats`, :meth:`reset`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvtier.copy.base import Direction
from kvtier.index.base import BlockIndex, BlockKey, EventKind, IndexEvent
from kvtier.keys import KeyNamespace
from kvtier.kinds import BLOCK_INDEX
from kvtier.offload.messages import (
    DeviceBlock,
    LazyCandidate,
    Transfer,
    TransferPlan,
    WorkerReport,
)

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

StoreMode = Literal["eager", "lazy"]
GroupBlockIds = Sequence[Sequence[int]]
"""Device block ids per kv-cache group: ``block_ids[group][position]``."""


@dataclass(frozen=True)
class OffloadStats:
    """Cumulative counters and current usage of the host tier, for metrics.

    Byte counters count every rank's shard (``blocks * record_bytes * world_size``).
    """

    num_slots: int
    """Slots in the host tier (per rank; every rank has the same slots)."""
    used_slots: int
    """Slots holding a readable block or one being written."""
    hit_tokens: int
    """Tokens the engine accepted from the tier (loads planned)."""
    stored_blocks: int
    """Blocks whose stores completed on every worker."""
    stored_bytes: int
    """Bytes of those blocks, all ranks together."""
    loaded_blocks: int
    """Blocks whose loads completed on every worker."""
    loaded_bytes: int
    """Bytes of those blocks, all ranks together."""
    evicted_blocks: int
    """Blocks evicted from the tier to make room (or by :meth:`OffloadManager.reset`)."""
    failed_stores: int
    """Blocks whose store failed on some worker (they were dropped)."""
    failed_loads: int
    """Blocks whose load failed on some worker or could not be started (recomputed)."""


@dataclass(frozen=True)
class Progress:
    """What completed on every worker, as learnt from one :meth:`OffloadManager.process` call."""

    released_requests: tuple[str, ...] = ()
    """Finished requests whose device blocks the engine may free now."""
    loaded_requests: tuple[str, ...] = ()
    """Requests whose loads all completed (successfully or not) on every worker."""
    failed_loads: dict[str, tuple[DeviceBlock, ...]] = field(default_factory=dict)
    """Per request, device blocks whose load failed: recompute them."""
    stored_blocks: tuple[DeviceBlock, ...] = ()
    """Device blocks whose stores completed (or failed) everywhere: no longer protected."""


@dataclass
class _Batch:
    transfer: Transfer
    keys: tuple[BlockKey, ...]
    requests: tuple[str, ...]
    done: int = 0
    failed: int = 0


@dataclass
class _Request:
    request_id: str
    num_groups: int
    block_hashes: Sequence[bytes] = ()
    block_ids: list[list[int]] = field(default_factory=list)
    store_cursor: list[int] = field(default_factory=list)
    computed_tokens: int = 0
    pending_loads: list[tuple[int, tuple[BlockKey, ...], tuple[int, ...]]] = field(
        default_factory=list
    )
    unavailable: list[DeviceBlock] = field(default_factory=list)
    batches: set[int] = field(default_factory=set)
    load_batches: set[int] = field(default_factory=set)
    finished: bool = False
    hold_announced: bool = False

    def __post_init__(self) -> None:
        if not self.block_ids:
            self.clear_blocks()

    def clear_blocks(self) -> None:
        """Forget the request's device blocks and restart store progress in every group."""
        self.block_ids = [[] for _ in range(self.num_groups)]
        self.store_cursor = [0] * self.num_groups


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
        group_windows: Sequence[int | None] | None = None,
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
            group_windows: Per kv-cache group, ``None`` when a prefix needs all
                its blocks (full attention), or ``w`` when only its last ``w``
                blocks matter (sliding window: the blocks the window spans;
                Mamba state: 1). Such a group stores, loads and requires for a
                hit only those blocks. ``None`` means full attention everywhere.

        Raises:
            ValueError: If a size is not positive, ``store_mode`` is unknown or
                ``group_windows`` does not give one entry per group.
        """
        for name, value in (
            ("block_tokens", block_tokens),
            ("record_bytes", record_bytes),
            ("world_size", world_size),
            ("num_groups", num_groups),
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
        self._requests: dict[str, _Request] = {}
        self._batches: dict[int, _Batch] = {}
        self._writing: dict[BlockKey, int] = {}
        self._next_batch_id = 0
        self._flush = False
        self._released: list[str] = []
        self._unavailable: dict[str, tuple[DeviceBlock, ...]] = {}
        self._events: list[IndexEvent] = []
        self._resetting = False
        self._hit_tokens = 0
        self._stored_blocks = 0
        self._loaded_blocks = 0
        self._evicted_blocks = 0
        self._failed_stores = 0
        self._failed_loads = 0

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
        group_windows: Sequence[int | None] | None = None,
        registry: Registry | None = None,
    ) -> OffloadManager:
        """Build a manager, and its index, from a validated :class:`~kvtier.config.KVTierConfig`.

        The tier gets ``capacity_per_rank(config, world_size) // record_bytes``
        slots, the same count :meth:`OffloadWorker.from_config
        <kvtier.offload.worker.OffloadWorker.from_config>` allocates.
        """
        from kvtier.plugins import default_registry
        from kvtier.tiers.host import capacity_per_rank, slots_for_bytes

        num_slots = slots_for_bytes(capacity_per_rank(config, world_size), record_bytes)
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
            group_windows=group_windows,
        )

    # ------------------------------------------------------------------ requests

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        num_tokens: int,
    ) -> int:
        """Return how many tokens past ``num_computed_tokens`` the tier can load.

        Counts whole blocks readable in every kv-cache group (for a group
        with a window, the last ``window`` blocks of the hit), starting at the
        first block the engine does not hold, and never covers the request's
        last token (the engine must compute at least one). Changes nothing.

        Args:
            request_id: The request (for logging only).
            block_hashes: The engine's hash of each full block of the request.
            num_computed_tokens: Tokens the engine already holds (its own prefix hits);
                a multiple of ``block_tokens``.
            num_tokens: Tokens of the request so far.
        """
        first = num_computed_tokens // self.block_tokens
        limit = max(0, num_tokens - 1 - num_computed_tokens) // self.block_tokens
        wanted = block_hashes[first : first + limit]
        if not wanted:
            return 0
        hits = len(wanted)
        for group, window in enumerate(self.group_windows):
            if window is None and hits:
                hits = min(hits, self.index.lookup(self.namespace.keys(wanted[:hits], group)))
        for group, window in enumerate(self.group_windows):
            if window is not None:
                hits = self._windowed_hits(wanted, hits, group, window)
        logger.debug("request %s: %d tier hit blocks after %d", request_id, hits, first)
        return hits * self.block_tokens

    def allocated(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: GroupBlockIds,
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """Record the engine's allocation; queue a load of ``num_external_tokens`` from the tier.

        The blocks at positions ``num_computed_tokens // block_tokens`` onwards
        (``num_external_tokens // block_tokens`` of them) are loaded into
        ``block_ids[group][position]`` in every group. Their host slots are
        pinned now, so no store can evict them before the load ran; a block
        that is no longer readable is reported to the engine as a failed load
        (recompute) by the next plan. The engine's own hits are touched in the
        tier's policy.

        Args:
            request_id: The request.
            block_hashes: The engine's hash of each full block of the request.
            block_ids: The request's device block ids per group, from position 0.
            num_computed_tokens: Tokens the engine held before the tier's hits.
            num_external_tokens: Tokens accepted from :meth:`lookup` (0 for none).
        """
        state = self._state(request_id)
        state.block_hashes = block_hashes
        first = num_computed_tokens // self.block_tokens
        count = num_external_tokens // self.block_tokens
        for group in range(self.num_groups):
            self.index.touch(self.namespace.keys(block_hashes[:first], group))
        if count == 0:
            return
        self._hit_tokens += count * self.block_tokens
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
            keys, blocks = [], []
            group_keys = self.namespace.keys(hashes[skip:], group)
            for key, block_id in zip(group_keys, group_ids[skip:], strict=True):
                if block_id != self.null_block_id:
                    keys.append(key)
                    blocks.append(block_id)
            readable = self.index.lookup(keys)
            if readable:
                pinned = tuple(keys[:readable])
                self.index.pin(pinned)
                state.pending_loads.append((group, pinned, tuple(blocks[:readable])))
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

    def preempted(self, request_ids: Iterable[str]) -> None:
        """The engine took these requests' device blocks back.

        The next plan makes every worker wait for in-flight copies before the
        blocks are reused; queued loads are dropped (the request starts over)
        and store progress restarts from the request's next blocks.
        """
        for request_id in request_ids:
            self._flush = True
            state = self._requests.get(request_id)
            if state is None:
                continue
            self._cancel_pending_loads(state)
            state.unavailable.clear()
            state.clear_blocks()
            state.computed_tokens = 0

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
        state = self._requests.get(request_id)
        if state is None:
            return False
        self._cancel_pending_loads(state)
        state.unavailable.clear()
        if num_computed_tokens is not None:
            state.computed_tokens = max(state.computed_tokens, num_computed_tokens)
        state.finished = True
        if state.batches or self._has_unstored_blocks(state):
            return True
        del self._requests[request_id]
        return False

    # ---------------------------------------------------------------------- steps

    def build_plan(self, lazy_candidates: Sequence[LazyCandidate] = ()) -> TransferPlan:
        """Return this step's plan for every worker.

        Args:
            lazy_candidates: In lazy mode, cached device blocks near the
                engine's eviction frontier, in eviction order; those not yet in
                the tier are stored while slots last. Ignored in eager mode.
        """
        self._drain_index_events()
        loads: list[Transfer] = []
        unavailable: dict[str, tuple[int, ...]] = {}
        for state in self._requests.values():
            for group, keys, blocks in state.pending_loads:
                slots = tuple(self._slot(key) for key in keys)
                transfer = Transfer(
                    self._new_batch_id(), Direction.LOAD, group, blocks, slots, state.request_id
                )
                self._batches[transfer.batch_id] = _Batch(transfer, keys, (state.request_id,))
                state.batches.add(transfer.batch_id)
                state.load_batches.add(transfer.batch_id)
                loads.append(transfer)
            state.pending_loads.clear()
            if state.unavailable:
                unavailable[state.request_id] = tuple(b.block_id for b in state.unavailable)
                self._unavailable[state.request_id] = tuple(state.unavailable)
                state.unavailable.clear()
        if self._resetting:
            stores: list[Transfer] = []
        elif self.store_mode == "eager":
            stores = self._plan_eager_stores()
        else:
            stores = self._plan_lazy_stores(lazy_candidates)
        holds: dict[str, tuple[int, ...]] = {}
        for request_id, state in list(self._requests.items()):
            if not state.finished or state.hold_announced:
                continue
            state.hold_announced = True
            holds[request_id] = tuple(sorted(state.batches))
            if not state.batches:
                self._release(request_id)
        plan = TransferPlan(
            stores=tuple(stores),
            loads=tuple(loads),
            flush=self._flush,
            holds=holds,
            unavailable=unavailable,
        )
        self._flush = False
        return plan

    def process(self, report: WorkerReport | Iterable[WorkerReport | None] | None) -> Progress:
        """Count worker completions; finish the batches every worker has reported.

        Args:
            report: One merged report, several (one per worker), or ``None``.

        Raises:
            ValueError: If a report names a batch that is not in flight, or
                counts more workers than ``world_size`` for it.
        """
        if report is None:
            merged = WorkerReport()
        elif isinstance(report, WorkerReport):
            merged = report
        else:
            merged = WorkerReport.merge_all(report)
        loaded: list[str] = []
        failed_loads: dict[str, list[DeviceBlock]] = {}
        for request_id, blocks in self._unavailable.items():
            failed_loads[request_id] = list(blocks)
            state = self._requests.get(request_id)
            if state is not None and not state.load_batches:
                loaded.append(request_id)
        self._unavailable.clear()
        stored: list[DeviceBlock] = []
        for outcome, counts in (("done", merged.done), ("failed", merged.failed)):
            for batch_id, count in counts.items():
                batch = self._batches.get(batch_id)
                if batch is None:
                    raise ValueError(
                        f"a worker reported batch {batch_id}, which is not in flight; "
                        "reports must come from plans of this manager, each worker once per batch"
                    )
                if outcome == "done":
                    batch.done += count
                else:
                    batch.failed += count
                if batch.done + batch.failed > self.world_size:
                    raise ValueError(
                        f"batch {batch_id} was reported by {batch.done + batch.failed} workers, "
                        f"but world_size is {self.world_size}"
                    )
        for batch_id in sorted(set(merged.done) | set(merged.failed)):
            batch = self._batches[batch_id]
            if batch.done + batch.failed < self.world_size:
                continue
            del self._batches[batch_id]
            transfer = batch.transfer
            ok = batch.failed == 0
            if transfer.direction is Direction.STORE:
                self._finish_store(batch, ok)
                stored.extend(DeviceBlock(transfer.group, b) for b in transfer.device_blocks)
            else:
                self.index.unpin(batch.keys)
                if ok:
                    self._loaded_blocks += len(transfer)
                else:
                    # What could not be read once is not offered as a hit again.
                    self.index.discard(batch.keys)
                    self._failed_loads += len(transfer)
                    assert transfer.request_id is not None
                    failed_loads.setdefault(transfer.request_id, []).extend(
                        DeviceBlock(transfer.group, b) for b in transfer.device_blocks
                    )
            for request_id in batch.requests:
                state = self._requests.get(request_id)
                if state is None:
                    continue
                state.batches.discard(batch_id)
                if batch_id in state.load_batches:
                    state.load_batches.discard(batch_id)
                    if not state.load_batches:
                        loaded.append(request_id)
                if state.finished and state.hold_announced and not state.batches:
                    self._release(request_id)
        self._drain_index_events()
        released, self._released = tuple(self._released), []
        return Progress(
            released_requests=released,
            loaded_requests=tuple(loaded),
            failed_loads={rid: tuple(blocks) for rid, blocks in failed_loads.items()},
            stored_blocks=tuple(stored),
        )

    # ------------------------------------------------------------------- queries

    def take_events(self) -> list[IndexEvent]:
        """Return and forget the tier's stored/evicted events (kept only with ``record_events``)."""
        self._drain_index_events()
        events, self._events = self._events, []
        return events

    def reset(self) -> bool:
        """Empty the tier; return whether it is empty now.

        Readable blocks are evicted at once; blocks being read or written are
        dropped when their copies complete, and no new store is planned until
        a call returns ``True``. Call again (each step) until it does.
        """
        self._resetting = True
        empty = self.index.clear() and not self._writing
        self._drain_index_events()
        if empty:
            self._resetting = False
            logger.info("host tier reset: empty")
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
            loaded_bytes=self._loaded_blocks * bytes_per_block,
            evicted_blocks=self._evicted_blocks,
            failed_stores=self._failed_stores,
            failed_loads=self._failed_loads,
        )

    @property
    def num_inflight_batches(self) -> int:
        """Batches planned and not yet reported by every worker."""
        return len(self._batches)

    @property
    def num_requests(self) -> int:
        """Requests the manager tracks (running, or finished and held)."""
        return len(self._requests)

    # ------------------------------------------------------------------ internals

    def _state(self, request_id: str) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            state = _Request(request_id, self.num_groups)
            self._requests[request_id] = state
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

    def _new_batch_id(self) -> int:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        return batch_id

    def _slot(self, key: BlockKey) -> int:
        slot = self.index.slot_of(key)
        if slot is None:
            raise RuntimeError(f"pinned block {key.hex()} lost its slot; the block index is broken")
        return slot

    def _present(self, key: BlockKey) -> bool:
        return key in self._writing or self.index.slot_of(key) is not None

    def _cancel_pending_loads(self, state: _Request) -> None:
        for _, keys, _ in state.pending_loads:
            self.index.unpin(keys)
        state.pending_loads.clear()

    def _has_unstored_blocks(self, state: _Request) -> bool:
        if self.store_mode != "eager" or self._resetting:
            return False
        ready = min(len(state.block_hashes), state.computed_tokens // self.block_tokens)
        return any(
            state.store_cursor[group] < min(ready, len(state.block_ids[group]))
            for group in range(self.num_groups)
        )

    def _plan_eager_stores(self) -> list[Transfer]:
        per_group: list[tuple[list[int], list[int], list[BlockKey], set[str]]] = [
            ([], [], [], set()) for _ in range(self.num_groups)
        ]
        out_of_space = False
        reserved_now: set[BlockKey] = set()
        for state in self._requests.values():
            if out_of_space:
                break
            if state.hold_announced:
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
                    break
        return self._store_transfers(per_group)

    def _plan_lazy_stores(self, candidates: Sequence[LazyCandidate]) -> list[Transfer]:
        per_group: list[tuple[list[int], list[int], list[BlockKey], set[str]]] = [
            ([], [], [], set()) for _ in range(self.num_groups)
        ]
        reserved_now: set[BlockKey] = set()
        for candidate in candidates:
            if candidate.block_id == self.null_block_id:
                continue
            if not 0 <= candidate.group < self.num_groups:
                raise ValueError(
                    f"lazy candidate names kv-cache group {candidate.group}, "
                    f"but the manager has {self.num_groups} groups"
                )
            key = self.namespace.key(candidate.block_hash, candidate.group)
            if key in reserved_now or self._present(key):
                continue
            (slot,) = self.index.reserve([key])
            if slot is None:
                if self._no_space():
                    break
                continue
            reserved_now.add(key)
            blocks, slot_list, key_list, _ = per_group[candidate.group]
            blocks.append(candidate.block_id)
            slot_list.append(slot)
            key_list.append(key)
        return self._store_transfers(per_group)

    def _no_space(self) -> bool:
        stats = self.index.stats()
        return stats.free == 0 and stats.readable == stats.pinned

    def _store_transfers(
        self, per_group: list[tuple[list[int], list[int], list[BlockKey], set[str]]]
    ) -> list[Transfer]:
        transfers = []
        for group, (blocks, slots, keys, requests) in enumerate(per_group):
            if not blocks:
                continue
            transfer = Transfer(
                self._new_batch_id(), Direction.STORE, group, tuple(blocks), tuple(slots)
            )
            self._batches[transfer.batch_id] = _Batch(
                transfer, tuple(keys), tuple(sorted(requests))
            )
            for key in keys:
                self._writing[key] = transfer.batch_id
            for request_id in requests:
                self._requests[request_id].batches.add(transfer.batch_id)
            transfers.append(transfer)
        return transfers

    def _finish_store(self, batch: _Batch, ok: bool) -> None:
        for key in batch.keys:
            del self._writing[key]
        if ok and not self._resetting:
            self.index.commit(batch.keys)
            self._stored_blocks += len(batch.keys)
        else:
            self.index.abort(batch.keys)
            if not ok:
                self._failed_stores += len(batch.keys)
                logger.warning(
                    "store batch %d of %d blocks failed on a worker; the blocks were dropped",
                    batch.transfer.batch_id,
                    len(batch.keys),
                )

    def _release(self, request_id: str) -> None:
        del self._requests[request_id]
        self._released.append(request_id)

    def _drain_index_events(self) -> None:
        events = self.index.take_events()
        if not events:
            return
        self._evicted_blocks += sum(1 for event in events if event.kind is EventKind.EVICTED)
        if self.record_events:
            self._events.extend(events)
