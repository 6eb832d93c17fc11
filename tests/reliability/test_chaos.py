"""Chaos: 10,000 requests on two ranks while copies fail, stall, hang and raise, ranks fall
silent and the tier is reset; every loaded byte is checked, and nothing leaks at the end."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kvtier.copy.base import CopyBackend, CopyBatch
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import hash_token_blocks
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout
from kvtier.offload import StoreMode
from kvtier.plugins import default_registry
from tests.support.engine import EngineSpec, OffloadedEngine
from tests.support.faults import FlakyBackend, ManualClock

SEED = 7
REQUESTS = 10_000
BLOCK_TOKENS = 2
NUM_SLOTS = 48
NUM_BLOCKS = 32
STEP_S = 0.01
"""Simulated time per engine step; the deadlines below are a few steps long."""
PROMPTS = [[random.Random(seed).randrange(1000) for _ in range(16)] for seed in range(16)]

FAULTS_PER_BATCH = {"fail": 0.03, "hang": 0.01, "submit_bug": 0.005, "poll_bug": 0.005}
"""Chance that a batch, on one rank, fails, hangs, or raises from submit or from a poll."""


class Chaos:
    """Draws at most one fault per batch and rank from one seeded generator.

    :class:`FlakyBackend` asks ``submit_bug`` first about every batch; that
    call draws the batch's fault and the other predicates report it. One
    fault per batch leaves out the one harm kvtier cannot prevent: a load
    abandoned while its copy still runs, which later fails and writes noise
    into device blocks the engine is already recomputing.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.on = True
        self.fault: str | None = None
        self.backends: list[FlakyBackend] = []

    def factory(self, layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
        registry = default_registry()
        config = registry.get(COPY_BACKEND, "torch").config_model(cpu_threads=1)
        backend = FlakyBackend(
            registry.build(COPY_BACKEND, config, layout, host_buffer),
            layout,
            host_buffer,
            delay_polls=len(self.backends),
            submit_bug=self._draw,
            fail=self._drawn("fail"),
            hang=self._drawn("hang"),
            poll_bug=self._drawn("poll_bug"),
        )
        self.backends.append(backend)
        return backend

    def _draw(self, batch: CopyBatch) -> bool:
        self.fault = None
        roll = self.rng.random()
        for fault, chance in FAULTS_PER_BATCH.items():
            if self.on and roll < chance:
                self.fault = fault
                break
            roll -= chance
        return self.fault == "submit_bug"

    def _drawn(self, fault: str) -> Callable[[CopyBatch], bool]:
        return lambda batch: self.fault == fault


def check_host_records(engine: OffloadedEngine, keys: set[bytes]) -> int:
    """Compare every readable block's host record, on every rank, with the key's values."""
    index = engine.manager.index
    readable = {key: index.slot_of(engine.manager.namespace.key(key)) for key in keys}
    readable = {key: slot for key, slot in readable.items() if slot is not None}
    for rank_engine, worker in zip(engine.engines, engine.workers, strict=True):
        scratch = rank_engine.allocate(1)[0]
        layout = rank_engine.layout
        for key, slot in readable.items():
            rank_engine.compute(scratch, key)
            record = worker.tier.buffer[slot]
            for region, offset in zip(layout.regions, layout.record_offsets, strict=True):
                expected = region.view[scratch]
                assert torch.equal(record[offset : offset + region.bytes_per_block], expected), (
                    f"host slot {slot} holds wrong bytes for {key.hex()[:12]} in {region.name}"
                )
        rank_engine.free([scratch])
    return len(readable)


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
def test_chaos(store_mode: StoreMode) -> None:
    rng = random.Random(f"{SEED}-{store_mode}")
    chaos = Chaos(rng)
    clock = ManualClock()
    spec = EngineSpec(
        num_blocks=NUM_BLOCKS, block_tokens=BLOCK_TOKENS, num_layers=1, num_kv_heads=1, head_dim=4
    )
    engine = OffloadedEngine(
        spec,
        PolicyIndex(NUM_SLOTS, LRUPolicy()),
        chaos.factory,
        world_size=2,
        store_mode=store_mode,
        copy_deadline_s=5 * STEP_S,
        report_deadline_s=20 * STEP_S,
        close_timeout_s=10 * STEP_S,
        clock=clock,
        sleep=clock.sleep,
    )
    keys = {key for tokens in PROMPTS for key in hash_token_blocks(tokens, BLOCK_TOKENS)}
    submitted = resets = 0
    try:
        while submitted < REQUESTS:
            while engine.num_waiting < 3 and submitted < REQUESTS:
                prompt = rng.choice(PROMPTS)[: rng.randint(1, 8) * BLOCK_TOKENS]
                engine.submit([*prompt, rng.randrange(1000, 2000)], rng.randint(1, 2))
                submitted += 1
            roll = rng.random()
            if roll < 0.01:
                engine.silence(rng.randrange(2), rng.randint(1, 40))
            elif roll < 0.015:
                engine.manager.reset()
                resets += 1
                assert engine.manager.index.stats().readable == 0
            elif roll < 0.06:
                rng.choice(chaos.backends).release_hung()
            elif roll < 0.2:
                for rank_engine in engine.engines:
                    rank_engine.drop_cache()
            preempt = [rng.choice(engine.running)] if engine.running and roll > 0.95 else []
            clock.advance(STEP_S)
            engine.step(preempt)
            stats = engine.manager.index.stats()
            assert stats.free + stats.writing + stats.readable + stats.discarded == NUM_SLOTS
        chaos.on = False
        for backend in chaos.backends:
            backend.release_hung()
        engine.drain(max_steps=500)
        assert engine.mismatches == []
        assert engine.manager.num_requests == 0
        assert engine.manager.num_quarantined_batches == 0
        stats = engine.manager.index.stats()
        assert (stats.pinned, stats.writing, stats.discarded) == (0, 0, 0)
        assert stats.free + stats.readable == NUM_SLOTS, "slot leak"
        for rank_engine, worker in zip(engine.engines, engine.workers, strict=True):
            assert rank_engine.num_free == NUM_BLOCKS, "device blocks leaked"
            assert worker.num_inflight == 0 and worker.num_abandoned == 0
        assert check_host_records(engine, keys) == stats.readable
        offload = engine.manager.stats()
        run = engine.stats
        assert offload.quarantined_blocks == 0 and offload.rejected_reports == 0
        # the faults happened, and the tier still served and verified many hits
        assert resets > 10 and run.preemptions > 100
        assert offload.expired_batches > 10 and offload.abandoned_copies > 10
        assert offload.store_failures > 100 and offload.load_failures > 10
        assert run.tier_hit_blocks > 1000 and run.verified_blocks > 1000
        assert run.requests >= REQUESTS
        assert engine.manager.reset() is True, "with no copy left, a reset empties every slot"
    finally:
        engine.close()
