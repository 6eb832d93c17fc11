"""kvtier-example: a kvtier plugin package that adds the ``fifo`` block index."""

from kvtier_example.fifo import FIFOConfig, FIFOPolicy, build_fifo_index

__all__ = ["FIFOConfig", "FIFOPolicy", "build_fifo_index"]
