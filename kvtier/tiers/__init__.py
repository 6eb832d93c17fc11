"""Storage tiers below the engine's own KV cache; the host (CPU memory) tier first."""

from kvtier.tiers.host import HostTier, capacity_per_rank, slots_for_bytes

__all__ = ["HostTier", "capacity_per_rank", "slots_for_bytes"]
