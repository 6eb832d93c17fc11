"""The copy benchmark runs end to end on tiny sizes and reports every direction."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.copy import bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--quiet", "--device", "cpu", *argv])


def test_report_has_every_direction_for_every_block_size(tmp_path: Path) -> None:
    output = tmp_path / "copy.json"
    args = _args(
        "--block-bytes", "4KiB", "16KiB",
        "--total-bytes", "256KiB",
        "--regions", "2",
        "--repeats", "2",
        "--pattern", "scattered",
        "--output", str(output),
    )  # fmt: skip
    assert bench.run(args) == 0
    report = json.loads(output.read_text())
    assert report["backend"] == "torch" and report["regions"] == 2
    assert [row["block_bytes"] for row in report["results"]] == [4096, 16384]
    assert [row["blocks"] for row in report["results"]] == [64, 16]
    for row in report["results"]:
        for mode in bench.MODES:
            numbers = row[mode]
            assert numbers["gb_per_s"] > 0 and numbers["contiguous_gb_per_s"] > 0
            assert numbers["ratio"] == pytest.approx(
                numbers["gb_per_s"] / numbers["contiguous_gb_per_s"], rel=0.01
            )


def test_json_goes_to_stdout_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.run(_args("--block-bytes", "4096", "--total-bytes", "32KiB", "--repeats", "1")) == 0
    )
    assert json.loads(capsys.readouterr().out)["results"][0]["blocks"] == 8


def test_sizes_take_units() -> None:
    assert _args("--block-bytes", "4KiB", "2MiB", "65536").block_bytes == [4096, 2 << 20, 65536]
    with pytest.raises(SystemExit):
        _args("--block-bytes", "four")


def test_blocks_that_do_not_split_into_regions_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.run(_args("--block-bytes", "4097", "--regions", "2")) == 2
    assert "do not split into 2 regions" in capsys.readouterr().err


def test_unknown_backend_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.run(_args("--backend", "nope", "--block-bytes", "4KiB", "--total-bytes", "8KiB"))
    assert status == 1
    assert "no copy backend named 'nope'" in capsys.readouterr().err
