"""Block indexes: ``BlockKey -> slot`` directories with pins and eviction policies."""

from kvtier.index.base import (
    BlockIndex,
    BlockKey,
    EventKind,
    IndexEvent,
    IndexStats,
    PrioritizedEviction,
    Priority,
)
from kvtier.index.policy import EvictionPolicy, PolicyIndex

__all__ = [
    "BlockIndex",
    "BlockKey",
    "EventKind",
    "EvictionPolicy",
    "IndexEvent",
    "IndexStats",
    "PolicyIndex",
    "PrioritizedEviction",
    "Priority",
]
