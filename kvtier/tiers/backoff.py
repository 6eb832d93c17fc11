"""Backoff: when a tier calls its store again after the store stopped answering.

A shared tier's batch that cannot reach its server opens a window during
which the tier answers requests at once (misses and drops, counted) instead
of waiting on the network again; each failure in a row doubles the window, up
to a longest one, and the first batch that gets an answer closes it. One
warning is logged when the store stops answering, one line when it answers again.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class Backoff:
    """When to call a store again after it stopped answering: a wait doubling per failure."""

    def __init__(self, name: str, where: str, first_s: float, longest_s: float) -> None:
        """Start with the store answering.

        Args:
            name: The tier's name, for log lines.
            where: The store as log lines show it (no secrets).
            first_s: The wait after the first failure in a row.
            longest_s: The longest wait.
        """
        self._name = name
        self._where = where
        self._first_s = first_s
        self._longest_s = longest_s
        self._lock = threading.Lock()
        self._failures = 0
        self._next_wait_s = first_s
        self._retry_at = 0.0

    def waiting(self) -> bool:
        """Whether the store failed and its wait is not over."""
        with self._lock:
            return time.monotonic() < self._retry_at

    def failed(self, reason: str) -> None:
        """Start, or double, the wait."""
        with self._lock:
            wait = min(self._next_wait_s, self._longest_s)
            self._next_wait_s = 2 * wait
            self._failures += 1
            self._retry_at = time.monotonic() + wait
            first = self._failures == 1
        if first:
            logger.warning(
                "%s tier: %s failed (%s); misses and dropped stores until it answers, "
                "next try in %.2f s",
                self._name,
                self._where,
                reason,
                wait,
            )

    def answered(self) -> None:
        """The store answered: the next failure waits the first wait again."""
        with self._lock:
            recovered, self._failures = self._failures > 0, 0
            self._next_wait_s = self._first_s
        if recovered:
            logger.info("%s tier: %s answers again", self._name, self._where)
