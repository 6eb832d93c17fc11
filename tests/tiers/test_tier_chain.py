"""TierChain: one rank's lower tiers, read in order for the longest prefix, written all at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig, load_config
from kvtier.keys import KeyNamespace
from kvtier.plugins import default_registry
from kvtier.testing.contracts_tier import block_hashes, make_spec, payloads
from kvtier.testing.tiers import MemoryTier
from kvtier.tiers.chain import Fetch, TierChain, tier_names

RECORD_BYTES = make_spec().record_bytes


def wait(fetch: Fetch) -> Fetch:
    deadline = time.monotonic() + 10
    while not fetch.done:
        assert time.monotonic() < deadline, "the fetch never finished"
        time.sleep(0.001)
    return fetch


def test_a_fetch_continues_in_the_next_tier_from_the_first_block_missed() -> None:
    first, second = MemoryTier(make_spec()), MemoryTier(make_spec())
    chain = TierChain([("disk", first), ("redis", second)])
    hashes = block_hashes("prompt", 6)
    records = payloads(6)
    first.put(first.keys.keys(hashes[:2]), records[:2]).result()
    second.put(second.keys.keys(hashes[2:5]), records[2:5]).result()
    fetch = wait(chain.fetch(0, hashes))
    assert [bytes(record) for record in fetch.records] == records[:5]
    assert fetch.sources == ["disk", "disk", "redis", "redis", "redis"]
    assert chain.take_counts() == {
        "disk": {
            "hits": 2,
            "misses": 4,
            "stores": 2,
            "bytes_read": 2 * RECORD_BYTES,
            "bytes_written": 2 * RECORD_BYTES,
        },
        "redis": {
            "hits": 3,
            "misses": 1,
            "stores": 3,
            "bytes_read": 3 * RECORD_BYTES,
            "bytes_written": 3 * RECORD_BYTES,
        },
    }
    assert chain.take_counts() == {}
    chain.close()


def test_store_writes_every_tier_and_a_stalled_one_drops_without_blocking() -> None:
    fast, stalled = MemoryTier(make_spec()), MemoryTier(make_spec(), queue_depth=1)
    stalled.gate.clear()
    chain = TierChain([("fast", fast), ("stalled", stalled)])
    started = time.monotonic()
    for round_ in range(4):
        hashes = block_hashes(f"round{round_}", 2)
        chain.store(0, hashes, payloads(2, seed=round_))
    assert time.monotonic() - started < 1.0
    counts = chain.take_counts()
    assert counts["stalled"]["queue_drops"] >= 2
    chain.close()
    assert len(fast.store) == 8


def test_tiers_of_a_config_are_built_for_the_rank(tmp_path: Path) -> None:
    config = load_config(
        {
            "namespace": "tenant-a",
            "tiers": [
                {"type": "disk", "path": str(tmp_path / "a"), "capacity_bytes": "1MiB"},
                {"type": "disk", "path": str(tmp_path / "b"), "capacity_bytes": "1MiB"},
            ],
        },
        env={},
    )
    keys = KeyNamespace("model", "layout", 1, 2)
    chain = TierChain.from_config(
        config, record_bytes=RECORD_BYTES, keys=keys, registry=default_registry()
    )
    assert [name for name, _ in chain.tiers] == ["disk0", "disk1"]
    for _, tier in chain.tiers:
        assert tier.keys == KeyNamespace("model", "layout", 1, 2, "tenant-a")
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == ["rank1-of2.kvtier"]
    chain.close()


def test_names_are_types_numbered_only_when_repeated() -> None:
    config = KVTierConfig(
        tiers=[{"type": "disk"}, {"type": "redis"}, {"type": "disk"}]  # type: ignore[list-item]
    )
    assert tier_names(config) == ["disk0", "redis", "disk1"]
    twins = [("a", MemoryTier(make_spec())), ("a", MemoryTier(make_spec()))]
    with pytest.raises(ValueError, match="must differ"):
        TierChain(twins)
    for _, tier in twins:
        tier.close()
