"""Trace replay: requests replayed through the offload manager, policy by policy.

Every policy is built through the plugin registry exactly as the offload
manager builds it, and replayed through an :class:`~kvtier.offload.manager.OffloadManager`
at each capacity (see :mod:`kvtier.simulator.replay`); the Belady (farthest next
use) bound is replayed alongside. :func:`simulate` returns the prefix hit rate
of each policy at each capacity with the blocks stored, loaded and evicted;
:mod:`kvtier.simulator.report` turns them into a table, JSON or a plot, and
``kvtier simulate`` (:mod:`kvtier.cli.simulate`) runs it from the command line.
:mod:`kvtier.simulator.fleet` replays a trace across a fleet of engines over
shared lower tiers and sizes the shared tier.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
from collections.abc import Callable, Sequence

from tqdm import tqdm

from kvtier.index.base import BlockIndex
from kvtier.index.policy import PolicyIndex
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry
from kvtier.simulator.belady import belady_index
from kvtier.simulator.policies import PolicySpec, parse_policy
from kvtier.simulator.replay import REPLAY_NAMESPACE, LowerWrites, ReplayResult, replay
from kvtier.simulator.report import BELADY
from kvtier.simulator.tiers import LowerChain
from kvtier.simulator.traces import TraceRequest

logger = logging.getLogger(__name__)

__all__ = ["simulate"]


def simulate(
    requests: Sequence[TraceRequest],
    policies: Sequence[str | PolicySpec],
    capacities: Sequence[int],
    *,
    belady: bool = True,
    device_blocks: int = 0,
    store_mode: str = "eager",
    show_progress: bool = False,
    lower_chains: Sequence[LowerChain] = ((),),
    lower_writes: LowerWrites = "eviction",
    state_every: int = 0,
) -> list[ReplayResult]:
    """Replay ``requests`` once per policy and capacity (plus the Belady bound).

    Args:
        requests: The trace.
        policies: Registered block-index names, each built from its default config,
            ``NAME:KEY=VALUE`` specs with settings changed (see :func:`parse_policy`),
            or :class:`PolicySpec` objects (e.g. from :func:`read_policy_file`).
        capacities: Tier sizes in blocks.
        belady: Whether to replay the Belady bound too (named ``"belady"`` in the results).
        device_blocks: Size of a device prefix cache in front of the tier; 0 for none.
        store_mode: ``"eager"`` or ``"lazy"`` (see :func:`kvtier.simulator.replay.replay`).
        show_progress: Draw a progress bar on stderr.
        lower_chains: Tiers below the host tier to replay each capacity over, one
            chain at a time (see :mod:`kvtier.simulator.tiers`); ``((),)`` for none.
        lower_writes: When the lower tiers are written: as the host tier evicts a block,
            or as it stores one (see :data:`kvtier.simulator.replay.LowerWrites`).
        state_every: Sample each policy's :meth:`~kvtier.index.EvictionPolicy.state`
            every this many requests into :attr:`ReplayResult.state`; 0 for never.

    Returns:
        One result per (capacity, lower chain, policy), capacities in the given order.
    """
    registry = default_registry()
    specs = [parse_policy(p) if isinstance(p, str) else p for p in policies]
    names: list[PolicySpec | None] = [*specs, *([None] if belady else [])]
    results = []
    with tqdm(
        total=len(requests) * len(names) * len(capacities) * len(lower_chains),
        desc="replay",
        unit="req",
        file=sys.stderr,
        disable=not show_progress,
    ) as bar:
        for capacity, chain in itertools.product(capacities, lower_chains):
            for spec in names:
                hook: Callable[[int], None] | None = None
                samples: list[dict[str, float]] = []
                tracked: PolicyIndex | None = None
                if spec is None:
                    index: BlockIndex
                    index, hook = belady_index(requests, capacity, REPLAY_NAMESPACE)
                    label = BELADY
                else:
                    index = registry.build(BLOCK_INDEX, spec.config, capacity)
                    label = spec.label
                    if state_every and isinstance(index, PolicyIndex):
                        tracked = index
                        hook = _state_sampler(index, state_every, samples)
                result = replay(
                    requests,
                    index,
                    policy_name=label,
                    device_blocks=device_blocks,
                    store_mode=store_mode,  # type: ignore[arg-type]
                    before_request=hook,
                    progress=bar.update,
                    lower_tiers=chain,
                    lower_writes=lower_writes,
                )
                if tracked is not None:
                    samples.append({"request": len(requests), **tracked.policy.state()})
                    result = dataclasses.replace(result, state=tuple(samples))
                logger.info("%s at %d blocks: hit rate %.4f", label, capacity, result.hit_rate)
                results.append(result)
    return results


def _state_sampler(
    index: PolicyIndex, every: int, samples: list[dict[str, float]]
) -> Callable[[int], None]:
    def sample(position: int) -> None:
        if position % every == 0:
            samples.append({"request": position, **index.policy.state()})

    return sample
