"""The Belady bound: an eviction policy that knows the future (farthest next use goes first).

It runs inside the same :class:`~kvtier.index.PolicyIndex` as the real policies
and is replayed through the same offload manager, so it obeys the same slots,
pins, prefix lookups and manager rules; only its knowledge differs. Before each
request the simulator tells it when each of the request's blocks is used next.
It never admits a block that is not used again, nor one used later than every
block it would have to evict, and it evicts the block whose next use is farthest
away. That is optimal for a cache of independent blocks; for prefix
chains it is a close, commonly used upper reference, not a proof of optimality.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from kvtier.index.base import BlockKey
from kvtier.index.policy import EvictionPolicy, PolicyIndex
from kvtier.keys import KeyNamespace
from kvtier.simulator.traces import TraceRequest

NEVER = math.inf


def next_uses(requests: Sequence[TraceRequest]) -> list[list[float]]:
    """For each request and each of its blocks, the position of the next request using it."""
    upcoming: dict[BlockKey, float] = {}
    result: list[list[float]] = [[] for _ in requests]
    for position in range(len(requests) - 1, -1, -1):
        keys = requests[position].keys
        result[position] = [upcoming.get(key, NEVER) for key in keys]
        for key in keys:
            upcoming[key] = position
    return result


class BeladyPolicy(EvictionPolicy):
    """Farthest-next-use eviction with bypass, fed by :meth:`foresee` before each request."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._next_use: dict[BlockKey, float] = {}
        self._present: dict[BlockKey, float] = {}
        # Max-heap of (-next use, key); an entry is stale once the key's next use changed.
        self._heap: list[tuple[float, BlockKey]] = []
        self._declined: BlockKey | None = None

    def foresee(self, keys: Sequence[BlockKey], uses: Sequence[float]) -> None:
        """Record that ``keys`` are in use now and are next used at ``uses``."""
        present = self._present
        for key, use in zip(keys, uses, strict=True):
            self._next_use[key] = use
            if key in present:
                present[key] = use
                heapq.heappush(self._heap, (-use, key))

    def _farthest(self) -> tuple[float, BlockKey] | None:
        heap, present = self._heap, self._present
        while heap:
            use, key = heap[0]
            if present.get(key) == -use:
                return -use, key
            heapq.heappop(heap)
        return None

    def admit(self, key: BlockKey, parent: BlockKey | None) -> bool:
        use = self._next_use.get(key, NEVER)
        declined = use == NEVER or (parent is not None and parent == self._declined)
        if not declined and len(self._present) >= self.num_slots:
            farthest = self._farthest()
            declined = farthest is not None and use >= farthest[0]
        self._declined = key if declined else None
        return not declined

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        use = self._next_use.get(key, NEVER)
        self._present[key] = use
        heapq.heappush(self._heap, (-use, key))

    def accessed(self, key: BlockKey) -> None:
        """Next uses arrive through :meth:`foresee`; a hit itself changes nothing."""

    def removed(self, key: BlockKey) -> None:
        del self._present[key]

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        skipped = []
        chosen = None
        while (farthest := self._farthest()) is not None:
            entry = heapq.heappop(self._heap)
            if evictable(farthest[1]):
                chosen = farthest[1]
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return chosen


def belady_index(
    requests: Sequence[TraceRequest], num_slots: int, namespace: KeyNamespace
) -> tuple[PolicyIndex, Callable[[int], None]]:
    """A Belady index for ``requests`` and the hook that feeds it before each request.

    Args:
        requests: The trace to be replayed.
        num_slots: The tier's size in blocks.
        namespace: The namespace the replay's manager turns trace keys into index keys with.
    """
    policy = BeladyPolicy(num_slots)
    uses = next_uses(requests)

    def before_request(position: int) -> None:
        policy.foresee(namespace.keys(requests[position].keys), uses[position])

    return PolicyIndex(num_slots, policy), before_request
