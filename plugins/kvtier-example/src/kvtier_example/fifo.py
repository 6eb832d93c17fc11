"""``fifo``: evict blocks in the order they were stored, optionally with a second chance.

Plain FIFO ignores hits, so its bookkeeping is one ordered dict and a hit costs
nothing. With ``second_chance`` it becomes CLOCK: a hit marks the block, and
when a marked block reaches the front of the queue it is unmarked and sent to
the back instead of being evicted. It is an eviction policy: kvtier puts it in
a :class:`~kvtier.api.PolicyIndex`, which owns the slots, their states and the
pins; this module only ranks keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from kvtier.api import BlockKey, EvictionPolicy, PluginConfig


class FIFOConfig(PluginConfig):
    """First-in, first-out eviction, optionally with a second chance for blocks hit since."""

    type: Literal["fifo"] = "fifo"
    second_chance: bool = Field(
        False,
        description=(
            "Send a block that was hit since it entered the queue to the back once instead of "
            "evicting it (CLOCK). Off: evict strictly in the order blocks were stored."
        ),
    )


class FIFOPolicy(EvictionPolicy):
    """Keys in the order they became readable, each with a 'hit since queued' mark."""

    def __init__(self, second_chance: bool = False) -> None:
        self.second_chance = second_chance
        self._queue: OrderedDict[BlockKey, bool] = OrderedDict()

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._queue[key] = False

    def accessed(self, key: BlockKey) -> None:
        if self.second_chance:
            self._queue[key] = True

    def removed(self, key: BlockKey) -> None:
        del self._queue[key]

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        if not self.second_chance:
            return next((key for key in self._queue if evictable(key)), None)
        # Each key is looked at most twice: once to clear its mark, once more to evict it.
        for _ in range(2 * len(self._queue)):
            key, marked = next(iter(self._queue.items()))
            if not marked and evictable(key):
                return key
            # Marked keys lose their mark; pinned keys wait behind the others.
            self._queue[key] = False
            self._queue.move_to_end(key)
        return None


def build_fifo_policy(config: FIFOConfig, num_slots: int) -> FIFOPolicy:
    """Build the ``fifo`` policy for a tier of ``num_slots`` slots (the registered factory).

    Args:
        config: The validated ``index`` section.
        num_slots: How many blocks the tier holds (FIFO needs no size).

    Returns:
        The policy; kvtier puts it in a :class:`~kvtier.api.PolicyIndex`.
    """
    return FIFOPolicy(second_chance=config.second_chance)
