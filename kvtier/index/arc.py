"""``arc``: Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

Keys live in one of two LRU lists: ``t1`` holds keys seen once since they
arrived, ``t2`` keys hit again. The keys each list evicted are remembered
(without slots) in the ghost lists ``b1`` and ``b2``; storing a key again that
a ghost list remembers moves the target size ``p`` of ``t1`` towards the list
that would have kept it. Victims come from ``t1`` while it is above its target,
else from ``t2``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from kvtier.index.base import BlockKey
from kvtier.index.policy import EvictionPolicy
from kvtier.models import PluginConfig


class ARCConfig(PluginConfig):
    """Adaptive Replacement Cache eviction; no settings (it tunes itself)."""

    type: Literal["arc"] = "arc"


def first_evictable(
    order: OrderedDict[BlockKey, object], evictable: Callable[[BlockKey], bool]
) -> BlockKey | None:
    """The oldest key of ``order`` that ``evictable`` accepts, else ``None``."""
    for key in order:
        if evictable(key):
            return key
    return None


def adapted_target_t1(
    target_t1: float, num_slots: int, b1: int, b2: int, *, in_b1: bool, toward_t2: bool
) -> float:
    """ARC's adaptation of the target size ``p`` of ``t1`` on a miss.

    Args:
        target_t1: The current target.
        num_slots: Slots of the tier (the target's upper bound).
        b1: Keys in the ghost list ``b1``.
        b2: Keys in the ghost list ``b2``.
        in_b1: The missed key is remembered by ``b1``: ``t1`` would have kept it, so it grows.
        toward_t2: Otherwise, whether the miss argues for a larger ``t2`` (a ``b2`` hit).

    Returns:
        The new target, within ``0 .. num_slots``.
    """
    if in_b1:
        return min(float(num_slots), target_t1 + max(1.0, b2 / b1))
    if toward_t2:
        return max(0.0, target_t1 - max(1.0, b1 / max(b2, 1)))
    return target_t1


def arc_prefers_t1(size_t1: int, target_t1: float, incoming_in_b2: bool) -> bool:
    """Whether ARC takes its victim from ``t1``, holding ``size_t1`` keys, rather than ``t2``.

    See :func:`arc_victim` for the arguments; the victim comes from the other list when the
    preferred one has no evictable key.
    """
    return size_t1 > 0 and (size_t1 > target_t1 or (incoming_in_b2 and size_t1 == int(target_t1)))


def arc_victim(
    t1: OrderedDict[BlockKey, None],
    t2: OrderedDict[BlockKey, None],
    target_t1: float,
    incoming_in_b2: bool,
    evictable: Callable[[BlockKey], bool],
) -> BlockKey | None:
    """ARC's replacement choice: the oldest evictable key of ``t1`` while it is above target.

    Args:
        t1: Keys seen once, oldest first.
        t2: Keys hit again, oldest first.
        target_t1: The adaptive target size ``p`` of ``t1``.
        incoming_in_b2: Whether the key being stored is remembered by the ghost list ``b2``
            (then ``t1`` also gives up a key when exactly at its target).
        evictable: Whether a key may be evicted now.

    Returns:
        The victim, from the other list when the preferred one has no evictable key; ``None``
        when neither has one.
    """
    first, second = (t1, t2) if arc_prefers_t1(len(t1), target_t1, incoming_in_b2) else (t2, t1)
    key = first_evictable(first, evictable)
    return key if key is not None else first_evictable(second, evictable)


class ARCPolicy(EvictionPolicy):
    """ARC over the tier's readable keys; ``num_slots`` sizes the ghost lists."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.target_t1 = 0.0
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._incoming_in_b2 = False

    def state(self) -> dict[str, float]:
        return {
            "target_t1": self.target_t1,
            "t1": len(self._t1),
            "t2": len(self._t2),
            "b1": len(self._b1),
            "b2": len(self._b2),
        }

    def admit(self, key: BlockKey, parent: BlockKey | None) -> bool:
        # ARC adapts on the miss, before choosing the victim that makes room for ``key``.
        self._incoming_in_b2 = key in self._b2
        if self._incoming_in_b2 or key in self._b1:
            self.target_t1 = adapted_target_t1(
                self.target_t1,
                self.num_slots,
                len(self._b1),
                len(self._b2),
                in_b1=key in self._b1,
                toward_t2=self._incoming_in_b2,
            )
        return True

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._b1:
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def accessed(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def removed(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        if len(self._t1) + len(self._b1) > self.num_slots and self._b1:
            self._b1.popitem(last=False)
        total = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)
        if total > 2 * self.num_slots and self._b2:
            self._b2.popitem(last=False)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        return arc_victim(self._t1, self._t2, self.target_t1, self._incoming_in_b2, evictable)


class ARCShadow:
    """ARC over keys alone, without slots, to count what ARC would hit on a sample of keys.

    The lists, target and ghost rules of :class:`ARCPolicy`, replayed in one call per use (a
    policy comparing rules on a sample of its keys calls it often). With ``history_size`` above
    0, keys that fall off the ghost lists are remembered that much longer, and one used again
    while remembered goes to ``t2`` and moves the target as a hit in ``b2`` does (the long
    memory of :mod:`kvtier.index.prefix_arc`).
    """

    def __init__(self, num_keys: int, history_size: int = 0) -> None:
        if num_keys <= 0:
            raise ValueError(f"an ARC shadow needs room for at least one key, got {num_keys}")
        self.num_keys = num_keys
        self.history_size = history_size
        self.target_t1 = 0.0
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._history: OrderedDict[BlockKey, None] = OrderedDict()

    def reference(self, key: BlockKey) -> bool:
        """Replay one use of ``key``; return whether ARC holding ``num_keys`` keys hit it."""
        t1, t2 = self._t1, self._t2
        if key in t2:
            t2.move_to_end(key)
            return True
        if key in t1:
            del t1[key]
            t2[key] = None
            return True
        b1, b2, history, num_keys = self._b1, self._b2, self._history, self.num_keys
        in_b1 = key in b1
        in_b2 = not in_b1 and key in b2
        remembered = in_b1 or in_b2 or key in history
        if remembered:
            self.target_t1 = adapted_target_t1(
                self.target_t1, num_keys, len(b1), len(b2), in_b1=in_b1, toward_t2=not in_b1
            )
        if len(t1) + len(t2) >= num_keys:
            # No key is pinned here: the victim is the oldest of the list ARC takes it from.
            if arc_prefers_t1(len(t1), self.target_t1, in_b2) or not t2:
                b1[t1.popitem(last=False)[0]] = None
            else:
                b2[t2.popitem(last=False)[0]] = None
            if len(t1) + len(b1) > num_keys and b1:
                history[b1.popitem(last=False)[0]] = None
            if len(t1) + len(t2) + len(b1) + len(b2) > 2 * num_keys and b2:
                history[b2.popitem(last=False)[0]] = None
            while len(history) > self.history_size:
                history.popitem(last=False)
        if not remembered:
            # Making room only moves keys that were already remembered.
            t1[key] = None
            return False
        if key in b1:
            del b1[key]
        elif key in b2:
            del b2[key]
        elif key in history:
            del history[key]
        else:
            t1[key] = None
            return False
        t2[key] = None
        return False


def build(config: ARCConfig, num_slots: int) -> ARCPolicy:
    """The ``arc`` policy's factory."""
    return ARCPolicy(num_slots)
