"""End-to-end round trips: a synthetic engine stores blocks, evicts, and loads them back."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.copy.base import CopyBackend
from kvtier.index.base import EventKind
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import hash_token_blocks
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout
from kvtier.offload import OffloadManager, OffloadWorker
from kvtier.plugins import default_registry
from kvtier.tiers import HostTier
from tests.support.engine import LAYOUTS, EngineSpec, OffloadedEngine, SyntheticEngine
from tests.support.faults import FlakyBackend

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]
BLOCK_TOKENS = 4


def torch_backend(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
    registry = default_registry()
    config = registry.get(COPY_BACKEND, "torch").config_model()
    return registry.build(COPY_BACKEND, config, layout, host_buffer)


def late_backend(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
    return FlakyBackend(torch_backend(layout, host_buffer), layout, host_buffer, delay_polls=2)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(50_000) for _ in range(rng.randint(2, 5) * BLOCK_TOKENS + 1)]
        for _ in range(count)
    ]


def run_roundtrip(engine: OffloadedEngine, seed: int) -> None:
    first = prompts(seed, 8)
    for tokens in first:
        engine.submit(tokens)
    engine.drain()
    stored = engine.manager.stats()
    assert stored.stored_blocks > engine.manager.index.num_slots, "no eviction was forced"
    assert stored.evicted_blocks > 0
    for rank_engine in engine.engines:
        rank_engine.drop_cache()
    for tokens in reversed(first):
        engine.submit(tokens)
    engine.drain()
    assert engine.mismatches == []
    assert engine.stats.tier_hit_blocks > 0
    assert engine.stats.verified_blocks == engine.stats.tier_hit_blocks
    assert engine.stats.relocated_blocks > 0
    assert engine.manager.num_requests == 0
    assert engine.manager.index.stats().pinned == 0
    for rank_engine in engine.engines:
        assert rank_engine.num_free == engine.spec.num_blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_every_layout_and_dtype(layout: str, dtype: torch.dtype) -> None:
    spec = EngineSpec(layout=layout, num_blocks=24, block_tokens=BLOCK_TOKENS, dtype=dtype)
    engine = OffloadedEngine(spec, PolicyIndex(10, LRUPolicy()), torch_backend)
    try:
        run_roundtrip(engine, seed=LAYOUTS.index(layout))
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roundtrip_two_workers_one_late(layout: str, dtype: torch.dtype) -> None:
    spec = EngineSpec(layout=layout, num_blocks=24, block_tokens=BLOCK_TOKENS, dtype=dtype)
    engine = OffloadedEngine(
        spec, PolicyIndex(10, LRUPolicy()), late_backend, world_size=2, late_worker=1
    )
    try:
        run_roundtrip(engine, seed=100 + LAYOUTS.index(layout))
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["flash_attn_nhd", "mamba"])
def test_roundtrip_lazy_mode(layout: str) -> None:
    spec = EngineSpec(layout=layout, num_blocks=24, block_tokens=BLOCK_TOKENS)
    engine = OffloadedEngine(
        spec, PolicyIndex(10, LRUPolicy()), late_backend, world_size=2, store_mode="lazy"
    )
    try:
        run_roundtrip(engine, seed=7)
    finally:
        engine.close()


def test_stored_events_name_each_block_with_its_tokens_and_parent() -> None:
    spec = EngineSpec(num_blocks=24, block_tokens=BLOCK_TOKENS)
    engine = OffloadedEngine(spec, PolicyIndex(10, LRUPolicy()), torch_backend, record_events=True)
    try:
        requests = prompts(11, 6)
        for tokens in requests:
            engine.submit(tokens)
        engine.drain()
    finally:
        engine.close()
    blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
    for tokens in requests:
        keys = hash_token_blocks(tokens, BLOCK_TOKENS)
        for position, key in enumerate(keys):
            start = position * BLOCK_TOKENS
            parent = keys[position - 1] if position else None
            blocks[key] = (parent, tuple(tokens[start : start + BLOCK_TOKENS]))
    stored = [event for event in engine.events if event.kind is EventKind.STORED]
    assert len(stored) == engine.manager.stats().stored_blocks > 0
    for event in stored:
        assert (event.parent_hash, event.token_ids) == blocks[event.block_hash]
    evicted = [event for event in engine.events if event.kind is EventKind.EVICTED]
    assert len(evicted) == engine.manager.stats().evicted_blocks > 0
    assert engine.session.tokens.num_requests == 0, "finished requests are forgotten"


def test_roundtrip_two_kv_cache_groups_with_their_own_layouts() -> None:
    """Two kv-cache groups, each with its own tensors, layout and block ids."""
    attention = SyntheticEngine(EngineSpec(layout="flash_attn_hnd", num_blocks=12))
    other = SyntheticEngine(EngineSpec(layout="flashinfer", num_blocks=12))
    assert other.layout.record_bytes == attention.layout.record_bytes
    groups = [attention, other]
    manager = OffloadManager(
        PolicyIndex(6, LRUPolicy()),
        block_tokens=BLOCK_TOKENS,
        record_bytes=attention.layout.record_bytes,
        num_groups=2,
    )
    worker = OffloadWorker(
        [attention.layout, other.layout],
        HostTier(6, attention.layout.record_bytes),
        torch_backend,
    )

    def run_step() -> None:
        worker.bind(manager.build_plan())
        worker.get_finished()
        manager.process(worker.take_report())

    tokens = list(range(3 * BLOCK_TOKENS + 1))
    keys = hash_token_blocks(tokens, BLOCK_TOKENS)
    first = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for group, engine in enumerate(groups):
        for position, key in enumerate(keys):
            engine.compute(first[group][position], key + bytes([group]))
    manager.scheduled(
        "a", num_computed_tokens=len(keys) * BLOCK_TOKENS, new_block_ids=first, block_hashes=keys
    )
    run_step()
    assert manager.finished("a") is False
    assert manager.lookup("b", keys, 0, len(tokens)) == 3 * BLOCK_TOKENS
    second = [[8, 9, 10, 11], [0, 1, 2, 3]]
    manager.allocated("b", keys, second, 0, 3 * BLOCK_TOKENS)
    run_step()
    for group, engine in enumerate(groups):
        for position, key in enumerate(keys):
            assert engine.mismatches(second[group][position], key + bytes([group])) == []
    worker.close()
