"""What the simulator tests share: the command line parsed as ``kvtier simulate`` parses it,
and traces of block-id chains."""

from __future__ import annotations

import argparse

from kvtier.cli.simulate import add_arguments
from kvtier.simulator.traces import TraceRequest, mooncake_key


def parse(*argv: str) -> argparse.Namespace:
    """``argv`` parsed by the arguments of ``kvtier simulate``."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def requests_of(*chains: list[int]) -> list[TraceRequest]:
    """One request per chain of Mooncake block ids, all at time 0."""
    return [TraceRequest(0.0, tuple(mooncake_key(h) for h in chain)) for chain in chains]
