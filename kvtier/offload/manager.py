"""Scheduler-side offload manager: decides what to store, what to load and when blocks are free.

The scheduler side owns all bookkeeping (the host tier's
:class:`~kvtier.index.BlockIndex`, request states, batches) and no bytes. It
speaks engine-neutral data: request ids, engine block hashes (namespaced here
by kv-cache group), device block ids per group and token counts. An engine
integration calls it in this order:

Per request:

1. :meth:`OffloadManager.lookup` — how many tokens past the engine's own
   prefix hits the tier can supply (whole blocks; never the last token). It
   may be asked again. With lower tiers, a host miss plans a promotion of the
   missing blocks into the host tier and answers ``None`` until it is over.
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
7. :meth:`OffloadManager.process` — the workers' :class:`WorkerReport`; once all
   ``world_size`` workers reported a batch (or ``report_deadline_s`` passed), its
   stores become readable or are dropped, its loads unpin their slots (a failed
   load is a recompute, never a hit).

At any time: :meth:`take_events` and :meth:`take_tier_events`, :meth:`stats`
or :meth:`take_stats`, :meth:`take_observations`, :meth:`reset`; and, with the cost
guard on, once per engine step that computed tokens: :meth:`step_timed`.

The manager only delegates: :mod:`kvtier.offload` says which module owns which
piece of the state (and how lower-tier moves and quarantined slots work).

Most steps of a serving engine change nothing in the tier. :attr:`OffloadManager.quiet`
says so in one attribute: :meth:`~OffloadManager.take_stats` sets it when it finds
nothing in flight, pending, evicted, observed or to announce, and every call that may
change that clears it. While it is set, :meth:`~OffloadManager.build_plan` (but for
lazy mode's frontier signature), ``process(None)``, :meth:`~OffloadManager.take_stats`
and :meth:`~OffloadManager.take_events` answer from it alone, without visiting the
modules (which a step of the engine's own work has pushed out of the CPU's caches).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config.model import DEFAULT_PIN_MAX_S, DEFAULT_PIN_SHARE, DEFAULT_REPORT_DEADLINE_S
from kvtier.index.base import BlockIndex, IndexEvent
from kvtier.index.push import push_evictions
from kvtier.keys import KeyNamespace
from kvtier.kinds import BLOCK_INDEX
from kvtier.models import WritePolicy, write_policy_of
from kvtier.offload.costguard import CostGuard
from kvtier.offload.events import LowerTierEvents, TierEvent
from kvtier.offload.frontier import EvictionFrontier
from kvtier.offload.ledger import BatchLedger, Progress
from kvtier.offload.messages import NO_PLAN, LazyCandidate, TransferPlan, WorkerReport
from kvtier.offload.moves import LowerTierMoves
from kvtier.offload.pins import TimedPins
from kvtier.offload.planner import Planner
from kvtier.offload.requests import RequestTable
from kvtier.offload.setup import GroupBlockIds, ManagerSetup, StoreMode
from kvtier.offload.stats import Counters, Observations, OffloadStats

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.offload.control import RequestControl
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

_NO_PROGRESS = Progress()


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
        write_policies: Sequence[WritePolicy] = (),
        clock: Callable[[], float] = time.monotonic,
        pin_share: float = DEFAULT_PIN_SHARE,
        pin_max_s: float = DEFAULT_PIN_MAX_S,
        cost_guard: bool = False,
        cost_guard_margin: float = 1.0,
        tier_names: Sequence[str] = (),
    ) -> None:
        """Create a manager over ``index``, the directory of the host tier.

        Every argument is the :class:`~kvtier.offload.setup.ManagerSetup` field of its
        name, which says what it means, but ``record_observations``: keep latencies,
        batch sizes and per-request hits for :meth:`take_observations` (whoever sets it
        must take them regularly); ``cost_guard`` and ``cost_guard_margin``: the
        :class:`~kvtier.config.KVTierConfig` settings of those names (see
        :mod:`~kvtier.offload.costguard`); ``tier_names``: the workers' lower tiers, in
        lookup order, as :func:`~kvtier.tiers.chain.tier_names` names them.

        Raises:
            ValueError: If a size, the deadline or the margin is not positive,
                ``store_mode`` is unknown or ``group_windows`` does not give one entry
                per group.
        """
        # The index tells the mover of its evictions as they happen.
        index = push_evictions(
            index, lambda keys: self.moves.evicted(keys), keep_events=record_events
        )
        self.setup = setup = ManagerSetup(
            index, block_tokens, record_bytes, world_size, store_mode, num_groups,
            namespace or KeyNamespace(), null_block_id, group_windows, report_deadline_s,
            tuple(write_policies), clock, record_events, pin_share, pin_max_s,
        )  # fmt: skip
        self.index, self.namespace = index, setup.namespace
        self.store_mode, self.world_size = setup.store_mode, world_size
        self.counters = Counters(record_observations=record_observations, logger=logger)
        self.requests = RequestTable(setup)
        self.ledger = BatchLedger(setup, self.requests, self.counters)
        self.guard = CostGuard(
            self.counters,
            block_tokens=block_tokens,
            tier_names=tier_names,
            enabled=cost_guard,
            margin=cost_guard_margin,
        )
        self.moves = LowerTierMoves(setup, self.ledger, self.counters, self.guard)
        self.pins = TimedPins(setup)
        self.planner = Planner(
            setup, self.requests, self.ledger, self.moves, self.counters, self.pins
        )
        self.tier_events = LowerTierEvents(world_size)
        self.quiet = False
        """Nothing is in flight, pending, evicted, observed or to announce (see the module's
        docstring): set by :meth:`take_stats`, cleared by every call that may change it."""

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
        <kvtier.offload.worker.OffloadWorker.from_config>` allocates (and checks the
        memory for). ``options``: the constructor's arguments the config does not set.
        """
        from kvtier.plugins import default_registry
        from kvtier.tiers.chain import tier_names

        num_slots = config.host_slots(record_bytes, world_size)
        registry = registry if registry is not None else default_registry()
        return cls(
            registry.build(BLOCK_INDEX, config.index, num_slots),
            record_bytes=record_bytes,
            world_size=world_size,
            store_mode=config.store_mode,
            report_deadline_s=config.report_deadline_s,
            write_policies=tuple(write_policy_of(tier) for tier in config.tiers),
            pin_share=config.pin_share,
            pin_max_s=config.pin_max_s,
            cost_guard=config.cost_guard,
            cost_guard_margin=config.cost_guard_margin,
            tier_names=tier_names(config),
            **options,
        )

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        num_tokens: int,
        control: RequestControl | None = None,
    ) -> int | None:
        """Return how many tokens past ``num_computed_tokens`` the tier can load.

        Counts whole blocks readable in every kv-cache group (for a group
        with a window, the last ``window`` blocks of the hit), starting at the
        first block the engine does not hold, and never covers the request's
        last token (the engine must compute at least one). A request whose
        load failed gets no hit until it finished, nor one the cost guard predicts
        slower to load than to recompute. ``None``: ask again later, the
        missing blocks are being promoted (:mod:`~kvtier.offload.moves`).

        Args:
            request_id: The request.
            block_hashes: The engine's hash of each full block of the request.
            num_computed_tokens: Tokens the engine already holds (its own prefix hits);
                a multiple of ``block_tokens``.
            num_tokens: Tokens of the request so far.
            control: What the request asked of kvtier; ``load=False`` gets no hit.
        """
        self.quiet = False
        if request_id in self.requests.load_failed or (control is not None and not control.load):
            return 0
        first, wanted, hits = self.requests.hits(block_hashes, num_computed_tokens, num_tokens)
        if hits < len(wanted) and self.setup.lower_tiers:
            if self.moves.wait_for(request_id, wanted, hits):
                return None
        if not self.guard.load_host_hit(request_id, hits):
            logger.debug("request %s: cost guard skips %d tier hit blocks", request_id, hits)
            return 0
        logger.debug("request %s: %d tier hit blocks after %d", request_id, hits, first)
        return hits * self.setup.block_tokens

    def allocated(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: GroupBlockIds,
        num_computed_tokens: int,
        num_external_tokens: int,
        *,
        same_step: bool = False,
        control: RequestControl | None = None,
    ) -> None:
        """Record the engine's allocation; queue a load of ``num_external_tokens`` from the tier.

        The accepted blocks' host slots are pinned now and their load queued
        (:meth:`Planner.accept_hit <kvtier.offload.planner.Planner.accept_hit>`). With
        ``same_step`` the engine runs the request in the step whose plan carries the
        load, so it is copied before that step's forward (:attr:`TransferPlan.same_step`)
        and a failed block shows in that step's output. Only with one kv-cache group.

        Args:
            request_id: The request.
            block_hashes: The engine's hash of each full block of the request.
            block_ids: The request's device block ids per group, from position 0.
            num_computed_tokens: Tokens the engine held before the tier's hits.
            num_external_tokens: Tokens accepted from :meth:`lookup` (0 for none).
            same_step: The engine runs the request in the step of the next plan.
            control: What the request asked of kvtier: which of its blocks to store, a
                timed pin of its prompt's (:mod:`~kvtier.offload.pins`), an eviction
                priority for the blocks it stores and loads. ``None`` asks for nothing.

        Raises:
            ValueError: ``same_step`` with several kv-cache groups, or ``block_ids``
                that do not cover the accepted blocks.
        """
        self.quiet = False
        self.moves.forget(request_id)
        self.guard.forget(request_id)
        self.planner.allocated(
            request_id,
            block_hashes,
            block_ids,
            num_computed_tokens,
            num_external_tokens,
            same_step,
            control,
        )

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
        state = self.requests.requests.get(request_id)
        if (
            state is not None
            and not resumed
            and not state.finished
            and (new_block_ids is None or not any(new_block_ids))
            and (block_hashes is None or block_hashes is state.block_hashes)
            and (num_computed_tokens // self.setup.block_tokens, len(state.block_hashes))
            == state.seen
        ):
            # Most decode steps: no block filled and no hash or block came.
            state.computed_tokens = num_computed_tokens
            return
        self.quiet = False
        self.requests.scheduled(
            request_id, num_computed_tokens, new_block_ids, block_hashes, resumed
        )

    def preempted(self, request_ids: Iterable[str]) -> None:
        """The engine took these requests' device blocks back.

        The next plan makes every worker wait for in-flight copies before the blocks
        are reused; queued loads are dropped and store progress restarts.
        """
        self.quiet = False
        for request_id in request_ids:
            self.planner.flush = True
            self.moves.forget(request_id)
            self.guard.forget(request_id)
            self.requests.restart(request_id)

    def finished(
        self,
        request_id: str,
        num_computed_tokens: int | None = None,
        *,
        engine_frees_blocks: bool = False,
    ) -> bool:
        """The request finished; return whether the engine must keep its device blocks.

        When ``True``, the engine frees them once :attr:`Progress.released_requests`
        (or every worker's :meth:`~kvtier.offload.OffloadWorker.get_finished`) names it.

        Args:
            request_id: The request.
            num_computed_tokens: Tokens whose KV is written at the end; in
                eager mode, full blocks not stored yet are stored before release.
            engine_frees_blocks: The engine frees them itself once its loads end (vLLM,
                for a request waiting for its load): no plan announces a hold.
        """
        self.quiet = False
        self.moves.forget(request_id)
        self.guard.forget(request_id)
        return self.requests.finish(request_id, num_computed_tokens, engine_frees_blocks)

    def build_plan(
        self,
        lazy_candidates: Sequence[LazyCandidate] = (),
        *,
        idle: bool = False,
        frontier: EvictionFrontier | None = None,
    ) -> TransferPlan:
        """Return this step's plan for every worker.

        Args:
            lazy_candidates: In lazy mode, cached device blocks near the engine's eviction
                frontier, in eviction order; those not in the tier are stored while slots last.
            idle: The engine computes nothing this step (see :attr:`TransferPlan.idle`).
            frontier: In lazy mode, the engine's eviction frontier, whose blocks
                join ``lazy_candidates`` (see :class:`~kvtier.offload.EvictionFrontier`).
        """
        if (
            self.quiet
            and not lazy_candidates
            and (frontier is None or self.planner.frontier.unchanged(frontier))
        ):
            return NO_PLAN  # most decode steps
        self.quiet = False
        return self.planner.plan(lazy_candidates, frontier, idle)

    def process(self, report: WorkerReport | Iterable[WorkerReport | None] | None) -> Progress:
        """Count worker completions; finish the batches every worker has reported.

        A batch not reported by every worker within ``report_deadline_s`` fails (a
        load becomes a recompute, a store is dropped); one whose copy may still run
        on a worker keeps its host slots until that worker reported the copy over.
        Impossible report entries are ignored (see :mod:`~kvtier.offload.ledger`).

        Args:
            report: One merged report, several (one per worker), or ``None``.
        """
        if report is None and self.quiet:
            return _NO_PROGRESS  # most decode steps
        self.quiet = False
        pins = self.pins
        if report is None and self.settled:
            # Nothing reported, in flight or waiting to be announced.
            if pins.active:
                pins.expire(self.setup.clock())
            return _NO_PROGRESS
        one = isinstance(report, WorkerReport)
        reports = [report] if one else [each for each in report or () if each is not None]
        self.moves.count(reports)
        if self.setup.record_events:
            for each in reports:
                self.tier_events.count(each)
        self.guard.measured(reports)
        collected = self.ledger.process(reports)
        self.moves.settle(collected.committed)
        if pins.active:
            pins.expire(self.setup.clock())
            pins.pin_readable()
        return collected.progress(self.requests.take_released())

    def step_timed(self, computed_tokens: int, seconds: float) -> None:
        """The engine ran a step that computed ``computed_tokens`` tokens (prefill and
        decode) in ``seconds``, from scheduling to its output: the cost guard's measure of
        the engine's prefill speed. Ignored with the guard off. Leaves :attr:`quiet` as it
        is: the speed counts only when a lookup asks the guard."""
        self.guard.step_timed(computed_tokens, seconds)

    def take_events(self) -> list[IndexEvent]:
        """Return and forget the tier's stored/evicted events (kept only with ``record_events``)."""
        if self.quiet:
            return []
        return self.ledger.take_events()

    def take_tier_events(self) -> list[TierEvent]:
        """Return and forget the lower tiers' stores and removals that every worker reported
        (kept only with ``record_events``; see :class:`~kvtier.offload.events.LowerTierEvents`)."""
        return self.tier_events.take()

    def reset(self) -> bool:
        """Empty the tier: no block stored before this call is served after it.

        Readable blocks are evicted at once, those being loaded included (promised
        loads still read them). Stores in flight are dropped when they complete, and
        blocks computed or loaded before the reset are never stored; later ones are
        (a reset never stops storing). Idempotent. Returns whether every slot is free
        now (copies in flight free theirs as they end).
        """
        self.quiet = False
        self.requests.reset()
        self.pins.reset()
        empty = self.ledger.reset()
        self.moves.reset()
        return empty

    def stats(self) -> OffloadStats:
        """Cumulative counters and current usage."""
        return self.counters.record(self.setup.index.stats(), self.ledger.quarantined_slots)

    def take_stats(self) -> OffloadStats | None:
        """What changed since the last call (:meth:`stats` ``.since()`` the last one's), or
        ``None`` when nothing did: counters as what they gained, gauges as they are now.

        Sets :attr:`quiet` when nothing is left to do or to announce."""
        if self.quiet:
            return None  # most steps
        ledger, moves, requests = self.ledger, self.moves, self.requests
        changes = self.counters.take_changes(
            (ledger.num_planned, len(ledger.quarantine)), self.stats
        )
        self.quiet = not (
            ledger.batches
            or ledger.quarantine
            or ledger.unavailable
            or ledger.events_pending
            or ledger.has_departed
            or moves.promotions
            or moves.has_work
            or requests.due
            or requests.released
            or self.planner.flush
            or self.pins.active
            or self.counters.observed
            or self.tier_events.has_events
        )
        return changes

    @property
    def has_observations(self) -> bool:
        """Whether :meth:`take_observations` would return any measurement."""
        return self.counters.observed

    def take_observations(self) -> Observations:
        """Return and forget the measurements since the last call (see ``record_observations``)."""
        return self.counters.take_observations()

    @property
    def num_inflight_batches(self) -> int:
        """Batches planned and not yet reported by every worker (nor failed by the deadline)."""
        return len(self.ledger.batches)

    @property
    def settled(self) -> bool:
        """Whether nothing is in flight or waits to be announced (``process(None)`` is a no-op)."""
        ledger = self.ledger
        return not (
            ledger.batches or ledger.unavailable or self.moves.promotions or self.requests.released
        )

    @property
    def has_tier_work(self) -> bool:
        """Whether lower-tier writes or promotions wait for the next plan."""
        return self.moves.has_work

    @property
    def num_quarantined_batches(self) -> int:
        """Failed batches whose copies may still run on some worker; their slots stay held."""
        return len(self.ledger.quarantine)

    @property
    def num_requests(self) -> int:
        """Requests the manager tracks (running, or finished and held)."""
        return len(self.requests.requests)

    @property
    def tracked_requests(self) -> Collection[str]:
        """The ids of the requests the manager tracks, as a live view."""
        return self.requests.requests.keys()
