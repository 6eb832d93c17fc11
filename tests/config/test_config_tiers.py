"""The ``tiers`` list: entries checked against their storage tier's model, one line per error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import Field

import kvtier
from kvtier import cli, hookspecs, plugins
from kvtier.config import ConfigError, KVTierConfig, PluginConfig, config_model, load_config
from kvtier.config_reference import render_config_reference, render_storage_tier_reference
from kvtier.default_plugins import storage_tiers as tier_plugin
from kvtier.kinds import STORAGE_TIER
from kvtier.plugins import Registry
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.redis_config import RedisTierConfig
from tests.config.conftest import Sections, make_registry

PASSWORD = "hunter2-secret"


class MemoryTierConfig(PluginConfig):
    """A third-party tier, registered through the same hook as the built-ins."""

    type: Literal["memory"] = "memory"
    blocks: int = Field(gt=0, description="Records held.")


class MemoryTierPlugin:
    @kvtier.hookimpl
    def register_storage_tiers(self, register: hookspecs.Register) -> None:
        register("memory", lambda config, spec: ("memory", config), MemoryTierConfig)


@pytest.fixture
def registry() -> Registry:
    return make_registry(Sections(), tier_plugin, MemoryTierPlugin())


def problems(registry: Registry, values: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(values, env={}, registry=registry)
    return caught.value.lines


def test_each_entry_is_its_plugins_own_config_in_order(registry: Registry, tmp_path: Path) -> None:
    config = load_config(
        {
            "namespace": "tenant-a",
            "tiers": [
                {"type": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"},
                {"type": "memory", "blocks": 8},
                {"type": "redis", "url": "redis://cache:6379/0"},
            ],
        },
        env={},
        registry=registry,
    )
    disk, memory, redis = config.tiers
    assert isinstance(disk, DiskTierConfig) and disk.capacity_bytes == 2**30
    assert isinstance(memory, MemoryTierConfig) and memory.blocks == 8
    assert isinstance(redis, RedisTierConfig)
    assert config.namespace == "tenant-a"
    assert load_config(env={}, registry=registry).tiers == ()
    # a plain config keeps each entry as given, to be checked where a registry is at hand
    plain = KVTierConfig(
        namespace="tenant-a",
        tiers=[
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"},
            {"type": "memory", "blocks": 8},
            {"type": "redis", "url": "redis://cache:6379/0"},
        ],
    )
    assert plain.tiers[1].type == "memory"


def test_tiers_come_from_an_env_variable(registry: Registry) -> None:
    env = {"KVTIER_TIERS": json.dumps([{"type": "memory", "blocks": 3}])}
    config = load_config(env=env, registry=registry)
    assert config.tiers == (MemoryTierConfig(blocks=3),)
    assert config.source_of("tiers") == "env KVTIER_TIERS"


def test_every_problem_is_one_line_naming_the_entry(registry: Registry) -> None:
    assert problems(
        registry,
        {
            "tiers": [
                {"type": "disk", "capacity_bytes": "1GiB"},
                {"type": "dsk"},
                {"blocks": 1},
                {"type": "memory", "blocks": 0, "color": "red"},
            ]
        },
    ) == [
        "explicit: tiers[0].path: Field required (got nothing)",
        "explicit: tiers[1].type: unknown storage tier type; installed: disk, memory, mooncake, "
        "redis, s3 (got 'dsk')",
        "explicit: tiers[2]: missing 'type'; installed storage tier types: disk, memory, "
        "mooncake, redis, s3 (got {'blocks': 1})",
        "explicit: tiers[3].blocks: Input should be greater than 0 (got 0)",
        "explicit: tiers[3].color: unknown key; valid keys here: blocks, type (got 'red')",
    ]


def test_a_bad_url_is_reported_without_its_password(registry: Registry) -> None:
    lines = problems(registry, {"tiers": [{"type": "redis", "url": f"http://:{PASSWORD}@h:1"}]})
    assert lines == [
        "explicit: tiers[0].url: expected a redis:// or rediss:// URL (got '**********')"
    ]


@pytest.mark.parametrize(
    "url",
    [
        "redis://cache:6379/0",
        "rediss://user:pw@[::1]:6380/15",
        "redis://cache?password=pw&db=3&protocol=3",
        "redis://cache/2?client_name=engine-a&health_check_interval=30&socket_keepalive=yes",
    ],
)
def test_urls_the_client_reads_as_meant_are_accepted(registry: Registry, url: str) -> None:
    config = load_config({"tiers": [{"type": "redis", "url": url}]}, env={}, registry=registry)
    assert isinstance(config.tiers[0], RedisTierConfig)


def test_tiers_of_one_store_are_refused_but_other_stores_of_a_type_are_not(
    registry: Registry, tmp_path: Path
) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "b")
    entries = [
        {"type": "disk", "path": str(tmp_path / "a"), "capacity_bytes": "1GiB"},
        {"type": "disk", "path": str(tmp_path / "b"), "capacity_bytes": "1GiB"},
        {"type": "redis", "url": "redis://cache:6379/0"},
        {"type": "redis", "url": "redis://cache:6379/0", "namespace": "tenant-b"},
        {"type": "memory", "blocks": 1},
        {"type": "memory", "blocks": 2},
    ]
    assert len(load_config({"tiers": entries}, env={}, registry=registry).tiers) == 6
    aliased = {"type": "disk", "path": str(tmp_path / "link"), "capacity_bytes": "2GiB"}
    assert problems(registry, {"tiers": [*entries, aliased]}) == [
        f"explicit: tiers: tiers[6] has the same store (disk path {tmp_path / 'b'}) as tiers[1]; "
        "list each store once: remove one entry, or point it at another store (got ['disk', "
        "'disk', 'redis', 'redis', 'memory', 'memory', ...])"
    ]
    assert problems(registry, {"tiers": [*entries, entries[4]]})[0].startswith(
        "explicit: tiers: tiers[6] has the same settings as tiers[4];"
    )


def test_no_storage_tier_installed(registry: Registry) -> None:
    bare = make_registry(Sections())
    assert problems(bare, {"tiers": [{"type": "disk"}]}) == [
        "explicit: tiers[0]: no storage tier is installed; install a plugin that provides one, "
        "or remove the entry (got {'type': 'disk'})"
    ]


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 2), (4, 4), (64, 4)])
def test_disk_io_threads_default_to_four_or_the_usable_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpus: int, threads: int
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert DiskTierConfig(path=tmp_path, capacity_bytes="1GiB").io_threads == threads
    assert DiskTierConfig(path=tmp_path, capacity_bytes="1GiB", io_threads=8).io_threads == 8


def test_schema_and_reference_cover_the_tiers(registry: Registry) -> None:
    schema = config_model(registry).model_json_schema()
    valid = {"tiers": [{"type": "memory", "blocks": 2}, {"type": "redis", "url": "redis://h/0"}]}
    jsonschema.validate(valid, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tiers": [{"type": "memory", "blocks": "two"}]}, schema)
    reference = render_config_reference(registry)
    assert "| `tiers` |" in reference and "| `namespace` |" in reference
    tiers = render_storage_tier_reference(registry)
    for name, key in (("disk", "path"), ("redis", "url"), ("mooncake", "master_address")):
        assert f"### `type: {name}`" in tiers and f"| `{key}` |" in tiers


def test_config_show_masks_the_redis_password(
    registry: Registry,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plugins, "_default_registry", registry)
    file = tmp_path / "kvtier.yaml"
    file.write_text(f'tiers:\n  - {{type: redis, url: "redis://:{PASSWORD}@cache:6379/0"}}\n')
    for argv in (["config", "show", str(file)], ["config", "show", "--json", str(file)]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "redis" in out and PASSWORD not in out


def test_a_tier_key_is_named_never_given_and_required_where_asked(registry: Registry) -> None:
    key = "5e" * 32
    assert problems(
        registry,
        {
            "tiers": [
                {"type": "redis", "url": "redis://h/0", "require_key": True},
                {"type": "disk", "path": "/d", "capacity_bytes": 8192, "encrypt": True},
                {"type": "redis", "url": "redis://h/0", "key_env": key},
                {"type": "redis", "url": "redis://h/0", "key_env": "KVTIER_KEY"},
            ]
        },
    ) == [
        "explicit: tiers[0].require_key: require_key is true but this redis tier has no key; "
        "set key_file or key_env (got True)",
        "explicit: tiers[1].encrypt: encrypt is true but this disk tier has no key; set "
        "key_file or key_env (got True)",
        "explicit: tiers[2].key_env: expected the name of an environment variable (letters, "
        "digits and _, not starting with a digit), not a key (got '**********')",
        "explicit: tiers[3].key_env: KVTIER_* variables are read as config settings; name the "
        "key's variable without that prefix (got '**********')",
    ]


def test_config_show_never_prints_a_tier_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "c0ffee" * 11
    monkeypatch.setenv("TEST_TIER_KEY", key)
    (tmp_path / "tier.key").write_text(key)
    tiers = [
        {"type": "redis", "url": "redis://h/0", "key_env": "TEST_TIER_KEY", "encrypt": True},
        {"type": "disk", "path": str(tmp_path), "capacity_bytes": 8192, "key_file": "tier.key"},
    ]
    config_file = tmp_path / "kvtier.json"
    config_file.write_text(json.dumps({"tiers": tiers}))
    assert cli.main(["config", "show", str(config_file)]) == 0
    shown = capsys.readouterr().out
    assert "TEST_TIER_KEY" in shown and key not in shown


REQUIRED = "(required)"
PER_MACHINE = "(made per machine)"
SEALED = {
    "key_file": None,
    "key_env": None,
    "encrypt": False,
    "require_key": False,
    "codec": None,
}
REMOTE = {
    "required": True,
    "namespace": "",
    "queue_depth": 64,
    "write_policy": "write_through",
    "get_deadline_s": 1.0,
    "fault_memory_s": 60.0,
    "reconnect_backoff_s": 0.5,
    "reconnect_max_backoff_s": 30.0,
}
BUILT_IN_TIER_KEYS = {
    "disk": {
        **SEALED,
        "path": REQUIRED,
        "capacity_bytes": REQUIRED,
        "eviction": "lru",
        "preallocate": True,
        "o_direct": False,
        "namespace": "",
        "io_threads": PER_MACHINE,
        "queue_depth": 64,
        "write_policy": "write_back",
        "get_deadline_s": 1.0,
    },
    "redis": {
        **SEALED,
        **REMOTE,
        "url": REQUIRED,
        "cluster": False,
        "timeout_s": 1.0,
        "tls_ca_path": None,
        "io_threads": 2,
    },
    "mooncake": {
        **SEALED,
        **REMOTE,
        "master_address": REQUIRED,
        "metadata_server": REQUIRED,
        "protocol": "tcp",
        "rdma_devices": "",
        "local_hostname": "127.0.0.1",
        "global_segment_bytes": 0,
        "local_buffer_bytes": 64 << 20,
        "put_batch_bytes": 4 << 20,
        "replicas": 1,
        "soft_pin_ttl_s": None,
        "io_threads": 2,
    },
    "s3": {
        **SEALED,
        **REMOTE,
        "bucket": REQUIRED,
        "prefix": "kvtier/",
        "endpoint_url": None,
        "region": None,
        "addressing_style": "virtual",
        "profile": None,
        "tls_ca_path": None,
        "chunk_blocks": 8,
        "timeout_s": 2.0,
        "io_threads": 4,
        "put_deadline_s": 10.0,
    },
}
"""Every key of the built-in tiers and its default, as users write them: a key renamed,
dropped, added or given another default is a change to the config files users have."""


@pytest.mark.parametrize("name", sorted(BUILT_IN_TIER_KEYS))
def test_the_built_in_tiers_keep_their_keys_and_defaults(registry: Registry, name: str) -> None:
    keys = {}
    for key, field in registry.get(STORAGE_TIER, name).config_model.model_fields.items():
        if field.is_required():
            keys[key] = REQUIRED
        else:
            keys[key] = PER_MACHINE if field.default_factory else field.default
    assert keys == {"type": name, **BUILT_IN_TIER_KEYS[name]}
