"""A TCP link of a given bandwidth in front of a server on 127.0.0.1, for the benchmarks.

On one machine every store is as fast as memory: a ``redis-server`` on the
loopback moves gigabytes a second, so nothing shows what a record codec buys
where the network is the limit. :class:`ShapedLink` listens on a port of its
own and relays each connection to the server, both ways, through one token
bucket per direction shared by all connections (a full-duplex link of
``megabits_per_s`` each way). It adds no latency of its own beyond the
bucket's waits. Use::

    with ShapedLink(("127.0.0.1", 6379), megabits_per_s=1000) as link:
        url = f"redis://127.0.0.1:{link.port}"
"""

from __future__ import annotations

import socket
import threading
import time
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


class ShapedLink:
    """Relays connections to ``target`` at ``megabits_per_s`` each way; a context manager."""

    def __init__(self, target: tuple[str, int], megabits_per_s: float) -> None:
        if megabits_per_s <= 0:
            raise ValueError(f"a link's bandwidth is positive, got {megabits_per_s}")
        self.target = target
        self.megabits_per_s = megabits_per_s
        rate = megabits_per_s * 1e6 / 8
        self._up, self._down = _Bucket(rate), _Bucket(rate)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._connections: list[_Connection] = []
        self._closed = False
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:  # the server refused: so does the link
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(client, server)
            self._connections = [
                each for each in self._connections if each.sockets[0].fileno() >= 0
            ]
            self._connections.append(connection)
            for source, sink, bucket in ((client, server, self._up), (server, client, self._down)):
                pump = threading.Thread(
                    target=connection.pump, args=(source, sink, bucket), daemon=True
                )
                pump.start()

    def close(self) -> None:
        """Stop accepting and cut every connection."""
        if self._closed:
            return
        self._closed = True
        self._listener.close()
        for connection in self._connections:
            connection.shutdown()

    def __enter__(self) -> ShapedLink:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
