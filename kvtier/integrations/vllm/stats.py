"""kvtier's metrics in vLLM: a ``KVConnectorStats`` payload and its Prometheus exporter.

Each engine step the scheduler-side connector hands vLLM a :class:`KVTierStats`
(a flat ``name -> number`` dict, so it pickles across processes) with what
changed since the previous step. vLLM merges payloads with
:meth:`KVTierStats.aggregate`, logs :meth:`KVTierStats.reduce` and feeds the
merged dict to :class:`KVTierPromMetrics`, which publishes every metric in
:data:`METRICS` as ``vllm:kvtier_<name>``.

Counters are added up when payloads merge; gauges keep the most recent value.
Everything is counted on the scheduler side, which learns of a transfer once
every rank reported it: block counts count it once, byte counts include every
rank's shard.

Each storage tier below the host tier has the metrics of :data:`TIER_METRICS`,
keyed ``<name>/<tier>`` in the payload (:func:`tier_key`) and published with a
``tier`` label. They add up every rank's counts (keys, not blocks).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

PROMETHEUS_PREFIX = "vllm:kvtier_"
"""Prefix of every kvtier metric name in vLLM's Prometheus output."""


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"


@dataclass(frozen=True)
class MetricSpec:
    """One kvtier metric: how it merges and what it means."""

    kind: MetricKind
    documentation: str


METRICS: Mapping[str, MetricSpec] = {
    "hit_tokens": MetricSpec(
        MetricKind.COUNTER,
        "Prompt tokens found in the host tier beyond vLLM's own prefix-cache hit and "
        "scheduled to load from it.",
    ),
    "stored_blocks": MetricSpec(
        MetricKind.COUNTER, "Blocks whose store to the host tier completed on every rank."
    ),
    "loaded_blocks": MetricSpec(
        MetricKind.COUNTER, "Blocks whose load from the host tier completed on every rank."
    ),
    "stored_bytes": MetricSpec(
        MetricKind.COUNTER, "Bytes copied from the device KV cache to the host tier, all ranks."
    ),
    "loaded_bytes": MetricSpec(
        MetricKind.COUNTER, "Bytes copied from the host tier to the device KV cache, all ranks."
    ),
    "evicted_blocks": MetricSpec(
        MetricKind.COUNTER, "Blocks evicted from the host tier to make room for new ones."
    ),
    "store_failures": MetricSpec(
        MetricKind.COUNTER, "Blocks whose store failed; they were never made readable."
    ),
    "load_failures": MetricSpec(
        MetricKind.COUNTER,
        "Blocks whose load failed or was no longer possible; vLLM recomputed them.",
    ),
    "abandoned_copies": MetricSpec(
        MetricKind.COUNTER,
        "Copies a rank stopped waiting for (past copy_deadline_s, or after a copy backend "
        "error); their loads were recomputed and their stores dropped.",
    ),
    "expired_batches": MetricSpec(
        MetricKind.COUNTER,
        "Batches of copies failed because some rank did not report them within report_deadline_s.",
    ),
    "rejected_reports": MetricSpec(
        MetricKind.COUNTER, "Entries of rank reports rejected as impossible and ignored."
    ),
    "used_blocks": MetricSpec(
        MetricKind.GAUGE, "Host-tier slots holding a block or being written, per rank."
    ),
    "quarantined_blocks": MetricSpec(
        MetricKind.GAUGE,
        "Host-tier slots kept out of use, per rank, because an abandoned or unreported copy "
        "may still write them.",
    ),
    "capacity_blocks": MetricSpec(MetricKind.GAUGE, "Host-tier slots per rank."),
    "used_bytes": MetricSpec(MetricKind.GAUGE, "Host-tier bytes in use, per rank."),
    "capacity_bytes": MetricSpec(MetricKind.GAUGE, "Host-tier bytes per rank."),
    "promoted_blocks": MetricSpec(
        MetricKind.COUNTER,
        "Blocks read from the tiers below the host tier into it, for requests that missed it.",
    ),
    "demoted_blocks": MetricSpec(
        MetricKind.COUNTER,
        "Blocks evicted from the host tier and written to the tiers below it.",
    ),
    "expired_promotions": MetricSpec(
        MetricKind.COUNTER,
        "Lower-tier lookups some rank did not answer within report_deadline_s (recomputed).",
    ),
}
"""Every metric the connector reports, by short name."""

TIER_METRICS: Mapping[str, MetricSpec] = {
    "tier_hits": MetricSpec(MetricKind.COUNTER, "Records a storage tier returned, all ranks."),
    "tier_misses": MetricSpec(
        MetricKind.COUNTER, "Records asked of a storage tier and not returned, whatever the reason."
    ),
    "tier_bytes_read": MetricSpec(
        MetricKind.COUNTER, "Payload bytes a storage tier returned, all ranks."
    ),
    "tier_bytes_written": MetricSpec(
        MetricKind.COUNTER, "Payload bytes written to a storage tier, all ranks."
    ),
    "tier_stores": MetricSpec(MetricKind.COUNTER, "Records written to a storage tier."),
    "tier_drops": MetricSpec(
        MetricKind.COUNTER, "Records a storage tier did not store (queue full, failure, refused)."
    ),
    "tier_queue_drops": MetricSpec(
        MetricKind.COUNTER,
        "Records of requests a storage tier answered at once because its queue was full.",
    ),
    "tier_deadline_misses": MetricSpec(
        MetricKind.COUNTER, "Records of reads a storage tier answered as misses at their deadline."
    ),
    "tier_errors": MetricSpec(
        MetricKind.COUNTER,
        "Records affected by a storage tier's faults: failed checks (checksum, namespace, "
        "layout), I/O and connection errors, timeouts.",
    ),
}
"""Metrics of each storage tier below the host tier, by short name."""

TIER_COUNTERS: Mapping[str, str] = {
    "tier_hits": "hits",
    "tier_misses": "misses",
    "tier_bytes_read": "bytes_read",
    "tier_bytes_written": "bytes_written",
    "tier_stores": "stores",
    "tier_drops": "drops",
    "tier_queue_drops": "queue_drops",
    "tier_deadline_misses": "deadline_misses",
}
"""Tier metric name -> the :class:`~kvtier.tiers.TierStats` counter it counts (``tier_errors``
adds up every fault)."""

TIER_ERRORS_PREFIX = "errors."
"""How a tier's fault counters are named in :attr:`~kvtier.offload.OffloadStats.tiers`."""


def tier_key(name: str, tier: str) -> str:
    """The payload key of tier metric ``name`` for ``tier``."""
    return f"{name}/{tier}"


def _spec(key: str) -> MetricSpec | None:
    """The spec of a payload key: a metric name, or a tier metric's :func:`tier_key`."""
    name, _, tier = key.partition("/")
    return TIER_METRICS.get(name) if tier else METRICS.get(name)


OFFLOAD_COUNTERS: Mapping[str, str] = {
    "hit_tokens": "hit_tokens",
    "stored_blocks": "stored_blocks",
    "stored_bytes": "stored_bytes",
    "loaded_blocks": "loaded_blocks",
    "loaded_bytes": "loaded_bytes",
    "evicted_blocks": "evicted_blocks",
    "store_failures": "failed_stores",
    "load_failures": "failed_loads",
    "abandoned_copies": "abandoned_copies",
    "expired_batches": "expired_batches",
    "rejected_reports": "rejected_reports",
    "promoted_blocks": "promoted_blocks",
    "demoted_blocks": "demoted_blocks",
    "expired_promotions": "expired_promotions",
}
"""Counter metric name -> the cumulative :class:`~kvtier.offload.OffloadStats` field it counts."""


@dataclass
class KVTierStats(KVConnectorStats):
    """The kvtier metrics of one interval: ``data`` maps names in :data:`METRICS` to numbers."""

    def __post_init__(self) -> None:
        unknown = sorted(key for key in self.data if _spec(key) is None)
        if unknown:
            raise ValueError(
                f"unknown kvtier metrics {unknown}; known: {sorted(METRICS)}, and per tier "
                f"{sorted(TIER_METRICS)} as <name>/<tier>"
            )

    def record(self, name: str, value: float) -> None:
        """Add ``value`` to counter ``name`` or set gauge ``name`` to it."""
        spec = _spec(name)
        if spec is None:
            raise KeyError(f"unknown kvtier metric {name!r}")
        if spec.kind is MetricKind.COUNTER:
            self.data[name] = self.data.get(name, 0) + value
        else:
            self.data[name] = value

    def record_tiers(
        self, now: Mapping[str, Mapping[str, int]], last: Mapping[str, Mapping[str, int]]
    ) -> None:
        """Count what each storage tier's counters gained from ``last`` to ``now``.

        Both map a tier's name to its cumulative counters, as
        :attr:`~kvtier.offload.OffloadStats.tiers` holds them.
        """
        for tier, counts in now.items():
            before = last.get(tier, {})
            grown = {name: value - before.get(name, 0) for name, value in counts.items()}
            for metric, counter in TIER_COUNTERS.items():
                if grown.get(counter):
                    self.record(tier_key(metric, tier), grown[counter])
            errors = sum(v for k, v in grown.items() if k.startswith(TIER_ERRORS_PREFIX))
            if errors:
                self.record(tier_key("tier_errors", tier), errors)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        """Merge ``other`` into this payload: counters add up, gauges take ``other``'s value."""
        if not isinstance(other, KVTierStats):
            raise TypeError(f"cannot merge {type(other).__name__} into KVTierStats")
        for name, value in other.data.items():
            self.record(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Publishes :class:`KVTierStats` payloads as Prometheus metrics, one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for name, spec in METRICS.items():
            if spec.kind is MetricKind.COUNTER:
                self._families[name] = self._counter_cls(
                    name=f"{PROMETHEUS_PREFIX}{name}",
                    documentation=spec.documentation,
                    labelnames=labelnames,
                )
            else:
                self._families[name] = self._gauge_cls(
                    name=f"{PROMETHEUS_PREFIX}{name}",
                    documentation=spec.documentation,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
        for name, spec in TIER_METRICS.items():
            self._families[name] = self._counter_cls(
                name=f"{PROMETHEUS_PREFIX}{name}",
                documentation=spec.documentation,
                labelnames=[*labelnames, "tier"],
            )
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one merged payload (``KVTierStats.data``) for engine ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            child = self._children.get((engine_idx, name))
            if child is None:
                metric, _, tier = name.partition("/")
                labels = [*self.per_engine_labelvalues[engine_idx], *([tier] if tier else [])]
                child = self._families[metric].labels(*labels)
                self._children[(engine_idx, name)] = child
            spec = _spec(name)
            assert spec is not None  # payloads are checked when built
            if spec.kind is MetricKind.COUNTER:
                child.inc(value)
            else:
                child.set(value)


__all__ = [
    "KVTierPromMetrics",
    "KVTierStats",
    "METRICS",
    "MetricKind",
    "OFFLOAD_COUNTERS",
    "PROMETHEUS_PREFIX",
    "TIER_COUNTERS",
    "TIER_METRICS",
    "tier_key",
]
