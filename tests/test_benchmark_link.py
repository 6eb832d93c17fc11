"""The benchmarks' shaped link: it relays every byte both ways, no faster than its rate, from a
process that ends with the link."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import REPO_ROOT, load_script

link = load_script(REPO_ROOT / "benchmarks" / "link.py")


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    """A server on 127.0.0.1 that sends back whatever each connection sends it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def echo(connection: socket.socket) -> None:
        with connection:
            while data := connection.recv(1 << 16):
                connection.sendall(data)

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=echo, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()
    listener.close()


def test_bytes_come_back_whole_and_no_faster_than_the_link(echo_server: tuple[str, int]) -> None:
    payload = bytes(range(256)) * (8 << 10)  # 2 MiB
    with link.ShapedLink(echo_server, megabits_per_s=80) as shaped:  # 10 MB/s each way
        began = time.monotonic()
        with socket.create_connection(("127.0.0.1", shaped.port)) as client:
            sender = threading.Thread(target=client.sendall, args=(payload,))
            sender.start()
            received = bytearray()
            while len(received) < len(payload) and (data := client.recv(1 << 16)):
                received += data
            sender.join()
        elapsed = time.monotonic() - began
        process = shaped._process
    assert received == payload
    # 2 MiB each way at 10 MB/s, the two ways at once, less the buckets' bursts (64 KiB).
    assert elapsed >= (len(payload) - (64 << 10)) / 10e6
    assert process.poll() is not None, "closing the link ends its relay's process"


def test_a_bandwidth_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        link.ShapedLink(("127.0.0.1", 1), megabits_per_s=0)
