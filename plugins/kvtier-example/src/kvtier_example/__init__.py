"""kvtier-example: a kvtier plugin package that adds the ``fifo`` eviction policy."""

from kvtier_example.fifo import FIFOConfig, FIFOPolicy, build_fifo_policy

__all__ = ["FIFOConfig", "FIFOPolicy", "build_fifo_policy"]
