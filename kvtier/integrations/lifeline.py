"""Stop an engine process whose parent was killed, so that it does not hold kvtier's files.

An engine's front process (vLLM's API server, or the program that made an offline
engine) starts its engine core with :mod:`multiprocessing`. When the front process is
killed with ``SIGKILL``, vLLM's engine core and its workers are left running, serving no
one and holding each rank's disk-tier file locked, so the engine restarted in its place
is refused (``... is in use by another kvtier process``) until someone finds and kills
them. :func:`stop_with_parent` watches for that: once the process that started this one
is gone (this process has a new parent), it logs one line and sends itself ``SIGTERM``,
which vLLM's engine core handles as a shutdown (its workers stop with it and close their
tiers). The watch is one ``getppid`` a second on a daemon thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
"""Seconds between two looks at this process's parent."""


def stop_with_parent(what: str, interval_s: float = CHECK_INTERVAL_S) -> bool:
    """Send this process ``SIGTERM`` once the process that started it has died.

    Only a process that :mod:`multiprocessing` started is watched: a program run from
    a shell or a service manager outlives its parent by design.

    Args:
        what: What this process is, for the log line (such as ``"vLLM's engine core"``).
        interval_s: Seconds between two looks at the parent.

    Returns:
        Whether the watch was started.
    """
    parent = multiprocessing.parent_process()
    parent_pid = os.getppid()
    if parent is None or parent.pid != parent_pid:
        return False

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                logger.error(
                    "kvtier: the process that started %s (pid %d) is gone; stopping this "
                    "one (pid %d) so that it releases kvtier's files for the next engine",
                    what,
                    parent_pid,
                    os.getpid(),
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="kvtier-lifeline", daemon=True).start()
    return True
