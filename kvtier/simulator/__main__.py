"""``python -m kvtier.simulator TRACE``: the same command as ``kvtier simulate``."""

import argparse
import sys

from kvtier.simulator import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m kvtier.simulator", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
