"""Scheduler-side offload manager: decides what to store, what to load and when blocks are free.

The scheduler side owns all bookkeeping (the host tier's :class:`~kvtier.index.BlockIndex`,
request states, batches) and no bytes, in engine-neutral terms: request ids, engine block
hashes (namespaced here by kv-cache group), device block ids per group, token counts. The
manager only delegates (:mod:`kvtier.offload` says which module owns what); engines drive it
through an :class:`~kvtier.offload.session.OffloadSession`, which gives the calls' order.

Most steps of a serving engine change nothing in the tier: :attr:`OffloadManager.quiet`
keeps the modules' joint answer (:mod:`~kvtier.offload.quiet`) from the last
:meth:`~OffloadManager.take_stats`, until a call marked :func:`~kvtier.offload.quiet.wakes`
or the slow path of :meth:`~OffloadManager.scheduled`, :meth:`~OffloadManager.build_plan`
or :meth:`~OffloadManager.process`. While it is set, ``build_plan`` (but for lazy mode's
frontier signature), ``process(None)``, :meth:`~OffloadManager.take_stats` and
:meth:`~OffloadManager.take_events` answer from it alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
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
from kvtier.offload.quiet import Idling, wakes
from kvtier.offload.requests import RequestTable
from kvtier.offload.setup import GroupBlockIds, ManagerSetup, StoreMode
from kvtier.offload.stats import Counters, Observations, OffloadStats

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig, PrefetchConfig
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
        prefetch: PrefetchConfig | None = None,
    ) -> None:
        """Create a manager over ``index``, the directory of the host tier.

        Every argument is the :class:`~kvtier.offload.setup.ManagerSetup` field of its
        name but ``record_observations`` (keep what :meth:`take_observations` returns;
        take it regularly), ``cost_guard`` and ``cost_guard_margin`` (the config's, see
        :mod:`~kvtier.offload.costguard`) and ``tier_names`` (the lower tiers, in lookup
        order, as :func:`~kvtier.tiers.chain.tier_names` names them) and ``prefetch``.

        Raises:
            ValueError: If a size, the deadline or the margin is not positive, the store
                mode is unknown or ``group_windows`` does not give one entry per group.
        """
        # The index tells the mover of its evictions as they happen.
        index = push_evictions(
            index, lambda keys: self.moves.evicted(keys), keep_events=record_events
        )
        self.setup = setup = ManagerSetup(
            index, block_tokens, record_bytes, world_size, store_mode, num_groups,
            namespace or KeyNamespace(), null_block_id, group_windows, report_deadline_s,
            tuple(write_policies), clock, record_events, pin_share, pin_max_s, prefetch,
        )  # fmt: skip
        self.index, self.namespace = index, setup.namespace
        self.store_mode, self.world_size = setup.store_mode, world_size
        self.counters = Counters(record_observations=record_observations, logger=logger)
        self.requests = RequestTable(setup)
        self.ledger = BatchLedger(setup, self.requests, self.counters)
        self.guard = CostGuard(
            self.counters, block_tokens=block_tokens, tier_names=tier_names, enabled=cost_guard,
            margin=cost_guard_margin,
        )  # fmt: skip
        self.moves = LowerTierMoves(setup, self.ledger, self.counters, self.guard)
        self.pins = TimedPins(setup)
        self.planner = Planner(
            setup, self.requests, self.ledger, self.moves, self.counters, self.pins
        )
        self.tier_events = LowerTierEvents(world_size)
        self.parts: tuple[Idling, ...] = (
            self.ledger, self.moves, self.requests, self.planner, self.pins, self.counters,
            self.tier_events,
        )  # fmt: skip
        self.quiet = False
        """Every one of :attr:`parts` was idle at the last :meth:`take_stats`, and no call
        since may have given one work."""

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
        """Build a manager, and its index of :meth:`config.host_slots
        <kvtier.config.KVTierConfig.host_slots>` slots (as many as the workers allocate), from
        a validated config; ``options``: the constructor's arguments the config does not set."""
        from kvtier.plugins import default_registry
        from kvtier.tiers.chain import tier_names

        num_slots = config.host_slots(record_bytes, world_size)
        registry = registry if registry is not None else default_registry()
        return cls(
            registry.build(BLOCK_INDEX, config.index, num_slots), record_bytes=record_bytes,
            world_size=world_size, store_mode=config.store_mode,
            report_deadline_s=config.report_deadline_s,
            write_policies=tuple(write_policy_of(tier) for tier in config.tiers),
            pin_share=config.pin_share, pin_max_s=config.pin_max_s,
            cost_guard=config.cost_guard, cost_guard_margin=config.cost_guard_margin,
            tier_names=tier_names(config), prefetch=config.prefetch, **options,
        )  # fmt: skip

    @wakes
    def arrived(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int,
        num_tokens: int,
    ) -> None:  # fmt: skip
        """A request entered the engine's queue: start reading the blocks :meth:`lookup` would
        want now that sit below the host tier into it (:mod:`~kvtier.offload.prefetch`)."""
        if self.moves.prefetches.enabled and self.setup.lower_tiers:
            self.moves.prefetch(request_id, block_hashes, num_computed_tokens, num_tokens)

    @wakes
    def lookup(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int,
        num_tokens: int, control: RequestControl | None = None, *, last_block: bool = False,
    ) -> int | None:  # fmt: skip
        """Return how many tokens past ``num_computed_tokens`` (the engine's own prefix hits, a
        multiple of ``block_tokens``) the tier can load, of the request's ``num_tokens``.

        Counts whole blocks readable in every kv-cache group (for a group with a window,
        the last ``window`` blocks of the hit), never the request's last token (the engine
        computes one) unless ``last_block``: the engine recomputes that token itself after
        loading the full block holding it. No hit for a request whose load failed (until it
        finished), that the cost guard predicts slower to load than to recompute, or that
        ``control`` refuses. ``None``: ask again later, the missing blocks are being promoted.
        """
        if request_id in self.requests.load_failed or (control is not None and not control.load):
            return 0
        first, wanted, hits = self.requests.hits(
            block_hashes, num_computed_tokens, num_tokens, last_block
        )
        if self.setup.lower_tiers and self.moves.wait_for(request_id, wanted, hits, first):
            return None
        if not self.guard.load_host_hit(request_id, hits):
            logger.debug("request %s: cost guard skips %d tier hit blocks", request_id, hits)
            return 0
        logger.debug("request %s: %d tier hit blocks after %d", request_id, hits, first)
        return hits * self.setup.block_tokens

    @wakes
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
        """The engine allocated ``block_ids`` (per group, from position 0) and accepted
        ``num_external_tokens`` past its own ``num_computed_tokens`` from :meth:`lookup`:
        their host slots are pinned and their load queued. With ``same_step`` (one group
        only) the engine runs the request in the step whose plan carries the load
        (:attr:`TransferPlan.same_step`). ``control``: which of its blocks to store, a
        timed pin of its prompt's (:mod:`~kvtier.offload.pins`), an eviction priority.

        Raises:
            ValueError: ``same_step`` with several kv-cache groups, or ``block_ids``
                that do not cover the accepted blocks.
        """
        self.moves.forget(request_id)
        self.guard.forget(request_id)
        self.planner.allocated(
            request_id, block_hashes, block_ids, num_computed_tokens, num_external_tokens,
            same_step, control,
        )  # fmt: skip

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

        ``num_computed_tokens``: tokens whose KV is in device memory by the time workers
        submit this step's plan (after the model ran); full blocks among them become store
        candidates. ``new_block_ids``: device blocks appended this step, per group (with
        ``resumed``, after a preemption, all of them). ``block_hashes``: the engine's hash
        of each full block so far (the same growing list may come each time)."""
        if self.requests.scheduled(
            request_id, num_computed_tokens, new_block_ids, block_hashes, resumed
        ):
            self.quiet = False

    @wakes
    def preempted(self, request_ids: Iterable[str]) -> None:
        """The engine took these requests' device blocks back: the next plan makes every
        worker wait for copies in flight; queued loads are dropped, store progress restarts."""
        for request_id in request_ids:
            self.planner.flush = True
            self.moves.forget(request_id)
            self.guard.forget(request_id)
            self.requests.restart(request_id)

    @wakes
    def finished(
        self,
        request_id: str,
        num_computed_tokens: int | None = None,
        *,
        engine_frees_blocks: bool = False,
    ) -> bool:
        """The request finished; return whether the engine must keep its device blocks until
        :attr:`Progress.released_requests` names it (eager mode first stores the full blocks
        of ``num_computed_tokens`` not stored yet). ``engine_frees_blocks``: the engine frees
        them itself once its loads end (vLLM, for a request waiting for its load), so no
        plan announces a hold."""
        self.moves.forget(request_id, finished=True)
        self.guard.forget(request_id)
        return self.requests.finish(request_id, num_computed_tokens, engine_frees_blocks)

    def build_plan(
        self, lazy_candidates: Sequence[LazyCandidate] = (), *, idle: bool = False,
        frontier: EvictionFrontier | None = None,
    ) -> TransferPlan:  # fmt: skip
        """Return this step's plan for every worker.

        ``lazy_candidates``: in lazy mode, cached device blocks near the engine's eviction
        frontier, in eviction order (those not in the tier are stored while slots last),
        and ``frontier`` the engine's frontier whose blocks join them. ``idle``: the engine
        computes nothing this step (:attr:`TransferPlan.idle`)."""
        if (
            self.quiet
            and not lazy_candidates
            and (frontier is None or self.planner.frontier.unchanged(frontier))
        ):
            return NO_PLAN  # most decode steps
        self.quiet = False
        return self.planner.plan(lazy_candidates, frontier, idle)

    def process(self, report: WorkerReport | Iterable[WorkerReport | None] | None) -> Progress:
        """Count worker completions in one merged ``report``, several (one per worker) or
        none; finish the batches every worker has reported.

        A batch not reported by every worker within ``report_deadline_s`` fails (a load
        becomes a recompute, a store is dropped); one whose copy may still run keeps its
        host slots until its worker reported the copy over. Impossible report entries are
        ignored (see :mod:`~kvtier.offload.ledger`)."""
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
        """The engine computed ``computed_tokens`` tokens in a step of ``seconds``: the cost
        guard's measure of its prefill speed (used by lookups; :attr:`quiet` stays as it is)."""
        self.guard.step_timed(computed_tokens, seconds)

    def take_events(self) -> list[IndexEvent]:
        """Return and forget the tier's stored/evicted events (kept only with ``record_events``)."""
        if self.quiet:
            return []
        return self.ledger.take_events()

    def take_tier_events(self) -> list[TierEvent]:
        """Return and forget the lower tiers' stores and removals every worker reported."""
        return self.tier_events.take()

    @wakes
    def reset(self) -> bool:
        """Empty the tier: no block stored before this call is served after it; return
        whether every slot is free now (copies in flight free theirs as they end).

        Readable blocks are evicted at once, those being loaded included (promised loads
        still read them). Stores in flight are dropped when they complete, and blocks
        computed or loaded before the reset are never stored; later ones are. Idempotent.
        """
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
        Sets :attr:`quiet` when every module is idle."""
        if self.quiet:
            return None  # most steps
        ledger = self.ledger
        changes = self.counters.take_changes(
            (ledger.num_planned, len(ledger.quarantine)),
            lambda: self.counters.gauges(self.setup.index.stats(), ledger.quarantined_slots),
        )
        self.quiet = self.idle
        return changes

    @property
    def idle(self) -> bool:
        """Whether every module says it is idle (:attr:`quiet` without the cache)."""
        return all(part.idle for part in self.parts)

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
        ledger, moves, requests = self.ledger, self.moves, self.requests
        return not (ledger.batches or ledger.unavailable or moves.promotions or requests.released)

    @property
    def num_quarantined_batches(self) -> int:
        """Failed batches whose copies may still run on some worker; their slots stay held."""
        return len(self.ledger.quarantine)

    @property
    def num_requests(self) -> int:
        """Requests the manager tracks (running, or finished and held)."""
        return len(self.requests.requests)
