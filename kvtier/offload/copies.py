"""Copies between the engine's device blocks and the host tier, each bounded by a deadline.

A :class:`CopyExecutor` holds one copy backend per layout (kv-cache groups that
share a layout share its backend) over the host tier's buffer, and runs the
:class:`~kvtier.offload.messages.Transfer` batches an
:class:`~kvtier.offload.OffloadWorker` hands it:

1. :meth:`CopyExecutor.check` — before a plan is accepted: the batch's group,
   device blocks and host slots exist.
2. :meth:`CopyExecutor.submit` — start a copy (a backend's error fails the batch).
3. :meth:`CopyExecutor.poll`, :meth:`CopyExecutor.wait` or
   :meth:`CopyExecutor.copy_now` — see which copies ended; a copy still running
   ``copy_deadline_s`` after its submission is abandoned.
4. :meth:`CopyExecutor.take_outcomes` — the batches done, failed, abandoned and
   settled since the last call, and how long each completed load took.
5. :meth:`CopyExecutor.close` — wait a while at most, abandon the rest,
   close the backends no abandoned copy still uses.

Each batch that ends (done, failed or abandoned) is passed to the ``on_end``
callback with whether it succeeded, once; an abandoned copy is polled on until
it is over and then reported ``settled``, so that its host slots are reused
only once nothing writes them. An exception other than
:class:`~kvtier.copy.CopyError` from a backend never escapes: from ``submit``
it fails the batch, from a poll it abandons the copy (its state is unknown).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, KeysView, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.layout.base import KVLayout, LayoutError
from kvtier.offload.failures import FailureCause, FailureLog
from kvtier.offload.messages import Transfer
from kvtier.tiers.host import HostTier

logger = logging.getLogger(__name__)

BackendFactory = Callable[[KVLayout, torch.Tensor], CopyBackend]
"""Builds a copy backend for one layout over the host buffer."""

FIRST_PAUSE_S = 1e-4
LONGEST_PAUSE_S = 1e-2
"""Bounds of the pause between polls while a caller waits for copies."""


class CopyOutcomes(NamedTuple):
    """The batches that ended since the last :meth:`CopyExecutor.take_outcomes`, by outcome;
    each value counts this worker once (the fields of a
    :class:`~kvtier.offload.messages.WorkerReport` they fill)."""

    done: dict[int, int]
    failed: dict[int, int]
    abandoned: dict[int, int]
    settled: dict[int, int]
    load_times: tuple[tuple[int, float], ...]
    """Per load that completed: (blocks, seconds from its submission until seen done)."""


@dataclass(frozen=True)
class _Copy:
    backend: CopyBackend
    handle: CopyHandle
    transfer: Transfer
    deadline: float
    """Clock time after which the executor stops waiting for the copy."""


class CopyExecutor:
    """Runs copy batches between device blocks and host slots and tracks how each ended."""

    def __init__(
        self,
        layouts: tuple[KVLayout, ...],
        tier: HostTier,
        backend_factory: BackendFactory,
        *,
        copy_deadline_s: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        on_end: Callable[[Transfer, bool], None],
    ) -> None:
        """Build a backend per distinct layout over ``tier``'s buffer.

        Args:
            layouts: One layout per kv-cache group (groups may share one layout object;
                they then share one backend). Every ``record_bytes`` must equal the tier's.
            tier: The host tier whose slots the copies read and write.
            backend_factory: ``factory(layout, host_buffer)`` returning a copy backend.
            copy_deadline_s: Seconds after its submission at which a copy still running
                is abandoned.
            clock: Monotonic time in seconds.
            sleep: Pauses a caller between polls while it waits.
            on_end: Called with each batch that ends and whether it succeeded (a failed or
                abandoned batch did not).

        Raises:
            LayoutError: If there is no layout or one's record size differs from the tier's.
            ValueError: If ``copy_deadline_s`` is not positive.
        """
        if copy_deadline_s <= 0:
            raise ValueError(f"copy_deadline_s must be positive, got {copy_deadline_s}")
        if not layouts:
            raise LayoutError("an offload worker needs at least one layout")
        self.layouts = layouts
        self.tier = tier
        backends: dict[int, CopyBackend] = {}
        self._group_backends: list[CopyBackend] = []
        for group, layout in enumerate(layouts):
            if layout.record_bytes != tier.record_bytes:
                raise LayoutError(
                    f"kv-cache group {group}'s layout has {layout.record_bytes}-byte records, "
                    f"but the host tier's slots hold {tier.record_bytes} bytes; every group "
                    "must share one record size"
                )
            if id(layout) not in backends:
                backends[id(layout)] = backend_factory(layout, tier.buffer)
            self._group_backends.append(backends[id(layout)])
        self._backends = list(backends.values())
        self.copy_deadline_s = copy_deadline_s
        self._clock = clock
        self._sleep = sleep
        self._on_end = on_end
        self._failures = FailureLog(logger)
        self._inflight: dict[int, _Copy] = {}
        # Copies the executor stopped waiting for; polled until they are over.
        self._abandoned: dict[int, _Copy] = {}
        self._done: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._abandoned_report: dict[int, int] = {}
        self._settled: dict[int, int] = {}
        self._load_times: list[tuple[int, float]] = []

    @property
    def idle(self) -> bool:
        """Whether no copy runs (abandoned ones included) and nothing is left to take."""
        return not (
            self._inflight
            or self._abandoned
            or self._done
            or self._failed
            or self._abandoned_report
            or self._settled
            or self._failures.has_new
        )

    @property
    def inflight(self) -> KeysView[int]:
        """Batch ids submitted and not ended (abandoned ones not included); a live view."""
        return self._inflight.keys()

    @property
    def num_abandoned(self) -> int:
        """Abandoned copies that may still be running."""
        return len(self._abandoned)

    @property
    def failure_counts(self) -> Mapping[FailureCause, int]:
        """Failures so far, by cause."""
        return self._failures.counts

    def take_failures(self) -> dict[FailureCause, int]:
        """Failures since the last call, by cause (empty when there were none)."""
        return self._failures.take_new()

    @property
    def has_outcomes(self) -> bool:
        """Whether :meth:`take_outcomes` would name a batch."""
        return bool(self._done or self._failed or self._abandoned_report or self._settled)

    def take_outcomes(self) -> CopyOutcomes:
        """The batches that ended, were abandoned or settled since the last call."""
        outcomes = CopyOutcomes(
            self._done,
            self._failed,
            self._abandoned_report,
            self._settled,
            tuple(self._load_times),
        )
        self._done, self._failed, self._abandoned_report, self._settled = {}, {}, {}, {}
        self._load_times = []
        return outcomes

    def check(self, transfer: Transfer) -> None:
        """Raise ``ValueError`` if ``transfer`` names a group, block or slot that does not exist."""
        if not 0 <= transfer.group < len(self.layouts):
            raise ValueError(
                f"transfer {transfer.batch_id} is for kv-cache group {transfer.group}, but this "
                f"worker has layouts for {len(self.layouts)} groups"
            )
        check_slots(transfer.host_slots, self.tier.num_slots, f"transfer {transfer.batch_id}")
        num_blocks = self.layouts[transfer.group].num_blocks
        block = _out_of_range(transfer.device_blocks, num_blocks)
        if block is not None:
            raise ValueError(
                f"transfer {transfer.batch_id} names device block {block}, but group "
                f"{transfer.group}'s layout has {num_blocks} blocks"
            )

    def submit(self, transfer: Transfer) -> None:
        """Start copying ``transfer``; a backend that refuses it fails the batch."""
        backend = self._group_backends[transfer.group]
        batch = CopyBatch(transfer.direction, transfer.device_blocks, transfer.host_slots)
        try:
            handle = backend.submit(batch)
        except CopyError as exc:
            self.fail(transfer, FailureCause.COPY_ERROR, str(exc))
            return
        except Exception as exc:  # a backend's bug fails its batch, never the engine
            self.fail(
                transfer,
                FailureCause.BACKEND_ERROR,
                f"{type(backend).__name__} raised {type(exc).__name__} submitting it (a copy "
                f"backend must raise CopyError): {exc}",
                exc_info=True,
            )
            return
        deadline = self._clock() + self.copy_deadline_s
        self._inflight[transfer.batch_id] = _Copy(backend, handle, transfer, deadline)

    def copy_now(self, transfers: Sequence[Transfer]) -> None:
        """Submit ``transfers`` and wait for them (each until its deadline at most), polling
        at the shortest pause: a step's forward waits for them."""
        for transfer in transfers:
            self.submit(transfer)
        batch_ids = {transfer.batch_id for transfer in transfers}
        while batch_ids & self._inflight.keys():
            self.poll()
            if batch_ids & self._inflight.keys():
                self._sleep(FIRST_PAUSE_S)

    def poll(self) -> None:
        """Poll every copy once; abandon those past their deadline."""
        if not (self._inflight or self._abandoned):  # most steps
            return
        now = self._clock()
        for batch_id, copy in list(self._inflight.items()):
            try:
                finished = copy.backend.done(copy.handle)
            except CopyError as exc:
                del self._inflight[batch_id]
                self.fail(copy.transfer, FailureCause.COPY_ERROR, str(exc))
                continue
            except Exception as exc:  # a backend's bug: the copy's state is unknown
                self._abandon(
                    batch_id,
                    FailureCause.BACKEND_ERROR,
                    f"{type(copy.backend).__name__} raised {type(exc).__name__} polling it "
                    f"(a copy backend must raise CopyError): {exc}",
                )
                continue
            if finished:
                del self._inflight[batch_id]
                self._record(copy.transfer, ok=True)
                if copy.transfer.direction is Direction.LOAD:
                    submitted = copy.deadline - self.copy_deadline_s
                    self._load_times.append((len(copy.transfer), now - submitted))
            elif now >= copy.deadline:
                self._abandon(
                    batch_id,
                    FailureCause.COPY_DEADLINE,
                    f"still running after {self.copy_deadline_s} s",
                )
        for batch_id, copy in list(self._abandoned.items()):
            try:
                over = copy.backend.done(copy.handle)
            except CopyError:
                over = True
            except Exception:  # still unknown: keep the slots held
                logger.debug("polling abandoned batch %d raised", batch_id, exc_info=True)
                continue
            if over:
                del self._abandoned[batch_id]
                self._settled[batch_id] = self._settled.get(batch_id, 0) + 1

    def wait(self, until: float | None = None) -> None:
        """Poll until no copy is in flight; with ``until``, also until abandoned ones are over.

        A copy still running at its deadline is abandoned, so this returns
        within ``copy_deadline_s``; with ``until``, by ``until`` at the latest.
        """
        pause = FIRST_PAUSE_S
        while True:
            self.poll()
            if not self._inflight and (until is None or not self._abandoned):
                return
            if until is not None and self._clock() >= until:
                return
            self._sleep(pause)
            pause = min(2 * pause, LONGEST_PAUSE_S)

    def close(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the copies, abandon those still running, and close
        the backends no abandoned copy uses; whether every copy is over.

        While a copy may still run, its backend stays open, and the host tier must too
        (a warning says so): freeing either would let the copy write freed memory.
        """
        self.wait(until=self._clock() + timeout_s)
        for batch_id in list(self._inflight):
            self._abandon(
                batch_id, FailureCause.CLOSE_TIMEOUT, "still running when the worker closed"
            )
        live = {id(copy.backend) for copy in self._abandoned.values()}
        for backend in self._backends:
            if id(backend) not in live:
                backend.close()
        if not self._abandoned:
            return True
        logger.warning(
            "closing with %d copies still running after close_timeout_s=%s (batches %s); "
            "their copy backends and the host tier's %d bytes are left open, not freed, so "
            "that the copies cannot write freed memory",
            len(self._abandoned),
            timeout_s,
            sorted(self._abandoned),
            self.tier.num_slots * self.tier.record_bytes,
        )
        return False

    def fail(
        self, transfer: Transfer, cause: FailureCause, why: str, *, exc_info: bool = False
    ) -> None:
        """Count and log ``transfer`` as failed for ``cause`` (its copy is over, or never ran)."""
        self._failures.failed(
            cause,
            "%s batch %d of %d blocks failed: %s",
            transfer.direction.value,
            transfer.batch_id,
            len(transfer),
            why,
            exc_info=exc_info,
        )
        self._record(transfer, ok=False)

    def _abandon(self, batch_id: int, cause: FailureCause, why: str) -> None:
        copy = self._inflight.pop(batch_id)
        self._abandoned[batch_id] = copy
        self._abandoned_report[batch_id] = self._abandoned_report.get(batch_id, 0) + 1
        transfer = copy.transfer
        self._failures.failed(
            cause,
            "stopped waiting for %s batch %d of %d blocks: %s; it counts as failed (a load is "
            "recomputed, a store dropped) and its host slots stay out of use until it ends",
            transfer.direction.value,
            batch_id,
            len(transfer),
            why,
        )
        self._on_end(transfer, False)

    def _record(self, transfer: Transfer, *, ok: bool) -> None:
        counts = self._done if ok else self._failed
        counts[transfer.batch_id] = counts.get(transfer.batch_id, 0) + 1
        self._on_end(transfer, ok)


def check_slots(slots: Sequence[int], num_slots: int, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` if a slot of ``slots`` is outside the host tier."""
    slot = _out_of_range(slots, num_slots)
    if slot is not None:
        raise ValueError(
            f"{what} names host slot {slot}, but this worker's tier has "
            f"{num_slots} slots; size the manager and the workers from the "
            "same config and record size"
        )


def _out_of_range(ids: Sequence[int], limit: int) -> int | None:
    """The first of ``ids`` outside ``[0, limit)``, or ``None``; all in range costs two C
    calls (``min``, ``max``) instead of a Python loop over a plan's blocks."""
    if not ids or (0 <= min(ids) and max(ids) < limit):
        return None
    return next(i for i in ids if not 0 <= i < limit)
