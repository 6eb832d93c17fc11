"""Random workloads through the manager, two workers and a flaky copy backend, checked each step."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.copy.base import CopyBackend, CopyBatch, Direction
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout
from kvtier.offload import StoreMode
from kvtier.plugins import default_registry
from tests.support.engine import EngineSpec, OffloadedEngine
from tests.support.faults import FlakyBackend

BLOCK_TOKENS = 2
NUM_SLOTS = 8
NUM_BLOCKS = 20
PREFIXES = [[random.Random(seed).randrange(1000) for _ in range(8)] for seed in range(3)]


class OffloadMachine(RuleBasedStateMachine):
    """Requests arrive, run, get preempted and finish while copies are slow or fail."""

    store_mode: StoreMode = "eager"

    def __init__(self) -> None:
        super().__init__()
        self.failing: set[int] = set()
        self.backends: list[FlakyBackend] = []
        registry = default_registry()
        copy_config = registry.get(COPY_BACKEND, "torch").config_model()

        def factory(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
            rank = len(self.backends)
            inner = registry.build(COPY_BACKEND, copy_config, layout, host_buffer)
            backend = FlakyBackend(
                inner,
                layout,
                host_buffer,
                fail=lambda batch, rank=rank: self._fails(rank, batch),
                delay_polls=rank,
            )
            self.backends.append(backend)
            return backend

        spec = EngineSpec(
            layout="flash_attn_hnd",
            num_blocks=NUM_BLOCKS,
            block_tokens=BLOCK_TOKENS,
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
        )
        self.engine = OffloadedEngine(
            spec,
            PolicyIndex(NUM_SLOTS, LRUPolicy()),
            factory,
            world_size=2,
            late_worker=1,
            store_mode=self.store_mode,
        )
        self.manager = self.engine.manager
        self.index = self.manager.index

    def _fails(self, rank: int, batch: CopyBatch) -> bool:
        return rank in self.failing

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        shared_blocks=st.integers(0, 4),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        decode_steps=st.integers(1, 3),
        cold=st.booleans(),
    )
    def arrive(
        self, prefix: int, shared_blocks: int, tail: list[int], decode_steps: int, cold: bool
    ) -> None:
        if cold:
            self.device_cache_pressure()
        self.engine.submit(PREFIXES[prefix][: shared_blocks * BLOCK_TOKENS] + tail, decode_steps)
        self.engine.step()

    @rule(steps=st.integers(1, 3))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.engine.step()

    @precondition(lambda self: bool(self.engine.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        victim = data.draw(st.sampled_from(self.engine.running))
        self.engine.step(preempt=[victim])

    @rule()
    def device_cache_pressure(self) -> None:
        for engine in self.engine.engines:
            engine.drop_cache()

    @rule(rank=st.integers(0, 1), on=st.sampled_from([True, False, False]))
    def failures(self, rank: int, on: bool) -> None:
        if on:
            self.failing.add(rank)
        else:
            self.failing.discard(rank)

    @rule(chance=st.integers(0, 4))
    def reset(self, chance: int) -> None:
        if chance:
            return  # a reset empties the tier: keep it rare so loads get exercised
        self.manager.reset()
        assert self.index.stats().readable == 0, "reset left a readable block"

    @invariant()
    def slots_are_accounted_for(self) -> None:
        stats = self.index.stats()
        held = stats.free + stats.writing + stats.readable + stats.discarded
        assert held == NUM_SLOTS, "slot leak"
        assert stats.writing == len(self.manager.ledger.writing)

    @invariant()
    def copies_never_share_a_slot_with_a_writer(self) -> None:
        store_slots: list[int] = []
        load_slots: set[int] = set()
        for batch in self.manager.ledger.batches.values():
            transfer = batch.transfer
            if transfer.direction is Direction.STORE:
                store_slots.extend(transfer.host_slots)
                for key in batch.keys:
                    assert self.index.slot_of(key) is None, "readable before its store completed"
            else:
                load_slots.update(transfer.host_slots)
                for key, slot in zip(batch.keys, transfer.host_slots, strict=True):
                    # a block another request failed to load is discarded, but its
                    # slot stays held by this load's pin until the load ends
                    current = self.index.slot_of(key)
                    assert current == slot or (current is None and self.index.stats().discarded), (
                        "a block being loaded lost its slot"
                    )
        assert len(store_slots) == len(set(store_slots)), "two stores write one slot"
        assert not load_slots & set(store_slots), "a slot being read is being rewritten"
        assert self.index.stats().pinned >= len(load_slots)

    @invariant()
    def bytes_are_right(self) -> None:
        assert self.engine.mismatches == []

    def teardown(self) -> None:
        self.failing.clear()
        try:
            self.engine.drain()
            assert self.manager.num_requests == 0
            assert self.manager.num_inflight_batches == 0
            stats = self.index.stats()
            assert stats.pinned == 0 and stats.writing == 0
            assert stats.free + stats.readable == NUM_SLOTS
            for engine in self.engine.engines:
                assert engine.num_free == NUM_BLOCKS, "device blocks leaked"
            assert self.engine.mismatches == []
        finally:
            self.engine.close()


class LazyOffloadMachine(OffloadMachine):
    """The same workload with lazy stores from the engine's eviction frontier."""

    store_mode: StoreMode = "lazy"


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,
)
TestOffloadMachine = OffloadMachine.TestCase
TestOffloadMachine.settings = SETTINGS
TestLazyOffloadMachine = LazyOffloadMachine.TestCase
TestLazyOffloadMachine.settings = SETTINGS
