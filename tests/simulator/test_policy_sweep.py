"""The policy sweep prints JSON rows and a summary, and reports saved runs without replaying."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, load_script


def test_sweep_prints_json_and_merges_saved_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = load_script(REPO_ROOT / "benchmarks" / "policy_sweep.py")
    argv = ["--policies", "arc", "--capacities", "20,80", "--synthetic-requests", "60"]
    assert sweep.main([*argv, "--traces", "synthetic:chat:0,synthetic:rag:1"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    cells = {(r["trace"], r["policy"], r["capacity_blocks"]) for r in report["rows"]}
    assert len(cells) == 2 * 2 * 2 and len(err.splitlines()) == 8
    assert all(r["vs_lru"] == 1.0 for r in report["rows"] if r["policy"] == "lru")
    assert report["summary"]["arc"]["cells"] == 4
    saved = tmp_path / "run.json"
    saved.write_text(out)
    plot = tmp_path / "ratios.png"
    assert sweep.main(["--from", str(saved), "--table", "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| trace | policy | 20 | 80 |\n")
    assert "| synthetic:rag:1 | arc |" in table
    assert plot.read_bytes().startswith(b"\x89PNG")
