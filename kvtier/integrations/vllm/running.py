"""Which running requests a vLLM step gives the offload manager news of, without visiting all.

A running request has news in a step when it resumes, gets new device
blocks, fills a block or is not tracked by the manager; any other request
only moved within a block, which the manager would note and drop. vLLM hands
the step's running requests over as parallel Python lists
(``CachedRequestData``), so finding them by looking at each costs every
step as much as the batch is large (about 0.3 µs a request).

Most steps of a serving engine are *uniform decode steps*: the same requests,
in the same order, as in the step before, each scheduled one token. In a run
of such steps every request advances by one token per step, so its position
within its block moves in lockstep with all others: a request fills its
block when ``computed % block_tokens == block_tokens - 1`` and needs a new one
when ``computed % block_tokens == 0``. :class:`RunningScan` keeps the
requests' positions (in vLLM's lists) in ``block_tokens`` buckets by that
phase and, in a uniform step, visits only the two buckets whose requests
fill or start a block in it.

Whether a step is uniform is checked, not assumed, with a few whole-list
operations that run in C (a few nanoseconds a request, not a Python visit
each): the request ids equal the last step's, their computed tokens sum to
what the last step's scheduled tokens predict (after a step vLLM only ever
moves a count back, for rejected drafts, failed loads or a replay, so an
equal sum means every count is as predicted), every request is scheduled
exactly one token, and every request vLLM gives new blocks is in a visited
bucket. Any other
step visits every request, as before, and the phases are rebuilt at the next
uniform step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput


class RunningScan:
    """Positions (in ``scheduled_cached_reqs``) of the running requests with news, per step."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        # The last step's running request ids and the sum of their computed tokens after
        # it; None when the last step cannot predict this one (speculative decoding).
        self._req_ids: list[str] | None = None
        self._computed_sum = 0
        # Positions by (computed tokens - self._shift) % block_tokens, built at the first
        # uniform step after a step that visited every request.
        self._phases: list[list[int]] | None = None
        self._shift = 0

    def positions(
        self, scheduler_output: SchedulerOutput, tracked: Collection[str]
    ) -> Sequence[int]:
        """The positions of the running requests that resume, get new device blocks, fill a
        block or are not in ``tracked``, in order.

        Every running request is tracked after the step that first saw it (this
        step's news makes the manager track it), and the manager stops tracking
        only finished requests, which leave the running list; so a uniform step
        never has an untracked request.
        """
        cached = scheduler_output.scheduled_cached_reqs
        if self._uniform(scheduler_output, cached):
            found = self._from_phases(cached)
            if found is not None:
                self._computed_sum += len(cached.req_ids)
                self._shift = (self._shift + 1) % self.block_tokens
                return found
        return self._visit_all(scheduler_output, cached, tracked)

    def _uniform(self, scheduler_output: SchedulerOutput, cached: CachedRequestData) -> bool:
        """Whether every request is the last step's, in its place, one token on and
        scheduled one token (vLLM schedules a request at least one token, so a total
        equal to the count means one each)."""
        req_ids = cached.req_ids
        return (
            self._req_ids is not None
            and not scheduler_output.scheduled_new_reqs
            and not scheduler_output.scheduled_spec_decode_tokens
            and not scheduler_output.preempted_req_ids
            and not cached.resumed_req_ids
            and scheduler_output.total_num_scheduled_tokens == len(req_ids)
            and len(scheduler_output.num_scheduled_tokens) == len(req_ids)
            and req_ids == self._req_ids
            and sum(cached.num_computed_tokens) == self._computed_sum
        )

    def _from_phases(self, cached: CachedRequestData) -> list[int] | None:
        """The positions of a uniform step, from the two buckets it visits; ``None`` when
        vLLM gave a request outside them new blocks."""
        size = self.block_tokens
        phases = self._phases
        if phases is None:
            phases = self._phases = [[] for _ in range(size)]
            self._shift = 0
            for position, computed in enumerate(cached.num_computed_tokens):
                phases[computed % size].append(position)
        filling = phases[(size - 1 - self._shift) % size]
        starting = phases[-self._shift % size]
        new_block_ids = cached.new_block_ids
        given = len(new_block_ids) - new_block_ids.count(None)
        visited = filling if filling is starting else filling + starting
        if given != sum(1 for i in visited if new_block_ids[i] is not None):
            return None
        if filling is starting:
            return filling
        return sorted(filling + [i for i in starting if new_block_ids[i]])

    def _visit_all(
        self,
        scheduler_output: SchedulerOutput,
        cached: CachedRequestData,
        tracked: Collection[str],
    ) -> Sequence[int]:
        """Look at every request; remember the step for the next one's check.

        A request that only moved within a block is left out: the manager
        would note and drop it (its block hashes come in before the tokens
        that fill the block are computed). One comprehension, because numpy's
        conversions of vLLM's lists cost more at every size measured. With
        speculative decoding a request's count may fall back across a block
        (rejected drafts), so every request is then passed on.
        """
        self._phases = None
        req_ids = cached.req_ids
        if scheduler_output.scheduled_spec_decode_tokens:
            self._req_ids = None
            return range(len(req_ids))
        scheduled = scheduler_output.num_scheduled_tokens
        new_tokens = sum(scheduled[new.req_id] for new in scheduler_output.scheduled_new_reqs)
        self._req_ids = list(req_ids)
        self._computed_sum = (
            sum(cached.num_computed_tokens)
            + scheduler_output.total_num_scheduled_tokens
            - new_tokens
        )
        get, resumed, size = scheduled.get, cached.resumed_req_ids, self.block_tokens
        return [
            i
            for i, (req_id, before, new_blocks) in enumerate(
                zip(req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True)
            )
            if new_blocks
            or (before + get(req_id, 0)) // size != before // size
            or req_id in resumed
            or req_id not in tracked
        ]
