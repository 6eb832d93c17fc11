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
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config.model import DEFAULT_REPORT_DEADLINE_S
from kvtier.index.base import BlockIndex, BlockKey, EventKind, IndexEvent
from kvtier.keys import KeyNamespace
from kvtier.kinds import BLOCK_INDEX
from kvtier.offload.failures import FailureLog
from kvtier.offload.frontier import EvictionFrontier, FrontierMemory
from kvtier.offload.ledger import BatchLedger, Collected, Progress
from kvtier.offload.messages import LazyCandidate, TransferPlan, WorkerReport
from kvtier.offload.moves import LowerTierMoves
from kvtier.offload.planner import Planner
from kvtier.offload.requests import RequestTable
from kvtier.offload.setup import GroupBlockIds, ManagerSetup, StoreMode
from kvtier.offload.stats import Counters, Observations, OffloadStats

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

_NO_PROGRESS = Progress()

_NO_PLAN = TransferPlan()
"""The plan of a step that asks nothing of the workers (shared: plans are never changed)."""


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

        Every argument but the two below is the :class:`~kvtier.offload.setup.ManagerSetup`
        field of that name, which says what it means.

        Args:
            record_events: Keep the index's stored/evicted events for
                :meth:`take_events`; otherwise they are only counted.
            record_observations: Keep latencies, batch sizes and per-request hits for
                :meth:`take_observations` (whoever sets it must take them regularly).

        Raises:
            ValueError: If a size or the deadline is not positive, ``store_mode``
                is unknown or ``group_windows`` does not give one entry per group.
        """
        self.setup = setup = ManagerSetup(
            index,
            block_tokens,
            record_bytes,
            world_size,
            store_mode,
            num_groups,
            namespace if namespace is not None else KeyNamespace(),
            null_block_id,
            None if group_windows is None else tuple(group_windows),
            report_deadline_s,
            lower_tiers,
            clock,
        )
        self.index, self.namespace = index, setup.namespace
        self.store_mode, self.world_size = setup.store_mode, world_size
        self.record_events = record_events
        self.counters = counters = Counters(record_observations=record_observations)
        failures = FailureLog(logger)
        self.requests = RequestTable(setup)
        self.ledger = BatchLedger(setup, self.requests, counters, failures)
        self.planner = Planner(setup, self.requests, self.ledger, counters)
        self.moves = LowerTierMoves(setup, self.ledger, counters, failures)
        self.frontier = FrontierMemory(setup, self.ledger)
        self._failures = failures
        self._flush = False
        # The keys the last lookup() made, per group without a window, for allocated() to
        # reuse when it is given the same hashes (the same sequence) and first block.
        self._looked_up: tuple[Sequence[bytes], int, dict[int, list[BlockKey]]] | None = None
        self._events: list[IndexEvent] = []
        self._taken = OffloadStats()

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        *,
        record_bytes: int,
        world_size: int = 1,
        registry: Registry | None = None,
        **options: Any,
    ) -> OffloadManager:
        """Build a manager, and its index, from a validated :class:`~kvtier.config.KVTierConfig`.

        The tier gets :meth:`config.host_slots <kvtier.config.KVTierConfig.host_slots>`
        slots, the same count :meth:`OffloadWorker.from_config
        <kvtier.offload.worker.OffloadWorker.from_config>` allocates (after it
        checked the memory available: vLLM builds the scheduler once the workers
        hold their buffers, so the memory left then says nothing about the tier).
        ``options`` are the constructor's other arguments (``block_tokens``,
        ``num_groups``, ...) but those the config sets.
        """
        from kvtier.plugins import default_registry

        num_slots = config.host_slots(record_bytes, world_size)
        registry = registry if registry is not None else default_registry()
        return cls(
            registry.build(BLOCK_INDEX, config.index, num_slots),
            record_bytes=record_bytes,
            world_size=world_size,
            store_mode=config.store_mode,
            report_deadline_s=config.report_deadline_s,
            lower_tiers=bool(config.tiers),
            **options,
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
        if request_id in self.requests.load_failed:
            return 0
        setup = self.setup
        first = num_computed_tokens // setup.block_tokens
        limit = max(0, num_tokens - 1 - num_computed_tokens) // setup.block_tokens
        wanted = block_hashes[first : first + limit]
        if not wanted:
            return 0
        hits, looked_up = self.requests.hits(wanted)
        self._looked_up = (block_hashes, first, looked_up)
        if setup.lower_tiers and hits < len(wanted):
            if self.moves.wait_for(request_id, wanted, hits):
                return None
        logger.debug("request %s: %d tier hit blocks after %d", request_id, hits, first)
        return hits * setup.block_tokens

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
        setup = self.setup
        if same_step and setup.num_groups > 1:
            raise ValueError(
                f"request {request_id}: a same-step load needs one kv-cache group, but there "
                f"are {setup.num_groups}; load it a step ahead"
            )
        self.moves.forget(request_id)
        state = self.requests.state(request_id)
        state.block_hashes = block_hashes
        first = num_computed_tokens // setup.block_tokens
        for group in range(setup.num_groups):
            setup.index.touch(setup.namespace.keys(block_hashes[:first], group))
        last, self._looked_up = self._looked_up, None
        looked_up = (
            last[2] if last is not None and last[0] is block_hashes and last[1] == first else {}
        )
        self.planner.accept_hit(state, block_ids, first, num_external_tokens, looked_up, same_step)

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
        self.requests.scheduled(
            request_id, num_computed_tokens, new_block_ids, block_hashes, resumed
        )

    def preempted(self, request_ids: Iterable[str]) -> None:
        """The engine took these requests' device blocks back.

        The next plan makes every worker wait for in-flight copies before the
        blocks are reused; queued loads are dropped (the request starts over)
        and store progress restarts from the request's next blocks.
        """
        for request_id in request_ids:
            self._flush = True
            self.moves.forget(request_id)
            state = self.requests.get(request_id)
            if state is not None:
                self.requests.restart(state)

    def finished(
        self,
        request_id: str,
        num_computed_tokens: int | None = None,
        *,
        engine_frees_blocks: bool = False,
    ) -> bool:
        """The request finished; return whether the engine must keep its device blocks.

        When ``True``, the engine frees the blocks once
        :attr:`Progress.released_requests` names the request (or, for engines
        that count worker reports themselves, once every worker's
        :meth:`~kvtier.offload.worker.OffloadWorker.get_finished` named it).

        Args:
            request_id: The request.
            num_computed_tokens: Tokens whose KV is written at the end; in
                eager mode, full blocks not stored yet are stored before release.
            engine_frees_blocks: The engine frees the blocks itself when the
                request's loads end (vLLM, for a request still waiting for its
                load): the request is tracked until its copies are over, but no
                plan announces its hold.
        """
        self.moves.forget(request_id)
        return self.requests.finish(request_id, num_computed_tokens, engine_frees_blocks)

    # ---------------------------------------------------------------------- steps

    def build_plan(
        self,
        lazy_candidates: Sequence[LazyCandidate] = (),
        *,
        idle: bool = False,
        frontier: EvictionFrontier | None = None,
    ) -> TransferPlan:
        """Return this step's plan for every worker.

        Args:
            lazy_candidates: In lazy mode, cached device blocks near the
                engine's eviction frontier, in eviction order; those not yet in
                the tier are stored while slots last. Ignored in eager mode.
            idle: The engine computes nothing this step (see :attr:`TransferPlan.idle`).
            frontier: In lazy mode, the engine's eviction frontier: its blocks
                not offered before, or whose contents changed since, join
                ``lazy_candidates`` (see :class:`~kvtier.offload.EvictionFrontier`).
        """
        self._drain_index_events()
        requests, moves, planner = self.requests, self.moves, self.planner
        offered = []
        if frontier is not None and self.setup.store_mode == "lazy":
            offered = self.frontier.offer(frontier)
            lazy_candidates = [*lazy_candidates, *(candidate for _, candidate in offered)]
        if not (
            requests.due
            or self._flush
            or lazy_candidates
            or moves.has_work
            or (idle and moves.promotions)
        ):
            return _NO_PLAN  # most decode steps
        now = self.setup.clock()
        due = requests.take_due()
        loads, unavailable, same_step = planner.plan_loads(due, now)
        if self.setup.store_mode == "eager":
            stores = planner.plan_eager_stores(due, now)
        else:
            stores = planner.plan_lazy_stores(lazy_candidates, now)
        self.frontier.taken(offered)
        self._drain_index_events()
        holds = requests.announce_holds(due)
        plan = TransferPlan(
            stores=tuple(stores),
            loads=tuple(loads),
            flush=self._flush,
            holds=holds,
            unavailable=unavailable,
            promotions=moves.take_promotions(),
            demotions=moves.take_demotions(),
            same_step=same_step,
            idle=idle and bool(moves.promotions),
        )
        self._flush = False
        return plan

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
        ledger, moves = self.ledger, self.moves
        collected = Collected()
        ledger.announce_unavailable(collected)
        touched: set[int] = set()
        for one in reports:
            touched |= ledger.count(one)
            moves.count(one)
            self.counters.add_tier_counts(one.tier_counts)
        ledger.settle(touched, collected)
        ledger.expire(collected)
        moves.remember(collected.committed)
        moves.expire()
        self._drain_index_events()
        return collected.progress(self.requests.take_released())

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
        index = self.setup.index
        self.ledger.reset()
        self.requests.reset()
        empty = index.clear()
        self.moves.reset()
        self._drain_index_events()
        if empty:
            logger.info("host tier reset: empty")
        else:
            logger.info(
                "host tier reset: nothing stored before it will be served; %d slot(s) are "
                "freed as the copies still using them complete",
                index.num_slots - index.stats().free,
            )
        return empty

    def stats(self) -> OffloadStats:
        """Cumulative counters and current usage."""
        self._drain_index_events()
        index_stats = self.setup.index.stats()
        return OffloadStats(
            capacity_blocks=index_stats.num_slots,
            used_blocks=index_stats.readable + index_stats.writing,
            quarantined_blocks=self.ledger.quarantined_slots,
            failures=self._failures.counts,
            tiers={name: dict(counts) for name, counts in self.counters.tiers.items()},
            **self.counters.values,
        )

    def take_stats(self) -> OffloadStats | None:
        """What the counters gained and the gauges' values since the last call (``None``
        when nothing changed): :meth:`stats` ``.since()`` the previous call's."""
        now = self.stats()
        last, self._taken = self._taken, now
        return None if now == last else now.since(last)

    def take_observations(self) -> Observations:
        """Return and forget the measurements since the last call (empty without
        ``record_observations``)."""
        return self.counters.take_observations()

    @property
    def num_inflight_batches(self) -> int:
        """Batches planned and not yet reported by every worker (nor failed by the deadline)."""
        return len(self.ledger.batches)

    @property
    def settled(self) -> bool:
        """Whether no batch or promotion is in flight and no outcome waits to be announced:
        then ``process(None)`` changes nothing."""
        return self.ledger.settled and not (self.moves.promotions or self.requests.released)

    @property
    def has_tier_work(self) -> bool:
        """Whether demotions or promotions wait for the next plan."""
        return self.moves.has_work

    @property
    def num_quarantined_batches(self) -> int:
        """Failed batches whose copies may still run on some worker; their slots stay held."""
        return len(self.ledger.quarantine)

    @property
    def num_requests(self) -> int:
        """Requests the manager tracks (running, or finished and held)."""
        return len(self.requests.requests)

    def _drain_index_events(self) -> None:
        events = self.setup.index.take_events()
        if not events:
            return
        evicted = sum(1 for event in events if event.kind is EventKind.EVICTED)
        self.counters.add("evicted_blocks", evicted)
        self.ledger.departures += evicted
        if self.setup.lower_tiers:
            self.moves.evicted(events)
        if self.record_events:
            self._events.extend(events)
