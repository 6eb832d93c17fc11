"""Free ports for the test servers."""

from __future__ import annotations

import random

from tests.support.redis_server import first_ephemeral_port, free_port


def test_free_ports_do_not_follow_the_shared_random_state() -> None:
    """vLLM seeds ``random`` in every process that builds an engine: test processes side by
    side then drew the same ports, and one's server lost its port to the other's."""
    random.seed(0)
    first = [free_port() for _ in range(4)]
    random.seed(0)
    assert [free_port() for _ in range(4)] != first


def test_free_ports_stay_below_the_ephemeral_range() -> None:
    """A port an outgoing connection may take (as one took a Mooncake master's metadata port
    between its check and its bind) is never handed out."""
    first = first_ephemeral_port()
    assert all(free_port() < first for _ in range(200))
    assert all(free_port(with_cluster_bus=True) + 10000 < first for _ in range(50))
