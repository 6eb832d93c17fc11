"""Bad input to ``kvtier simulate`` and ``kvtier bench copy``: one line, status 2, no traceback.

Every case runs the real command line in a subprocess with a timeout, so a
traceback, a hang or a late failure (after the work it should have prevented)
shows exactly as a user would see it. Runs that would start are kept tiny.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TIMEOUT_S = 120
"""Upper bound of one command; a refused input takes a few seconds (importing torch)."""

TINY_SIMULATION = (
    "--policies", "lru", "--capacities", "10", "--no-belady", "--synthetic-requests", "20",
)  # fmt: skip
TINY_BENCH = ("--block-bytes", "4KiB", "--total-bytes", "16KiB", "--repeats", "1")
"""A benchmark that started would print its table on stdout."""


def kvtier(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvtier ARGV`` on this checkout's code; fail the test if it hangs."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *argv],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=TIMEOUT_S,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Status 2, nothing on stdout, exactly one line on stderr holding every fragment."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == 2, output
    assert result.stdout == "", output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, output
    for fragment in fragments:
        assert fragment in lines[0], output
    return lines[0]


def token_trace(path: Path, *second_line_tokens: int) -> Path:
    """A kvtier-format trace: one good request, then one with ``second_line_tokens``."""
    good = json.dumps({"timestamp": 0, "token_ids": list(range(16))})
    bad = json.dumps({"timestamp": 1, "token_ids": list(second_line_tokens)})
    path.write_text(f"{good}\n{bad}\n")
    return path


# kvtier simulate


def test_zero_block_tokens(tmp_path: Path) -> None:
    trace = token_trace(tmp_path / "trace.jsonl", *range(16))
    result = kvtier("simulate", str(trace), *TINY_SIMULATION, "--block-tokens", "0", cwd=tmp_path)
    assert_refused(result, "--block-tokens must be at least 1, got 0")


@pytest.mark.parametrize(
    ("tokens", "shown"),
    [
        ([*range(15), 2**63], "token_ids[15] is 9223372036854775808"),
        ([-(2**63) - 1, *range(15)], "token_ids[0] is -9223372036854775809"),
        # In the trailing partial block, which is never hashed: still not a token id.
        ([*range(16), 2**64], "token_ids[16] is 18446744073709551616"),
    ],
)
def test_token_ids_beyond_64_bits(tmp_path: Path, tokens: list[int], shown: str) -> None:
    trace = token_trace(tmp_path / "trace.jsonl", *tokens)
    result = kvtier("simulate", str(trace), *TINY_SIMULATION, cwd=tmp_path)
    assert_refused(result, f"{trace}:2: {shown}", "-2**63 to 2**63 - 1")


def test_directory_as_trace(tmp_path: Path) -> None:
    result = kvtier("simulate", str(tmp_path), *TINY_SIMULATION, cwd=tmp_path)
    assert_refused(result, f"{tmp_path}: is a directory, not a trace file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX only")
def test_named_pipe_as_trace_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    result = kvtier("simulate", str(fifo), *TINY_SIMULATION, cwd=tmp_path)
    assert_refused(result, f"{fifo}: is a named pipe, not a trace file")


def test_non_utf8_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(b'{"hash_ids": [1]}\n{"hash_ids": [2], "note": "\xff\xfe"}\n')
    result = kvtier("simulate", str(trace), *TINY_SIMULATION, cwd=tmp_path)
    assert_refused(result, f"{trace}:2: not UTF-8 text (byte 0xff at column 28)")


def test_deeply_nested_json_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"hash_ids": [1]}\n{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    result = kvtier("simulate", str(trace), *TINY_SIMULATION, cwd=tmp_path)
    assert_refused(result, f"{trace}:2: JSON nested too deeply")


def test_number_with_thousands_of_digits(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"hash_ids": [1]}\n{"hash_ids": [1' + "0" * 5000 + "]}\n")
    result = kvtier("simulate", str(trace), *TINY_SIMULATION, cwd=tmp_path)
    assert_refused(result, f"{trace}:2: a number has too many digits")


@pytest.mark.parametrize("count", ["0", "-3"])
def test_no_synthetic_requests(tmp_path: Path, count: str) -> None:
    result = kvtier(
        "simulate", "synthetic:chat", *TINY_SIMULATION, "--synthetic-requests", count, cwd=tmp_path
    )
    assert_refused(result, f"--synthetic-requests must be at least 1, got {count}")


@pytest.mark.parametrize(
    "sizes",
    [
        ["--capacities", "10," + str(10**18)],
        ["--capacity-bytes", "4096TiB", "--block-bytes", "1"],
    ],
)
def test_huge_capacities_are_bounded(tmp_path: Path, sizes: list[str]) -> None:
    result = kvtier("simulate", "synthetic:chat", *TINY_SIMULATION, *sizes, cwd=tmp_path)
    assert_refused(result, "exceed the simulator's limit of 16777216 blocks per tier")


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("missing/rates.png", "--plot missing/rates.png: directory missing does not exist"),
        (".", "--plot .: is a directory"),
        ("rates.xyz", "--plot rates.xyz: name the file with one of the suffixes"),
    ],
)
def test_plot_that_cannot_be_written_is_refused_before_the_replay(
    tmp_path: Path, plot: str, message: str
) -> None:
    result = kvtier("simulate", "synthetic:chat", *TINY_SIMULATION, "--plot", plot, cwd=tmp_path)
    assert_refused(result, message)
    assert list(tmp_path.iterdir()) == []


# kvtier bench copy


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("nonsense", "--device 'nonsense' is not a device; use cpu or cuda[:N]"),
        ("meta", "--device meta: the benchmark runs on cpu or cuda[:N] only"),
    ],
)
def test_device_the_benchmark_cannot_use(tmp_path: Path, device: str, message: str) -> None:
    result = kvtier("bench", "copy", *TINY_BENCH, "--device", device, cwd=tmp_path)
    assert_refused(result, message)


def test_cuda_device_that_is_not_here(tmp_path: Path) -> None:
    result = kvtier("bench", "copy", *TINY_BENCH, "--device", "cuda:99", cwd=tmp_path)
    line = assert_refused(result, "--device cuda:99: ")
    assert "CUDA is not available" in line or "this machine has CUDA devices 0 to" in line


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("missing/copy.json", "--output missing/copy.json: directory missing does not exist"),
        (".", "--output .: is a directory"),
    ],
)
def test_output_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, output: str, message: str
) -> None:
    result = kvtier(
        "bench", "copy", *TINY_BENCH, "--device", "cpu", "--output", output, cwd=tmp_path
    )
    assert_refused(result, message)
    assert list(tmp_path.iterdir()) == []


def test_unknown_backend(tmp_path: Path) -> None:
    result = kvtier("bench", "copy", *TINY_BENCH, "--backend", "nope", cwd=tmp_path)
    assert_refused(result, "--backend: no copy backend named 'nope'; installed: ", "torch")


@pytest.mark.parametrize(
    "sizes",
    [
        ["--total-bytes", "4096TiB"],
        ["--block-bytes", "4096TiB"],
    ],
)
def test_sizes_beyond_this_machines_memory(tmp_path: Path, sizes: list[str]) -> None:
    result = kvtier("bench", "copy", *TINY_BENCH, *sizes, "--device", "cpu", cwd=tmp_path)
    assert_refused(result, "needs 16.0PiB of host memory for its block pools", "this machine has")
