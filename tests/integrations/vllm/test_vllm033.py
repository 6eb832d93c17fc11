"""What only vLLM 0.33 has: the sleep-mode hooks of the connector API. Skipped on other releases."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import kvtier.plugins  # noqa: E402
from kvtier.integrations.vllm.adapters import VLLM_0_33  # noqa: E402
from kvtier.integrations.vllm.connector import VLLM  # noqa: E402
from tests.support.faults import flaky_copy_registry  # noqa: E402
from tests.support.vllm_steps import StepsSpec, VllmSteps, write_model_config  # noqa: E402

pytestmark = [
    pytest.mark.vllm033,
    pytest.mark.skipif(VLLM is not VLLM_0_33, reason="needs vLLM 0.33 (make test's second env)"),
]


def test_vllm_lets_sleep_mode_run_with_the_connector() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
    )
    connector_class = KVConnectorFactory.get_connector_class(transfer)
    assert connector_class.supports_sleep_mode(transfer) is True


def test_unregistering_before_sleep_waits_for_every_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.plugins, "_default_registry", flaky_copy_registry(delay_polls=5))
    engine = VllmSteps(
        write_model_config(tmp_path), {"cpu_bytes": 4 << 20, "copy": {"type": "flaky"}}, StepsSpec()
    )
    try:
        engine.add(list(range(40)))
        engine.step()
        engine.step()
        offload = engine.worker.worker.offload
        assert offload.num_inflight > 0, "the stores are meant to be still running"
        engine.worker.unregister_kv_caches()
        assert offload.num_inflight == 0
        engine.run()
        assert engine.connector.manager.stats().stored_blocks == 2
    finally:
        engine.close()
