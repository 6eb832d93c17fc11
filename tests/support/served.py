"""An OpenAI-compatible server process on 127.0.0.1 for tests and benchmarks: start, wait, stop.

Each server leads its own process group, so stopping it also stops the engine processes it
started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_S = 20.0
"""Seconds a server has to exit after SIGTERM, and again after SIGKILL."""


class PortTaken(RuntimeError):
    """The server exited because another process listened on its port first: a free port is
    only free when it is picked, and a vLLM server binds it a minute or more later."""


@dataclass
class Server:
    """A server process (leader of its own process group), its port, log and model."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path
    model: str

    @classmethod
    def start(
        cls, command: Sequence[str], log: Path, port: int, model: str, env: Mapping[str, str]
    ) -> Server:
        """Start ``command`` (which must listen on ``port``) with ``env`` added to the
        environment, its output going to ``log``."""
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(command),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        return cls(process, port, log, model)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, deadline: float) -> None:
        """Return once ``/health`` answers 200.

        Raises:
            PortTaken: The process exited because its port was taken; start it on another.
            RuntimeError: The process exited, or ``deadline`` (``time.monotonic``) passed.
        """
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                exited = PortTaken if "Address already in use" in self.log_tail() else RuntimeError
                raise exited(
                    f"server exited with {self.process.returncode}; its log {self.log} ends:\n"
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready in time; its log {self.log} ends:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it is still there after a while."""
        if self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)
