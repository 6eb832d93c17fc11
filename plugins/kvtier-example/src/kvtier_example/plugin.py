"""Hook implementations: what kvtier loads through this package's ``kvtier`` entry point."""

from __future__ import annotations

import kvtier
from kvtier.hookspecs import Register
from kvtier_example.fifo import FIFOConfig, build_fifo_index


@kvtier.hookimpl
def register_block_indexes(register: Register) -> None:
    """Register the ``fifo`` block index with its config model."""
    register("fifo", build_fifo_index, FIFOConfig)
