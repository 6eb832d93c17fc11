"""Storage tiers below the engine's own KV cache: host memory first, then disk, Redis and S3.

The names below load on first use: validating a config imports only the tiers'
config models (:mod:`kvtier.tiers.configs` and each tier's ``<name>_config``
module), never the host tier's torch or the lower tiers' machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.tiers.base import (
        ContainsResult,
        DeleteResult,
        GetResult,
        PutResult,
        StorageTier,
        TierError,
        TierSpec,
        TierState,
        TierStats,
    )
    from kvtier.tiers.host import HostTier
    from kvtier.tiers.queued import QueuedTier

_HOMES = {
    "ContainsResult": "kvtier.tiers.base",
    "DeleteResult": "kvtier.tiers.base",
    "GetResult": "kvtier.tiers.base",
    "HostTier": "kvtier.tiers.host",
    "PutResult": "kvtier.tiers.base",
    "QueuedTier": "kvtier.tiers.queued",
    "StorageTier": "kvtier.tiers.base",
    "TierError": "kvtier.tiers.base",
    "TierSpec": "kvtier.tiers.base",
    "TierState": "kvtier.tiers.base",
    "TierStats": "kvtier.tiers.base",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
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
    "TierState",
    "TierStats",
]
