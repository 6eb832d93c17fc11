"""The server process helper tells a server whose port was taken from one that failed otherwise."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from tests.support.redis_server import free_port
from tests.support.served import PortTaken, Server


def test_a_server_whose_port_another_process_listens_on_raises_port_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Binds as vLLM's server does: SO_REUSEADDR, which a listening socket still refuses.
        code = (
            "import socket; s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('127.0.0.1', {port}))"
        )
        server = Server.start([sys.executable, "-c", code], tmp_path / "log", port, "m", {})
        with pytest.raises(PortTaken, match="Address already in use"):
            server.wait_ready(time.monotonic() + 60)


def test_a_server_that_fails_otherwise_raises_runtime_error(tmp_path: Path) -> None:
    code = "raise SystemExit('no such model')"
    server = Server.start([sys.executable, "-c", code], tmp_path / "log", free_port(), "m", {})
    with pytest.raises(RuntimeError, match="no such model") as caught:
        server.wait_ready(time.monotonic() + 60)
    assert not isinstance(caught.value, PortTaken)
