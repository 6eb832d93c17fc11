"""Failure logging for the offload path: each cause warns once, then logs at debug level.

A flaky copy backend or a silent rank fails many batches in a row; logging
each one would bury everything else. Each failure is still counted in the
manager's :class:`~kvtier.offload.OffloadStats` (and so in the engine's metrics).
"""

from __future__ import annotations

import logging


class FailureLog:
    """Logs a warning for the first failure of each cause and debug lines for the rest."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()

    def failed(self, cause: str, message: str, *args: object, exc_info: bool = False) -> None:
        """Log one failure; ``message`` and ``args`` are a ``logging`` format and its arguments."""
        if cause in self._seen:
            self._logger.debug(message, *args, exc_info=exc_info)
            return
        self._seen.add(cause)
        self._logger.warning(
            message + " (further %s failures are logged at debug level and counted in the stats)",
            *args,
            cause,
            exc_info=exc_info,
        )
