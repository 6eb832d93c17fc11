"""The vLLM connector's pieces that need no engine: version check, metrics, messages, docs."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm033

from kvtier.copy.base import Direction  # noqa: E402
from kvtier.integrations.vllm.adapters import (  # noqa: E402
    VLLM_0_32,
    VLLM_0_33,
    VllmAdapter,
    adapter_for,
)
from kvtier.integrations.vllm.scheduler import lazy_frontier_blocks  # noqa: E402
from kvtier.integrations.vllm.stats import (  # noqa: E402
    METRICS,
    PROMETHEUS_PREFIX,
    KVTierPromMetrics,
    KVTierStats,
    MetricKind,
)
from kvtier.integrations.vllm.version import (  # noqa: E402
    UnsupportedVLLMVersion,
    check_vllm_version,
)
from kvtier.offload import (  # noqa: E402
    FailureCause,
    Observations,
    OffloadStats,
    Transfer,
    TransferPlan,
    WorkerReport,
)
from kvtier.offload.stats import (  # noqa: E402
    OFFLOAD_COUNTERS,
    OFFLOAD_HISTOGRAMS,
    TIER_COUNTERS,
)
from tests.conftest import REPO_ROOT  # noqa: E402
from tests.integrations.vllm.conftest import MIB, Registered, vllm_config  # noqa: E402

DOCS = REPO_ROOT / "docs" / "metrics.md"
LABELS = {"model_name": "m", "engine": "0"}


@pytest.mark.parametrize(
    "version, adapter",
    [
        ("0.32.0", VLLM_0_32),
        ("0.32.7", VLLM_0_32),
        ("0.32.1+cpu", VLLM_0_32),
        ("0.33.0", VLLM_0_33),
        ("0.33.2+cu130", VLLM_0_33),
    ],
)
def test_supported_versions_pick_their_adapter(version: str, adapter: VllmAdapter) -> None:
    assert check_vllm_version(version) == adapter.series
    assert adapter_for(version) is adapter


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_other_versions_fail_with_what_to_do(version: str) -> None:
    with pytest.raises(UnsupportedVLLMVersion) as raised:
        adapter_for(version)
    message = str(raised.value)
    assert f"vLLM {version} is installed" in message
    assert "0.32.x, 0.33.x" in message
    assert "pip install" in message


def test_installed_vllm_is_supported() -> None:
    from kvtier.integrations.vllm.connector import VLLM

    assert VLLM is adapter_for()


def test_only_releases_with_sleep_hooks_run_with_sleep_mode() -> None:
    VLLM_0_32.check(SimpleNamespace(model_config=None))  # type: ignore[arg-type]
    sleeping = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(ValueError, match="sleep mode on vLLM 0.32"):
        VLLM_0_32.check(sleeping)  # type: ignore[arg-type]
    VLLM_0_33.check(sleeping)  # type: ignore[arg-type]


def test_stats_add_counters_and_keep_the_latest_gauge() -> None:
    scheduler = KVTierStats()
    scheduler.record("stored_blocks", 3)
    scheduler.record("used_blocks", 10)
    later = KVTierStats(data={"stored_blocks": 2, "used_blocks": 12, "hit_tokens": 64})
    merged = scheduler.aggregate(later)
    assert merged.reduce() == {"stored_blocks": 5, "used_blocks": 12, "hit_tokens": 64}
    assert not merged.is_empty()
    merged.reset()
    assert merged.is_empty()


def test_stats_merge_failures_by_cause_and_join_histogram_observations() -> None:
    worker = KVTierStats()
    worker.record("failures", 1, label="copy_error")
    worker.observe("load_seconds", [0.5])
    scheduler = KVTierStats(data={"failures": {"copy_error": 2, "report_deadline": 1}})
    scheduler.observe("load_seconds", [0.25, 0.75])
    scheduler.observe("store_seconds", [])
    merged = worker.aggregate(scheduler)
    assert merged.data == {
        "failures": {"copy_error": 3, "report_deadline": 1},
        "load_seconds": [0.5, 0.25, 0.75],
    }
    assert merged.reduce() == {
        "failures_copy_error": 3,
        "failures_report_deadline": 1,
        "load_seconds_count": 3,
        "load_seconds_mean": 0.5,
    }


def test_stats_refuse_the_wrong_call_for_a_kind() -> None:
    stats = KVTierStats()
    with pytest.raises(ValueError, match="histogram: use observe"):
        stats.record("load_seconds", 1.0)
    with pytest.raises(ValueError, match="counter: use record"):
        stats.observe("hit_tokens", [1])
    with pytest.raises(ValueError, match="'cause' label"):
        stats.record("failures", 1)
    with pytest.raises(ValueError, match="no label"):
        stats.record("hit_tokens", 1, label="x")


def test_stats_reject_unknown_names_and_foreign_payloads() -> None:
    with pytest.raises(ValueError, match="unknown kvtier metrics"):
        KVTierStats(data={"stored_blokcs": 1})
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    with pytest.raises(TypeError):
        KVTierStats().aggregate(KVConnectorStats())


def test_stats_survive_pickling_and_vllms_engine_messages() -> None:
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = KVTierStats(data={"loaded_bytes": 4096})
    stats.record("failures", 1, label="copy_error")
    stats.observe("store_batch_blocks", [3, 5])
    assert pickle.loads(pickle.dumps(stats)).data == stats.data
    # a served engine sends the payload to the frontend inside msgpack-encoded SchedulerStats
    sent = SchedulerStats(kv_connector_stats=stats.to_dict())
    (frame, *_) = MsgpackEncoder().encode(sent)
    received = MsgpackDecoder(SchedulerStats).decode(frame)
    assert KVTierStats(data=received.kv_connector_stats).data == stats.data


def test_prometheus_metrics_publish_every_payload() -> None:
    bound = Registered()
    config = vllm_config({"cpu_bytes": 4 * MIB})
    prom = KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"hit_tokens": 64, "used_blocks": 3}, engine_idx=0)
    prom.observe({"hit_tokens": 32, "used_blocks": 5}, engine_idx=0)
    value = bound.registry.get_sample_value
    assert value(f"{PROMETHEUS_PREFIX}hit_tokens_total", LABELS) == 96
    assert value(f"{PROMETHEUS_PREFIX}used_blocks", LABELS) == 5


def test_prometheus_histograms_and_failures_count_every_observation() -> None:
    bound = Registered()
    prom = KVTierPromMetrics(
        vllm_config({"cpu_bytes": 4 * MIB}), bound.types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    payload = KVTierStats()
    payload.observe("load_seconds", [0.002, 0.004, 3.0])
    payload.observe("request_hit_tokens", [0, 0, 96])
    payload.record("failures", 2, label="copy_deadline")
    prom.observe(payload.to_dict(), engine_idx=0)
    value = bound.registry.get_sample_value
    load = f"{PROMETHEUS_PREFIX}load_seconds"
    assert value(f"{load}_count", LABELS) == 3
    assert value(f"{load}_sum", LABELS) == pytest.approx(3.006)
    assert value(f"{load}_bucket", {**LABELS, "le": "0.005"}) == 2
    hits = f"{PROMETHEUS_PREFIX}request_hit_tokens_bucket"
    assert value(hits, {**LABELS, "le": "0.0"}) == 2
    assert value(hits, {**LABELS, "le": "128.0"}) == 3
    failures = f"{PROMETHEUS_PREFIX}failures_total"
    assert value(failures, {**LABELS, "cause": "copy_deadline"}) == 2
    assert value(failures, {**LABELS, "cause": "copy_error"}) == 0


@pytest.mark.parametrize(
    "kvtier, world_size, capacity",
    [
        ({"cpu_bytes": 4 * MIB}, 1, 4 * MIB),
        ({"cpu_bytes": 4 * MIB}, 2, 2 * MIB),
        ({"cpu_bytes_per_rank": 3 * MIB}, 2, 3 * MIB),
    ],
)
def test_every_series_has_a_value_at_start_up(
    kvtier: dict[str, object], world_size: int, capacity: int
) -> None:
    bound = Registered()
    engines = {0: ["m", "0"], 1: ["m", "1"]}
    config = vllm_config(kvtier, world_size)
    KVTierPromMetrics(config, bound.types, ["model_name", "engine"], engines)
    value = bound.registry.get_sample_value
    for engine in ("0", "1"):
        labels = {"model_name": "m", "engine": engine}
        assert value(f"{PROMETHEUS_PREFIX}capacity_bytes", labels) == capacity
        for gauge in ("used_blocks", "used_bytes", "quarantined_blocks"):
            assert value(f"{PROMETHEUS_PREFIX}{gauge}", labels) == 0
        for name, spec in METRICS.items():
            full = f"{PROMETHEUS_PREFIX}{name}"
            if spec.kind is MetricKind.HISTOGRAM:
                assert value(f"{full}_count", labels) == 0, name
            elif spec.label is not None:
                for label in spec.label_values:
                    assert value(f"{full}_total", {**labels, spec.label: label}) == 0
            elif spec.kind is MetricKind.COUNTER:
                assert value(f"{full}_total", labels) == 0, name
    # the record size, hence the slot count, is known only once the engine reports
    assert value(f"{PROMETHEUS_PREFIX}capacity_blocks", LABELS) is None


def test_start_up_capacity_is_zero_when_prefix_caching_disables_kvtier() -> None:
    bound = Registered()
    config = vllm_config({"cpu_bytes": 4 * MIB})
    config.cache_config.enable_prefix_caching = False
    KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    assert bound.registry.get_sample_value(f"{PROMETHEUS_PREFIX}capacity_bytes", LABELS) == 0


def test_start_up_publishes_each_configured_tier_at_zero(tmp_path: Path) -> None:
    bound = Registered()
    tiers = [
        {"type": "disk", "path": str(tmp_path / "a"), "capacity_bytes": 4 * MIB},
        {"type": "disk", "path": str(tmp_path / "b"), "capacity_bytes": 4 * MIB},
    ]
    config = vllm_config({"cpu_bytes": 4 * MIB, "tiers": tiers})
    KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    value = bound.registry.get_sample_value
    for tier in ("disk0", "disk1"):
        assert value(f"{PROMETHEUS_PREFIX}tier_errors_total", {**LABELS, "tier": tier}) == 0
    assert value(f"{PROMETHEUS_PREFIX}tier_errors_total", {**LABELS, "tier": "disk"}) is None


def test_auth_failures_count_per_tier_and_among_the_errors() -> None:
    stats = KVTierStats()
    grown = {"redis": {"errors.auth": 3, "errors.key": 1}, "disk": {"errors.checksum": 1}}
    stats.record_tiers(grown)
    assert stats.data == {
        "tier_auth_failures": {"redis": 3},
        "tier_errors": {"redis": 4, "disk": 1},
    }


def test_per_tier_counters_publish_with_a_tier_label() -> None:
    from vllm.config import DeviceConfig, VllmConfig

    stats = KVTierStats()
    grown = {"disk": {"hits": 3, "bytes_read": 30, "errors.checksum": 1, "errors.io": 1}}
    stats.record_tiers({**grown, "redis": {"queue_drops": 4}})
    assert stats.data == {
        "tier_hits": {"disk": 3},
        "tier_bytes_read": {"disk": 30},
        "tier_errors": {"disk": 2},
        "tier_queue_drops": {"redis": 4},
    }
    assert stats.reduce()["tier_hits_disk"] == 3
    with pytest.raises(ValueError, match="takes a 'tier' label"):
        stats.record("tier_hits", 1)
    bound = Registered()
    config = VllmConfig(device_config=DeviceConfig("cpu"))
    prom = KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(stats.data, engine_idx=0)
    prom.observe({"tier_hits": {"disk": 1}}, engine_idx=0)
    value = bound.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value(f"{PROMETHEUS_PREFIX}tier_hits_total", {**labels, "tier": "disk"}) == 4
    assert value(f"{PROMETHEUS_PREFIX}tier_queue_drops_total", {**labels, "tier": "redis"}) == 4


def test_tier_queues_and_states_publish_per_tier_and_the_latest_wins(tmp_path: Path) -> None:
    stats = KVTierStats()
    grown = OffloadStats(
        tier_gauges={"redis": {"queued": 3, "state": 1}, "disk": {"queued": 0, "state": 0}}
    )
    stats.record_offload(grown, record_bytes=1, capacity_bytes=1)
    later = KVTierStats()
    later.record_offload(
        OffloadStats(tier_gauges={"redis": {"queued": 0, "state": 0}}),
        record_bytes=1,
        capacity_bytes=1,
    )
    merged = stats.aggregate(later)
    assert merged.data["tier_queued"] == {"redis": 0, "disk": 0}
    assert merged.data["tier_state"] == {"redis": 0, "disk": 0}
    bound = Registered()
    tiers = [{"type": "disk", "path": str(tmp_path / "a"), "capacity_bytes": 4 * MIB}]
    config = vllm_config({"cpu_bytes": 4 * MIB, "tiers": tiers})
    prom = KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    value = bound.registry.get_sample_value
    assert value(f"{PROMETHEUS_PREFIX}tier_state", {**LABELS, "tier": "disk"}) == 0
    prom.observe({"tier_queued": {"disk": 5}, "tier_state": {"disk": 2}}, engine_idx=0)
    prom.observe({"tier_queued": {"disk": 1}}, engine_idx=0)
    assert value(f"{PROMETHEUS_PREFIX}tier_queued", {**LABELS, "tier": "disk"}) == 1
    assert value(f"{PROMETHEUS_PREFIX}tier_state", {**LABELS, "tier": "disk"}) == 2


def test_docs_list_every_metric() -> None:
    text = DOCS.read_text()
    for name, spec in METRICS.items():
        exposed = f"{PROMETHEUS_PREFIX}{name}"
        if spec.kind is MetricKind.COUNTER:
            exposed += "_total"
        row = f"| `{exposed}` | {spec.kind.value} | {spec.unit} |"
        assert row in text, f"{DOCS.name} has no row {row!r}"
    for cause in FailureCause:
        assert f"`{cause.value}`" in text, f"failure cause {cause.value} is missing"


def test_every_offload_counter_and_observation_is_published() -> None:
    counters = {field.name for field in dataclasses.fields(OffloadStats)} - {
        "failures",
        "tiers",
        "tier_gauges",
    }
    assert {counter.name for counter in OFFLOAD_COUNTERS} == counters
    assert all(METRICS[c.name].kind.value == c.kind.value for c in OFFLOAD_COUNTERS)
    assert METRICS["stored_blocks"].kind is MetricKind.COUNTER
    assert METRICS["quarantined_blocks"].kind is MetricKind.GAUGE
    assert all(METRICS[f"tier_{c.name}"].label == "tier" for c in TIER_COUNTERS)
    observed = {field.name for field in dataclasses.fields(Observations)}
    assert {histogram.field for histogram in OFFLOAD_HISTOGRAMS} == observed
    assert all(METRICS[h.name].kind is MetricKind.HISTOGRAM for h in OFFLOAD_HISTOGRAMS)
    assert METRICS["failures"].label_values == tuple(cause.value for cause in FailureCause)


def test_plan_and_reports_cross_processes() -> None:
    from kvtier.integrations.vllm.connector import KVTierMetadata, KVTierWorkerMetadata

    plan = TransferPlan(
        stores=(Transfer(0, Direction.STORE, 0, (4, 5), (0, 1)),),
        loads=(Transfer(1, Direction.LOAD, 0, (7,), (2,), request_id="r"),),
        holds={"q": (0,)},
    )
    assert pickle.loads(pickle.dumps(KVTierMetadata(plan))).plan == plan
    rank0 = KVTierWorkerMetadata(WorkerReport(done={0: 1, 1: 1}))
    rank1 = KVTierWorkerMetadata(WorkerReport(done={0: 1}, abandoned={1: 1}, settled={1: 1}))
    merged = pickle.loads(pickle.dumps(rank0)).aggregate(rank1)
    assert merged.report == WorkerReport(done={0: 2, 1: 1}, abandoned={1: 1}, settled={1: 1})


def test_the_lazy_frontier_covers_two_steps_of_allocation_in_every_group() -> None:
    assert lazy_frontier_blocks(1, 512, 32) == 2 * 16
    assert lazy_frontier_blocks(2, 512, 32) == 2 * 2 * 16, "a step allocates in both groups"
    assert lazy_frontier_blocks(2, 500, 32) == 2 * 2 * 16
