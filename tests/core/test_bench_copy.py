"""The copy benchmark runs end to end on tiny sizes and reports every direction."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.cli import bench


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


def test_json_goes_to_stdout_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--json", "--block-bytes", "4096", "--total-bytes", "32KiB", "--repeats", "1")
    assert bench.run(args) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["blocks"] == 8


def test_table_by_default_and_no_progress_bar_off_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--device", "cpu", "--block-bytes", "4KiB", "1MiB", "--total-bytes", "1MiB"]
    assert bench.run(parser.parse_args([*argv, "--repeats", "1"])) == 0
    out, err = capsys.readouterr()
    heading, header, *rows = out.splitlines()
    assert heading.startswith("torch on cpu, permutation blocks, 1 region(s) per block, 1MiB ")
    assert header.split() == [
        "BLOCK", "BLOCKS", "MODE", "GB/S", "CONTIGUOUS", "GB/S", "RATIO", "RATIO", "OF", "MEDIANS"
    ]  # fmt: skip
    assert [row.split()[:3] for row in rows] == [
        [block, blocks, mode] for block, blocks in (("4KiB", "256"), ("1MiB", "1"))
        for mode in bench.MODES
    ]  # fmt: skip
    assert err == ""


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
    assert status == 2
    assert "no copy backend named 'nope'" in capsys.readouterr().err


@pytest.fixture
def one_small_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch report one CUDA device of 1 GiB, so the checks run without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=1 << 30)
    )


@pytest.mark.usefixtures("one_small_gpu")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda:1"], "--device cuda:1: this machine has CUDA devices 0 to 0"),
        (
            ["--device", "cuda", "--total-bytes", "1GiB"],
            "needs 2.0GiB of cuda memory for its block pools, and this machine has 1.0GiB",
        ),
    ],
)
def test_cuda_devices_and_memory_are_checked_before_allocating(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.run(_args("--block-bytes", "4KiB", *argv)) == 2
    assert message in capsys.readouterr().err


def test_report_that_cannot_be_written_is_one_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The directory vanishes between the check at the start and the write at the end.
    monkeypatch.setattr(bench, "check_output_file", lambda path: None)
    output = tmp_path / "gone" / "copy.json"
    args = _args("--block-bytes", "4KiB", "--total-bytes", "8KiB", "--repeats", "1")
    args.output = str(output)
    assert bench.run(args) == 1
    assert capsys.readouterr().err == (
        f"kvtier bench copy: cannot write {output}: No such file or directory\n"
    )
