"""Storage tiers below the engine's own KV cache; the host (CPU memory) tier first."""

from kvtier.tiers.host import HostTier

__all__ = ["HostTier"]
