"""Tests of the ``kvtier`` command line, run in-process against a small plugin registry."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvtier import cli, config, plugins
from kvtier.cli import plugins as plugins_command
from kvtier.plugins import PluginError, Registry
from tests.config.conftest import BAD_FILES, Sections, make_registry

AVAILABLE_BYTES = 100 * 1024**3
"""Memory the tests' machine has available, whatever the machine running them has."""


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """Make the test registry the process default, fix the memory available, clear KVTIER_*."""
    registry = make_registry(Sections())
    monkeypatch.setattr(plugins, "_default_registry", registry)
    monkeypatch.setattr(config.model, "available_memory_bytes", lambda: AVAILABLE_BYTES)
    for name in [name for name in os.environ if name.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    return registry


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_plugins_table_lists_every_kind(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "plugins")
    assert status == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["KIND", "NAME", "DISTRIBUTION", "VERSION", "PLUGIN"]
    assert ["copy", "backend", "twin", "unknown"] == rows[5][:4]
    assert rows[-1] == ["storage", "tier", "(none", "installed)"]


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "plugins", "--json")
    assert status == 0
    entries = {(row["kind"], row["name"]): row for row in json.loads(out)}
    assert set(entries) == {
        ("layout_resolvers", "auto"),
        ("copy_backends", "torch"),
        ("copy_backends", "twin"),
        ("block_indexes", "lru"),
        ("block_indexes", "prefix_arc"),
    }
    assert entries[("block_indexes", "lru")]["config_model"] == "kvtier.index.lru.LRUConfig"


def test_plugin_failure_is_one_line_and_status_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> Registry:
        raise PluginError("plugin 'x' (kvtier-x 1.0) failed to import x: ImportError: nope")

    monkeypatch.setattr(plugins_command, "default_registry", broken)
    status, _, err = run(capsys, "plugins")
    assert status == 1
    assert err == (
        "kvtier: cannot load plugins: plugin 'x' (kvtier-x 1.0) failed to import x: "
        "ImportError: nope\n"
    )


def test_validate_accepts_a_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("cpu_bytes: 64GiB\nstore_mode: lazy\ncopy:\n  type: twin\n  depth: 4\n")
    status, out, err = run(capsys, "config", "validate", str(file))
    assert (status, out, err) == (0, f"{file}: valid kvtier configuration\n", "")


def test_validate_accepts_a_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "extra.json"
    file.write_text('{"cpu_bytes": "64G", "copy": {"type": "twin", "depth": 4}}')
    status, out, err = run(capsys, "config", "validate", str(file))
    assert (status, out, err) == (0, f"{file}: valid kvtier configuration\n", "")


def test_validate_checks_the_string_given_to_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    extra = '{"cpu_bytes": "1.5GiB", "copy": "twin"}'
    status, out, err = run(capsys, "config", "validate", "--json", extra)
    assert (status, out, err) == (0, "--json: valid kvtier configuration\n", "")
    extra = '{"cpu_bytes": "64GiB", "copy": {"type": "turbo"}, "store_mode": "never"}'
    status, out, err = run(capsys, "config", "validate", "--json", extra, "--no-memory-check")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "invalid kvtier configuration: 2 problems",
        "explicit: store_mode: Input should be 'eager' or 'lazy' (got 'never')",
        "explicit: copy.type: unknown copy backend type; installed: torch, twin (got 'turbo')",
    ]


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ("{'cpu_bytes': 1}", "argument --json: (root): not JSON: Expecting property name "),
        ('["cpu_bytes"]', "argument --json: (root): expected a JSON object of config keys, "),
        ("[" * 5000 + "]" * 5000, "argument --json: (root): nested more than 32 levels deep "),
        ('{"x": ' + "[" * 40 + "]" * 40 + "}", "explicit: (root): nested more than 32 levels "),
    ],
)
def test_validate_refuses_a_string_that_is_not_a_json_object(
    extra: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(capsys, "config", "validate", "--json", extra)
    assert (status, out) == (2, "")
    header, problem = err.splitlines()
    assert header == "invalid kvtier configuration: 1 problem"
    assert problem.startswith(line)


def test_validate_applies_the_json_string_over_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("cpu_bytes: 1MiB\n")
    argv = ("config", "validate", str(file), "--json", '{"cpu_bytes": 4096}')
    status, out, _ = run(capsys, *argv, "--record-bytes", "1KiB")
    assert (status, out) == (
        0,
        f"{file} with --json: valid kvtier configuration; 4 blocks of 1024 bytes per rank over "
        "1 rank(s)\n",
    )


def test_validate_falls_back_to_kvtier_config_like_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "kvtier.toml"
    file.write_text("store_mode = 'sometimes'\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(file))
    status, out, err = run(capsys, "config", "validate")
    assert (status, out) == (2, "")
    assert err.splitlines()[1] == (
        f"file {file}: store_mode: Input should be 'eager' or 'lazy' (got 'sometimes')"
    )
    file.write_text("store_mode = 'lazy'\n")
    status, out, _ = run(capsys, "config", "validate")
    assert (status, out) == (0, f"{file}: valid kvtier configuration\n")
    monkeypatch.delenv("KVTIER_CONFIG")
    status, out, _ = run(capsys, "config", "validate")
    assert (status, out) == (0, "KVTIER_* variables and defaults: valid kvtier configuration\n")


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_validate_rejects_bad_file_with_status_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, expected = BAD_FILES[case]
    file = tmp_path / "kvtier.yaml"
    file.write_text(text)
    status, out, err = run(capsys, "config", "validate", str(file))
    header, line = err.splitlines()
    assert (status, out, header) == (2, "", "invalid kvtier configuration: 1 problem")
    assert line.startswith(f"file {file}: {expected}")
    assert "Traceback" not in err


def test_validate_checks_the_host_tier_holds_a_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("cpu_bytes: 1MiB\n")
    status, out, _ = run(capsys, "config", "validate", str(file), "--record-bytes", "64KiB")
    assert (status, out) == (
        0,
        f"{file}: valid kvtier configuration; 16 blocks of 65536 bytes per rank over 1 rank(s)\n",
    )
    argv = ("config", "validate", str(file), "--record-bytes", "512KiB", "--world-size", "4")
    status, out, err = run(capsys, *argv)
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "invalid kvtier configuration: 1 problem",
        f"file {file}: cpu_bytes: 262144 bytes per rank over 4 rank(s) is below one block "
        "record of 524288 bytes; set it to at least 2097152 (got 1048576)",
    ]


def test_validate_checks_every_rank_fits_in_the_memory_available(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("cpu_bytes_per_rank: 30GiB\n")
    status, out, _ = run(capsys, "config", "validate", str(file), "--world-size", "3")
    assert (status, out) == (0, f"{file}: valid kvtier configuration\n")
    status, out, err = run(capsys, "config", "validate", str(file), "--world-size", "4")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "invalid kvtier configuration: 1 problem",
        f"file {file}: cpu_bytes_per_rank: 4 ranks of 32212254720 bytes need 128849018880 bytes "
        "(120.0 GiB), more than the 107374182400 bytes (100.0 GiB) of memory available on this "
        "machine; lower cpu_bytes_per_rank (got 32212254720)",
    ]
    argv = ("config", "validate", str(file), "--world-size", "4", "--no-memory-check")
    status, out, _ = run(capsys, *argv)
    assert (status, out) == (0, f"{file}: valid kvtier configuration\n")


def test_validate_rejects_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # errors cut values at 80 characters, more than a tmp_path can be
    missing = Path("absent.toml")
    status, _, err = run(capsys, "config", "validate", str(missing))
    assert status == 2
    assert err.splitlines()[1] == (
        f"argument config_file: config_file: no such file (got '{missing}')"
    )


def test_validate_rejects_bad_env_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "kvtier.toml"
    file.write_text("store_mode = 'lazy'\n")
    monkeypatch.setenv("KVTIER_STORE_MODE", "sometimes")
    monkeypatch.setenv("KVTIER_CPU_BYTES", "0")
    status, _, err = run(capsys, "config", "validate", str(file))
    assert status == 2
    assert err.splitlines() == [
        "invalid kvtier configuration: 2 problems",
        "env KVTIER_CPU_BYTES: cpu_bytes: Input should be greater than 0 (got '0')",
        "env KVTIER_STORE_MODE: store_mode: Input should be 'eager' or 'lazy' (got 'sometimes')",
    ]


def test_show_reports_each_value_and_its_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("cpu_bytes: 1GiB\n")
    monkeypatch.setenv("KVTIER_COPY__STREAMS", "2")
    status, out, _ = run(capsys, "config", "show", str(file))
    assert status == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["cpu_bytes"] == ["1GiB", "file", str(file)]
    assert rows["copy.streams"] == ["2", "env", "KVTIER_COPY__STREAMS"]
    assert rows["store_mode"] == ['"eager"', "default"]
    status, out, _ = run(capsys, "config", "show", "--json")
    shown = json.loads(out)
    assert shown["config"]["copy"] == {"type": "torch", "streams": 2}
    assert shown["sources"]["cpu_bytes"] == "default"


def test_show_prints_sizes_in_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_CPU_BYTES", "1.5GiB")
    monkeypatch.setenv("KVTIER_CPU_BYTES_PER_RANK", "500000001")
    status, out, _ = run(capsys, "config", "show")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert status == 0
    assert rows["cpu_bytes"] == ["1.5GiB", "env", "KVTIER_CPU_BYTES"]
    assert rows["cpu_bytes_per_rank"] == ["500000001", "env", "KVTIER_CPU_BYTES_PER_RANK"]
    status, out, _ = run(capsys, "config", "show", "--json")
    assert json.loads(out)["config"]["cpu_bytes"] == 1536 * 1024**2


def test_show_credits_a_json_valued_variable_to_itself(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_COPY", '{"type": "twin", "depth": 3}')
    monkeypatch.setenv("KVTIER_INDEX", '{"type": "prefix_arc"}')
    status, out, _ = run(capsys, "config", "show")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert status == 0
    assert rows["copy.type"] == ['"twin"', "env", "KVTIER_COPY"]
    assert rows["copy.depth"] == ["3", "env", "KVTIER_COPY"]
    assert rows["index.type"] == ['"prefix_arc"', "env", "KVTIER_INDEX"]
    assert all(row[-1] == "default" for key, row in rows.items() if key.startswith("index.h"))


def test_schema_includes_plugin_models(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "config", "schema")
    schema = json.loads(out)
    assert status == 0
    assert {"TorchConfig", "TwinConfig", "AutoConfig", "LRUConfig"} <= set(schema["$defs"])


def test_reference_renders_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "config", "reference", "--all")
    assert status == 0
    for key in ("cpu_bytes", "cpu_bytes_per_rank", "store_mode", "copy.streams", "copy.depth"):
        assert f"| `{key}` |" in out
    assert "### `copy.type: twin`" in out


def test_delegated_command_gets_its_own_parser(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[argparse.Namespace] = []
    module = types.ModuleType("fake_bench")
    module.add_arguments = lambda parser: parser.add_argument("--block-bytes", type=int)  # type: ignore[attr-defined]
    module.run = lambda args: seen.append(args) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_bench", module)
    monkeypatch.setitem(cli.DELEGATED, ("bench", "copy"), ("fake_bench", "benchmark"))
    assert run(capsys, "bench", "copy", "--block-bytes", "4096")[0] == 0
    assert seen == [argparse.Namespace(block_bytes=4096)]


def test_missing_delegated_module_is_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(cli.DELEGATED, ("simulate",), ("kvtier_no_such_module", "replay"))
    status, _, err = run(capsys, "simulate", "trace.jsonl")
    assert status == 1
    assert "kvtier simulate: not available in this installation" in err


def test_help_texts_cover_every_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.DELEGATED, ("simulate",), ("kvtier_no_such_module", "replay"))
    texts = cli.help_texts()
    assert texts["kvtier config validate"].startswith("usage: kvtier config validate")
    assert texts["kvtier simulate"] == (
        "kvtier simulate: not available in this installation (kvtier_no_such_module is missing)\n"
    )
    assert {"kvtier", "kvtier plugins", "kvtier config show", "kvtier bench copy"} <= set(texts)


def test_every_option_with_a_default_shows_it_in_its_help() -> None:
    parsers = [(("kvtier",), cli._build_parser())]
    missing = []
    while parsers:
        words, parser = parsers.pop()
        delegate = parser.get_default("delegate")
        if delegate is not None:
            parsers.append((delegate, cli._delegated_parser(delegate)[0]))
            continue
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(((*words, name), child) for name, child in action.choices.items())
            elif action.nargs != 0 and action.default is not None and action.help:
                helped = " ".join(action.help.split())
                shown = helped if "(default" in helped else f"{helped} (default: {action.default})"
                if shown not in text:
                    missing.append(f"{' '.join(words)} {action.dest}")
    assert missing == []
    assert "(default: 1)" in cli.help_texts()["kvtier config validate"]


def test_unknown_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["plugins", "--yaml"])
    assert caught.value.code == 2
    assert "unrecognized arguments: --yaml" in capsys.readouterr().err


def test_cli_module_imports_no_heavy_dependency() -> None:
    code = (
        "import sys, kvtier.cli; heavy = ('torch', 'numpy', 'vllm', 'kvtier.simulator'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout == "[]\n"


def test_python_dash_m_kvtier_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    assert "usage: kvtier" in result.stdout
    for command in ("plugins", "config", "bench", "simulate"):
        assert command in result.stdout
