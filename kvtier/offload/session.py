"""One engine's session with the offload manager: its requests, the decisions made for each.

Every driver (vLLM's scheduler half, the synthetic engine of the tests, the
simulator) holds one :class:`OffloadSession` over its
:class:`~kvtier.offload.OffloadManager` and calls it in this order.

Per request:

0. :meth:`~OffloadSession.arrived` — the request entered the engine's queue: its
   blocks below the host tier start being read ahead (:mod:`~kvtier.offload.prefetch`).
1. :meth:`~OffloadSession.lookup` — how many tokens past the engine's own prefix
   hits the tier supplies, and whether they load asynchronously (the request waits
   for its load) or in the step that runs it (within this step's same-step budget).
   May be asked again; ``None`` while lower tiers are searched.
2. :meth:`~OffloadSession.allocated` — the engine allocated device blocks and
   accepted tokens from the lookup: their load is queued. An asynchronous load is
   over for the engine once :meth:`~OffloadSession.process` was told so.
3. :meth:`~OffloadSession.scheduled` — every step the request runs.
4. :meth:`~OffloadSession.preempted` — the engine took the request's blocks back.
5. :meth:`~OffloadSession.finished` — whether the engine must keep the request's
   device blocks until :attr:`Progress.released_requests
   <kvtier.offload.Progress.released_requests>` names it.

Per step:

6. :meth:`~OffloadSession.plan` — the :class:`~kvtier.offload.TransferPlan` for
   every worker; it opens a new same-step budget and starts timing the step.
7. :meth:`~OffloadSession.process` — the workers' reports.
8. :meth:`~OffloadSession.step_ended` once the step's output is in (the cost guard's
   measure of the engine's speed), then :meth:`~OffloadSession.take_events`.

The manager's own rules (whole blocks, never a failed load again, the cost guard,
holds) stay the manager's; the session adds what an engine decides around them:
which hits load in the step that runs them, the request's control, where its lookup
started, whether the engine still awaits its load, and its tokens and adapter for events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.offload.events import Adapter, BlockEvent, RequestTokens
from kvtier.offload.frontier import EvictionFrontier
from kvtier.offload.ledger import Progress
from kvtier.offload.messages import LazyCandidate, TransferPlan, WorkerReport
from kvtier.offload.setup import GroupBlockIds

if TYPE_CHECKING:
    from kvtier.offload.control import RequestControl
    from kvtier.offload.manager import OffloadManager

TIMED_STEPS = 16
"""Most steps timed at once (an engine has at most its batch queue's in flight)."""


@dataclass
class RequestSession:
    """What a session decided for one request, from its first lookup until it finished."""

    control: RequestControl | None = None
    """What the request asked of kvtier, given at its first lookup (``None``: nothing)."""
    looked_up_at: int | None = None
    """The engine's own computed tokens at the last lookup not yet followed by an allocation."""
    same_step: bool = False
    """The last lookup's hit loads in the step of the next plan."""
    awaited: bool = False
    """It loads asynchronously and the engine has not heard its load ended."""


class OffloadSession:
    """An engine's requests as the offload manager serves them, and the decisions made for each."""

    def __init__(
        self,
        manager: OffloadManager,
        *,
        same_step_bytes: int = 0,
        last_block: bool = False,
    ) -> None:
        """Drive ``manager``.

        Args:
            manager: The scheduler-side manager.
            same_step_bytes: Bytes per rank of hits each step may load for the requests it
                runs (the rest load asynchronously); only with one kv-cache group (an
                engine's report of a failed same-step load names one group's blocks).
            last_block: The engine recomputes the last token of a request it loaded
                whole (vLLM rewinds one token after an asynchronous load), so an
                asynchronous hit may cover the full block holding that token.
        """
        setup = manager.setup
        self.manager = manager
        self.requests: dict[str, RequestSession] = {}
        """Requests looked up or allocated and not finished, by id."""
        self.tokens = RequestTokens(setup.block_tokens, keep_forgotten=setup.record_events)
        self.last_block = last_block
        self.same_step_bytes = same_step_bytes if setup.num_groups == 1 else 0
        self._same_step_left = self.same_step_bytes
        self._same_step: list[RequestSession] = []
        self._clock = setup.clock
        # Steps being timed for the cost guard, oldest first: (planned at, scheduled tokens);
        # bounded for drivers that never end them.
        self._steps: deque[tuple[float, int]] | None = (
            deque(maxlen=TIMED_STEPS) if manager.guard.enabled else None
        )
        self.scheduled = manager.scheduled
        """:meth:`OffloadManager.scheduled <kvtier.offload.OffloadManager.scheduled>`,
        called as it is: most steps of most requests take its fast path."""

    def arrived(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        control: RequestControl | None = None,
        *,
        num_computed_tokens: int = 0,
        salt: bytes | None = None,
    ) -> None:
        """The request entered the engine's queue with ``num_tokens`` tokens: read its blocks
        held below the host tier ahead (:meth:`OffloadManager.arrived
        <kvtier.offload.OffloadManager.arrived>`), unless ``control`` refuses loads; ``control``
        counts from now on, as from a first lookup. ``num_computed_tokens``: the tokens of the
        blocks the engine's own prefix cache holds now (a multiple of the block size).
        ``salt``: the request's tenant salt (vLLM's ``cache_salt``), if it names one: the
        lower tiers seal its blocks' records for that tenant (:mod:`kvtier.tiers.record`)."""
        if request_id not in self.requests:
            self.requests[request_id] = RequestSession(control)
        self._tenant(request_id, salt)
        if control is None or control.load:
            # an engine that recomputes the last token wants the full block holding it
            self.manager.arrived(
                request_id, block_hashes, num_computed_tokens, num_tokens + self.last_block
            )

    def lookup(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        num_tokens: int,
        control: RequestControl | None = None,
        *,
        salt: bytes | None = None,
    ) -> tuple[int | None, bool]:
        """Tokens past the engine's ``num_computed_tokens`` that the tier loads, and whether
        asynchronously (:meth:`OffloadManager.lookup
        <kvtier.offload.OffloadManager.lookup>` says which are a hit).

        A hit that fits in what is left of this step's ``same_step_bytes`` loads before the
        step's forward, which computes the request's remaining tokens: it stops one token
        short of the request's last (the full block holding that token is still loaded,
        and the forward writes the token's KV into it again). ``control`` counts from the
        request's first lookup on. ``salt``: as for :meth:`arrived`. ``(None, False)``: ask
        again later.
        """
        session = self.requests.get(request_id)
        if session is None:
            session = self.requests[request_id] = RequestSession(control)
            self._tenant(request_id, salt)
        session.looked_up_at = num_computed_tokens
        hit = self.manager.lookup(
            request_id,
            block_hashes,
            num_computed_tokens,
            num_tokens,
            session.control,
            last_block=self.last_block,
        )
        if not hit or not self.same_step_bytes:
            return hit, bool(hit)
        cost = hit // self.manager.setup.block_tokens * self.manager.setup.record_bytes
        if cost > self._same_step_left:
            return hit, True
        self._same_step_left -= cost
        session.same_step = True
        self._same_step.append(session)
        return min(hit, num_tokens - 1 - num_computed_tokens), False

    def _tenant(self, request_id: str, salt: bytes | None) -> None:
        if salt and self.manager.setup.lower_tiers:  # the manager forgets it with the request
            self.manager.requests.salts[request_id] = salt

    def allocated(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: GroupBlockIds,
        num_external_tokens: int,
        *,
        num_computed_tokens: int = 0,
        token_ids: Sequence[int] | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        """The engine allocated ``block_ids`` (per group, from position 0) and accepted
        ``num_external_tokens`` from the last lookup, whose load is queued.

        Args:
            request_id: The request.
            block_hashes: The engine's hash of each full block of the request.
            block_ids: The request's device block ids per group.
            num_external_tokens: Tokens accepted from :meth:`lookup` (0 for none).
            num_computed_tokens: The engine's own computed tokens, for a request allocated
                without a lookup since its last allocation.
            token_ids: The request's tokens, kept with ``block_hashes`` to describe the
                tier's events (both sequences may keep growing); ``None``: not kept.
            adapter: The adapter the request runs under, kept with ``token_ids`` for the
                events of its blocks (``None``: the base model).
        """
        session = self.requests.get(request_id)
        if session is None:
            session = self.requests[request_id] = RequestSession()
        if session.looked_up_at is not None:
            num_computed_tokens, session.looked_up_at = session.looked_up_at, None
        same_step, session.same_step = session.same_step, False
        if num_external_tokens and not same_step:
            session.awaited = True
        if token_ids is not None:
            self.tokens.track(request_id, block_hashes, token_ids, adapter)
        self.manager.allocated(
            request_id,
            block_hashes,
            block_ids,
            num_computed_tokens,
            num_external_tokens,
            same_step=same_step and num_external_tokens > 0,
            control=session.control,
        )

    def preempted(self, request_ids: Iterable[str]) -> None:
        """The engine took these requests' device blocks back (see :meth:`OffloadManager.preempted
        <kvtier.offload.OffloadManager.preempted>`)."""
        self.manager.preempted(request_ids)

    def finished(self, request_id: str, num_computed_tokens: int | None = None) -> bool:
        """The request finished with ``num_computed_tokens`` written; return whether the engine
        must keep its device blocks until :attr:`Progress.released_requests
        <kvtier.offload.Progress.released_requests>` names it.

        A request whose asynchronous load the engine still awaits is never held: the engine
        frees its blocks at the load's end, which is the only report it hears of them.
        """
        session = self.requests.pop(request_id, None)
        awaited = session is not None and session.awaited
        hold = self.manager.finished(request_id, num_computed_tokens, engine_frees_blocks=awaited)
        if not hold:
            self.tokens.forget([request_id])
        return hold and not awaited

    def plan(
        self,
        lazy_candidates: Sequence[LazyCandidate] = (),
        *,
        frontier: EvictionFrontier | None = None,
        scheduled_tokens: int | None = None,
    ) -> TransferPlan:
        """This step's plan for every worker (:meth:`OffloadManager.build_plan
        <kvtier.offload.OffloadManager.build_plan>`); a new same-step budget opens.

        ``scheduled_tokens``: the tokens the engine computes in this step (0: it is idle),
        timed for the cost guard until :meth:`step_ended`; ``None``: not counted.
        """
        if self._same_step:
            for session in self._same_step:
                session.same_step = False
            self._same_step.clear()
        self._same_step_left = self.same_step_bytes
        if self._steps is not None and scheduled_tokens is not None:
            self._steps.append((self._clock(), scheduled_tokens))
        return self.manager.build_plan(
            lazy_candidates, idle=scheduled_tokens == 0, frontier=frontier
        )

    def process(
        self,
        report: WorkerReport | Iterable[WorkerReport | None] | None,
        loaded: Iterable[str] | None = None,
    ) -> Progress:
        """Count the workers' ``report`` (see :meth:`OffloadManager.process
        <kvtier.offload.OffloadManager.process>`); forget the released requests' tokens.

        ``loaded``: the requests whose loads the engine now knows ended on every worker;
        ``None``: those the returned progress names.
        """
        if loaded:
            self._heard_loaded(loaded)
        progress = self.manager.process(report)
        if progress.released_requests:
            self.tokens.forget(progress.released_requests)
        if loaded is None and progress.loaded_requests:
            self._heard_loaded(progress.loaded_requests)
        return progress

    def _heard_loaded(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            session = self.requests.get(request_id)
            if session is not None:
                session.awaited = False

    def step_ended(self) -> None:
        """The oldest step planned and not ended yet has its output: the cost guard learns its
        computed tokens over the time from its plan to now."""
        if self._steps:
            planned_at, tokens = self._steps.popleft()
            self.manager.step_timed(tokens, self._clock() - planned_at)

    def take_events(self) -> list[BlockEvent]:
        """Every tier's KV-cache events since the last call, in the engine's terms
        (:meth:`RequestTokens.describe <kvtier.offload.events.RequestTokens.describe>`)."""
        manager = self.manager
        return self.tokens.describe(
            manager.take_events(), manager.namespace, manager.take_tier_events()
        )

    @property
    def has_pending_work(self) -> bool:
        """Whether copies are in flight, lower-tier work waits for the next plan, or a lower
        tier still runs requests whose counts no report carried yet."""
        manager = self.manager
        return (
            manager.num_inflight_batches > 0
            or manager.moves.has_work
            or manager.counters.pending_tier_requests()
        )

    @property
    def tracked_requests(self) -> Collection[str]:
        """The ids of the requests the manager tracks, as a live view."""
        return self.manager.requests.requests.keys()
