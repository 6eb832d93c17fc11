"""A fleet of engines replayed over shared lower tiers: hits by source, shared traffic, sizing.

Each engine has its own offload manager over its own host tier (and its own
device cache, with ``device_blocks``), replayed exactly as
:func:`kvtier.simulator.replay.replay` replays one engine; the tiers below the
host tier are shared: one directory per configured lower tier, which every
engine's demotions write to and every engine's host misses are looked up in.
Requests are replayed in trace order, each on the engine the routing picks:

- ``round_robin``: request ``i`` goes to engine ``i mod N``;
- ``prefix_affinity``: a request goes to the engine its first block key
  hashes to (BLAKE2b of the key, modulo N), so every request of a prefix
  lands where that prefix was served before.

:func:`replay_fleet` returns a :class:`FleetResult`; :func:`size_shared_tier`
searches the smallest capacity of the deepest shared tier whose hit rate
reaches a fraction of what an unbounded one reaches.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tqdm import tqdm

from kvtier.index.base import BlockIndex
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry
from kvtier.simulator.policies import PolicySpec
from kvtier.simulator.replay import EngineReplay, LowerTier, LowerWrites, StoreMode
from kvtier.simulator.tiers import LowerChain
from kvtier.simulator.traces import TraceRequest

logger = logging.getLogger(__name__)

Routing = Literal["round_robin", "prefix_affinity"]
ROUTINGS: tuple[Routing, ...] = ("round_robin", "prefix_affinity")

SIZING_PRECISION = 0.05
"""The capacity search stops when the capacity that reaches the target is within this
fraction of the largest one replayed that does not."""


@dataclass(frozen=True)
class FleetResult:
    """Counts from one replay of a trace across a fleet of engines over shared tiers."""

    engines: int
    routing: str
    policy: str
    host_blocks: int
    """Host tier size of each engine, in blocks."""
    shared_tiers: tuple[tuple[str, int], ...]
    """The shared tiers below the host tiers: (name, capacity in blocks), in lookup order."""
    lower_writes: str
    """When the shared tiers were written: ``"eviction"`` or ``"store"``."""
    requests: int
    blocks: int
    """Prompt blocks requested, over all requests."""
    device_hits: int
    """Blocks served by the engines' device caches (0 without them)."""
    host_hits: int
    """Blocks loaded from the engines' own host tiers."""
    shared_hits: tuple[tuple[str, int], ...]
    """Blocks each shared tier supplied, promoted through a host tier."""
    shared_written: tuple[tuple[str, int], ...]
    """Blocks written to each shared tier (every demotion from any host tier)."""
    stored: int
    """Blocks written to the host tiers."""
    evicted: int
    """Blocks the host tiers evicted."""
    busiest_engine_requests: int
    """Requests replayed on the engine the routing gave the most."""
    seconds: float
    """Wall time of the replay."""

    @property
    def hit_rate(self) -> float:
        """Fraction of all requested blocks the host and shared tiers served (device hits apart)."""
        served = self.host_hits + sum(blocks for _, blocks in self.shared_hits)
        return served / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counts plus ``hit_rate``, for JSON output."""
        return {**asdict(self), "hit_rate": self.hit_rate}


def route(routing: Routing, engines: int) -> Callable[[int, TraceRequest], int]:
    """The routing's choice of engine for the request at a position of the trace.

    Raises:
        ValueError: ``routing`` is not one of :data:`ROUTINGS`.
    """
    if routing == "round_robin":
        return lambda position, request: position % engines
    if routing == "prefix_affinity":

        def by_prefix(position: int, request: TraceRequest) -> int:
            if not request.keys:
                return position % engines
            digest = hashlib.blake2b(request.keys[0], digest_size=8).digest()
            return int.from_bytes(digest, "big") % engines

        return by_prefix
    raise ValueError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")


def replay_fleet(
    requests: Sequence[TraceRequest],
    build_index: Callable[[int], BlockIndex],
    *,
    engines: int,
    routing: Routing,
    host_blocks: int,
    shared_tiers: Sequence[tuple[str, int]],
    policy_name: str,
    device_blocks: int = 0,
    store_mode: StoreMode = "eager",
    lower_writes: LowerWrites = "eviction",
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Replay ``requests`` across ``engines`` engines, each with its own host tier.

    Args:
        requests: The trace, in arrival order.
        build_index: Builds one engine's host tier index of the given number of slots.
        engines: How many engines serve the trace.
        routing: Which engine serves each request (see :func:`route`).
        host_blocks: Each engine's host tier size in blocks.
        shared_tiers: The tiers below the host tiers, every engine's alike, in lookup
            order: (name, capacity in blocks).
        policy_name: Name recorded in the result.
        device_blocks: Size of each engine's device prefix cache; 0 for none.
        store_mode: ``"eager"`` or ``"lazy"`` (see :func:`kvtier.simulator.replay.replay`).
        lower_writes: When the shared tiers are written: as a host tier evicts a block, or
            as it stores one (see :data:`kvtier.simulator.replay.LowerWrites`).
        progress: Called with the number of requests replayed since the last call.

    Returns:
        The fleet's counts, summed over the engines.
    """
    if engines <= 0:
        raise ValueError(f"a fleet needs at least one engine, got {engines}")
    chain = [LowerTier(name, capacity) for name, capacity in shared_tiers]
    fleet = [
        EngineReplay(
            build_index(host_blocks),
            chain,
            device_blocks=device_blocks,
            store_mode=store_mode,
            lower_writes=lower_writes,
        )
        for _ in range(engines)
    ]
    pick = route(routing, engines)
    started = time.perf_counter()
    for position, request in enumerate(requests):
        fleet[pick(position, request)].serve(position, request)
        if progress is not None:
            progress(1)
    seconds = time.perf_counter() - started
    results = [engine.result(policy_name, seconds) for engine in fleet]
    from_shared = sum(tier.served for tier in chain)
    return FleetResult(
        engines=engines,
        routing=routing,
        policy=policy_name,
        host_blocks=host_blocks,
        shared_tiers=tuple((tier.name, tier.capacity) for tier in chain),
        lower_writes=lower_writes,
        requests=len(requests),
        blocks=sum(result.blocks for result in results),
        device_hits=sum(result.device_hits for result in results),
        host_hits=sum(result.tier_hits for result in results) - from_shared,
        shared_hits=tuple((tier.name, tier.served) for tier in chain),
        shared_written=tuple((tier.name, tier.written) for tier in chain),
        stored=sum(result.stored for result in results),
        evicted=sum(result.evicted for result in results),
        busiest_engine_requests=max(result.requests for result in results),
        seconds=seconds,
    )


@dataclass(frozen=True)
class SharedSizing:
    """The smallest capacity of the deepest shared tier that reaches a fraction of unbounded."""

    tier: str
    """The shared tier whose capacity was searched (the last of the chain)."""
    target_fraction: float
    unbounded_hit_rate: float
    """Hit rate with that tier holding every block of the trace (it never evicts)."""
    capacity_blocks: int
    """The smallest capacity replayed whose hit rate reached the target."""
    hit_rate: float
    """The hit rate at ``capacity_blocks``."""
    replays: tuple[tuple[int, float], ...]
    """Every (capacity, hit rate) replayed, in search order."""

    def as_dict(self) -> dict[str, Any]:
        """The search's outcome, for JSON output."""
        return asdict(self)


def size_shared_tier(
    replay_at: Callable[[int], float],
    unbounded_blocks: int,
    tier: str,
    target_fraction: float,
    precision: float = SIZING_PRECISION,
) -> SharedSizing:
    """Search, on a log scale, the smallest capacity whose hit rate reaches ``target_fraction``.

    Args:
        replay_at: The fleet's hit rate with the searched tier at a capacity in blocks.
        unbounded_blocks: A capacity that never evicts (the trace's distinct blocks).
        tier: Name of the searched tier, for the result.
        target_fraction: Fraction of the unbounded hit rate to reach, in (0, 1].
        precision: Stop when the answer is within this fraction of a capacity that misses.

    Returns:
        The capacity found with every replay made on the way. The search assumes the
        hit rate grows with the capacity, as it does for the LRU shared tier replayed.
    """
    if not 0 < target_fraction <= 1:
        raise ValueError(f"the target is a fraction in (0, 1], got {target_fraction}")
    unbounded = replay_at(unbounded_blocks)
    target = target_fraction * unbounded
    replays = [(unbounded_blocks, unbounded)]
    low, high, at_high = 0, unbounded_blocks, unbounded
    while high - low > 1 and high > low * (1 + precision):
        middle = min(max(round(math.sqrt(max(low, 1) * high)), low + 1), high - 1)
        rate = replay_at(middle)
        replays.append((middle, rate))
        if rate >= target:
            high, at_high = middle, rate
        else:
            low = middle
    return SharedSizing(
        tier=tier,
        target_fraction=target_fraction,
        unbounded_hit_rate=unbounded,
        capacity_blocks=high,
        hit_rate=at_high,
        replays=tuple(replays),
    )


def fleet_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... up to ``largest``, and ``largest`` itself when it is not a power of two."""
    sizes = [1 << power for power in range(largest.bit_length()) if 1 << power <= largest]
    return sizes if sizes[-1] == largest else [*sizes, largest]


@dataclass(frozen=True)
class FleetRun:
    """One fleet replay, with the shared tier's sizing search when one was asked for."""

    result: FleetResult
    sizing: SharedSizing | None


def simulate_fleet(
    requests: Sequence[TraceRequest],
    policy: PolicySpec,
    host_capacities: Sequence[int],
    shared_chains: Sequence[LowerChain],
    engines: Sequence[int],
    routings: Sequence[Routing],
    *,
    device_blocks: int = 0,
    store_mode: StoreMode = "eager",
    lower_writes: LowerWrites = "eviction",
    target_fraction: float | None = None,
    show_progress: bool = False,
) -> list[FleetRun]:
    """Replay ``requests`` across each fleet size, routing, host capacity and shared chain.

    Args:
        requests: The trace.
        policy: The host tiers' eviction policy, built through the plugin registry.
        host_capacities: Each engine's host tier sizes to replay, in blocks.
        shared_chains: Shared tiers to replay below the host tiers, one chain at a time;
            each needs at least one tier.
        engines: Fleet sizes.
        routings: Routings (see :func:`route`).
        device_blocks: Size of each engine's device prefix cache; 0 for none.
        store_mode: ``"eager"`` or ``"lazy"``.
        lower_writes: When the shared tiers are written (see :func:`replay_fleet`).
        target_fraction: With a value, also search the smallest capacity of each
            chain's last tier that reaches this fraction of an unbounded one's hit
            rate (see :func:`size_shared_tier`).
        show_progress: Draw a progress bar on stderr.

    Returns:
        One run per (fleet size, routing, host capacity, chain), in that nesting order.
    """
    if any(not chain for chain in shared_chains):
        raise ValueError("a fleet replay needs at least one shared tier below the host tiers")
    registry = default_registry()
    unbounded = len({key for request in requests for key in request.keys})

    def build_index(slots: int) -> BlockIndex:
        return registry.build(BLOCK_INDEX, policy.config, slots)

    runs = []
    with tqdm(desc="fleet replay", unit="req", file=sys.stderr, disable=not show_progress) as bar:
        for size, routing, host, chain in itertools.product(
            engines, routings, host_capacities, shared_chains
        ):
            replay_with = functools.partial(
                replay_fleet,
                requests,
                build_index,
                engines=size,
                routing=routing,
                host_blocks=host,
                policy_name=policy.label,
                device_blocks=device_blocks,
                store_mode=store_mode,
                lower_writes=lower_writes,
                progress=bar.update,
            )
            result = replay_with(shared_tiers=chain)
            logger.info(
                "%d engines, %s, host %d: hit rate %.4f", size, routing, host, result.hit_rate
            )
            sizing = None
            if target_fraction is not None:
                name = chain[-1][0]
                sizing = size_shared_tier(
                    _with_last_tier_at(replay_with, chain), unbounded, name, target_fraction
                )
                logger.info(
                    "%d engines, %s: %s of %d blocks reaches %.4f (%.0f%% of %.4f)",
                    size,
                    routing,
                    name,
                    sizing.capacity_blocks,
                    sizing.hit_rate,
                    100 * target_fraction,
                    sizing.unbounded_hit_rate,
                )
            runs.append(FleetRun(result, sizing))
    return runs


def _with_last_tier_at(
    replay_with: Callable[..., FleetResult], chain: LowerChain
) -> Callable[[int], float]:
    """The hit rate of ``replay_with`` over ``chain`` with its last tier at a given capacity."""
    *upper, (name, _) = chain

    def rate(capacity: int) -> float:
        return replay_with(shared_tiers=(*upper, (name, capacity))).hit_rate

    return rate
