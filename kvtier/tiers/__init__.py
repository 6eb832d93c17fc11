"""Storage tiers below the engine's own KV cache: host memory first, then disk and Redis."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from kvtier.tiers.host import HostTier


def __getattr__(name: str) -> Any:
    # The host tier needs torch; the lower tiers' interface and config models must not.
    if name == "HostTier":
        from kvtier.tiers.host import HostTier

        return HostTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
]
