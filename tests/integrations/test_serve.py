"""``kvtier serve``: the config is checked before vLLM starts, and vLLM's server module is run."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.integrations import serve
from kvtier.integrations.serve import (
    VLLM_SERVER_MODULE,
    thread_layout,
    vanilla_reserved_cpus,
    world_size_of,
)


class _Started(Exception):
    """Raised by the stand-in for os.execv: the command line vLLM would have been started with."""


@pytest.fixture
def exec_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_execv(path: str, argv: list[str]) -> None:
        calls.append(list(argv))
        raise _Started

    monkeypatch.setattr(os, "execv", fake_execv)
    for name in [name for name in os.environ if name.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    return calls


def _transfer_config(command: list[str]) -> dict[str, object]:
    flag = command.index("--kv-transfer-config")
    parsed: dict[str, object] = json.loads(command[flag + 1])
    return parsed


def test_runs_vllm_server_module_with_the_connector_and_the_config_file(
    tmp_path: Path, exec_calls: list[list[str]]
) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("kvtier serve starts nothing without vLLM installed")
    config = tmp_path / "kvtier.yaml"
    config.write_text("cpu_bytes: 64MiB\n")
    with pytest.raises(_Started):
        main(["serve", "--kvtier-config", str(config), "/models/m", "--port", "8123"])
    (command,) = exec_calls
    assert command[:3] == [sys.executable, "-m", VLLM_SERVER_MODULE]
    assert command[3:7] == ["--model", "/models/m", "--port", "8123"]
    assert _transfer_config(command) == {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config_file": str(config.resolve())},
    }
    assert command[-2:] == ["--middleware", "kvtier.integrations.middleware.KVTransferParamsCheck"]


def test_print_command_starts_nothing(
    exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--print-command", "--model", "/models/m"]) == 0
    assert exec_calls == []
    printed = shlex.split(capsys.readouterr().out)
    assert printed[1:5] == ["-m", VLLM_SERVER_MODULE, "--model", "/models/m"]
    assert _transfer_config(printed)["kv_connector_extra_config"] == {}


def test_invalid_config_is_refused_once_before_vllm_starts(
    tmp_path: Path, exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("store_mode: sometimes\ncopy: {type: nope}\n")
    assert main(["serve", "--kvtier-config", str(config), "/models/m"]) == 2
    assert exec_calls == []
    err = capsys.readouterr().err
    assert err.count(f"file {config}: store_mode: ") == 1
    assert err.count(f"file {config}: copy.type: ") == 1
    assert "Traceback" not in err


def test_host_tier_larger_than_memory_is_one_line_naming_both_numbers(
    tmp_path: Path, exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("cpu_bytes: 4096TiB\n")
    assert main(["serve", "--kvtier-config", str(config), "/models/m"]) == 2
    assert exec_calls == []
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "cpu_bytes" in line]
    assert line.startswith(f"file {config}: cpu_bytes: the host tier needs {4096 * 2**40} bytes")
    assert "of memory available on this machine; lower cpu_bytes" in line


def test_every_rank_of_the_server_counts_against_memory(
    tmp_path: Path, exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("cpu_bytes_per_rank: 1TiB\n")
    assert main(["serve", "--kvtier-config", str(config), "m", "-tp", "2", "-pp", "2"]) == 2
    assert "4 ranks of 1099511627776 bytes need" in capsys.readouterr().err


def test_world_size_is_tensor_times_pipeline_parallel() -> None:
    assert world_size_of(["m"]) == 1
    assert world_size_of(["m", "-tp", "2", "--pipeline-parallel-size=3"]) == 6
    assert world_size_of(["--tensor-parallel-size", "4", "--port", "1"]) == 4


def test_a_transfer_config_of_ones_own_is_refused(
    exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "m", "--kv-transfer-config={}"]) == 2
    assert exec_calls == []
    assert "--kvtier-config FILE" in capsys.readouterr().err


def test_vanilla_reserves_one_core_per_rank_on_x86_and_arm_and_one_elsewhere() -> None:
    assert vanilla_reserved_cpus(1, "x86_64") == 1
    assert vanilla_reserved_cpus(4, "aarch64") == 4
    assert vanilla_reserved_cpus(4, "ppc64le") == 1


def test_thread_layout_is_vanillas_unless_the_environment_sets_it() -> None:
    variables, line = thread_layout({}, world_size=1)
    assert variables == {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(vanilla_reserved_cpus(1))}
    assert line.startswith("kvtier serve: VLLM_CPU_NUM_OF_RESERVED_CPU=")
    assert "\n" not in line
    variables, line = thread_layout({"VLLM_CPU_NUM_OF_RESERVED_CPU": "7"}, world_size=1)
    assert variables == {}
    assert "=7 from the environment, kept" in line


def test_the_cpu_build_starts_with_vanillas_thread_layout(
    tmp_path: Path,
    exec_calls: list[list[str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("kvtier serve starts nothing without vLLM installed")
    monkeypatch.setattr(serve, "cpu_build_installed", lambda: True)
    # Set first so that the variable kvtier serve sets is undone after the test.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    with pytest.raises(_Started):
        main(["serve", "/models/m", "-tp", "2"])
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(vanilla_reserved_cpus(2))
    (line,) = capsys.readouterr().err.splitlines()
    assert "the cores vLLM reserves without a connector" in line


def _printed_command(
    config: Path, capsys: pytest.CaptureFixture[str], *vllm_args: str
) -> tuple[list[str], str]:
    assert main(["serve", "--kvtier-config", str(config), "--print-command", *vllm_args]) == 0
    out, err = capsys.readouterr()
    return shlex.split(out), err


def test_a_write_back_tier_gets_the_shutdown_timeout_its_flush_needs(
    tmp_path: Path, exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's default --shutdown-timeout 0 kills the engine before the write-back flush."""
    config = tmp_path / "kvtier.yaml"
    disk = f"{{type: disk, path: {tmp_path / 'disk'}, capacity_bytes: 1MiB}}"
    config.write_text(f"cpu_bytes: 64MiB\nflush_deadline_s: 7.5\ntiers: [{disk}]\n")
    command, err = _printed_command(config, capsys, "m")
    flag = command.index("--shutdown-timeout")
    assert command[flag + 1] == "20", "close_timeout_s 10 + flush_deadline_s 7.5 + 2, rounded up"
    (line,) = err.splitlines()
    assert line.startswith("kvtier serve: --shutdown-timeout 20: vLLM's default 0 kills")
    command, err = _printed_command(config, capsys, "m", "--shutdown-timeout=60")
    assert command.count("--shutdown-timeout=60") == 1 and "--shutdown-timeout" not in command
    assert err == ""
    command, err = _printed_command(config, capsys, "m", "--shutdown-timeout", "3")
    assert command.count("--shutdown-timeout") == 1
    assert (
        "--shutdown-timeout 3 from the command line, kept; the write-back flush needs 20 s" in err
    )


def test_no_write_back_tier_leaves_vllms_shutdown_alone(
    tmp_path: Path, exec_calls: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    disk = f"{{type: disk, path: {tmp_path / 'disk'}, capacity_bytes: 1MiB}}"
    config.write_text(f"cpu_bytes: 64MiB\ntiers: [{disk}]\nflush_deadline_s: 0\n")
    command, err = _printed_command(config, capsys, "m")
    assert "--shutdown-timeout" not in command and err == ""
    config.write_text("cpu_bytes: 64MiB\n")
    command, err = _printed_command(config, capsys, "m")
    assert "--shutdown-timeout" not in command and err == ""
