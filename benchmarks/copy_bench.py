"""Copy-backend bandwidth, 4 KiB to 2 MiB per block, against a contiguous copy in the same run.

A thin wrapper over :mod:`kvtier.cli.bench` (the same as ``kvtier bench copy``)
that prints JSON to stdout (and a progress bar on stderr when it is a terminal). Any option of
``kvtier bench copy`` is accepted, e.g.::

    python benchmarks/copy_bench.py
    python benchmarks/copy_bench.py --regions 2 --pattern scattered
    python benchmarks/copy_bench.py --backend dma --device cuda
"""

from __future__ import annotations

import argparse
import sys

from kvtier.cli import bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.set_defaults(json=True)
    return bench.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
