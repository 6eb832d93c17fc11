"""``lru``: evict the least recently stored or hit block."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal

from kvtier.index.base import BlockKey
from kvtier.index.policy import EvictionPolicy
from kvtier.models import PluginConfig


class LRUConfig(PluginConfig):
    """Least-recently-used eviction; no settings."""

    type: Literal["lru"] = "lru"


class LRUPolicy(EvictionPolicy):
    """Keys in recency order, oldest first."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._order[key] = None

    def accessed(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def accessed_all(self, keys: Sequence[BlockKey]) -> None:
        move_to_end = self._order.move_to_end
        for key in keys:
            move_to_end(key)

    def removed(self, key: BlockKey) -> None:
        del self._order[key]

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        for key in self._order:
            if evictable(key):
                return key
        return None


def build(config: LRUConfig, num_slots: int) -> LRUPolicy:
    """The ``lru`` policy's factory."""
    return LRUPolicy()
