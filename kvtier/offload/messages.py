"""Messages between the scheduler-side manager and the worker side: small, typed, picklable.

One :class:`TransferPlan` goes down each engine step (scheduler to every
worker) and one :class:`WorkerReport` comes back (each worker to the
scheduler). Both hold only ints, strings, tuples and dicts, so they cross
process boundaries with plain pickle. Batch ids are unique and increasing over
the manager's lifetime; loads and stores share one id space.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from kvtier.copy.base import Direction
from kvtier.tiers.chain import TierBlock


@dataclass(frozen=True)
class Transfer:
    """One batch of block copies in one kv-cache group and one direction.

    A store copies ``device_blocks[i]`` into ``host_slots[i]``; a load copies
    ``host_slots[i]`` into ``device_blocks[i]``.
    """

    batch_id: int
    """Unique id of this batch; workers report completions by it."""
    direction: Direction
    """Store (device to host) or load (host to device)."""
    group: int
    """The kv-cache group whose device block ids these are."""
    device_blocks: tuple[int, ...]
    """Engine block ids, in the group's block-id space."""
    host_slots: tuple[int, ...]
    """Host tier slots, one per device block."""
    request_id: str | None = None
    """The request a load is for (workers report finished loads by request); ``None`` for stores."""
    block_hashes: tuple[bytes, ...] = ()
    """For a store, when some lower tier is written back or through: the engine's hashes of
    the blocks, so that a worker closing gracefully can write those still in their slots to
    the tiers that lack them. Empty otherwise."""
    salts: tuple[bytes | None, ...] = ()
    """With ``block_hashes``, when some of the blocks are of salted requests: each block's
    tenant salt (``None`` for none), so that the close writes them sealed for their tenant."""

    def __post_init__(self) -> None:
        if len(self.device_blocks) != len(self.host_slots):
            raise ValueError(
                f"transfer {self.batch_id} pairs {len(self.device_blocks)} device blocks "
                f"with {len(self.host_slots)} host slots; they must be equal"
            )
        if self.block_hashes and len(self.block_hashes) != len(self.host_slots):
            raise ValueError(
                f"transfer {self.batch_id} names {len(self.block_hashes)} block hashes for "
                f"{len(self.host_slots)} host slots; give one per slot, or none"
            )
        if self.salts and len(self.salts) != len(self.block_hashes):
            raise ValueError(
                f"transfer {self.batch_id} names {len(self.salts)} salts for "
                f"{len(self.block_hashes)} block hashes; give one per hash, or none"
            )

    def __len__(self) -> int:
        return len(self.device_blocks)


@dataclass(frozen=True)
class Promotion:
    """Read blocks from the lower tiers into reserved host slots; keep the longest prefix found.

    Workers search the tiers in order, each from the first block the tiers
    before it did not have, and report how many leading blocks they wrote into
    ``host_slots``. Without ``host_slots`` it is a *probe*: workers read nothing and
    report how many leading blocks the tiers hold (any of them, each block), so
    that host slots are reserved, and host blocks evicted, only for blocks found.
    """

    batch_id: int
    """Unique id of this batch (shared with transfers); workers report it in ``promoted``."""
    group: int
    """The kv-cache group the blocks belong to."""
    block_hashes: tuple[bytes, ...]
    """The engine's hashes of the blocks, in prefix order (each rank namespaces them itself)."""
    host_slots: tuple[int, ...]
    """Host tier slots reserved for them, one per block; empty for a probe."""
    skip_tiers: frozenset[str] = frozenset()
    """Tiers not to ask: the cost guard predicted their read slower than recomputing."""
    salt: bytes | None = None
    """The salt of the request's tenant: its records are read as that tenant's."""


@dataclass(frozen=True)
class Demotion:
    """Write blocks of host slots to some lower tiers, before the plan's copies reuse the slots.

    In :attr:`TransferPlan.demotions` the blocks were just evicted from the host
    tier; in :attr:`TransferPlan.write_throughs` they stay in it.
    """

    group: int
    """The kv-cache group the blocks belong to."""
    block_hashes: tuple[bytes, ...]
    """The engine's hashes of the blocks."""
    host_slots: tuple[int, ...]
    """The host tier slots that still hold them."""
    tiers: tuple[int, ...]
    """Positions, in the workers' chain, of the lower tiers to write them to (may be none:
    an evicted block no tier writes back)."""
    salt: bytes | None = None
    """The salt of the tenant whose request stored or promoted the blocks: their records are
    sealed for that tenant."""


@dataclass(frozen=True)
class TransferPlan:
    """What every worker does this step.

    Workers execute it in this order: if ``flush``, wait for every copy already
    in flight (requests were preempted and their device blocks are about to be
    reused); before the step's forward, copy the loads of the ``same_step``
    requests and wait for them; after it, copy ``demotions`` and ``write_throughs``
    out of their slots (the plan's stores and promotions may reuse those slots), then
    submit ``stores``, the other ``loads`` and ``promotions``; then report.
    """

    stores: tuple[Transfer, ...] = ()
    """Device-to-host batches to submit."""
    loads: tuple[Transfer, ...] = ()
    """Host-to-device batches to submit, one per request and group."""
    flush: bool = False
    """Wait for all in-flight copies before touching anything (set after preemptions)."""
    holds: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Finished requests whose device blocks the engine keeps until these batches complete."""
    unavailable: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Per request, device blocks promised as tier hits that cannot be loaded: report as failed."""
    promotions: tuple[Promotion, ...] = ()
    """Lower-tier reads into host slots, and probes, for requests waiting on their lookup."""
    demotions: tuple[Demotion, ...] = ()
    """Blocks evicted from the host tier, to write to the lower tiers that write them back."""
    write_throughs: tuple[Demotion, ...] = ()
    """Blocks the host tier keeps, just stored or reused, to write to the lower tiers that
    write them through."""
    same_step: frozenset[str] = frozenset()
    """Requests the engine runs in this very step, on the blocks their loads write: workers
    copy those loads (and report those requests' ``unavailable`` blocks as failed) before
    the step's forward, and never name the requests among finished loads."""
    idle: bool = False
    """The engine computes nothing this step and steps again at once: a worker with lower-tier
    reads in flight waits a little for them instead of returning, so that the tiers' threads
    get the interpreter rather than a loop of empty steps."""

    @property
    def empty(self) -> bool:
        """Whether the plan asks nothing of the workers."""
        return not (
            self.stores
            or self.loads
            or self.flush
            or self.holds
            or self.unavailable
            or self.promotions
            or self.demotions
            or self.write_throughs
        )


NO_PLAN = TransferPlan()
"""The plan of a step that asks nothing of the workers (shared: plans are never changed)."""


@dataclass(frozen=True)
class WorkerReport:
    """Batches that finished on workers since their last report, by outcome.

    Each value counts workers; reports from several workers (or steps) merge by
    adding counts. Every worker reports each batch once as ``done``, ``failed``
    or ``abandoned``; the manager completes a batch once ``world_size`` workers
    have reported it, counting it failed unless all of them reported it done.
    A worker that abandoned a copy reports the batch once more, as ``settled``,
    when the copy is over: only then may the batch's host slots be reused.
    """

    done: Mapping[int, int] = field(default_factory=dict)
    """Batch id -> number of workers that completed it successfully."""
    failed: Mapping[int, int] = field(default_factory=dict)
    """Batch id -> number of workers on which it failed (the copy is over)."""
    abandoned: Mapping[int, int] = field(default_factory=dict)
    """Batch id -> number of workers that stopped waiting for its copy, which may still run."""
    settled: Mapping[int, int] = field(default_factory=dict)
    """Batch id -> number of workers on which an abandoned copy of it is now over."""
    promoted: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """Promotion batch id -> (workers that answered it, fewest leading blocks any of them found,
    or for a probe held)."""
    tier_counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Lower tier name -> counters that grew since the last report (``TierStats`` field names,
    ``errors.<cause>`` for faults), added up over workers."""
    tier_stored: Mapping[TierBlock, int] = field(default_factory=dict)
    """Block -> number of workers that wrote their part of it to the lower tier (sent only
    when the engine publishes KV-cache events)."""
    tier_removed: Mapping[TierBlock, int] = field(default_factory=dict)
    """Block -> number of workers whose lower tier no longer holds their part of it (evicted,
    found corrupt or deleted, where the tier knows; sent only with KV-cache events)."""
    load_times: tuple[tuple[int, float], ...] = field(default=(), compare=False)
    """Per load batch that completed: (blocks, seconds from its submission until the worker
    saw it done), for the cost guard; every worker's, one after the other. Timings are
    measurements, not outcomes: reports that differ only in them are equal."""
    read_times: Mapping[str, tuple[tuple[int, float], ...]] = field(
        default_factory=dict, compare=False
    )
    """Lower tier name -> per read of a promotion: (records it returned, seconds from asking
    to its answer), for the cost guard; every worker's, one after the other (not compared,
    as ``load_times``)."""
    tier_gauges: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Lower tier name -> ``queued`` (requests waiting or running in the tier) and ``state``
    (a :class:`~kvtier.tiers.base.TierState`) when the report was taken: summed and the
    worst over workers. A worker sends them when they changed or are not all 0, so a tier
    no report names has nothing queued and is up."""

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Return a report holding both reports' counts."""
        promoted = dict(self.promoted)
        for batch_id, (workers, found) in other.promoted.items():
            had = promoted.get(batch_id)
            promoted[batch_id] = (
                (workers, found) if had is None else (had[0] + workers, min(had[1], found))
            )
        tier_counts = {name: dict(counts) for name, counts in self.tier_counts.items()}
        for name, counts in other.tier_counts.items():
            merged = tier_counts.setdefault(name, {})
            for counter, value in counts.items():
                merged[counter] = merged.get(counter, 0) + value
        read_times = dict(self.read_times)
        for name, times in other.read_times.items():
            read_times[name] = read_times.get(name, ()) + times
        tier_gauges = {name: dict(gauges) for name, gauges in self.tier_gauges.items()}
        for name, gauges in other.tier_gauges.items():
            merged = tier_gauges.setdefault(name, {"queued": 0, "state": 0})
            merged["queued"] += gauges["queued"]
            merged["state"] = max(merged["state"], gauges["state"])
        return WorkerReport(
            _add_counts(self.done, other.done),
            _add_counts(self.failed, other.failed),
            _add_counts(self.abandoned, other.abandoned),
            _add_counts(self.settled, other.settled),
            promoted,
            tier_counts,
            _add_counts(self.tier_stored, other.tier_stored),
            _add_counts(self.tier_removed, other.tier_removed),
            self.load_times + other.load_times,
            read_times,
            tier_gauges,
        )

    @classmethod
    def merge_all(cls, reports: Iterable[WorkerReport | None]) -> WorkerReport:
        """Merge any number of reports, skipping ``None`` (a worker with nothing to say)."""
        merged = cls()
        for report in reports:
            if report is not None:
                merged = merged.merge(report)
        return merged

    @property
    def empty(self) -> bool:
        """Whether the report holds no batch."""
        return not (
            self.done
            or self.failed
            or self.abandoned
            or self.settled
            or self.promoted
            or self.tier_counts
            or self.tier_stored
            or self.tier_removed
            or self.load_times
            or self.read_times
            or self.tier_gauges
        )

    @property
    def batch_ids(self) -> set[int]:
        """Every copy batch the report names (promotions are in ``promoted``)."""
        return {*self.done, *self.failed, *self.abandoned, *self.settled}


class DeviceBlock(NamedTuple):
    """One engine block: its kv-cache group and block id (a named tuple: made per block)."""

    group: int
    block_id: int


@dataclass(frozen=True)
class LazyCandidate:
    """A cached device block near the engine's eviction frontier, offered for a lazy store."""

    block_hash: bytes
    """The engine's hash of the block (namespaced by the manager)."""
    group: int
    """The kv-cache group of ``block_id``."""
    block_id: int
    """The engine block holding the data."""


_Counted = TypeVar("_Counted", bound=Hashable)


def _add_counts(left: Mapping[_Counted, int], right: Mapping[_Counted, int]) -> dict[_Counted, int]:
    merged = dict(left)
    for item, count in right.items():
        merged[item] = merged.get(item, 0) + count
    return merged
