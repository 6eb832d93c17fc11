"""``s3fifo``: S3-FIFO (Yang et al., SOSP 2023), three FIFO queues and a two-bit hit counter.

New keys enter a small FIFO (``small_fraction`` of the slots). A key leaving
the small queue moves to the main FIFO if it was hit more than once, else it is
evicted and remembered in a ghost FIFO; a key stored again while the ghost
queue remembers it goes straight to the main queue. The main queue is a
CLOCK: a key at its head with hits left is reinserted at the tail with one hit
fewer, a key without hits is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from kvtier.index.base import BlockKey
from kvtier.index.policy import EvictionPolicy
from kvtier.models import PluginConfig

MAX_HITS = 3


class S3FIFOConfig(PluginConfig):
    """S3-FIFO eviction."""

    type: Literal["s3fifo"] = "s3fifo"
    small_fraction: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="Share of the slots given to the small FIFO that new keys enter.",
    )


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO over the tier's readable keys."""

    def __init__(self, num_slots: int, small_fraction: float = 0.1) -> None:
        self.small_target = max(1, int(num_slots * small_fraction))
        self.ghost_size = max(1, num_slots - self.small_target)
        # Queues map each key to its hit counter, oldest key first.
        self._small: OrderedDict[BlockKey, int] = OrderedDict()
        self._main: OrderedDict[BlockKey, int] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()

    def state(self) -> dict[str, float]:
        return {"small": len(self._small), "main": len(self._main), "ghost": len(self._ghost)}

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def accessed(self, key: BlockKey) -> None:
        queue = self._small if key in self._small else self._main
        if queue[key] < MAX_HITS:
            queue[key] += 1

    def removed(self, key: BlockKey) -> None:
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            if len(self._ghost) > self.ghost_size:
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        small, main = self._small, self._main
        # Every key may be passed over once per queue: pinned ones, or ones with hits to spend.
        budget = 2 * (len(small) + len(main)) + 2 * MAX_HITS * len(main)
        pinned_small = 0
        while budget > 0:
            budget -= 1
            small_turn = len(small) >= self.small_target or not main
            if small and pinned_small < len(small) and small_turn:
                key = next(iter(small))
                if small[key] > 1:
                    del small[key]
                    main[key] = 0
                elif evictable(key):
                    return key
                else:
                    pinned_small += 1
                    small.move_to_end(key)
            elif main:
                key = next(iter(main))
                if main[key] > 0:
                    main[key] -= 1
                    main.move_to_end(key)
                elif evictable(key):
                    return key
                else:
                    main.move_to_end(key)
            else:
                return None
        return None


def build(config: S3FIFOConfig, num_slots: int) -> S3FIFOPolicy:
    """The ``s3fifo`` policy's factory."""
    return S3FIFOPolicy(num_slots, config.small_fraction)
