"""The GPU target checks on synthetic ``kvtier bench copy`` reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, load_script

KiB = 1 << 10
SIZES = (4 * KiB, 16 * KiB, 32 * KiB, 256 * KiB, 1024 * KiB)


gpu_targets = load_script(REPO_ROOT / "benchmarks" / "gpu_targets.py")


def _report(backend: str, speeds: dict[int, tuple[float, float, float]]) -> dict[str, Any]:
    """A report whose contiguous copy runs at 50 GB/s; speeds are (store, load, both) GB/s."""
    rows = []
    for size, (store, load, both) in speeds.items():
        rows.append(
            {
                "block_bytes": size,
                "blocks": 1,
                "store": {"gb_per_s": store, "contiguous_gb_per_s": 50.0, "ratio": store / 50},
                "load": {"gb_per_s": load, "contiguous_gb_per_s": 50.0, "ratio": load / 50},
                "both": {"gb_per_s": both, "contiguous_gb_per_s": 45.0, "ratio": both / 45},
            }
        )
    return {"backend": backend, "results": rows}


def _dma(large: tuple[float, float, float]) -> dict[str, Any]:
    return _report("dma", {size: large if size >= 256 * KiB else (9, 10, 8) for size in SIZES})


def _checks(verdict: dict[str, Any]) -> dict[str, bool | None]:
    return {check["target"]: check["met"] for check in verdict["checks"]}


def test_all_targets_met() -> None:
    kernel = _report("kernel", {size: (42, 41, 30) for size in SIZES})
    verdict = gpu_targets.evaluate({"dma": _dma((47, 46, 40)), "kernel": kernel})
    assert verdict["all_met"]
    assert set(_checks(verdict).values()) == {True}
    assert verdict["auto_kernel_below_bytes_measured"] == 256 * KiB


def test_slow_dma_and_no_overlap_are_missed() -> None:
    verdict = gpu_targets.evaluate({"dma": _dma((40, 46, 25))})
    checks = _checks(verdict)
    assert checks["dma >= 90% of the contiguous copy from 256 KiB"] is False
    assert checks["dma: store and load together >= 1.6x a single direction, from 256 KiB"] is False
    assert not verdict["all_met"]


def test_kernel_behind_dma_is_missed() -> None:
    kernel = _report("kernel", {size: (8, 9, 7) for size in SIZES})
    verdict = gpu_targets.evaluate({"dma": _dma((47, 46, 40)), "kernel": kernel})
    assert _checks(verdict)["kernel ahead of dma at 16-32 KiB"] is False
    assert verdict["auto_kernel_below_bytes_measured"] == 4 * KiB


def test_main_reads_reports_and_sets_the_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dma.json"
    path.write_text(json.dumps(_dma((47, 46, 40))))
    assert gpu_targets.main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["all_met"]
    path.write_text(json.dumps(_dma((30, 46, 40))))
    assert gpu_targets.main([str(path)]) == 1
    assert gpu_targets.main([str(tmp_path / "missing.json")]) == 2
