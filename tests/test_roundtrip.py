"""End-to-end round trips: a synthetic engine stores blocks, evicts, and loads them back."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.copy.base import CopyBackend
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.layout.base import KVLayout
from kvtier.plugins import default_registry
from kvtier.testing.engine import LAYOUTS, EngineSpec, OffloadedEngine
from kvtier.testing.faults import FlakyBackend

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]
BLOCK_TOKENS = 4


def torch_backend(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
    registry = default_registry()
    config = registry.get("copy_backends", "torch").config_model()
    return registry.build("copy_backends", config, layout, host_buffer)  # type: ignore[no-any-return]


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
