"""TierChain: one rank's lower tiers, read in order for the longest prefix, written all at once."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig, load_config
from kvtier.index.base import BlockKey
from kvtier.keys import KeyNamespace
from kvtier.plugins import default_registry
from kvtier.testing.contracts_tier import block_hashes, make_spec, payloads
from kvtier.tiers.chain import Fetch, TierBlock, TierChain, tier_names
from kvtier.tiers.disk import SUPERBLOCK_BYTES, DiskTier, DiskTierConfig, build_disk_tier
from tests.support.tiers import MemoryTier

RECORD_BYTES = make_spec().record_bytes
DISK_BYTES = SUPERBLOCK_BYTES + 4 * DiskTier.slot_bytes_for(RECORD_BYTES)
"""A disk tier of four records."""


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


def test_a_probe_counts_the_leading_blocks_some_tier_holds_and_reads_none() -> None:
    first, second, skipped = (MemoryTier(make_spec()) for _ in range(3))
    chain = TierChain([("disk", first), ("redis", second), ("s3", skipped)])
    hashes = block_hashes("prompt", 6)
    records = payloads(6)
    first.put(first.keys.keys(hashes[:2] + hashes[3:4]), records[:3]).result()
    second.put(second.keys.keys(hashes[2:3]), records[3:4]).result()
    skipped.put(skipped.keys.keys(hashes[4:]), records[4:]).result()
    chain.take_counts()
    chain.read_times.clear()
    presence = chain.probe(0, hashes, frozenset({"s3"}))
    assert presence.wait(10)
    assert presence.held == 4, "blocks 0-3, each in one of the tiers asked; 4 only in s3"
    assert all(not counts.get("hits") for counts in chain.take_counts().values())
    # each answer is timed, for the cost guard, as a read that returned no record
    assert sorted((name, found) for name, found, _ in chain.read_times) == [
        ("disk", 0),
        ("redis", 0),
    ]
    assert chain.probe(0, hashes, frozenset({"disk", "redis", "s3"})).held == 0
    chain.close()


def test_store_writes_every_tier_and_a_stalled_one_drops_without_blocking() -> None:
    fast, stalled = MemoryTier(make_spec()), MemoryTier(make_spec(), queue_depth=1)
    stalled.gate.clear()
    chain = TierChain([("fast", fast), ("stalled", stalled)])
    started = time.monotonic()
    for round_ in range(4):
        hashes = block_hashes(f"round{round_}", 2)
        chain.store(0, hashes, payloads(2, seed=round_), (0, 1))
    assert time.monotonic() - started < 1.0
    counts = chain.take_counts()
    assert counts["stalled"]["queue_drops"] >= 2
    chain.close()
    assert len(fast.store) == 8


def test_with_report_blocks_the_chain_names_what_landed_and_what_the_tiers_removed(
    tmp_path: Path,
) -> None:
    disk_config = DiskTierConfig(path=tmp_path, capacity_bytes=DISK_BYTES)
    disk = build_disk_tier(disk_config, make_spec())
    hashes = block_hashes("landed", 6)
    refused = set(make_spec().keys.keys(hashes[2:], 1))

    def fail(op: str, keys: Sequence[BlockKey]) -> None:
        if refused.intersection(keys):
            raise OSError("the store refused the write")

    shared, failing = MemoryTier(make_spec()), MemoryTier(make_spec(), fail=fail)
    shared.shared = True
    chain = TierChain([("disk", disk), ("redis", shared), ("fails", failing)], report_blocks=True)
    # The first two land before the next four evict them: a disk slot being written is not
    # a victim, so four more puts while the first two are in flight would find two slots.
    for future in chain.store(1, hashes[:2], payloads(2), (0, 1, 2)):
        future.result(timeout=10)
    chain.store(1, hashes[2:], payloads(4, seed=1), (0, 1, 2))  # lands everywhere but in "fails"
    chain.close()
    stored, removed = chain.take_blocks()
    assert stored == {
        **{TierBlock("disk", False, 1, block_hash): 1 for block_hash in hashes},
        **{TierBlock("redis", True, 1, block_hash): 1 for block_hash in hashes},
        **{TierBlock("fails", False, 1, block_hash): 1 for block_hash in hashes[:2]},
    }
    assert removed == {TierBlock("disk", False, 1, block_hash): 1 for block_hash in hashes[:2]}
    assert chain.take_blocks() == ({}, {})


def test_without_report_blocks_the_chain_keeps_no_blocks(tmp_path: Path) -> None:
    disk_config = DiskTierConfig(path=tmp_path, capacity_bytes=DISK_BYTES)
    chain = TierChain([("disk", build_disk_tier(disk_config, make_spec()))])
    chain.store(0, block_hashes("quiet", 6), payloads(6), (0,))
    chain.close()
    assert chain.take_blocks() == ({}, {})


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
