"""Which requests' loads and holds are over on one worker, and which of their loads failed.

A :class:`RequestCompletions` is the part of an
:class:`~kvtier.offload.OffloadWorker` that knows requests. It takes each plan's
loads, unavailable blocks and holds (:meth:`RequestCompletions.bind`), hears how
each copy ended (:meth:`RequestCompletions.ended`), and answers the engine:
which requests' held blocks may be freed and whose loads ended
(:meth:`RequestCompletions.take_finished`), and what of those loads failed
(:meth:`RequestCompletions.take_load_failures`).

A same-step load (its tokens are computed in the step that loads it) is never
named as loaded: the engine runs the request already, and learns of its failed
blocks alone.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView
from dataclasses import dataclass

from kvtier.copy.base import Direction
from kvtier.offload.messages import Transfer, TransferPlan


@dataclass(frozen=True)
class LoadFailures:
    """Failed loads the engine must recompute, as blocks or as whole requests."""

    blocks: frozenset[int] = frozenset()
    """Device block ids whose loads failed (one kv-cache group only)."""
    requests: frozenset[str] = frozenset()
    """Requests whose loads finished with some block failed (several kv-cache groups)."""


_NO_LOAD_FAILURES = LoadFailures()


class RequestCompletions:
    """The loads and holds a worker's requests wait for, and the loads that failed."""

    def __init__(self, num_groups: int) -> None:
        """Track requests whose device blocks span ``num_groups`` kv-cache groups."""
        self._num_groups = num_groups
        self._loads_by_request: dict[str, set[int]] = {}
        self._holds: dict[str, set[int]] = {}
        # Batch ids of same-step loads not ended yet: their requests are never named as loaded.
        self._same_step_batches: set[int] = set()
        self._failed_load_blocks: set[int] = set()
        self._failed_load_requests: set[str] = set()

    @property
    def idle(self) -> bool:
        """Whether no request waits for a batch and no failed load is left to take."""
        return not (
            self._loads_by_request
            or self._holds
            or self._same_step_batches
            or self._failed_load_blocks
            or self._failed_load_requests
        )

    def bind(self, plan: TransferPlan) -> list[Transfer]:
        """Wait for the plan's loads and holds; return its same-step loads, which the worker
        copies before the step's forward."""
        same_step = []
        for transfer in plan.loads:
            assert transfer.request_id is not None
            if transfer.request_id in plan.same_step:
                same_step.append(transfer)
                self._same_step_batches.add(transfer.batch_id)
            else:
                self._loads_by_request.setdefault(transfer.request_id, set()).add(transfer.batch_id)
        for request_id, blocks in plan.unavailable.items():
            self._failed_load_blocks.update(blocks)
            if request_id not in plan.same_step:
                self._failed_load_requests.add(request_id)
                self._loads_by_request.setdefault(request_id, set())
        for request_id, batch_ids in plan.holds.items():
            self._holds[request_id] = set(batch_ids)
        return same_step

    def ended(self, transfer: Transfer, ok: bool) -> None:
        """``transfer``'s copy ended (``ok``), failed or was abandoned (not ``ok``)."""
        if ok or transfer.direction is not Direction.LOAD:
            self._same_step_batches.discard(transfer.batch_id)
            return
        self._failed_load_blocks.update(transfer.device_blocks)
        if transfer.batch_id in self._same_step_batches:
            # the engine runs the request already: it learns of the blocks alone
            self._same_step_batches.discard(transfer.batch_id)
        elif transfer.request_id is not None:
            self._failed_load_requests.add(transfer.request_id)

    def take_finished(self, inflight: KeysView[int]) -> tuple[set[str], set[str]]:
        """``(released, loaded)``: the requests held and the requests loading none of whose
        batches is in ``inflight`` any longer, each named once."""
        loaded = _pop_settled(self._loads_by_request, inflight) if self._loads_by_request else set()
        released = _pop_settled(self._holds, inflight) if self._holds else set()
        return released, loaded

    def take_failed_load_blocks(self) -> set[int]:
        """Device block ids whose loads failed since the last call."""
        failed, self._failed_load_blocks = self._failed_load_blocks, set()
        return failed

    def take_load_failures(self, loaded: Iterable[str]) -> LoadFailures:
        """The failed loads to report with ``loaded`` (from :meth:`take_finished`).

        With one kv-cache group, every device block whose load failed since the
        last call. With several, block ids repeat across groups, so the
        requests of ``loaded`` with a failed block are named instead.
        """
        if not (self._failed_load_blocks or self._failed_load_requests):
            return _NO_LOAD_FAILURES
        blocks = self.take_failed_load_blocks()
        failed = self._failed_load_requests.intersection(loaded)
        self._failed_load_requests -= failed
        if self._num_groups == 1:
            return LoadFailures(blocks=frozenset(blocks))
        return LoadFailures(requests=frozenset(failed))


def _pop_settled(waiting: dict[str, set[int]], inflight: KeysView[int]) -> set[str]:
    """Remove and return the requests in ``waiting`` none of whose batches is in ``inflight``."""
    settled = {request_id for request_id, batch_ids in waiting.items() if not batch_ids & inflight}
    for request_id in settled:
        del waiting[request_id]
    return settled
