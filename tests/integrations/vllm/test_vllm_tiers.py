"""End to end: real vLLM on CPU with disk, Redis and Mooncake tiers below a small host tier.

Engines run one after another in this process (vLLM keeps one worker connector
per process): each serves the same prompts, and every engine's tokens must
equal the first engine's, whatever it found in the lower tiers. Every tier has
its default write policy: the shared ones are written as blocks are stored, a
disk as the host tier evicts them and when the engine shuts down.
"""

from __future__ import annotations

import os
import random
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec
from kvtier.offload import OffloadStats
from tests.conftest import mount_tmpfs, unmount
from tests.integrations.vllm.conftest import BLOCK, manager_of, start_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]

RECORD_BYTES = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
PROMPT_BLOCKS = 6
PROMPTS = [
    [random.Random(seed).randrange(1000) for _ in range(PROMPT_BLOCKS * BLOCK + 5)]
    for seed in range(8)
]
"""Eight prompts of six full blocks: 48 blocks, far more than the host tier holds."""
HOST_BYTES = 8 * RECORD_BYTES
DEVICE = {"num_device_blocks": 64, "max_model_len": 512, "max_num_seqs": 4}
MAX_TOKENS = 3


def serve(llm: Any, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN401
    """The prompts' outputs, one at a time so each finds what the ones before it stored."""
    from kvtier.integrations.vllm.offline import generate, settle

    got = []
    for prompt in prompts:
        got.extend(generate(llm, [prompt], max_tokens=MAX_TOKENS))
        settle(llm)
    return got


def run(
    model: str, config: dict[str, Any], prompts: list[list[int]]
) -> tuple[list[list[int]], OffloadStats]:
    """Serve ``prompts`` on a fresh engine, shut it down; its outputs and its tier's stats."""
    from kvtier.integrations.vllm.offline import shutdown

    llm = start_engine(model, config, **DEVICE)
    try:
        got = serve(llm, prompts)
        stats = manager_of(llm).stats()
    finally:
        shutdown(llm)
    return got, stats


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("redis")
    from tests.support.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def redis_tier(server: Any) -> dict[str, Any]:  # noqa: ANN401
    return {
        "type": "redis",
        "url": server.url,
        "timeout_s": 0.5,
        "reconnect_backoff_s": 0.05,
        "reconnect_max_backoff_s": 0.2,
    }


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk-tier")


@pytest.fixture(scope="module")
def chain_config(disk_dir: Path, redis_server: Any) -> dict[str, Any]:  # noqa: ANN401
    disk = {"type": "disk", "path": str(disk_dir), "capacity_bytes": 256 * RECORD_BYTES}
    return {"cpu_bytes": HOST_BYTES, "tiers": [disk, redis_tier(redis_server)]}


@pytest.fixture(scope="module")
def first_run(
    model_dir: str,
    chain_config: dict[str, Any],
) -> tuple[list[list[int]], OffloadStats]:
    """Engine A: serves the prompts, demoting what the host tier evicts to disk and Redis."""
    return run(model_dir, chain_config, PROMPTS)


def test_a_restarted_engine_serves_disk_hits_with_identical_tokens(
    model_dir: str,
    disk_dir: Path,
    chain_config: dict[str, Any],
    first_run: tuple[list[list[int]], OffloadStats],
) -> None:
    expected, first = first_run
    assert first.demoted_blocks > 0 and first.promoted_blocks == 0
    assert first.written_through_blocks > 0
    assert first.tiers["disk"]["stores"] > 0 and first.tiers["redis"]["stores"] > 0
    # corrupt one record's payload: a miss, counted, never a wrong token
    from kvtier.tiers.disk import HEADER_AREA_BYTES, SUPERBLOCK_BYTES

    (file,) = disk_dir.glob("*.kvtier")
    with open(file, "r+b") as handle:
        handle.seek(SUPERBLOCK_BYTES + HEADER_AREA_BYTES + 100)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    got, stats = run(model_dir, chain_config, PROMPTS)
    assert got == expected
    # every block the first engine stored is found again: the one corrupted on disk in Redis
    assert stats.promoted_blocks == first.stored_blocks
    assert stats.loaded_blocks >= stats.promoted_blocks
    disk, redis = stats.tiers["disk"], stats.tiers["redis"]
    # a fetch keeps the leading hits only; Redis had the record corrupted on disk
    assert disk["hits"] + redis["hits"] >= stats.promoted_blocks
    assert disk["errors.checksum"] == 1 and redis["hits"] >= 1


def test_a_restart_finds_every_prefix_block_even_those_the_host_tier_never_evicted(
    model_dir: str, tmp_path: Path
) -> None:
    """Four prefixes of six blocks, used twice between fillers, on a 32-slot host tier: the
    host tier keeps the hot prefixes, so only a disk written at shutdown has them all."""
    rng = random.Random(36)
    prefixes = [[rng.randrange(1000) for _ in range(PROMPT_BLOCKS * BLOCK)] for _ in range(4)]

    def prefixed() -> list[list[int]]:
        return [prefix + [rng.randrange(1000) for _ in range(5)] for prefix in prefixes]

    fillers = [[rng.randrange(1000) for _ in range(PROMPT_BLOCKS * BLOCK + 5)] for _ in range(8)]
    disk = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 256 * RECORD_BYTES}
    config = {"cpu_bytes": 32 * RECORD_BYTES, "tiers": [disk]}
    run(model_dir, config, [*prefixed(), *fillers[:4], *prefixed(), *fillers[4:]])
    again = prefixed()
    got, stats = run(model_dir, config, again)
    assert stats.promoted_blocks == stats.loaded_blocks == 4 * PROMPT_BLOCKS
    vanilla = start_engine(model_dir, None, **DEVICE)
    try:
        assert got == serve(vanilla, again)
    finally:
        from kvtier.integrations.vllm.offline import shutdown

        shutdown(vanilla)


def test_another_tenant_on_the_same_stores_gets_no_hits(
    model_dir: str,
    chain_config: dict[str, Any],
    first_run: tuple[list[list[int]], OffloadStats],
) -> None:
    expected, _ = first_run
    got, stats = run(model_dir, {**chain_config, "namespace": "tenant-b"}, PROMPTS[:3])
    assert got == expected[:3]
    assert stats.promoted_blocks == 0
    assert stats.tiers["disk"].get("hits", 0) == stats.tiers["redis"].get("hits", 0) == 0


def test_an_engine_sharing_the_redis_and_a_redis_that_restarts(
    model_dir: str,
    redis_server: Any,  # noqa: ANN401
    first_run: tuple[list[list[int]], OffloadStats],
) -> None:
    from kvtier.integrations.vllm.offline import shutdown

    expected, _ = first_run
    config = {"cpu_bytes": HOST_BYTES, "tiers": [redis_tier(redis_server)]}
    llm = start_engine(model_dir, config, **DEVICE)
    try:
        # an engine on another machine finds every block engine A stored of these prompts
        assert serve(llm, PROMPTS[:3]) == expected[:3]
        before = manager_of(llm).stats()
        assert before.promoted_blocks == 3 * PROMPT_BLOCKS
        # the server dies: lookups miss and stores drop, counted; tokens stay right
        redis_server.kill()
        assert serve(llm, PROMPTS[3:6]) == expected[3:6]
        down = manager_of(llm).stats()
        assert down.tiers["redis"].get("errors.connection", 0) > 0
        # it comes back, empty: once the back-off window that the last failure
        # opened has passed, the next batch reconnects and stores again
        redis_server.start()
        time.sleep(redis_tier(redis_server)["reconnect_max_backoff_s"])
        assert serve(llm, PROMPTS[6:] + PROMPTS[:2]) == expected[6:] + expected[:2]
        after = manager_of(llm).stats()
        assert after.tiers["redis"]["stores"] > down.tiers["redis"].get("stores", 0)
    finally:
        shutdown(llm)


def test_a_disk_that_fills_up_drops_stores_and_keeps_tokens_right(
    model_dir: str,
    tmp_path: Path,
    first_run: tuple[list[list[int]], OffloadStats],
) -> None:
    from kvtier.tiers.disk import HEADER_AREA_BYTES, PAGE_BYTES, SUPERBLOCK_BYTES

    expected, _ = first_run
    slot_bytes = HEADER_AREA_BYTES + -(-RECORD_BYTES // PAGE_BYTES) * PAGE_BYTES
    small = tmp_path / "small"
    if not mount_tmpfs(small, SUPERBLOCK_BYTES + 4 * slot_bytes):
        pytest.skip("this process may not mount a tmpfs")
    try:
        disk = {
            "type": "disk",
            "path": str(small),
            "capacity_bytes": 256 * RECORD_BYTES,
            "preallocate": False,
        }
        got, stats = run(model_dir, {"cpu_bytes": HOST_BYTES, "tiers": [disk]}, PROMPTS[:4])
    finally:
        unmount(small)
    assert got == expected[:4]
    counts = stats.tiers["disk"]
    assert counts["errors.no_space"] > 0 and counts["drops"] >= counts["errors.no_space"]


@pytest.fixture(scope="module")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.support.mooncake_server import MooncakeStore, mooncake_binaries

    if mooncake_binaries() is None:
        pytest.skip("mooncake_master is not installed; `make install` installs kvtier[mooncake]")
    store = MooncakeStore(tmp_path_factory.mktemp("mooncake")).start()
    yield store
    store.stop()


def test_two_engines_one_after_the_other_share_a_mooncake_store(
    model_dir: str,
    mooncake_store: Any,  # noqa: ANN401
    first_run: tuple[list[list[int]], OffloadStats],
) -> None:
    expected, _ = first_run
    config = {"cpu_bytes": HOST_BYTES, "tiers": [mooncake_store.tier_settings()]}
    got, first = run(model_dir, config, PROMPTS)
    assert got == expected
    assert first.written_through_blocks > 0 and first.tiers["mooncake"]["stores"] > 0
    # the second engine finds every block the first one stored, and its tokens stay the same
    got, second = run(model_dir, config, PROMPTS[:3])
    assert got == expected[:3]
    assert second.promoted_blocks == 3 * PROMPT_BLOCKS
    assert second.tiers["mooncake"]["hits"] >= second.promoted_blocks


@pytest.fixture(scope="module")
def s3_tier() -> Iterator[dict[str, Any]]:
    """The s3 tier's config on a new bucket of moto's server; credentials in the environment."""
    pytest.importorskip("moto")
    from tests.support.s3_server import MotoS3Server, aws_test_environment

    with mock.patch.dict(os.environ, aws_test_environment()):
        server = MotoS3Server().start()
        try:
            yield {
                "type": "s3",
                "bucket": server.create_bucket("kvtier-vllm"),
                "endpoint_url": server.url,
                "addressing_style": "path",
                "timeout_s": 10.0,
                "get_deadline_s": 10.0,
            }
        finally:
            server.stop()


def test_a_second_engine_serves_the_first_engines_prefixes_from_an_s3_bucket(
    model_dir: str, s3_tier: dict[str, Any]
) -> None:
    # a prompt read at arrival in one read (not its share of the host tier, then the rest at
    # its lookup): the cost guard's warm-up of eight reads covers the second engine's prompts
    config = {"cpu_bytes": HOST_BYTES, "tiers": [s3_tier], "prefetch": {"max_host_share": 1.0}}
    expected, first = run(model_dir, config, PROMPTS)
    assert first.written_through_blocks > 0 and first.tiers["s3"]["stores"] > 0
    got, second = run(model_dir, config, PROMPTS)
    assert got == expected
    assert second.promoted_blocks == first.stored_blocks == len(PROMPTS) * PROMPT_BLOCKS
    assert second.tiers["s3"]["hits"] >= second.promoted_blocks
    assert "errors.server" not in second.tiers["s3"]


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_a_restart_serves_disk_hits_through_a_lossy_codec(
    model_dir: str, tmp_path: Path, codec: str
) -> None:
    """The lossy codecs halve the disk's records and still serve every prefix block after a
    restart; their tokens may differ from vanilla's, and the share that does not is printed
    (the codec page reports it)."""
    rng = random.Random(47)
    prompts = [[rng.randrange(1000) for _ in range(PROMPT_BLOCKS * BLOCK + 5)] for _ in range(4)]
    disk = {
        "type": "disk",
        "path": str(tmp_path),
        "capacity_bytes": 256 * RECORD_BYTES,
        "codec": codec,
    }
    config = {"cpu_bytes": 32 * RECORD_BYTES, "tiers": [disk]}
    run(model_dir, config, prompts)
    from kvtier.tiers.disk import SUPERBLOCK_BYTES, DiskTier

    (file,) = tmp_path.glob("*.kvtier")
    data = file.read_bytes()
    slot = DiskTier.slot_bytes_for(RECORD_BYTES)
    lengths = [  # each stored record's payload length, from its header
        struct.unpack_from("<Q", data, at + 8)[0]
        for at in range(SUPERBLOCK_BYTES, len(data), slot)
        if data[at : at + 4] == b"KVTR"
    ]
    assert len(lengths) >= 4 * PROMPT_BLOCKS
    assert all(length < RECORD_BYTES * 0.51 for length in lengths), "records were not encoded"
    got, stats = run(model_dir, config, prompts)
    assert stats.promoted_blocks == stats.loaded_blocks == 4 * PROMPT_BLOCKS
    assert "errors.codec" not in stats.tiers["disk"]
    vanilla = start_engine(model_dir, None, **DEVICE)
    try:
        expected = serve(vanilla, prompts)
    finally:
        from kvtier.integrations.vllm.offline import shutdown

        shutdown(vanilla)
    same = sum(
        a == b
        for ours, theirs in zip(got, expected, strict=True)
        for a, b in zip(ours, theirs, strict=True)
    )
    print(f"{codec}: {same} of {len(prompts) * MAX_TOKENS} greedy tokens equal vanilla's")
