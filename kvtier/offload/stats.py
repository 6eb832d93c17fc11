"""Owns the scheduler side's counters: one declaration per counter, and the records built on it.

:data:`OFFLOAD_COUNTERS` declares every number the manager keeps (name, kind,
unit, meaning), :data:`TIER_COUNTERS` every per-tier number the workers
report for the tiers below the host tier and :data:`OFFLOAD_HISTOGRAMS` every
measurement of single events. :class:`OffloadStats` and :class:`Observations`
are derived from them, and an engine integration's metrics from all three
(vLLM's Prometheus names are ``vllm:kvtier_<name>`` and ``vllm:kvtier_tier_<name>``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any

from kvtier.index.base import IndexStats
from kvtier.offload.failures import FailureCause, FailureLog

if TYPE_CHECKING:
    from kvtier.offload.messages import WorkerReport


class CounterKind(enum.Enum):
    COUNTER = "counter"
    """Only grows; handed out as what it gained since the last record."""
    GAUGE = "gauge"
    """A current value; handed out as it is now."""


@dataclass(frozen=True)
class Counter:
    """One number of the scheduler side, as every record and metric of it names it."""

    name: str
    kind: CounterKind
    unit: str
    help: str
    source: str = ""
    """Per-tier counters only: the :class:`~kvtier.tiers.TierStats` counter it counts if
    not ``name`` (a fault's as ``errors.<cause>``); one ending in ``.`` adds up every
    counter so named."""


_C, _G = CounterKind.COUNTER, CounterKind.GAUGE

OFFLOAD_COUNTERS: tuple[Counter, ...] = (
    Counter(
        "hit_tokens",
        _C,
        "tokens",
        "Prompt tokens found in the host tier beyond the engine's own prefix-cache hit and "
        "scheduled to load from it.",
    ),
    Counter(
        "stored_blocks",
        _C,
        "blocks",
        "Blocks whose store to the host tier completed on every rank.",
    ),
    Counter(
        "stored_bytes",
        _C,
        "bytes",
        "Bytes copied from the device KV cache to the host tier, all ranks.",
    ),
    Counter(
        "loaded_blocks",
        _C,
        "blocks",
        "Blocks whose load from the host tier completed on every rank.",
    ),
    Counter(
        "same_step_loaded_blocks",
        _C,
        "blocks",
        "Of the loaded blocks, those copied in the step that ran their request "
        "(same_step_load_bytes).",
    ),
    Counter(
        "loaded_bytes",
        _C,
        "bytes",
        "Bytes copied from the host tier to the device KV cache, all ranks.",
    ),
    Counter(
        "evicted_blocks",
        _C,
        "blocks",
        "Blocks evicted from the host tier to make room for new ones (or by a reset).",
    ),
    Counter(
        "store_failures",
        _C,
        "blocks",
        "Blocks whose store failed, timed out or was abandoned on some rank; they were never "
        "made readable.",
    ),
    Counter(
        "load_failures",
        _C,
        "blocks",
        "Blocks whose load failed or was no longer possible; the engine recomputed them.",
    ),
    Counter(
        "abandoned_copies",
        _C,
        "copies",
        "Copies a rank stopped waiting for (past copy_deadline_s, or after a copy backend "
        "error); their loads were recomputed and their stores dropped.",
    ),
    Counter(
        "expired_batches",
        _C,
        "batches",
        "Batches of copies failed because some rank did not report them within report_deadline_s.",
    ),
    Counter(
        "rejected_reports",
        _C,
        "report entries",
        "Entries of rank reports rejected as impossible and ignored.",
    ),
    Counter(
        "promoted_blocks",
        _C,
        "blocks",
        "Blocks read from the tiers below the host tier into it, for requests that missed it.",
    ),
    Counter(
        "demoted_blocks",
        _C,
        "blocks",
        "Blocks evicted from the host tier and written to the write_back tiers below it.",
    ),
    Counter(
        "written_through_blocks",
        _C,
        "blocks",
        "Blocks written to the write_through tiers below the host tier as they were stored, "
        "or to the write_through_admitted ones as they were first reused.",
    ),
    Counter(
        "expired_promotions",
        _C,
        "lookups",
        "Lower-tier lookups some rank did not answer within report_deadline_s (recomputed).",
    ),
    Counter(
        "unread_blocks",
        _C,
        "blocks",
        "Blocks the tiers below the host tier held for a lookup or a prefetch that found no "
        "host slot to be read into (every one pinned or being written) before the read gave "
        "up; they were computed.",
    ),
    Counter(
        "prefetches_started",
        _C,
        "requests",
        "Requests whose blocks below the host tier started being read into it when they "
        "arrived, while they waited in the engine's queue (prefetch).",
    ),
    Counter(
        "prefetches_completed",
        _C,
        "requests",
        "Prefetches whose reads every rank reported while their request still waited for them.",
    ),
    Counter(
        "prefetches_cancelled",
        _C,
        "requests",
        "Prefetches whose request finished (was aborted) before the engine allocated it; "
        "their slots and pins were released.",
    ),
    Counter(
        "prefetches_expired",
        _C,
        "requests",
        "Prefetches still being read when their request's lookup stopped waiting for them "
        "(prefetch.policy best_effort, timeout_s passed, or the cost guard predicted the reads "
        "slower than recomputing); the request computed those blocks.",
    ),
    Counter(
        "prefetched_blocks",
        _C,
        "blocks",
        "Blocks read from the tiers below the host tier into it by prefetches (also counted "
        "in promoted_blocks).",
    ),
    Counter(
        "prefetched_used_blocks",
        _C,
        "blocks",
        "Prefetched blocks the engine then loaded from the host tier.",
    ),
    Counter(
        "prefetched_unused_blocks",
        _C,
        "blocks",
        "Prefetched blocks evicted from the host tier before the engine loaded them (wasted "
        "reads).",
    ),
    Counter(
        "guard_skipped_tokens",
        _C,
        "tokens",
        "Host-tier hit tokens the cost guard did not load, because loading them was predicted "
        "slower than recomputing them; the engine computed them.",
    ),
    Counter("capacity_blocks", _G, "blocks", "Host-tier slots per rank."),
    Counter(
        "used_blocks", _G, "blocks", "Host-tier slots holding a block or being written, per rank."
    ),
    Counter(
        "quarantined_blocks",
        _G,
        "blocks",
        "Host-tier slots kept out of use, per rank, because an abandoned or unreported copy "
        "may still write them.",
    ),
)
"""Every number the manager keeps, in :class:`OffloadStats` under the same name. Block
counters count a transfer once, when every rank reported it; byte counters count every
rank's shard (``blocks * record_bytes * world_size``)."""

TIER_ERRORS_PREFIX = "errors."
"""How a tier's fault counters are named in :attr:`OffloadStats.tiers`."""

TIER_COUNTERS: tuple[Counter, ...] = (
    Counter("hits", _C, "records", "Records a storage tier returned, all ranks."),
    Counter(
        "misses",
        _C,
        "records",
        "Records a read asked of a storage tier and not returned, whatever the reason.",
    ),
    Counter("bytes_read", _C, "bytes", "Payload bytes a storage tier returned, all ranks."),
    Counter("bytes_written", _C, "bytes", "Payload bytes written to a storage tier, all ranks."),
    Counter(
        "read_buffer_bytes",
        _C,
        "bytes",
        "Bytes of the buffers a storage tier's I/O threads read records into and keep for "
        "later reads, all ranks; kept until the tier closes, at most 32 MiB an I/O thread.",
    ),
    Counter("stores", _C, "records", "Records written to a storage tier."),
    Counter(
        "drops",
        _C,
        "records",
        "Records a storage tier did not store (queue full, failure, refused).",
    ),
    Counter(
        "held",
        _C,
        "records",
        "Records a storage tier was handed and already held, answered as stored without "
        "writing them again (the disk tier, for a block promoted from it and evicted again).",
    ),
    Counter(
        "queue_drops",
        _C,
        "records",
        "Records of requests a storage tier answered at once because its queue was full.",
    ),
    Counter(
        "deadline_misses",
        _C,
        "records",
        "Records of reads a storage tier answered as misses at their deadline.",
    ),
    Counter(
        "errors",
        _C,
        "records",
        "Records affected by a storage tier's faults: failed checks (checksum, namespace, "
        "layout), I/O and connection errors, timeouts.",
        source=TIER_ERRORS_PREFIX,
    ),
    Counter(
        "auth_failures",
        _C,
        "records",
        "Records a storage tier read that were not sealed by its keys (forged, altered, or "
        "written without the key); each is a miss, also counted in tier_errors.",
        source=TIER_ERRORS_PREFIX + "auth",
    ),
    Counter(
        "guard_skipped_records",
        _C,
        "records",
        "Records the cost guard did not read from a storage tier, because reading them (and "
        "loading them from the host tier) was predicted slower than recomputing them; counted "
        "once for all ranks, by the scheduler.",
    ),
)
"""Per storage tier below the host tier, the workers' counts added up (keys, not blocks),
under the :class:`~kvtier.tiers.TierStats` counter each names (its ``source``), and the
cost guard's skips (:mod:`~kvtier.offload.costguard`), which the scheduler counts."""


TIER_GAUGES: tuple[Counter, ...] = (
    Counter(
        "queued",
        _G,
        "requests",
        "Requests waiting in a storage tier's queues or being run, all ranks, as their last "
        "reports gave them; while any is, the scheduler keeps the engine stepping so that "
        "their counts are reported.",
    ),
    Counter(
        "state",
        _G,
        "state",
        "Whether a storage tier calls its store: 0 up, 1 backing off (its store stopped "
        "answering), 2 disabled (started without its store); the worst of the ranks.",
    ),
)
"""Per storage tier below the host tier, the gauges the workers report
(:attr:`~kvtier.tiers.TierStats.queued` and :attr:`~kvtier.tiers.TierStats.state`)."""

_TIER_GAUGES = tuple(gauge.name for gauge in TIER_GAUGES)


FLUSH_COUNTERS: tuple[Counter, ...] = (
    Counter(
        "flushed_blocks",
        _C,
        "records",
        "Blocks of the host tier a rank closing gracefully wrote to a lower tier that lacked "
        "them: a write_back tier, or a write_through one no plan wrote them to yet.",
    ),
    Counter(
        "flush_skipped_blocks",
        _C,
        "records",
        "Blocks a rank closing gracefully did not hand to a lower tier that lacked them, "
        "because flush_deadline_s had passed.",
    ),
)
"""Per write_back or write_through tier, what one rank's graceful close wrote of the host
tier's blocks. They
come after the rank's last report, so no metric carries them: the close logs them and
:attr:`OffloadWorker.flush_counts <kvtier.offload.worker.OffloadWorker.flush_counts>`
holds them."""


def tier_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """One tier's counts from :attr:`OffloadStats.tiers` as :data:`TIER_COUNTERS` name them."""
    row = {}
    for counter in TIER_COUNTERS:
        source = counter.source or counter.name
        if source.endswith("."):
            row[counter.name] = sum(v for k, v in counts.items() if k.startswith(source))
        else:
            row[counter.name] = counts.get(source, 0)
    return row


def _grown(now: Mapping[Any, int], last: Mapping[Any, int]) -> dict[Any, int]:
    return {
        key: value - last.get(key, 0) for key, value in now.items() if value != last.get(key, 0)
    }


def _since(self: Any, last: Any) -> Any:
    """What changed from ``last`` (an earlier record) to this one: each counter, failure
    cause and tier counter as what it gained, each gauge as it is now."""
    changes: dict[str, Any] = {
        counter.name: getattr(self, counter.name)
        - (getattr(last, counter.name) if counter.kind is CounterKind.COUNTER else 0)
        for counter in OFFLOAD_COUNTERS
    }
    tiers = {name: _grown(counts, last.tiers.get(name, {})) for name, counts in self.tiers.items()}
    changes["tiers"] = {name: grown for name, grown in tiers.items() if grown}
    changes["tier_gauges"] = self.tier_gauges
    changes["failures"] = _grown(self.failures, last.failures)
    return type(self)(**changes)


OffloadStats = make_dataclass(
    "OffloadStats",
    [
        *((counter.name, int, field(default=0)) for counter in OFFLOAD_COUNTERS),
        ("tiers", dict[str, dict[str, int]], field(default_factory=dict)),
        ("tier_gauges", dict[str, dict[str, int]], field(default_factory=dict)),
        ("failures", Mapping[FailureCause, int], field(default_factory=dict)),
    ],
    frozen=True,
    namespace={"since": _since},
)
OffloadStats.__module__ = __name__
OffloadStats.__doc__ = """The manager's numbers: one field per :data:`OFFLOAD_COUNTERS` entry, and

- ``tiers``: per lower tier, the workers' counters added up (``TierStats`` field names,
  and ``errors.<cause>`` per fault); empty without lower tiers;
- ``tier_gauges``: per lower tier, :data:`TIER_GAUGES` as the workers last reported them
  (``queued`` summed, ``state`` the worst), handed out as they are now;
- ``failures``: failures the manager detected, by cause (the workers count theirs).

Every field defaults to 0 (or empty): ``OffloadStats()`` is "nothing yet".
:meth:`OffloadManager.stats` gives cumulative counters, :meth:`OffloadManager.take_stats`
what they gained since its previous call (``since``)."""


LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds, in seconds, of the latency histograms' buckets."""

BATCH_BUCKETS_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
"""Upper bounds, in blocks, of the batch-size histograms' buckets."""

HIT_BUCKETS_TOKENS = (0, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
"""Upper bounds, in tokens, of the per-request hit histogram's buckets (``le="0"``: no hit)."""


@dataclass(frozen=True)
class Histogram:
    """One kind of measurement of single events, as :class:`Observations` and every metric
    of it name it."""

    name: str
    """The metric's name."""
    field: str
    """The :class:`Observations` list that keeps its measurements."""
    unit: str
    help: str
    buckets: tuple[float, ...]
    """The metric's bucket upper bounds."""


OFFLOAD_HISTOGRAMS: tuple[Histogram, ...] = (
    Histogram(
        "load_seconds",
        "load_seconds",
        "seconds",
        "Seconds from planning a load batch to every rank reporting it complete.",
        LATENCY_BUCKETS_S,
    ),
    Histogram(
        "store_seconds",
        "store_seconds",
        "seconds",
        "Seconds from planning a store batch to every rank reporting it complete.",
        LATENCY_BUCKETS_S,
    ),
    Histogram(
        "load_batch_blocks",
        "load_blocks",
        "blocks",
        "Blocks per load batch planned.",
        BATCH_BUCKETS_BLOCKS,
    ),
    Histogram(
        "store_batch_blocks",
        "store_blocks",
        "blocks",
        "Blocks per store batch planned.",
        BATCH_BUCKETS_BLOCKS,
    ),
    Histogram(
        "request_hit_tokens",
        "request_hit_tokens",
        "tokens",
        "Tokens each request loads from the host tier (0 for a miss), observed when vLLM "
        "allocates it.",
        HIT_BUCKETS_TOKENS,
    ),
    Histogram(
        "prefetch_covered_seconds",
        "prefetch_covered_seconds",
        "seconds",
        "Per prefetched request, at its first lookup: the seconds its prefetch's reads ran "
        "while it waited in the engine's queue (from its arrival to the reads' end or its "
        "first lookup, whichever came first): read time the request did not wait for.",
        LATENCY_BUCKETS_S,
    ),
    Histogram(
        "guard_load_seconds",
        "guard_load_seconds",
        "seconds",
        "Per cost-guard decision made on measurements: the predicted seconds of the load "
        "(a lower tier's read and the host tier's load, or the host tier's load alone).",
        LATENCY_BUCKETS_S,
    ),
    Histogram(
        "guard_recompute_seconds",
        "guard_recompute_seconds",
        "seconds",
        "Per cost-guard decision made on measurements: the predicted seconds of recomputing "
        "the same tokens instead.",
        LATENCY_BUCKETS_S,
    ),
)
"""Every measurement the manager keeps of single events, in :class:`Observations` under
``field``; an engine integration publishes each as a histogram named ``name``."""

Observations = make_dataclass(
    "Observations",
    [(each.field, list[float], field(default_factory=list)) for each in OFFLOAD_HISTOGRAMS],
)
Observations.__module__ = __name__
Observations.__doc__ = """Measurements of single events since the last
:meth:`OffloadManager.take_observations`: one list per :data:`OFFLOAD_HISTOGRAMS` entry.

Only kept with ``record_observations``; an engine integration turns them into histograms."""


class Counters:
    """The manager's cumulative counters and failures, its measurements and the workers'
    tier counts, and what of them was last handed out."""

    def __init__(self, *, record_observations: bool, logger: logging.Logger) -> None:
        self.values: dict[str, int] = {
            counter.name: 0 for counter in OFFLOAD_COUNTERS if counter.kind is CounterKind.COUNTER
        }
        self.record_observations = record_observations
        self.observations = Observations()
        self.observed = False
        """Whether :attr:`observations` holds any measurement."""
        self.tiers: dict[str, dict[str, int]] = {}
        self.tier_gauges: dict[str, dict[str, int]] = {}
        """Per lower tier, ``queued`` and ``state`` summed and the worst over the workers, as
        their last reports gave them."""
        self.failures = FailureLog(logger)
        self.changes = 0
        """Grows whenever a counter may have changed: a record built at the same value
        holds the same counters."""
        self._taken_mark: tuple[object, ...] = ()
        self._taken_values = dict(self.values)
        self._taken_gauges: dict[str, int] = {}
        self._taken_tiers: dict[str, dict[str, int]] = {}
        self._taken_tier_gauges: dict[str, dict[str, int]] = {}
        self._taken_failures: Mapping[FailureCause, int] = {}

    @property
    def idle(self) -> bool:
        """Whether no measurement waits to be taken."""
        return not self.observed

    def add(self, name: str, count: int) -> None:
        """Add ``count`` to the :data:`OFFLOAD_COUNTERS` counter ``name``."""
        self.values[name] += count
        self.changes += 1

    def observe(self, into: list[Any], value: float) -> None:
        if self.record_observations:
            into.append(value)
            self.observed = True

    def add_tier_counts(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        self.changes += 1
        for name, grown in counts.items():
            totals = self.tiers.setdefault(name, {})
            for counter, value in grown.items():
                totals[counter] = totals.get(counter, 0) + value

    def set_tier_gauges(self, reports: Sequence[WorkerReport]) -> None:
        """Take the tiers' gauges from one step's ``reports``: a tier none names has nothing
        queued and is up (a worker sends them while they are not, and once when they change)."""
        gauges = {name: dict.fromkeys(_TIER_GAUGES, 0) for name in self.tier_gauges}
        for report in reports:
            for name, values in report.tier_gauges.items():
                row = gauges.setdefault(name, dict.fromkeys(_TIER_GAUGES, 0))
                row["queued"] += values["queued"]
                row["state"] = max(row["state"], values["state"])
        if gauges != self.tier_gauges:
            self.tier_gauges = gauges
            self.changes += 1

    def pending_tier_requests(self) -> bool:
        """Whether a worker's lower tier still runs requests whose counts it has not reported."""
        return any(row["queued"] for row in self.tier_gauges.values())

    def take_observations(self) -> Observations:
        observations, self.observations = self.observations, Observations()
        self.observed = False
        return observations

    @staticmethod
    def gauges(index_stats: IndexStats, quarantined_slots: int) -> dict[str, int]:
        """The :data:`OFFLOAD_COUNTERS` gauges: the host tier's usage as ``index_stats``
        counts it."""
        return {
            "capacity_blocks": index_stats.num_slots,
            "used_blocks": index_stats.readable + index_stats.writing,
            "quarantined_blocks": quarantined_slots,
        }

    def record(self, index_stats: IndexStats, quarantined_slots: int) -> OffloadStats:
        """The cumulative record, with the host tier's usage as ``index_stats`` counts it."""
        return OffloadStats(
            failures=self.failures.counts,
            tiers={name: dict(counts) for name, counts in self.tiers.items()},
            tier_gauges={name: dict(gauges) for name, gauges in self.tier_gauges.items()},
            **self.gauges(index_stats, quarantined_slots),
            **self.values,
        )

    def take_changes(
        self, state: tuple[object, ...], gauges: Callable[[], dict[str, int]]
    ) -> OffloadStats | None:
        """What changed since the last call (``None`` if nothing did): the record's
        ``since()`` the last one's, with the gauges as ``gauges()`` gives them now.

        ``state`` is all else whose change may change a record (batches planned, the
        quarantine); while it and the counters stay the same, nothing is compared. The
        counters are compared with the last call's copy of them, so a step that changed
        a few builds one record of what they gained, not two whole records.
        """
        mark = (self.changes, self.failures.total, *state)
        if mark == self._taken_mark:
            return None  # most steps
        self._taken_mark = mark
        values = self.values
        grown = _grown(values, self._taken_values)
        now = gauges()
        taken_tiers = self._taken_tiers
        tiers = {
            name: gained
            for name, counts in self.tiers.items()
            if (gained := _grown(counts, taken_tiers.get(name, {})))
        }
        failures = self.failures.counts
        failed = _grown(failures, self._taken_failures)
        tier_gauges = self.tier_gauges
        if not (grown or tiers or failed) and (
            now == self._taken_gauges and tier_gauges == self._taken_tier_gauges
        ):
            return None
        self._taken_values = dict(values)
        self._taken_gauges = now
        self._taken_tiers = {name: dict(counts) for name, counts in self.tiers.items()}
        self._taken_tier_gauges = {name: dict(row) for name, row in tier_gauges.items()}
        self._taken_failures = failures
        return OffloadStats(
            tiers=tiers, tier_gauges=self._taken_tier_gauges, failures=failed, **now, **grown
        )
