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
}
"""Every metric the connector reports, by short name."""

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
}
"""Counter metric name -> the cumulative :class:`~kvtier.offload.OffloadStats` field it counts."""


@dataclass
class KVTierStats(KVConnectorStats):
    """The kvtier metrics of one interval: ``data`` maps names in :data:`METRICS` to numbers."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(METRICS))
        if unknown:
            raise ValueError(f"unknown kvtier metrics {unknown}; known: {sorted(METRICS)}")

    def record(self, name: str, value: float) -> None:
        """Add ``value`` to counter ``name`` or set gauge ``name`` to it."""
        spec = METRICS[name]
        if spec.kind is MetricKind.COUNTER:
            self.data[name] = self.data.get(name, 0) + value
        else:
            self.data[name] = value

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
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one merged payload (``KVTierStats.data``) for engine ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            child = self._children.get((engine_idx, name))
            if child is None:
                family = self._families[name]
                child = family.labels(*self.per_engine_labelvalues[engine_idx])
                self._children[(engine_idx, name)] = child
            if METRICS[name].kind is MetricKind.COUNTER:
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
]
