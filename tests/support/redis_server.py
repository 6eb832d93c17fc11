"""Real ``redis-server`` processes for tests: one server, or a three-node Redis Cluster.

Servers listen on 127.0.0.1 on free ports, keep nothing on disk, and are
stopped by :meth:`RedisServer.stop` (tests call it from a fixture's teardown).
:func:`redis_server_binary` returns ``None`` when ``redis-server`` is not
installed, for tests to skip with that reason.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0
_CLUSTER_BUS_OFFSET = 10000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_PORTS = random.SystemRandom()
"""Draws ports from the OS, not from ``random``'s shared state: vLLM seeds that (with the
model's seed) in every process that builds an engine, so test processes running side by
side drew the same ports and one's server failed to bind what the other's had just taken."""


def redis_server_binary() -> str | None:
    """Path of ``redis-server``, or ``None`` when it is not installed."""
    return shutil.which("redis-server")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def first_ephemeral_port() -> int:
    """The first port the kernel hands to outgoing connections (Linux's default: 32768)."""
    try:
        return int(Path(_EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A port free on 127.0.0.1 now (and its cluster bus port, ``port + 10000``, if asked),
    below the kernel's ephemeral range: a port in it may be taken by any outgoing connection
    (a client of another test's server) between this check and the server's bind."""
    low = 10000
    high = min(first_ephemeral_port(), 65536) - (_CLUSTER_BUS_OFFSET if with_cluster_bus else 0)
    for _ in range(200):
        port = _PORTS.randrange(low, high)
        if _bindable(port) and (not with_cluster_bus or _bindable(port + _CLUSTER_BUS_OFFSET)):
            return port
    raise RuntimeError(f"no free port found on 127.0.0.1 between {low} and {high}")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, started by :meth:`start`."""

    def __init__(self, directory: Path, *, port: int | None = None, args: Sequence[str] = ()):
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **options: object) -> redis.Redis:
        """A client of this server."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **options)  # type: ignore[arg-type]

    def start(self, *, ping: bool = True) -> RedisServer:
        """Start the server and wait until it answers (``ping=False`` only waits for the port)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {self.process.returncode}"
                )
            try:
                if ping:
                    with self.client(socket_connect_timeout=0.2) as client:
                        client.ping()
                else:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except (redis.exceptions.RedisError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """Kill the server at once (``SIGKILL``): it loses everything it held."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def pause(self) -> None:
        """Stop the server process (``SIGSTOP``): it keeps connections but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run again."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server if it runs. Idempotent."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


def start_cluster(directory: Path, nodes: int = 3) -> list[RedisServer]:
    """Start ``nodes`` servers as one Redis Cluster (no replicas) and wait until it serves.

    On failure every server started is stopped before the error propagates.
    """
    servers: list[RedisServer] = []
    try:
        for number in range(nodes):
            port = free_port(with_cluster_bus=True)
            server = RedisServer(
                directory / f"node{number}",
                port=port,
                args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
            servers.append(server.start())
        # Slots split evenly, then every node introduced to the first; gossip does the rest.
        bounds = [round(16384 * number / nodes) for number in range(nodes + 1)]
        for server, start, end in zip(servers, bounds, bounds[1:], strict=False):
            server.client().execute_command("CLUSTER", "ADDSLOTSRANGE", start, end - 1)
        for server in servers[1:]:
            servers[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(
            server.client().cluster("info").get("cluster_state") == "ok"
            and len(server.client().cluster("nodes")) == nodes
            for server in servers
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the local Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
