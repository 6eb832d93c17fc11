"""Hook implementations: what kvtier loads through this package's ``kvtier`` entry point."""

from __future__ import annotations

from kvtier.api import BlockIndexFactory, Register, hookimpl
from kvtier_example.fifo import FIFOConfig, build_fifo_index


@hookimpl
def register_block_indexes(register: Register[BlockIndexFactory]) -> None:
    """Register the ``fifo`` block index with its config model."""
    register("fifo", build_fifo_index, FIFOConfig)
