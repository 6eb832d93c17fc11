"""Storage tiers below the engine's own KV cache: host memory first, then disk and Redis."""

from kvtier.tiers.base import (
    ContainsResult,
    DeleteResult,
    GetResult,
    PutResult,
    QueuedTier,
    StorageTier,
    TierError,
    TierSpec,
    TierStats,
)
from kvtier.tiers.host import HostTier, capacity_per_rank, slots_for_bytes

__all__ = [
    "ContainsResult",
    "DeleteResult",
    "GetResult",
    "HostTier",
    "PutResult",
    "QueuedTier",
    "StorageTier",
    "TierError",
    "TierSpec",
    "TierStats",
    "capacity_per_rank",
    "slots_for_bytes",
]
