"""kvtier's metrics in vLLM: a ``KVConnectorStats`` payload and its Prometheus exporter.

Each engine step the scheduler-side connector, and every worker-side one,
hands vLLM a :class:`KVTierStats` with what changed since its previous step:
a ``name -> value`` dict of plain numbers, lists and string-keyed dicts, so it
crosses processes. vLLM merges payloads with :meth:`KVTierStats.aggregate`,
logs :meth:`KVTierStats.reduce` and feeds the merged dict to
:class:`KVTierPromMetrics`, which publishes every metric in :data:`METRICS` as
``vllm:kvtier_<name>`` with vLLM's own ``model_name`` and ``engine`` labels.

A counter's value is a number, or for a counter with an extra label a
``label value -> number`` dict; counters add up when payloads merge. A gauge's
value is a number (or such a dict) and the most recent one wins. A histogram's value is the list
of its observations, and lists are joined. The scheduler side counts transfers
once every rank reported them (block counts count a transfer once, byte counts
include every rank's shard) and measures their latency from planning to then;
each worker counts its own failures.

:class:`KVTierPromMetrics` publishes every series when vLLM builds it, before
any request: counters at 0, histograms empty, the usage gauges at 0 and
``capacity_bytes`` at the configured size. Only ``capacity_blocks`` waits for
the first engine step, because the record size is known only in the engine.

Each storage tier below the host tier (the config's ``tiers``) has the
counters of :data:`~kvtier.offload.stats.TIER_COUNTERS` (``tier_<name>``), labelled
``tier`` with the names
:func:`~kvtier.tiers.chain.tier_names` gives; they add up every rank's counts
(keys, not blocks) and are published at 0 from start-up for the configured tiers, as
are the gauges of :data:`~kvtier.offload.stats.TIER_GAUGES` (``tier_queued``,
``tier_state``). Those change only when the engine steps: the scheduler keeps it stepping
while a tier has requests queued, so an idle engine shows every queue empty, and the state
its tiers were in at its last step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvtier.config import KVTierConfig, load_config
from kvtier.offload.failures import FailureCause
from kvtier.offload.stats import (
    OFFLOAD_COUNTERS,
    OFFLOAD_HISTOGRAMS,
    TIER_COUNTERS,
    TIER_GAUGES,
    Counter,
    CounterKind,
    OffloadStats,
    tier_counts,
)
from kvtier.tiers.chain import tier_names

PROMETHEUS_PREFIX = "vllm:kvtier_"
"""Prefix of every kvtier metric name in vLLM's Prometheus output."""


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One kvtier metric: how it merges, what it means, and its extra label or buckets."""

    kind: MetricKind
    unit: str
    documentation: str
    label: str | None = None
    """A counter's or gauge's label besides vLLM's (``model_name``, ``engine``), if it has
    one."""
    label_values: tuple[str, ...] = ()
    """The values of ``label``, each published at 0 from start-up."""
    buckets: tuple[float, ...] = ()
    """A histogram's bucket upper bounds."""


def _declared(counter: Counter, label: str | None = None) -> MetricSpec:
    return MetricSpec(MetricKind(counter.kind.value), counter.unit, counter.help, label=label)


METRICS: Mapping[str, MetricSpec] = {
    **{counter.name: _declared(counter) for counter in OFFLOAD_COUNTERS},
    "used_bytes": MetricSpec(MetricKind.GAUGE, "bytes", "Host-tier bytes in use, per rank."),
    "capacity_bytes": MetricSpec(
        MetricKind.GAUGE,
        "bytes",
        "Host-tier bytes per rank, as configured (cpu_bytes over the ranks, or "
        "cpu_bytes_per_rank).",
    ),
    "failures": MetricSpec(
        MetricKind.COUNTER,
        "failures",
        "Failed copies and reports, by cause: one per batch and rank for a rank's causes, "
        "one per batch or report entry for the scheduler's.",
        label="cause",
        label_values=tuple(cause.value for cause in FailureCause),
    ),
    **{
        each.name: MetricSpec(MetricKind.HISTOGRAM, each.unit, each.help, buckets=each.buckets)
        for each in OFFLOAD_HISTOGRAMS
    },
    **{f"tier_{counter.name}": _declared(counter, "tier") for counter in TIER_COUNTERS},
    **{f"tier_{gauge.name}": _declared(gauge, "tier") for gauge in TIER_GAUGES},
}
"""Every metric the connector reports, by short name: the offload counters, gauges and
histograms and the per-tier counters as :mod:`kvtier.offload.stats` declares them, and the
metrics only the connector measures."""

LabelledCounts = dict[str, float]
"""A labelled counter's value in a payload: label value -> count."""


@dataclass
class KVTierStats(KVConnectorStats):
    """The kvtier metrics of one interval: ``data`` maps names in :data:`METRICS` to numbers."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(METRICS))
        if unknown:
            raise ValueError(f"unknown kvtier metrics {unknown}; known: {sorted(METRICS)}")

    def record(self, name: str, value: float, *, label: str | None = None) -> None:
        """Add ``value`` to counter ``name`` or set gauge ``name`` to it.

        Args:
            name: A counter or gauge of :data:`METRICS`.
            value: The increment or the gauge's value.
            label: The value of the counter's extra label; only for counters that have one.

        Raises:
            ValueError: ``name`` is a histogram, or ``label`` is given for a metric without one
                (or missing for one with).
        """
        spec = METRICS[name]
        if spec.kind is MetricKind.HISTOGRAM:
            raise ValueError(f"{name} is a histogram: use observe()")
        if (label is None) != (spec.label is None):
            wanted = "no label" if spec.label is None else f"a {spec.label!r} label"
            raise ValueError(f"{name} takes {wanted}, got label={label!r}")
        if spec.kind is MetricKind.GAUGE and label is None:
            self.data[name] = value
        elif spec.kind is MetricKind.GAUGE:
            self.data.setdefault(name, {})[label] = value
        elif label is None:
            self.data[name] = self.data.get(name, 0) + value
        else:
            counts = self.data.setdefault(name, {})
            counts[label] = counts.get(label, 0) + value

    def observe(self, name: str, values: Iterable[float]) -> None:
        """Add observations to histogram ``name``.

        Raises:
            ValueError: ``name`` is not a histogram.
        """
        if METRICS[name].kind is not MetricKind.HISTOGRAM:
            raise ValueError(f"{name} is a {METRICS[name].kind.value}: use record()")
        values = list(values)
        if values:
            self.data.setdefault(name, []).extend(values)

    def record_offload(
        self, grown: OffloadStats, *, record_bytes: int, capacity_bytes: int
    ) -> None:
        """Record what :meth:`~kvtier.offload.OffloadManager.take_stats` handed out.

        Args:
            grown: The counters' gains and the gauges' values.
            record_bytes: Bytes of one block's record on one rank, for ``used_bytes``.
            capacity_bytes: The configured host-tier bytes per rank.
        """
        for counter in OFFLOAD_COUNTERS:
            value = getattr(grown, counter.name)
            if value or counter.kind is CounterKind.GAUGE:
                self.record(counter.name, value)
        self.record("used_bytes", grown.used_blocks * record_bytes)
        self.record("capacity_bytes", capacity_bytes)
        for cause, count in grown.failures.items():
            self.record("failures", count, label=cause.value)
        self.record_tiers(grown.tiers)
        for tier, gauges in grown.tier_gauges.items():
            for gauge in TIER_GAUGES:
                self.record(f"tier_{gauge.name}", gauges[gauge.name], label=tier)

    def record_tiers(self, grown: Mapping[str, Mapping[str, int]]) -> None:
        """Count what each storage tier's counters gained (a tier's name -> its counters'
        gains, as :attr:`~kvtier.offload.OffloadStats.tiers` names them)."""
        for tier, counts in grown.items():
            for name, value in tier_counts(counts).items():
                if value:
                    self.record(f"tier_{name}", value, label=tier)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        """Merge ``other`` into this payload.

        Counters add up (per label value), gauges take ``other``'s value (per label value),
        histograms join their observations.
        """
        if not isinstance(other, KVTierStats):
            raise TypeError(f"cannot merge {type(other).__name__} into KVTierStats")
        for name, value in other.data.items():
            spec = METRICS[name]
            if spec.kind is MetricKind.HISTOGRAM:
                self.observe(name, value)
            elif spec.label is not None:
                for label, count in value.items():
                    self.record(name, count, label=label)
            else:
                self.record(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One number per series for vLLM's log line: a labelled counter per label value
        (``failures_copy_error``), a histogram as its count and mean (``load_seconds_count``,
        ``load_seconds_mean``)."""
        reduced: dict[str, int | float] = {}
        for name, value in self.data.items():
            spec = METRICS[name]
            if spec.kind is MetricKind.HISTOGRAM:
                reduced[f"{name}_count"] = len(value)
                reduced[f"{name}_mean"] = sum(value) / len(value)
            elif spec.label is not None:
                reduced.update({f"{name}_{label}": count for label, count in value.items()})
            else:
                reduced[name] = value
        return reduced

    def is_empty(self) -> bool:
        return not self.data


def _kvtier_config(vllm_config: VllmConfig) -> KVTierConfig | None:
    """The connector's config, or None where vLLM will not run the connector."""
    transfer_config = vllm_config.kv_transfer_config
    if not vllm_config.cache_config.enable_prefix_caching or transfer_config is None:
        return None
    return load_config(dict(transfer_config.kv_connector_extra_config))


def startup_gauges(vllm_config: VllmConfig) -> dict[str, float]:
    """The gauges' values before the engine's first step: an empty tier of the configured size.

    ``capacity_blocks`` is not among them: it depends on the record size, which only the
    engine knows.
    """
    config = _kvtier_config(vllm_config)
    capacity = 0
    if config is not None:
        capacity = config.host_bytes_per_rank(vllm_config.parallel_config.world_size)
    return {"used_blocks": 0, "quarantined_blocks": 0, "used_bytes": 0, "capacity_bytes": capacity}


def startup_tiers(vllm_config: VllmConfig) -> list[str]:
    """The ``tier`` label values the per-tier counters start with: the configured tiers."""
    config = _kvtier_config(vllm_config)
    return [] if config is None else tier_names(config)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Publishes :class:`KVTierStats` payloads as Prometheus metrics, one child per engine.

    Every series exists from construction (vLLM builds this once the engine is up, before
    any request): see :func:`startup_gauges`.
    """

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
            full_name = f"{PROMETHEUS_PREFIX}{name}"
            if spec.kind is MetricKind.COUNTER:
                extra = [spec.label] if spec.label is not None else []
                family = self._counter_cls(
                    name=full_name, documentation=spec.documentation, labelnames=labelnames + extra
                )
            elif spec.kind is MetricKind.GAUGE:
                extra = [spec.label] if spec.label is not None else []
                family = self._gauge_cls(
                    name=full_name,
                    documentation=spec.documentation,
                    labelnames=labelnames + extra,
                    multiprocess_mode="mostrecent",
                )
            else:
                family = self._histogram_cls(
                    name=full_name,
                    documentation=spec.documentation,
                    labelnames=labelnames,
                    buckets=spec.buckets,
                )
            self._families[name] = family
        self._children: dict[tuple[int, str, str | None], Any] = {}
        gauges = startup_gauges(vllm_config)
        tiers = tuple(startup_tiers(vllm_config))
        for engine_idx in per_engine_labelvalues:
            for name, spec in METRICS.items():
                if spec.kind is MetricKind.GAUGE and spec.label is None:
                    if name in gauges:
                        self._child(engine_idx, name).set(gauges[name])
                    continue
                if spec.label is None:
                    self._child(engine_idx, name)
                for label in spec.label_values or (tiers if spec.label == "tier" else ()):
                    self._child(engine_idx, name, label)

    def _child(self, engine_idx: int, name: str, label: str | None = None) -> Any:
        key = (engine_idx, name, label)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            if label is not None:
                values.append(label)
            child = self._families[name].labels(*values)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one merged payload (``KVTierStats.data``) for engine ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            spec = METRICS[name]
            if spec.kind is MetricKind.HISTOGRAM:
                child = self._child(engine_idx, name)
                for observation in value:
                    child.observe(observation)
            elif spec.kind is MetricKind.GAUGE and spec.label is None:
                self._child(engine_idx, name).set(value)
            elif spec.kind is MetricKind.GAUGE:
                for label, level in value.items():
                    self._child(engine_idx, name, label).set(level)
            elif spec.label is not None:
                for label, count in value.items():
                    self._child(engine_idx, name, label).inc(count)
            else:
                self._child(engine_idx, name).inc(value)


__all__ = [
    "KVTierPromMetrics",
    "KVTierStats",
    "METRICS",
    "MetricKind",
    "MetricSpec",
    "PROMETHEUS_PREFIX",
    "startup_gauges",
    "startup_tiers",
]
