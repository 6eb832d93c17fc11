"""A TCP link of a given bandwidth in front of a server on 127.0.0.1, for the benchmarks.

On one machine every store is as fast as memory: a ``redis-server`` on the
loopback moves gigabytes a second, so nothing shows what a record codec buys
where the network is the limit. :class:`ShapedLink` listens on a port of its
own and relays each connection to the server, both ways, through one token
bucket per direction shared by all connections (a full-duplex link of
``megabits_per_s`` each way). It adds no latency of its own beyond the
bucket's waits. The relay runs in a process of its own, as a network would:
its threads never take the measured process's GIL. Use::

    with ShapedLink(("127.0.0.1", 6379), megabits_per_s=1000) as link:
        url = f"redis://127.0.0.1:{link.port}"
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

CHUNK_BYTES = 64 << 10
BURST_S = 0.005
"""The bucket holds this long a link's bytes: a burst never outruns the rate for long."""


class _Bucket:
    """Bytes a direction may send: refilled at ``rate`` bytes a second, up to a burst."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._burst = max(rate * BURST_S, CHUNK_BYTES)
        self._tokens = self._burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, count: int) -> None:
        """Wait until ``count`` bytes may go."""
        with self._lock:  # one sender at a time, in turn, as on a wire
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            self._tokens -= count
            owed = -self._tokens / self._rate
            if owed > 0:
                time.sleep(owed)


class _Connection:
    """A client's socket and the server's, relayed both ways by two pumps; closed when both
    pumps are done."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.sockets = (client, server)
        self._pumps = 2
        self._lock = threading.Lock()

    def pump(self, source: socket.socket, sink: socket.socket, bucket: _Bucket) -> None:
        """Relay ``source`` to ``sink`` until either side closes, then close both ways."""
        buffer = bytearray(CHUNK_BYTES)
        view = memoryview(buffer)
        try:
            while received := source.recv_into(buffer):
                bucket.take(received)
                sink.sendall(view[:received])
        except OSError:
            pass
        self.shutdown()
        with self._lock:
            self._pumps -= 1
            last = self._pumps == 0
        if last:
            for sock in self.sockets:
                sock.close()

    def shutdown(self) -> None:
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed already
                pass


def relay(listener: socket.socket, target: tuple[str, int], megabits_per_s: float) -> None:
    """Accept connections on ``listener`` and relay each to ``target`` through the link's
    two buckets, for as long as the process lives."""
    rate = megabits_per_s * 1e6 / 8
    up, down = _Bucket(rate), _Bucket(rate)
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # closed
            return
        try:
            server = socket.create_connection(target)
        except OSError:  # the server refused: so does the link
            client.close()
            continue
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(client, server)
        for source, sink, bucket in ((client, server, up), (server, client, down)):
            threading.Thread(
                target=connection.pump, args=(source, sink, bucket), daemon=True
            ).start()


class ShapedLink:
    """Relays connections to ``target`` at ``megabits_per_s`` each way, from a child process
    that lives as long as the link; a context manager."""

    def __init__(self, target: tuple[str, int], megabits_per_s: float) -> None:
        if megabits_per_s <= 0:
            raise ValueError(f"a link's bandwidth is positive, got {megabits_per_s}")
        self.target = target
        self.megabits_per_s = megabits_per_s
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), f"{target[0]}:{target[1]}", str(megabits_per_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait()
            raise RuntimeError(f"the link's relay exited with status {self._process.returncode}")
        self.port = int(line)

    def close(self) -> None:
        """Stop the relay, cutting every connection."""
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()  # the relay's cue to exit
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> ShapedLink:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """The relay's process: print the port it listens on, relay until stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="HOST:PORT of the server")
    parser.add_argument("megabits_per_s", type=float)
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=relay, args=(listener, (host, int(port)), args.megabits_per_s), daemon=True
    ).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
