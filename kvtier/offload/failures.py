"""Failure logging and counting for the offload path, by cause.

A flaky copy backend or a silent rank fails many batches in a row; logging
each one would bury everything else. So each cause warns once, then logs at
debug level, and every failure is counted by cause (the engine's metrics
publish the counts). The blocks involved are also counted in the manager's
:class:`~kvtier.offload.OffloadStats`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping


class FailureCause(str, enum.Enum):
    """Why a copy or a report failed; the value is the ``cause`` label of the failure metric."""

    COPY_ERROR = "copy_error"
    """A rank's copy backend reported a failed copy (``CopyError``); counted by that rank."""
    BACKEND_ERROR = "backend_error"
    """A rank's copy backend raised something other than ``CopyError``; counted by that rank."""
    COPY_DEADLINE = "copy_deadline"
    """A rank stopped waiting for a copy past ``copy_deadline_s``; counted by that rank."""
    LOAD_NOT_STARTED = "load_not_started"
    """A rank's engine ran a step's forward before copying that step's same-step loads (it
    never called the worker's ``load_same_step``); their blocks are recomputed."""
    CLOSE_TIMEOUT = "close_timeout"
    """A copy was still running when its rank closed, after ``close_timeout_s``."""
    REPORT_DEADLINE = "report_deadline"
    """Some rank did not report a batch within ``report_deadline_s``; counted by the scheduler."""
    STORE_DROPPED = "store_dropped"
    """A store batch did not complete on every rank, so its blocks were dropped; counted by the
    scheduler once per batch, on top of the rank-side cause."""
    REJECTED_REPORT = "rejected_report"
    """An entry of a rank's report was impossible and ignored; counted by the scheduler."""


class FailureLog:
    """Logs a warning for the first failure of each cause and debug lines for the rest."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._counts: dict[FailureCause, int] = {}
        self.total = 0
        """Failures so far, of every cause."""
        self._taken: dict[FailureCause, int] = {}
        self._taken_total = 0

    @property
    def counts(self) -> Mapping[FailureCause, int]:
        """Failures so far, by cause (causes that never failed are absent)."""
        return dict(self._counts)

    @property
    def has_new(self) -> bool:
        """Whether :meth:`take_new` would return any failure."""
        return self.total != self._taken_total

    def take_new(self) -> dict[FailureCause, int]:
        """Failures since the last call, by cause (empty when there were none)."""
        if self.total == self._taken_total:
            return {}  # most calls
        new = {
            cause: count - self._taken.get(cause, 0)
            for cause, count in self._counts.items()
            if count != self._taken.get(cause, 0)
        }
        self._taken, self._taken_total = dict(self._counts), self.total
        return new

    def failed(
        self, cause: FailureCause, message: str, *args: object, exc_info: bool = False
    ) -> None:
        """Count and log one failure; ``message`` and ``args`` are a ``logging`` format."""
        seen = cause in self._counts
        self._counts[cause] = self._counts.get(cause, 0) + 1
        self.total += 1
        if seen:
            self._logger.debug(message, *args, exc_info=exc_info)
            return
        self._logger.warning(
            message + " (further %s failures are logged at debug level and counted in the stats)",
            *args,
            cause.value,
            exc_info=exc_info,
        )
