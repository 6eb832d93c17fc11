"""Tests of kvtier.config: sources, precedence, provenance, and one test per kind of bad input."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ByteSize, TypeAdapter, ValidationError

import kvtier
from kvtier import plugins
from kvtier.config import (
    DEFAULT_CPU_BYTES,
    ConfigError,
    KVTierConfig,
    SectionConfig,
    available_memory_bytes,
    config_model,
    format_bytes,
    load_config,
    parse_bytes,
)
from kvtier.index.lru import LRUConfig
from kvtier.index.prefix_arc import PrefixARCConfig
from kvtier.kinds import COPY_BACKEND, Kind
from kvtier.plugins import Registry
from tests.config.conftest import (
    BAD_EXPLICIT,
    LONG_VALUES,
    NATIVE_BOUNDS,
    AutoConfig,
    Sections,
    TorchConfig,
    TwinConfig,
    make_registry,
)
from tests.conftest import REPO_ROOT


def lines_of(caught: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return caught.value.lines


def test_defaults_fill_every_field(registry: Registry) -> None:
    config = load_config(env={}, registry=registry)
    assert config.cpu_bytes == DEFAULT_CPU_BYTES
    assert config.cpu_bytes_per_rank is None
    assert config.store_mode == "eager"
    defaults = (PrefixARCConfig(), TorchConfig(), AutoConfig())
    assert (config.index, config.copy, config.layout) == defaults
    assert set(config.sources().values()) == {"default"}
    assert isinstance(config, KVTierConfig)


def test_config_is_frozen(registry: Registry) -> None:
    config = load_config(env={}, registry=registry)
    with pytest.raises(ValueError, match="frozen"):
        config.cpu_bytes = 1  # type: ignore[misc]


def test_config_pickles_with_its_sources(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugins, "_default_registry", registry)
    config = load_config({"copy": "twin", "cpu_bytes": "1GiB"}, env={}, registry=registry)
    restored = pickle.loads(pickle.dumps(config))
    assert restored == config
    assert restored.source_of("copy.type") == "explicit"


def test_explicit_beats_env_beats_file(tmp_path: Path, registry: Registry) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("cpu_bytes: 1GiB\nstore_mode: lazy\ncopy:\n  streams: 2\n")
    env = {"KVTIER_CONFIG": str(file), "KVTIER_STORE_MODE": "eager", "KVTIER_COPY__STREAMS": "3"}
    config = load_config({"copy": {"streams": 4}}, env=env, registry=registry)
    assert (config.cpu_bytes, config.store_mode, config.copy) == (
        1024**3,
        "eager",
        TorchConfig(streams=4),
    )
    assert config.source_of("cpu_bytes") == f"file {file}"
    assert config.source_of("store_mode") == "env KVTIER_STORE_MODE"
    assert config.source_of("copy.streams") == "explicit"
    assert config.source_of("copy.type") == "default"
    assert config.source_of("layout.type") == "default"


def test_toml_file_named_by_argument_and_by_explicit_key(
    tmp_path: Path, registry: Registry
) -> None:
    file = tmp_path / "kvtier.toml"
    file.write_text('cpu_bytes_per_rank = "512MiB"\n[copy]\ntype = "twin"\ndepth = 8\n')
    by_argument = load_config(env={}, registry=registry, config_file=file)
    by_key = load_config({"config_file": str(file)}, env={}, registry=registry)
    assert by_argument == by_key
    assert by_key.cpu_bytes_per_rank == 512 * 1024**2
    assert by_key.copy == TwinConfig(depth=8)


def test_switching_type_drops_the_lower_sources_settings(
    tmp_path: Path, registry: Registry
) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("copy:\n  type: torch\n  streams: 2\n")
    config = load_config({"copy": "twin"}, env={}, registry=registry, config_file=file)
    assert config.copy == TwinConfig()
    assert config.source_of("copy.depth") == "default"
    assert config.source_of("copy.type") == "explicit"


def test_env_variables_nest_with_double_underscores(registry: Registry) -> None:
    env = {
        "KVTIER_COPY__TYPE": "twin",
        "KVTIER_COPY__DEPTH": "5",
        "KVTIER_CPU_BYTES": "2 GB",
        "KVTIER_LOAD_PLUGINS": "",
        "OTHER": "ignored",
    }
    config = load_config(env=env, registry=registry)
    assert (config.copy, config.cpu_bytes) == (TwinConfig(depth=5), 2 * 1000**3)
    assert config.source_of("copy.depth") == "env KVTIER_COPY__DEPTH"


def test_env_json_value_sets_a_whole_section(registry: Registry) -> None:
    config = load_config(env={"KVTIER_COPY": '{"type": "twin", "depth": 3}'}, registry=registry)
    assert config.copy == TwinConfig(depth=3)


SETTINGS = {
    "cpu_bytes": ("KVTIER_CPU_BYTES", st.integers(1, 2**40)),
    "store_mode": ("KVTIER_STORE_MODE", st.sampled_from(["eager", "lazy"])),
    "copy.streams": ("KVTIER_COPY__STREAMS", st.integers(1, 64)),
}


def nest(flat: dict[str, object]) -> dict[str, object]:
    tree: dict[str, object] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})  # type: ignore[assignment]
        node[leaf] = value
    return tree


@settings(max_examples=60, deadline=None)
@given(
    chosen=st.fixed_dictionaries(
        {
            path: st.lists(st.tuples(st.sampled_from(["file", "env", "explicit"]), values))
            for path, (_, values) in SETTINGS.items()
        }
    )
)
def test_highest_source_wins_and_is_reported(
    chosen: dict[str, list[tuple[str, object]]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    registry = make_registry(Sections())
    by_source: dict[str, dict[str, object]] = {"file": {}, "env": {}, "explicit": {}}
    for path, settings_of_path in chosen.items():
        for source, value in settings_of_path:
            by_source[source][path] = value
    file = tmp_path_factory.mktemp("config") / "kvtier.yaml"
    file.write_text(yaml.safe_dump(nest(by_source["file"])))
    env = {SETTINGS[path][0]: str(value) for path, value in by_source["env"].items()}
    config = load_config(nest(by_source["explicit"]), env=env, registry=registry, config_file=file)
    dumped = config.model_dump()
    for path, (variable, _) in SETTINGS.items():
        section, _, key = path.rpartition(".")
        actual = dumped[section][key] if section else dumped[key]
        for source, label in (
            ("explicit", "explicit"),
            ("env", f"env {variable}"),
            ("file", f"file {file}"),
        ):
            if path in by_source[source]:
                assert (actual, config.source_of(path)) == (by_source[source][path], label)
                break
        else:
            assert config.source_of(path) == "default"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("8GiB", 8 * 1024**3),
        ("512 MB", 512 * 1000**2),
        ("3kib", 3072),
        (7, 7),
        ("1.5GiB", 1536 * 1024**2),
        ("64G", 64 * 1000**3),
        ("500MB", 500 * 1000**2),
        ("0.5 tb", 500 * 1000**3),
        (".25KiB", 256),
        ("2k", 2000),
        ("1.5", 1),
        ("9223372036854775807", 2**63 - 1),
    ],
)
def test_parse_bytes_accepts_units(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text",
    ["1.5GiB", "64G", "500MB", "0.5 tb", ".25KiB", "2k", "7", "1 EiB", "3m", "1.1GB", "999gib"],
)
def test_sizes_mean_what_pydantic_bytesize_means(text: str) -> None:
    assert parse_bytes(text) == TypeAdapter(ByteSize).validate_python(text)


@pytest.mark.parametrize("text", ["1.GB", "8GiB of it", "1kbit", "1Ki", "-1", "1e9", "GiB", ""])
def test_parse_bytes_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="expected a number of bytes such as"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (8 * 1024**3, "8GiB"),
        (1536 * 1024**2, "1.5GiB"),
        (64 * 1000**3, "64GB"),
        (4096, "4KiB"),
        (1000001, "1000001"),
        (1, "1"),
        (2**63 - 1, "9223372036854775807"),
    ],
)
def test_format_bytes_is_short_and_exact(count: int, shown: str) -> None:
    assert format_bytes(count) == shown
    assert parse_bytes(shown) == count


def test_host_slots_split_over_ranks_and_per_rank_override(registry: Registry) -> None:
    config = load_config({"cpu_bytes": 10_000}, env={}, registry=registry)
    assert config.host_slots(record_bytes=1000, world_size=1) == 10
    assert config.host_slots(record_bytes=1000, world_size=4) == 2
    per_rank = load_config(
        {"cpu_bytes": 10_000, "cpu_bytes_per_rank": 3000}, env={}, registry=registry
    )
    assert per_rank.host_slots(record_bytes=1000, world_size=4) == 3


def test_schema_includes_every_plugin_model(registry: Registry) -> None:
    schema = config_model(registry).model_json_schema()
    assert {"TorchConfig", "TwinConfig", "AutoConfig", "LRUConfig"} <= set(schema["$defs"])
    assert schema["properties"]["copy"]["discriminator"]["propertyName"] == "type"
    assert schema["additionalProperties"] is False


def test_direct_construction_keeps_sections_as_plain_data(registry: Registry) -> None:
    config = KVTierConfig(index=LRUConfig(), copy=TwinConfig(), layout=AutoConfig())
    assert (config.index, config.copy) == (LRUConfig(), TwinConfig())
    plain = KVTierConfig(copy={"type": "torch"}, index="lru", layout={})
    assert (plain.copy, plain.index, plain.layout) == (
        SectionConfig(type="torch"),
        SectionConfig(type="lru"),
        SectionConfig(type="auto"),
    )
    assert KVTierConfig(copy={"depth": 3}).copy == SectionConfig(type="torch", depth=3)
    assert type(load_config(env={}, registry=registry)) is KVTierConfig


def test_building_from_plain_data_validates_against_the_plugins_model(
    registry: Registry,
) -> None:
    config = KVTierConfig(copy={"type": "twin", "depth": 3})
    assert registry.build(COPY_BACKEND, config.copy, None, None) == ("twin", TwinConfig(depth=3))
    wrong = KVTierConfig(copy={"type": "twin", "depth": "deep"})
    with pytest.raises(ValidationError, match="depth"):
        registry.build(COPY_BACKEND, wrong.copy, None, None)


def test_plain_and_loaded_configs_compare_by_their_settings(registry: Registry) -> None:
    assert KVTierConfig() == load_config({}, env={}, registry=registry)
    assert hash(KVTierConfig()) == hash(load_config({}, env={}, registry=registry))
    given = {"cpu_bytes": "1GiB", "copy": {"type": "twin", "depth": 3}}
    loaded = load_config(given, env={}, registry=registry)
    assert loaded.source_of("cpu_bytes") == "explicit"
    assert KVTierConfig(**given) == loaded, "where a value came from is not compared"
    assert KVTierConfig(copy={"type": "torch", "streams": 1}) != KVTierConfig()
    assert KVTierConfig(copy="twin") != loaded


def test_constructing_a_config_loads_no_plugin_and_imports_no_torch() -> None:
    code = (
        "from kvtier.config import KVTierConfig; KVTierConfig(); import sys; "
        "assert 'torch' not in sys.modules; "
        "seen = set(sys.modules); from kvtier.plugins import DEFAULT_PLUGINS; "
        "loaded = {'kvtier.plugins', *DEFAULT_PLUGINS} & seen; assert not loaded, loaded"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=env
    )
    assert result.returncode == 0, result.stderr


def test_importing_the_config_installs_no_warning_filter() -> None:
    code = (
        "import warnings; before = list(warnings.filters); "
        "import kvtier.config; kvtier.config.config_model(); "
        "assert warnings.filters == before, warnings.filters[: len(warnings.filters) - len(before)]"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**env, "KVTIER_LOAD_PLUGINS": ""},
    )
    assert result.returncode == 0, result.stderr


# One test per kind of bad input: each gives `<source>: <path>: <message> (got <value>)` lines.


def test_unknown_type_lists_the_installed_choices(registry: Registry) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(BAD_EXPLICIT["unknown type"], env={}, registry=registry)
    assert lines_of(caught) == [
        "explicit: copy.type: unknown copy backend type; installed: torch, twin (got 'turbo')"
    ]
    assert str(caught.value).startswith("invalid kvtier configuration: 1 problem\n")


def test_unknown_key_at_top_level_and_in_a_section(registry: Registry) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(BAD_EXPLICIT["unknown keys"], env={}, registry=registry)
    assert lines_of(caught) == [
        "explicit: copy.stream: unknown key; valid keys here: streams, type (got 2)",
        "explicit: cpu_byte: unknown key; valid keys here: close_timeout_s, copy, "
        "copy_deadline_s, cost_guard, cost_guard_margin, cpu_bytes, cpu_bytes_per_rank, "
        "flush_deadline_s, index, layout, namespace, pin_max_s, pin_share, prefetch, "
        "report_deadline_s, same_step_load_bytes, store_mode, "
        "tiers (got 5)",
    ]
    assert str(caught.value).startswith("invalid kvtier configuration: 2 problems\n")


@pytest.mark.parametrize("case", ["zero size", "negative size", "zero size with a unit"])
def test_zero_or_negative_size(case: str, registry: Registry) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(BAD_EXPLICIT[case], env={}, registry=registry)
    size = BAD_EXPLICIT[case]["cpu_bytes_per_rank"]
    assert lines_of(caught) == [
        f"explicit: cpu_bytes_per_rank: Input should be greater than 0 (got {size!r})"
    ]


def test_deadlines_are_seconds_with_defaults_and_bounds(registry: Registry) -> None:
    config = load_config(env={"KVTIER_CLOSE_TIMEOUT_S": "0"}, registry=registry)
    assert (config.copy_deadline_s, config.report_deadline_s) == (10.0, 30.0)
    assert config.close_timeout_s == 0
    with pytest.raises(ConfigError) as caught:
        load_config(BAD_EXPLICIT["deadlines"], env={}, registry=registry)
    assert lines_of(caught) == [
        "explicit: copy_deadline_s: Input should be greater than 0 (got 0)",
        "explicit: report_deadline_s: Input should be a valid number, unable to parse string "
        "as a number (got 'soon')",
        "explicit: close_timeout_s: Input should be less than or equal to 3600 (got 7200)",
    ]


def test_size_below_one_block_names_cpu_bytes_and_its_source(registry: Registry) -> None:
    config = load_config(env={"KVTIER_CPU_BYTES": "6000"}, registry=registry)
    with pytest.raises(ConfigError) as caught:
        config.host_slots(record_bytes=4096, world_size=2)
    assert lines_of(caught) == [
        "env KVTIER_CPU_BYTES: cpu_bytes: 3000 bytes per rank over 2 rank(s) is below one block "
        "record of 4096 bytes; set it to at least 8192 (got 6000)"
    ]


def test_size_below_one_block_names_cpu_bytes_per_rank(registry: Registry) -> None:
    config = load_config({"cpu_bytes_per_rank": 100}, env={}, registry=registry)
    with pytest.raises(ConfigError) as caught:
        config.host_slots(record_bytes=4096)
    assert lines_of(caught) == [
        "explicit: cpu_bytes_per_rank: below one block record of 4096 bytes; "
        "set it to at least 4096 (got 100)"
    ]


def test_wrong_type(registry: Registry) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(BAD_EXPLICIT["wrong types"], env={}, registry=registry)
    assert lines_of(caught) == [
        "explicit: cpu_bytes: Input should be a valid integer (got [1])",
        "explicit: store_mode: Input should be 'eager' or 'lazy' (got 3)",
        "explicit: copy.streams: Input should be a valid integer, unable to parse string as an "
        "integer (got 'many')",
    ]


def test_missing_file(tmp_path: Path, registry: Registry) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(env={"KVTIER_CONFIG": str(missing)}, registry=registry)
    assert lines_of(caught) == [f"env KVTIER_CONFIG: config_file: no such file (got '{missing}')"]


def test_unparseable_yaml(tmp_path: Path, registry: Registry) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text("copy: [torch\n")
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, registry=registry, config_file=file)
    (line,) = lines_of(caught)
    assert line.startswith(f"file {file}: (file): cannot parse YAML: ")
    assert "line 2" in line and line.endswith(f"(got '{file}')")


def test_unparseable_toml(tmp_path: Path, registry: Registry) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("cpu_bytes = = 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, registry=registry, config_file=file)
    (line,) = lines_of(caught)
    assert line.startswith(f"file {file}: (file): cannot parse TOML: ")


def test_json_file(tmp_path: Path, registry: Registry) -> None:
    file = tmp_path / "kvtier.json"
    file.write_text('{"cpu_bytes": "1.5GiB", "copy": {"type": "twin", "depth": 3}}')
    config = load_config(env={}, registry=registry, config_file=file)
    assert (config.cpu_bytes, config.copy) == (1536 * 1024**2, TwinConfig(depth=3))
    assert config.source_of("copy.depth") == f"file {file}"
    file.write_text('{"cpu_bytes": 1,}')
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, registry=registry, config_file=file)
    (line,) = lines_of(caught)
    assert line.startswith(f"file {file}: (file): cannot parse JSON: Expecting property name ")


def test_file_of_unknown_type_or_shape(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # errors cut values at 80 characters, more than a tmp_path can be
    ini_file = Path("kvtier.ini")
    ini_file.write_text("{}")
    with pytest.raises(ConfigError) as caught:
        load_config({"config_file": str(ini_file)}, env={}, registry=registry)
    assert lines_of(caught) == [
        f"explicit: config_file: unknown file type; use .yaml, .yml, .toml or .json "
        f"(got '{ini_file}')"
    ]
    list_file = Path("list.yaml")
    list_file.write_text("- 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, registry=registry, config_file=list_file)
    assert lines_of(caught) == [
        f"file {list_file}: (file): the top level must be a mapping of config keys (got [1])"
    ]


def test_bad_env_variables(registry: Registry) -> None:
    env = {
        "KVTIER_CPU_BYTES": "lots",
        "KVTIER_COPY__": "x",
        "KVTIER_BOGUS": "1",
        "KVTIER_INDEX": "{not json",
    }
    with pytest.raises(ConfigError) as caught:
        load_config(env=env, registry=registry)
    assert lines_of(caught) == [
        "env KVTIER_COPY__: copy.: not a config path; write KVTIER_<FIELD>, nesting sections with "
        "a double underscore, e.g. KVTIER_CPU_BYTES or KVTIER_COPY__TYPE (got 'x')",
        "env KVTIER_INDEX: index: value looks like JSON but is not: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1) (got '{not json')",
        "env KVTIER_CPU_BYTES: cpu_bytes: expected a number of bytes such as 8589934592, '8GiB', "
        "'1.5GiB', '64G' or '512MB' (got 'lots')",
        "env KVTIER_BOGUS: bogus: unknown key; valid keys here: close_timeout_s, copy, "
        "copy_deadline_s, cost_guard, cost_guard_margin, cpu_bytes, cpu_bytes_per_rank, "
        "flush_deadline_s, index, layout, namespace, pin_max_s, pin_share, prefetch, "
        "report_deadline_s, same_step_load_bytes, store_mode, "
        "tiers (got '1')",
    ]


def test_missing_default_implementation_says_what_to_set() -> None:
    registry = make_registry()
    with pytest.raises(ConfigError) as caught:
        load_config(BAD_EXPLICIT["no plugin installed"], env={}, registry=registry)
    assert lines_of(caught) == [
        "default: index: required: the default block index 'prefix_arc' is not installed; set "
        "index.type to one of: none (got nothing)",
        "explicit: copy: no copy backend is installed; install a plugin that provides one "
        "(got {'type': 'torch'})",
        "default: layout: required: the default layout resolver 'auto' is not installed; set "
        "layout.type to one of: none (got nothing)",
    ]


def test_json_env_value_names_the_variable_set(registry: Registry) -> None:
    env = {"KVTIER_COPY": '{"type": "nope"}', "KVTIER_INDEX": '{"type": "lru", "size": 1}'}
    with pytest.raises(ConfigError) as caught:
        load_config(env=env, registry=registry)
    assert lines_of(caught) == [
        "env KVTIER_INDEX: index.size: unknown key; valid keys here: type (got 1)",
        "env KVTIER_COPY: copy.type: unknown copy backend type; installed: torch, twin "
        "(got 'nope')",
    ]


# Hostile input: every limit answers with one line, in bounded time and size.


def nested(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


def test_explicit_values_nested_too_deep_or_cyclic(registry: Registry) -> None:
    cyclic: dict[str, object] = {}
    cyclic["self"] = cyclic
    for explicit in ({"bogus": nested(5000)}, {"copy": cyclic}):
        with pytest.raises(ConfigError) as caught:
            load_config(explicit, env={}, registry=registry)
        (line,) = lines_of(caught)
        assert line.startswith("explicit: (root): nested more than 32 levels deep (got {")


def test_explicit_values_sharing_containers_are_counted_expanded(registry: Registry) -> None:
    laughs: object = ["lol"] * 10
    for _ in range(9):
        laughs = [laughs] * 10
    with pytest.raises(ConfigError) as caught:
        load_config({"bogus": laughs}, env={}, registry=registry)
    (line,) = lines_of(caught)
    assert line.startswith("explicit: (root): more than 10000 values; a config needs far fewer")


def test_env_json_nested_too_deep_or_unreadable(registry: Registry) -> None:
    env = {
        "KVTIER_INDEX": "[" * 5000 + "]" * 5000,
        "KVTIER_COPY__DEPTH": "[" * 40 + "]" * 40,
        "KVTIER_CPU_BYTES": f"[1{'0' * 5000}]",
    }
    with pytest.raises(ConfigError) as caught:
        load_config(env=env, registry=registry)
    assert [line.split(" (got ")[0] for line in lines_of(caught)] == [
        "env KVTIER_COPY__DEPTH: copy.depth: nested more than 32 levels deep",
        "env KVTIER_CPU_BYTES: cpu_bytes: value looks like JSON but is not: Exceeds the limit "
        "(4300 digits) for integer string conversion: value has 5001 digits; use "
        "sys.set_int_max_str_digits() to increase the limit",
        "env KVTIER_INDEX: index: nested more than 32 levels deep",
    ]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("deep.yaml", "x: " + "[" * 40 + "]" * 40, "nested more than 32 levels deep"),
        ("deep.toml", "x = " + "[" * 5000 + "]" * 5000, "nested more than 32 levels deep"),
        ("alias.yaml", "a: &a 1\nb: *a\n", "cannot parse YAML: found alias *a; kvtier does not"),
        ("digits.toml", f"cpu_bytes = 1{'0' * 5000}", "cannot parse TOML: Exceeds the limit"),
        ("date.yaml", "cpu_bytes: 2001-13-45", "cannot parse YAML: month must be in 1..12"),
    ],
    ids=["YAML 40 levels", "TOML 5000 levels", "YAML alias", "TOML 5000 digits", "YAML date"],
)
def test_file_content_python_cannot_hold(
    name: str, text: str, message: str, tmp_path: Path, registry: Registry
) -> None:
    file = tmp_path / name
    file.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, registry=registry, config_file=file)
    assert lines_of(caught)[0].startswith(f"file {file}: (file): {message}")


@pytest.mark.parametrize(("make", "shown"), LONG_VALUES.values(), ids=list(LONG_VALUES))
def test_error_values_are_cut_short(
    make: Callable[[], object], shown: str, registry: Registry
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"bogus": make()}, env={}, registry=registry)
    (line,) = lines_of(caught)
    got = line.partition(" (got ")[2]
    assert got.startswith(shown) and len(got) <= 81


def test_every_float_field_of_the_builtin_models_must_be_finite() -> None:
    from kvtier.plugins import default_registry

    models = [KVTierConfig, *(reg.config_model for reg in default_registry().all())]
    checked = 0
    for model in models:
        for name, info in model.model_fields.items():
            if info.annotation not in (float, float | None):
                continue
            checked += 1
            for bad in (float("inf"), float("-inf"), float("nan"), "inf", "nan"):
                with pytest.raises(ValueError, match=f"{name}\n  Input should be a finite number"):
                    model.model_validate({name: bad})
    assert checked >= 5


@pytest.mark.parametrize("factor", ["history_factor", "first_sight_memory_factor"])
def test_prefix_arc_memory_factors_are_bounded(factor: str) -> None:
    from kvtier.index.prefix_arc import PrefixARCPolicy

    with pytest.raises(ValueError, match="less than or equal to 1024"):
        PrefixARCConfig.model_validate({factor: 1e308})
    largest = PrefixARCConfig.model_validate({factor: 1024})
    policy = PrefixARCPolicy(
        10**9, largest.history_factor, first_sight_memory_factor=largest.first_sight_memory_factor
    )
    assert policy.num_slots == 10**9


@pytest.mark.parametrize(("kind", "name", "field", "value"), NATIVE_BOUNDS)
def test_integers_that_reach_native_code_are_bounded(
    kind: Kind[Any], name: str, field: str, value: int
) -> None:
    from kvtier.plugins import default_registry

    model = default_registry().get(kind, name).config_model
    with pytest.raises(ValueError, match=f"{field}\n  Input should be"):
        model.model_validate({field: value})


def test_available_memory_reads_meminfo_else_physical_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096 kB\nMemAvailable:   2048 kB\n")
    assert available_memory_bytes(meminfo) == 2048 * 1024
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo.write_text("MemTotal:       4096 kB\n")
    assert available_memory_bytes(meminfo) == physical
    assert available_memory_bytes(tmp_path / "absent") == physical


@pytest.mark.parametrize(
    ("explicit", "world_size", "ranks", "message"),
    [
        (
            {"cpu_bytes": 5000},
            1,
            1,
            "explicit: cpu_bytes: the host tier needs 5000 bytes (0.0 GiB), more than the 4096 "
            "bytes (0.0 GiB) of memory available on this machine; lower cpu_bytes (got 5000)",
        ),
        (
            {"cpu_bytes": 40_000},
            8,
            1,
            "explicit: cpu_bytes: one rank of 8 needs 5000 bytes (0.0 GiB), more than the 4096 "
            "bytes (0.0 GiB) of memory available on this machine; lower cpu_bytes (got 40000)",
        ),
        (
            {"cpu_bytes_per_rank": 2000},
            4,
            3,
            "explicit: cpu_bytes_per_rank: 3 ranks of 2000 bytes need 6000 bytes (0.0 GiB), more "
            "than the 4096 bytes (0.0 GiB) of memory available on this machine; lower "
            "cpu_bytes_per_rank (got 2000)",
        ),
    ],
)
def test_host_memory_check_names_the_field_and_both_numbers(
    explicit: dict[str, int], world_size: int, ranks: int, message: str, registry: Registry
) -> None:
    config = load_config(explicit, env={}, registry=registry)
    with pytest.raises(ConfigError) as caught:
        config.check_host_memory(world_size, ranks=ranks, available_bytes=4096)
    assert lines_of(caught) == [message]
    config.check_host_memory(world_size, ranks=ranks - 1 or 1, available_bytes=4096 * 2)


def test_host_memory_check_reads_the_machine_and_skips_when_unknown(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config({"cpu_bytes": "1000TiB"}, env={}, registry=registry)
    with pytest.raises(ConfigError, match="cpu_bytes: the host tier needs 1099511627776000 bytes"):
        config.check_host_memory()
    monkeypatch.setattr(kvtier.config.model, "available_memory_bytes", lambda: None)
    config.check_host_memory()


def test_file_larger_than_it_reports_is_read_no_further_than_the_limit(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # errors cut values at 80 characters, more than a tmp_path can be
    file = Path("kvtier.yaml")
    file.write_text("#" * (2 << 20))

    def zero_size(stat: Callable[..., os.stat_result]) -> Callable[..., os.stat_result]:
        # Keywords too: pytest's own report of a failure calls os.stat(path, follow_symlinks=...).
        def report(*args: object, **options: object) -> os.stat_result:
            fields = list(stat(*args, **options))
            fields[6] = 0  # st_size, as /proc reports it
            return os.stat_result(fields)

        return report

    monkeypatch.setattr(os, "stat", zero_size(os.stat))
    monkeypatch.setattr(os, "fstat", zero_size(os.fstat))
    with pytest.raises(ConfigError) as caught:
        load_config(env={}, registry=registry, config_file=file)
    assert lines_of(caught) == [
        "argument config_file: config_file: larger than the 1048576 bytes a config file may have "
        f"(got '{file}')"
    ]
