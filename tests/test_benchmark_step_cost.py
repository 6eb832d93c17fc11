"""The step-cost benchmark on its quick settings: it runs all four engines, kvtier's connector
really runs in the kvtier engine and vLLM's offloading connector in its own, and every field
it prints is documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, field_names

pytestmark = pytest.mark.vllm


def test_the_quick_step_cost_run_times_all_four_engines_and_documents_its_fields() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "step_cost.py"), "--quick"]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert {(r["store_mode"], r["prefix_hit"]) for r in report["runs"]} == {
        ("eager", 0.0),
        ("eager", 0.5),
        ("lazy", 0.0),
        ("lazy", 0.5),
    }
    for row in report["runs"]:
        assert row["steps"] == 8
        assert set(row["scheduler_s"]) == {"none", "null", "kvtier", "vllm_offload"}
        for arm in row["scheduler_s"].values():
            assert arm["all"]["n"] == 8 and arm["all"]["median"] > 0
            low, high = arm["all"]["ci95"]
            assert low <= arm["all"]["median"] <= high
        for calls in (row["calls"], row["vllm_offload"]["calls"], row["null"]["calls"]):
            for name in (
                "build_connector_meta",
                "update_connector_output",
                "get_kv_connector_stats",
            ):
                assert calls[name]["count"] == 8, name
        assert row["connector_s"]["all"]["median"] > 0
        assert row["worker_s"]["all"]["median"] > 0
        assert row["vllm_offload"]["worker_s"]["median"] > 0
        assert row["null"]["connector_s"]["all"]["median"] > 0
        assert row["null"]["worker_s"]["all"]["median"] > 0
        assert len(row["per_step"]["changed"]) == 8
        # every arrival stores its new blocks through both connectors, so each moves blocks
        for arm in ("kvtier", "vllm_offload"):
            moved = row["moved_blocks"][arm]
            assert moved["stored"] > 0 and moved["moving_steps"] > 0, arm
            assert row["per_block_us"][arm]["median"] > 0, arm
            assert row["run_per_block_us"][arm] > 0, arm
        if row["prefix_hit"]:  # and each loads the repeated halves from its host pool
            assert row["moved_blocks"]["vllm_offload"]["loaded"] > 0
    eager = [row for row in report["runs"] if row["store_mode"] == "eager"]
    assert all(row["stored_blocks"] > 0 for row in eager)
    assert any(row["hit_tokens"] > 0 for row in report["runs"] if row["prefix_hit"])
    page = (REPO_ROOT / "docs" / "benchmarks" / "step-cost.md").read_text()
    missing = sorted(name for name in field_names(report) if f"`{name}`" not in page)
    assert not missing, f"docs/benchmarks/step-cost.md does not describe {missing}"
