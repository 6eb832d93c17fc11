"""What the simulator tests share: the command line parsed as ``kvtier simulate`` parses it."""

from __future__ import annotations

import argparse

from kvtier.cli.simulate import add_arguments


def parse(*argv: str) -> argparse.Namespace:
    """``argv`` parsed by the arguments of ``kvtier simulate``."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)
