"""Owns the scheduler side's counters and measurements, and the records they are handed out in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.offload.failures import FailureCause


@dataclass(frozen=True)
class OffloadStats:
    """Cumulative counters and current usage of the host tier, for metrics.

    Byte counters count every rank's shard (``blocks * record_bytes * world_size``).
    Every field defaults to 0: ``OffloadStats()`` is "nothing yet".
    """

    num_slots: int = 0
    """Slots in the host tier (per rank; every rank has the same slots)."""
    used_slots: int = 0
    """Slots holding a readable block or one being written."""
    hit_tokens: int = 0
    """Tokens the engine accepted from the tier (loads planned)."""
    stored_blocks: int = 0
    """Blocks whose stores completed on every worker."""
    stored_bytes: int = 0
    """Bytes of those blocks, all ranks together."""
    loaded_blocks: int = 0
    """Blocks whose loads completed on every worker."""
    same_step_loaded_blocks: int = 0
    """Of ``loaded_blocks``, those loaded in the step that ran their request."""
    loaded_bytes: int = 0
    """Bytes of those blocks, all ranks together."""
    evicted_blocks: int = 0
    """Blocks evicted from the tier to make room (or by :meth:`OffloadManager.reset`)."""
    failed_stores: int = 0
    """Blocks whose store failed, timed out or was abandoned on some worker (they were dropped)."""
    failed_loads: int = 0
    """Blocks whose load failed, timed out or could not be started (recomputed)."""
    abandoned_copies: int = 0
    """Copies a worker stopped waiting for (past its copy deadline, or after a backend error)."""
    expired_batches: int = 0
    """Batches failed because some worker did not report them within the report deadline."""
    rejected_reports: int = 0
    """Worker report entries rejected as impossible (and ignored)."""
    quarantined_slots: int = 0
    """Slots kept out of use because an abandoned or unreported copy may still write them."""
    promoted_blocks: int = 0
    """Blocks read from the lower tiers into the host tier on every worker."""
    demoted_blocks: int = 0
    """Blocks evicted from the host tier and handed to workers to write to the lower tiers."""
    expired_promotions: int = 0
    """Promotions some worker did not report within the report deadline (their lookups missed)."""
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per lower tier, the workers' counters added up (``TierStats`` field names, and
    ``errors.<cause>`` per fault); empty without lower tiers."""
    failures: Mapping[FailureCause, int] = field(default_factory=dict)
    """Failures the manager detected, by cause (the workers count theirs)."""


@dataclass
class Observations:
    """Measurements of single events since the last :meth:`OffloadManager.take_observations`.

    Only kept with ``record_observations``; an engine integration turns them into histograms.
    """

    load_seconds: list[float] = field(default_factory=list)
    """Per load batch that completed on every worker: seconds from its planning to then."""
    store_seconds: list[float] = field(default_factory=list)
    """Per store batch that completed on every worker: seconds from its planning to then."""
    load_blocks: list[int] = field(default_factory=list)
    """Blocks of each load batch planned."""
    store_blocks: list[int] = field(default_factory=list)
    """Blocks of each store batch planned."""
    request_hit_tokens: list[int] = field(default_factory=list)
    """Per request, at its first allocation: the tokens it accepted from the tier (0 for
    none). A preempted request that starts over is counted again."""


class Counters:
    """The manager's cumulative counters, its measurements and the workers' tier counts."""

    def __init__(self, *, record_observations: bool) -> None:
        self.values: dict[str, int] = {}
        self.record_observations = record_observations
        self.observations = Observations()
        self.tiers: dict[str, dict[str, int]] = {}

    def add(self, name: str, count: int) -> None:
        self.values[name] = self.values.get(name, 0) + count

    def observe(self, into: list[Any], value: float) -> None:
        if self.record_observations:
            into.append(value)

    def add_tier_counts(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        for name, grown in counts.items():
            totals = self.tiers.setdefault(name, {})
            for counter, value in grown.items():
                totals[counter] = totals.get(counter, 0) + value

    def take_observations(self) -> Observations:
        observations, self.observations = self.observations, Observations()
        return observations
