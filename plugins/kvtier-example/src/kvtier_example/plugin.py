"""Hook implementations: what kvtier loads through this package's ``kvtier`` entry point."""

from __future__ import annotations

from kvtier.api import EvictionPolicyFactory, Register, hookimpl
from kvtier_example.fifo import FIFOConfig, build_fifo_policy


@hookimpl
def register_eviction_policies(register: Register[EvictionPolicyFactory]) -> None:
    """Register the ``fifo`` eviction policy with its config model."""
    register("fifo", build_fifo_policy, FIFOConfig)
