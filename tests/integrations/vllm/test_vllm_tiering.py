"""kvtier's storage tiers below vLLM's own CPU tier: vLLM's TieringOffloadingManager on CPU.

Each scenario runs vLLM's own manager, which loads the kvtier secondary tier by
``module_path`` through its factory, with the disk tier and with a real Redis.
Marked ``vllm033`` too, so ``make test`` runs them under vLLM 0.33 as well.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import Locality, Medium  # noqa: E402

from kvtier.config import ConfigError, load_config  # noqa: E402
from kvtier.integrations.vllm.tiering import (  # noqa: E402
    ENTRY_KEYS,
    KVTierSecondaryTier,
    tier_config,
)
from kvtier.tiers.s3 import chunk_ends  # noqa: E402
from tests.support.s3_server import MotoS3Server, aws_test_environment  # noqa: E402
from tests.support.vllm_tiering import (  # noqa: E402
    TIER_CLASS,
    TIER_MODULE,
    chunk_bytes,
    chunk_keys,
    secondary_tier,
)

pytestmark = [pytest.mark.vllm, pytest.mark.vllm033]

Engine = Callable[..., Any]


def _tier(engine: Any) -> KVTierSecondaryTier:  # noqa: ANN401
    (tier,) = engine.manager.secondary_tiers
    assert isinstance(tier, KVTierSecondaryTier)
    return tier


def _stats_counters(engine: Any) -> dict[str, dict[tuple[str, ...], float]]:  # noqa: ANN401
    stats = engine.manager.get_stats()
    return {} if stats is None else stats.data["data"]


def test_a_store_cascades_into_the_kvtier_tier(
    tiering_engine: Engine, kvtier_tier: dict[str, Any]
) -> None:
    engine = tiering_engine(secondary_tier(kvtier_tier))
    keys = chunk_keys(4, "cascade")
    engine.store(keys)
    tier = _tier(engine)
    shared = kvtier_tier["type"] == "redis"
    assert tier.locality is (Locality.REMOTE if shared else Locality.LOCAL)
    assert tier.tier.stats().stores == 4
    assert tier.tier.contains(tier.tier_keys(keys)).result().present == (True,) * 4
    counters = _stats_counters(engine)
    assert counters["vllm:kvtier_tier_stores"] == {(kvtier_tier["type"],): 4}
    assert sum(counters["vllm:kv_offload_tiering_write_bytes"].values()) == 4 * 4096


def test_a_promotion_brings_every_byte_back(
    tiering_engine: Engine, kvtier_tier: dict[str, Any]
) -> None:
    engine = tiering_engine(secondary_tier(kvtier_tier))
    keys = chunk_keys(6, "promotion")
    engine.store(keys)
    engine.evict_cpu_tier()
    assert engine.lookup(keys) == 6
    assert engine.load(keys) == [chunk_bytes(key) for key in keys]
    counters = _stats_counters(engine)
    assert counters["vllm:kvtier_tier_hits"] == {(kvtier_tier["type"],): 6}
    assert sum(counters["vllm:kv_offload_tiering_read_bytes"].values()) == 6 * 4096


def test_absent_keys_miss_and_move_nothing(
    tiering_engine: Engine, kvtier_tier: dict[str, Any]
) -> None:
    engine = tiering_engine(secondary_tier(kvtier_tier))
    engine.store(chunk_keys(2, "present"))
    assert engine.lookup(chunk_keys(3, "absent")) == 0
    stats = _tier(engine).tier.stats()
    assert (stats.hits, stats.misses) == (0, 0), "no record was read"
    assert not engine.manager.has_pending_work()


def test_a_damaged_record_is_a_partial_failure_never_a_wrong_byte(
    tiering_engine: Engine,
    kvtier_tier: dict[str, Any],
    damage_record: Callable[[dict[str, Any], bytes], None],
) -> None:
    engine = tiering_engine(secondary_tier(kvtier_tier))
    keys = chunk_keys(4, "partial")
    engine.store(keys)
    engine.evict_cpu_tier()
    damage_record(kvtier_tier, chunk_bytes(keys[2]))
    # The damaged chunk fails its promotion; the prefix before it was loaded.
    assert engine.lookup(keys) == 2
    assert engine.load(keys[:2]) == [chunk_bytes(key) for key in keys[:2]]
    stats = _tier(engine).tier.stats()
    assert stats.errors == {"checksum": 1}
    failures = _stats_counters(engine)["vllm:kv_offload_tiering_promotion_job_failures"]
    assert sum(failures.values()) == 1, "the failed key was not promoted again every step"
    assert engine.lookup(keys) == 2


def test_chunks_survive_an_engine_restart(
    tiering_engine: Engine, kvtier_tier: dict[str, Any]
) -> None:
    keys = chunk_keys(5, "restart")
    first = tiering_engine(secondary_tier(kvtier_tier))
    first.store(keys)
    first.close()
    second = tiering_engine(secondary_tier(kvtier_tier))
    assert second.lookup(keys) == 5
    assert second.load(keys) == [chunk_bytes(key) for key in keys]


def test_records_are_sealed_with_the_tier_configs_keys(
    tiering_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERING_KEY", os.urandom(32).hex())
    disk = {"type": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": 64 * 8192}
    keyed = {**disk, "key_env": "TIERING_KEY", "require_key": True}
    keys = chunk_keys(3, "sealed")
    writer = tiering_engine(secondary_tier(keyed))
    writer.store(keys)
    writer.close()
    monkeypatch.setenv("TIERING_KEY", os.urandom(32).hex())
    stranger = tiering_engine(secondary_tier(keyed))
    assert stranger.lookup(keys) == 0, "a record sealed under another key is a miss"
    assert _tier(stranger).tier.stats().errors == {"auth": 3}


def test_vllm_declares_the_kvtier_tier_counters(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": "1MiB"}
    definitions = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [secondary_tier(disk)]}
    )
    for name in ("hits", "misses", "stores", "drops", "auth_failures", "errors"):
        assert definitions[f"vllm:kvtier_tier_{name}"].labelnames == ("tier",)


def test_backpressure_settings_reach_vllms_detector(
    tiering_engine: Engine, kvtier_tier: dict[str, Any]
) -> None:
    backpressure = {"backpressure_cls": "EMABackpressureDetector"}
    engine = tiering_engine(secondary_tier(kvtier_tier, backpressure=backpressure))
    detector = _tier(engine).bp_detector
    assert detector is not None
    engine.store(chunk_keys(3, "backpressure"))
    assert not detector.is_under_pressure()


def test_a_bad_tier_config_is_one_line_per_problem(tiering_engine: Engine, tmp_path: Path) -> None:
    bad = {"type": "disk", "path": str(tmp_path), "capacity_bytes": "lots", "colour": "blue"}
    with pytest.raises(ConfigError) as caught:
        tiering_engine(secondary_tier(bad))
    assert sorted(caught.value.lines) == [
        "vLLM secondary tier KVTierSecondaryTier: tier.capacity_bytes: "
        + caught.value.problems[0].message
        + " (got 'lots')",
        "vLLM secondary tier KVTierSecondaryTier: tier.colour: unknown key; valid keys here: "
        + caught.value.problems[1].message.split("valid keys here: ")[1]
        + " (got 'blue')",
    ]


def test_an_unknown_tier_type_lists_the_installed_ones(tiering_engine: Engine) -> None:
    with pytest.raises(ConfigError) as caught:
        tiering_engine(secondary_tier({"type": "tape"}))
    (line,) = caught.value.lines
    assert line.startswith("vLLM secondary tier KVTierSecondaryTier: tier.type: unknown")
    assert "disk" in line and "redis" in line and line.endswith("(got 'tape')")


def test_a_bad_locality_is_a_config_line(tiering_engine: Engine, tmp_path: Path) -> None:
    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": "1MiB"}
    with pytest.raises(ConfigError) as caught:
        tiering_engine(secondary_tier(disk, locality="nearby"))
    assert caught.value.lines == [
        "vLLM secondary tier KVTierSecondaryTier: locality: expected one of LOCAL, REMOTE "
        "(got 'nearby')"
    ]


def test_a_missing_tier_says_what_to_give(tiering_engine: Engine) -> None:
    entry = secondary_tier({})
    del entry["tier"]
    with pytest.raises(ConfigError) as caught:
        tiering_engine(entry)
    (line,) = caught.value.lines
    assert line.startswith("vLLM secondary tier KVTierSecondaryTier: tier: required")


def test_an_unknown_entry_key_is_a_config_line(tiering_engine: Engine, tmp_path: Path) -> None:
    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": "1MiB"}
    with pytest.raises(ConfigError) as caught:
        tiering_engine(secondary_tier(disk, namspace="tenant-a", enable_kv_events="yes"))
    assert sorted(caught.value.lines) == [
        "vLLM secondary tier KVTierSecondaryTier: namspace: unknown key; valid keys here: "
        f"{', '.join(ENTRY_KEYS)} (got 'tenant-a')",
    ]
    with pytest.raises(ConfigError) as caught:
        tiering_engine(secondary_tier(disk, enable_kv_events="yes"))
    assert caught.value.lines == [
        "vLLM secondary tier KVTierSecondaryTier: enable_kv_events: expected true or false "
        "(got 'yes')"
    ]


def test_enable_kv_events_publishes_the_stored_chunks(
    tiering_engine: Engine, kvtier_tier: dict[str, Any]
) -> None:
    engine = tiering_engine(secondary_tier(kvtier_tier, enable_kv_events=True), kv_events=True)
    keys = chunk_keys(4, "events")
    engine.store(keys)
    stored = [event for event in engine.manager.take_events() if event.medium is Medium.STORAGE]
    assert [(sorted(event.keys), event.removed) for event in stored] == [(sorted(keys), False)]
    assert stored[0].locality is _tier(engine).locality
    other = {**kvtier_tier, "path": kvtier_tier["path"] + "-2"} if "path" in kvtier_tier else None
    quiet = tiering_engine(secondary_tier(other or kvtier_tier), kv_events=True)
    quiet.store(chunk_keys(2, "quiet"))
    assert not [event for event in quiet.manager.take_events() if event.medium is Medium.STORAGE]


@pytest.fixture(scope="module")
def s3_server() -> Iterator[MotoS3Server]:
    started = MotoS3Server().start()
    try:
        yield started
    finally:
        started.stop()


def test_s3_objects_follow_prefix_order_so_a_shared_half_is_found(
    tiering_engine: Engine, s3_server: MotoS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM hands a store job's keys as a set; the s3 tier must still cut objects along the
    prefix, or a request sharing only the first half of it finds little of it."""
    for name, value in aws_test_environment().items():
        monkeypatch.setenv(name, value)
    chunk_blocks = 4
    s3 = {
        "type": "s3",
        "bucket": s3_server.create_bucket("kvtier-tiering-prefix"),
        "endpoint_url": s3_server.url,
        "addressing_style": "path",
        "chunk_blocks": chunk_blocks,
        "timeout_s": 10.0,
        "get_deadline_s": 10.0,
    }
    engine = tiering_engine(secondary_tier(s3), cpu_chunks=32)
    keys = chunk_keys(24, "halves")
    engine.store(keys)
    engine.evict_cpu_tier()
    ends = chunk_ends(_tier(engine).tier_keys(keys[:12]), chunk_blocks)
    # Found: every chunk up to the last chunk end among the first 12 (the rest of the
    # first half shares an object with chunks after it).
    found = max(position + 1 for position, end in enumerate(ends) if end)
    assert found >= 6, "the seed gives the shared half several chunk ends"
    assert engine.lookup(keys[:12]) == found
    assert engine.load(keys[:found]) == [chunk_bytes(key) for key in keys[:found]]


DOCS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "vllm-native.md"


def _documented_transfer_configs() -> dict[str, dict[str, Any]]:
    page = DOCS_PAGE.read_text()
    configs = [json.loads(text) for text in re.findall(r"--kv-transfer-config '(.*?)'", page, re.S)]
    return {config["kv_connector"]: config for config in configs}


def test_the_documented_configs_are_valid() -> None:
    configs = _documented_transfer_configs()
    load_config(configs["KVTierConnector"]["kv_connector_extra_config"], env={})
    native = configs["OffloadingConnector"]["kv_connector_extra_config"]
    assert native["spec_name"] == "TieringOffloadingSpec"
    for entry in native["secondary_tiers"]:
        assert (entry["type"], entry["module_path"]) == (TIER_CLASS, TIER_MODULE)
        tier_config(entry["tier"], entry.get("namespace", ""), entry["type"])


def test_the_documented_error_is_what_vllm_shows(tiering_engine: Engine) -> None:
    page = DOCS_PAGE.read_text()
    shown = re.search(r"```text\n(invalid kvtier configuration.*?)\n```", page, re.S)
    assert shown is not None
    with pytest.raises(ConfigError) as caught:
        tiering_engine(secondary_tier({"type": "tape"}))
    assert str(caught.value) == shown.group(1)
