"""The crash benchmark, short: three SIGKILLs of an engine with host and disk tiers at random
moments, each restarted on the same directories; every check of the benchmark must hold."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def crash(benchmarks_on_path: None) -> ModuleType:
    import crash

    return crash


def test_three_kills_serve_no_wrong_byte_and_leave_the_disk_tier_consistent(
    crash: ModuleType, tmp_path: Path
) -> None:
    result = crash.crash_runs(argparse.Namespace(kills=3, seed=1, work=str(tmp_path)))
    runs = result["runs"]
    assert result["wrong_outputs"] == 0 and result["outputs_checked"] >= 3 * 12
    assert [run["returncode"] for run in runs] == [-signal.SIGKILL] * 3 + [0]
    assert result["max_accounting_error"] <= 1
    # Every restart found what the killed run left on disk, in a file within its capacity.
    assert all(run["file_fits"] and not run["stray_files"] for run in runs)
    assert sum(run["records_found"] for run in runs[1:]) > 0
    assert result["leftovers"] == []
    assert result["ok"], result
