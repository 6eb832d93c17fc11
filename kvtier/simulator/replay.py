"""Replay a trace through a real :class:`~kvtier.index.BlockIndex` the way the offload manager does.

For each request the tier is asked, in production order:

1. :meth:`~kvtier.index.BlockIndex.lookup` on the blocks the device cache
   missed: the readable prefix is a hit;
2. :meth:`~kvtier.index.BlockIndex.pin` and :meth:`~kvtier.index.BlockIndex.unpin`
   on the hit blocks (a load);
3. :meth:`~kvtier.index.BlockIndex.reserve` and
   :meth:`~kvtier.index.BlockIndex.commit` for the blocks to store.

Without a device cache every prompt block reaches the tier. With one (an LRU
prefix cache of ``device_blocks`` blocks that, like vLLM's, frees a request's
blocks tail first), the tier sees only the device's misses; device hits are
passed to :meth:`~kvtier.index.BlockIndex.touch`. In ``eager`` mode every
computed block is stored; in ``lazy`` mode a block is stored when the device
cache evicts it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtier.index.base import BlockIndex, BlockKey, EventKind
from kvtier.simulator.traces import TraceRequest

StoreMode = Literal["eager", "lazy"]


@dataclass(frozen=True)
class ReplayResult:
    """Counts from one replay of a trace through one tier."""

    policy: str
    capacity_blocks: int
    requests: int
    blocks: int
    """Prompt blocks requested, over all requests."""
    device_hits: int
    """Blocks served by the device cache (0 without one)."""
    tier_hits: int
    """Blocks loaded from the tier (its prefix hits)."""
    stored: int
    """Blocks written to the tier."""
    evicted: int
    """Blocks the tier evicted."""
    seconds: float
    """Wall time of the replay."""

    @property
    def hit_rate(self) -> float:
        """Fraction of all requested blocks the tier served."""
        return self.tier_hits / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counts plus ``hit_rate``, for JSON output."""
        return {**asdict(self), "hit_rate": self.hit_rate}


class DeviceCache:
    """An engine's device prefix cache: LRU over blocks, a request's blocks freed tail first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a device cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._order: OrderedDict[BlockKey, BlockKey | None] = OrderedDict()

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are cached."""
        hits = 0
        for key in keys:
            if key not in self._order:
                break
            hits += 1
        return hits

    def use(self, keys: Sequence[BlockKey]) -> list[tuple[BlockKey, BlockKey | None]]:
        """Record that a request used ``keys``; return the evicted ``(key, parent)`` pairs."""
        order = self._order
        parent = None
        for key in keys:
            order[key] = parent
            parent = key
        # Freed tail first, so the request's deepest block is the oldest of its chain.
        for key in reversed(keys):
            order.move_to_end(key)
        evicted = []
        while len(order) > self.num_blocks:
            evicted.append(order.popitem(last=False))
        return evicted


def replay(
    requests: Sequence[TraceRequest],
    index: BlockIndex,
    *,
    policy_name: str,
    device_blocks: int = 0,
    store_mode: StoreMode = "eager",
    before_request: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` through ``index`` and count hits, stores and evictions.

    Args:
        requests: The trace, in arrival order.
        index: The tier's block index, empty.
        policy_name: Name recorded in the result.
        device_blocks: Size of the device prefix cache in front of the tier; 0 for none.
        store_mode: ``"eager"`` stores every computed block, ``"lazy"`` stores
            blocks as the device cache evicts them (needs ``device_blocks > 0``).
        before_request: Called with each request's position before it is replayed.
        progress: Called with the number of requests replayed since the last call.

    Returns:
        The replay's counts.
    """
    if store_mode == "lazy" and device_blocks <= 0:
        raise ValueError(
            "lazy store mode stores blocks as the device cache evicts them; "
            "give the device cache a size (device_blocks > 0)"
        )
    device = DeviceCache(device_blocks) if device_blocks > 0 else None
    blocks = device_hits = tier_hits = stored = evicted = 0
    started = time.perf_counter()
    for position, request in enumerate(requests):
        if before_request is not None:
            before_request(position)
        keys = request.keys
        blocks += len(keys)
        on_device = 0
        if device is not None:
            on_device = device.lookup(keys)
            if on_device:
                index.touch(keys[:on_device])
            device_hits += on_device
        wanted = keys[on_device:]
        hits = index.lookup(wanted)
        if hits:
            loaded = wanted[:hits]
            index.pin(loaded)
            index.unpin(loaded)
            tier_hits += hits
        if store_mode == "eager" and hits < len(wanted):
            parent = keys[on_device + hits - 1] if on_device + hits else None
            stored += _store(index, wanted[hits:], parent)
        if device is not None:
            for key, parent in device.use(keys):
                if store_mode == "lazy":
                    stored += _store(index, (key,), parent)
        evicted += sum(1 for event in index.take_events() if event.kind is EventKind.EVICTED)
        if progress is not None:
            progress(1)
    return ReplayResult(
        policy=policy_name,
        capacity_blocks=index.num_slots,
        requests=len(requests),
        blocks=blocks,
        device_hits=device_hits,
        tier_hits=tier_hits,
        stored=stored,
        evicted=evicted,
        seconds=time.perf_counter() - started,
    )


def _store(index: BlockIndex, keys: Sequence[BlockKey], parent: BlockKey | None) -> int:
    slots = index.reserve(keys, parent)
    reserved = [key for key, slot in zip(keys, slots, strict=True) if slot is not None]
    if reserved:
        index.commit(reserved)
    return len(reserved)
