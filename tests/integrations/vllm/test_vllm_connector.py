"""The vLLM connector's pieces that need no engine: version check, metrics, messages, docs."""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm033

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

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
    OFFLOAD_COUNTERS,
    PROMETHEUS_PREFIX,
    KVTierPromMetrics,
    KVTierStats,
    MetricKind,
)
from kvtier.integrations.vllm.version import (  # noqa: E402
    UnsupportedVLLMVersion,
    check_vllm_version,
)
from kvtier.offload import OffloadStats, Transfer, TransferPlan, WorkerReport  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402

DOCS = REPO_ROOT / "docs" / "vllm.md"


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


def test_stats_reject_unknown_names_and_foreign_payloads() -> None:
    with pytest.raises(ValueError, match="unknown kvtier metrics"):
        KVTierStats(data={"stored_blokcs": 1})
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    with pytest.raises(TypeError):
        KVTierStats().aggregate(KVConnectorStats())


def test_stats_survive_pickling() -> None:
    stats = KVTierStats(data={"loaded_bytes": 4096})
    assert pickle.loads(pickle.dumps(stats)).reduce() == {"loaded_bytes": 4096}


class _Registered:
    """Metric classes bound to a private registry, as vLLM's factory passes them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.types = {kind: self._bound(kind) for kind in (Counter, Gauge, Histogram)}

    def _bound(self, kind: type) -> type:
        registry = self.registry

        class Bound(kind):  # type: ignore[misc, valid-type]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound


def test_prometheus_metrics_publish_every_payload() -> None:
    from vllm.config import DeviceConfig, VllmConfig

    bound = _Registered()
    config = VllmConfig(device_config=DeviceConfig("cpu"))
    prom = KVTierPromMetrics(config, bound.types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"hit_tokens": 64, "used_blocks": 3}, engine_idx=0)
    prom.observe({"hit_tokens": 32, "used_blocks": 5}, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    value = bound.registry.get_sample_value
    assert value(f"{PROMETHEUS_PREFIX}hit_tokens_total", labels) == 96
    assert value(f"{PROMETHEUS_PREFIX}used_blocks", labels) == 5


def test_docs_list_every_metric() -> None:
    text = DOCS.read_text()
    for name in METRICS:
        assert f"`{PROMETHEUS_PREFIX}{name}`" in text, f"{name} is missing from docs/vllm.md"


def test_every_offload_counter_is_a_vllm_counter() -> None:
    gauges = {"num_slots", "used_slots", "quarantined_slots"}
    counters = {field.name for field in dataclasses.fields(OffloadStats)} - gauges
    assert set(OFFLOAD_COUNTERS.values()) == counters
    assert all(METRICS[name].kind is MetricKind.COUNTER for name in OFFLOAD_COUNTERS)
    assert METRICS["quarantined_blocks"].kind is MetricKind.GAUGE


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
