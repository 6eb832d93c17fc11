"""Replay a trace through a real :class:`~kvtier.offload.manager.OffloadManager` over a block index.

A simulated hit is a hit the manager would serve: each request is one
engine request, driven through an :class:`~kvtier.offload.session.OffloadSession`
over the manager as every engine drives it, with a worker side on which every
copy completes at once:

1. :meth:`~kvtier.offload.session.OffloadSession.lookup` past the device
   cache's own hit (the tier's longest readable prefix, never the prompt's
   last block: the engine computes at least one token), then
   :meth:`~kvtier.offload.session.OffloadSession.allocated` accepts it (device
   hits are touched in the tier's policy, the hit blocks pinned);
2. :meth:`~kvtier.offload.session.OffloadSession.scheduled` with the whole
   prompt computed;
3. :meth:`~kvtier.offload.session.OffloadSession.plan` (loads, and the
   stores the manager chooses), then every one of ``world_size`` ranks reports
   each batch done to :meth:`~kvtier.offload.session.OffloadSession.process`;
4. :meth:`~kvtier.offload.session.OffloadSession.finished`, and one more step
   while the manager holds the request.

Each trace block is one full block of the prompt, and the prompt ends at its
last block. Without a device cache every prompt block reaches the tier. With
one (an LRU prefix cache of ``device_blocks`` blocks that, like vLLM's, frees a
request's blocks tail first), the manager is told the device's hits. In
``eager`` mode the manager stores every computed block the tier lacks; in
``lazy`` mode it is offered, as lazy candidates, the blocks the device cache
evicts. Hits, stores and evictions are the manager's own counters.

With lower tiers (``lower_tiers``), each is a directory of the given capacity
(LRU) on the instant worker side: a host miss is looked up down the chain as
the manager plans it (a promotion; the lookup is asked again once the
promotion is reported), and every block the host tier evicts is written to
every lower tier, as the offload path writes them; with ``lower_writes="store"``
every block the host tier stores is written to every lower tier at once instead
(write-through). :attr:`ReplayResult.lower_hits` says how many of the tier
hits each lower tier supplied. :class:`EngineReplay` is one engine's side of
this, so a fleet of them can share lower tiers (:mod:`kvtier.simulator.fleet`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtier.index.base import BlockIndex, BlockKey
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace
from kvtier.offload.manager import OffloadManager
from kvtier.offload.messages import LazyCandidate, TransferPlan, WorkerReport
from kvtier.offload.session import OffloadSession
from kvtier.simulator.traces import TraceRequest

StoreMode = Literal["eager", "lazy"]
LowerWrites = Literal["eviction", "store"]
"""When blocks reach the lower tiers: as the host tier evicts them (what the offload path
does), or as soon as the host tier stores them (write-through; eager stores only)."""

REPLAY_NAMESPACE = KeyNamespace()
"""The namespace the replay's manager turns trace keys into index keys with."""


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
    lower_tiers: tuple[tuple[str, int], ...] = ()
    """The lower tiers replayed below the host tier: (name, capacity in blocks), in order."""
    lower_hits: tuple[tuple[str, int], ...] = ()
    """Of ``tier_hits``, the blocks each lower tier supplied (the rest came from host memory)."""
    state: tuple[dict[str, float], ...] = ()
    """The policy's own counters over the replay (``--trace-state``): each sample is
    ``{"request": position, counter: value, ...}``, taken before that request."""

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
    world_size: int = 1,
    before_request: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    lower_tiers: Sequence[tuple[str, int]] = (),
    lower_writes: LowerWrites = "eviction",
) -> ReplayResult:
    """Replay ``requests`` through an offload manager over ``index``; count hits, stores, evictions.

    Args:
        requests: The trace, in arrival order.
        index: The tier's block index, empty.
        policy_name: Name recorded in the result.
        device_blocks: Size of the device prefix cache in front of the tier; 0 for none.
        store_mode: ``"eager"`` stores every computed block, ``"lazy"`` stores
            blocks as the device cache evicts them (needs ``device_blocks > 0``).
        world_size: Ranks that each report every batch, as the manager's workers do.
        before_request: Called with each request's position before it is replayed.
        progress: Called with the number of requests replayed since the last call.
        lower_tiers: Tiers below the host tier, in lookup order: (name, capacity in blocks).
        lower_writes: When blocks are written to the lower tiers (see :data:`LowerWrites`).

    Returns:
        The replay's counts.
    """
    engine = EngineReplay(
        index,
        [LowerTier(name, capacity) for name, capacity in lower_tiers],
        device_blocks=device_blocks,
        store_mode=store_mode,
        world_size=world_size,
        lower_writes=lower_writes,
    )
    started = time.perf_counter()
    for position, request in enumerate(requests):
        if before_request is not None:
            before_request(position)
        engine.serve(position, request)
        if progress is not None:
            progress(1)
    return engine.result(policy_name, time.perf_counter() - started)


class EngineReplay:
    """One engine's replay: its offload manager over its host tier's index, its device cache.

    The lower tiers are given, so several engines can share them (see
    :mod:`kvtier.simulator.fleet`); :meth:`serve` replays one request.
    """

    def __init__(
        self,
        index: BlockIndex,
        lower_tiers: Sequence[LowerTier] = (),
        *,
        device_blocks: int = 0,
        store_mode: StoreMode = "eager",
        world_size: int = 1,
        lower_writes: LowerWrites = "eviction",
    ) -> None:
        if store_mode == "lazy" and device_blocks <= 0:
            raise ValueError(
                "lazy store mode stores blocks as the device cache evicts them; "
                "give the device cache a size (device_blocks > 0)"
            )
        if lower_writes == "store" and store_mode != "eager":
            raise ValueError("writing lower tiers on store needs eager stores")
        self.device = DeviceCache(device_blocks) if device_blocks > 0 else None
        self.store_mode = store_mode
        # One token stands for one block: the manager only ever counts whole blocks.
        self.manager = OffloadManager(
            index,
            block_tokens=1,
            record_bytes=1,
            world_size=world_size,
            store_mode=store_mode,
            namespace=REPLAY_NAMESPACE,
            write_policies=("write_back",) * len(lower_tiers),
        )
        self.session = OffloadSession(self.manager)
        self.index = index
        self.chain = list(lower_tiers)
        self.requests = 0
        self.blocks = 0
        self.device_hits = 0
        self.lower_writes = lower_writes

    def serve(self, position: int, request: TraceRequest) -> None:
        """Replay ``request``, the trace's ``position``-th, from lookup to finish."""
        session, device, chain = self.session, self.device, self.chain
        keys = request.keys
        # One request at a time, finished before the next: every store in these steps is its.
        written_on_store = keys if self.lower_writes == "store" else None
        request_id = str(position)
        num_blocks = len(keys)
        self.requests += 1
        self.blocks += num_blocks
        on_device = device.lookup(keys) if device is not None else 0
        self.device_hits += on_device
        block_ids = [range(num_blocks)]
        hits, _ = session.lookup(request_id, keys, on_device, num_blocks)
        for _ in range(2):
            if hits is not None:
                break
            # a promotion: the instant workers answer its probe in the next step, its read in
            # the one after
            _step(session, (), chain, written_on_store)
            hits, _ = session.lookup(request_id, keys, on_device, num_blocks)
        assert hits is not None, "an instant promotion is answered in two steps"
        session.allocated(request_id, keys, block_ids, hits)
        session.scheduled(request_id, num_computed_tokens=num_blocks, new_block_ids=block_ids)
        candidates: list[LazyCandidate] = []
        if device is not None:
            evicted = device.use(keys)
            if self.store_mode == "lazy":
                candidates = [LazyCandidate(key, 0, 0) for key, _ in evicted]
        _step(session, candidates, chain, written_on_store)
        if session.finished(request_id, num_blocks):
            _step(session, (), chain, written_on_store)

    def result(self, policy_name: str, seconds: float) -> ReplayResult:
        """The counts so far, with the lower tiers' (shared ones: every engine's) hits."""
        stats = self.manager.stats()
        return ReplayResult(
            policy=policy_name,
            capacity_blocks=self.index.num_slots,
            requests=self.requests,
            blocks=self.blocks,
            device_hits=self.device_hits,
            tier_hits=stats.loaded_blocks,
            stored=stats.stored_blocks,
            evicted=stats.evicted_blocks,
            seconds=seconds,
            lower_tiers=tuple((tier.name, tier.capacity) for tier in self.chain),
            lower_hits=tuple((tier.name, tier.served) for tier in self.chain),
        )


class LowerTier:
    """A lower tier's directory on the instant worker side: which keys it holds, LRU.

    Counts the blocks it served (:attr:`served`) and the blocks written to it
    (:attr:`written`: every demotion, held before or not, as the tiers write them).
    """

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.index = PolicyIndex(capacity, LRUPolicy())
        self.served = 0
        self.written = 0

    def holds(self, key: BlockKey) -> bool:
        if not self.index.lookup([key]):
            return False
        self.index.touch([key])
        return True

    def put(self, key: BlockKey) -> None:
        self.written += 1
        if self.index.reserve([key])[0] is not None:
            self.index.commit([key])
        self.index.take_events()


def _step(
    session: OffloadSession,
    candidates: Sequence[LazyCandidate],
    chain: Sequence[LowerTier],
    written_on_store: Sequence[BlockKey] | None = None,
) -> None:
    """One engine step: plan, and every rank reports every copy done at once."""
    plan = session.plan(candidates)
    world_size = session.manager.world_size
    session.process(_instant_reports(plan, world_size, chain, written_on_store))


def _instant_reports(
    plan: TransferPlan,
    world_size: int,
    chain: Sequence[LowerTier],
    written_on_store: Sequence[BlockKey] | None = None,
) -> list[WorkerReport]:
    """Each rank's report of ``plan`` on a worker side where every copy completes at once.

    With ``written_on_store`` (the trace keys of the request being replayed, whose device
    block ``i`` holds key ``i``), the blocks stored to the host tier are written to every
    lower tier at once, and demotions are not written again.
    """
    done = {transfer.batch_id: 1 for transfer in (*plan.stores, *plan.loads)}
    if written_on_store is None:
        for demotion in plan.demotions:
            for block_hash in demotion.block_hashes:
                for tier in chain:
                    tier.put(REPLAY_NAMESPACE.key(block_hash, demotion.group))
    else:
        for store in plan.stores:
            for block in store.device_blocks:
                for tier in chain:
                    tier.put(REPLAY_NAMESPACE.key(written_on_store[block], store.group))
    promoted = {}
    for promotion in plan.promotions:
        keys = REPLAY_NAMESPACE.keys(promotion.block_hashes, promotion.group)
        found = 0
        for tier in chain:
            start = found
            while found < len(keys) and tier.holds(keys[found]):
                found += 1
            if promotion.host_slots:  # a read, not a probe
                tier.served += found - start
        promoted[promotion.batch_id] = (1, found)
    return [WorkerReport(done=done, promoted=promoted) for _ in range(world_size)]
