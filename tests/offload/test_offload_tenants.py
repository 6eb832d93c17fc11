"""Tenants' salts through the offload path: records sealed per tenant, read only by it."""

from __future__ import annotations

import time

import pytest

from kvtier.index.base import BlockKey
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace
from kvtier.offload import LazyCandidate, OffloadManager, OffloadSession, WorkerReport
from kvtier.tiers import TierSpec
from kvtier.tiers.chain import TierChain
from kvtier.tiers.record import RecordKeys
from tests.offload.conftest import BLOCK_TOKENS, PROMPT_BLOCKS, prompt, torch_backend
from tests.support.engine import EngineSpec, OffloadedEngine, SyntheticEngine
from tests.support.tiers import MemoryTier

KEYS = RecordKeys([bytes(range(32))])
SALT_A = b"tenant-a"
SALT_B = b"tenant-b"


def engine_on(store: dict[BlockKey, bytes]) -> tuple[OffloadedEngine, MemoryTier]:
    """An engine whose keyed lower tier is ``store``; its host tier holds one prompt."""
    spec = EngineSpec(num_blocks=24, block_tokens=BLOCK_TOKENS)
    record_bytes = SyntheticEngine(spec).layout.record_bytes
    keys = KeyNamespace("model-a", "layout", 0, 1)
    tier = MemoryTier(TierSpec(record_bytes, keys), store=store, record_keys=KEYS)
    index = PolicyIndex(PROMPT_BLOCKS + 1, LRUPolicy())
    chain = TierChain([("memory", tier)])
    return OffloadedEngine(spec, index, torch_backend, chains=[chain]), tier


def serve(engine: OffloadedEngine, seed: int, salt: bytes | None) -> None:
    engine.submit(prompt(seed), salt=salt)
    deadline = time.monotonic() + 10
    while not engine.idle:
        assert time.monotonic() < deadline, "the engine did not drain"
        engine.step()
        time.sleep(0.001)


def test_a_tenants_demoted_and_flushed_blocks_hit_only_with_its_salt() -> None:
    store: dict[BlockKey, bytes] = {}
    first, _ = engine_on(store)
    serve(first, 1, SALT_A)
    serve(first, 2, SALT_A)  # evicts prompt 1 from the host tier: demoted, sealed for A
    first.step()
    assert first.manager.stats().demoted_blocks >= 1
    first.close()  # writes prompt 2's blocks, still in the host tier, sealed for A
    assert len(store) == 2 * PROMPT_BLOCKS
    assert first.manager.requests.salts == {}  # forgotten with the requests
    # a block's salt is kept while the host tier holds the block, no longer
    assert len(first.manager.requests.block_salts) <= PROMPT_BLOCKS + 1

    same, _ = engine_on(store)
    serve(same, 1, SALT_A)
    serve(same, 2, SALT_A)
    assert same.stats.tier_hit_blocks == same.manager.stats().promoted_blocks
    assert same.stats.tier_hit_blocks >= 2 * PROMPT_BLOCKS - 1
    assert same.mismatches == []
    same.close()

    for salt in (SALT_B, None):
        other, tier = engine_on(store)
        serve(other, 1, salt)
        assert other.manager.stats().promoted_blocks == 0
        assert other.stats.tier_hit_blocks == 0
        assert tier.stats().errors.keys() == {"tenant"}
        other.close()  # rewrites prompt 1 for its own tenant (the keys are the same here)


@pytest.mark.parametrize("salt", [None, SALT_A])
def test_records_of_a_request_without_a_salt_are_sealed_as_before(salt: bytes | None) -> None:
    store: dict[BlockKey, bytes] = {}
    engine, _ = engine_on(store)
    serve(engine, 1, salt)
    engine.close()
    record = next(iter(store.values()))
    tenant_byte = 41  # after the scheme byte; see kvtier.tiers.record
    assert record[tenant_byte] == (salt is not None)


def test_lazy_stores_of_a_salted_requests_blocks_carry_its_salt_down_the_chain() -> None:
    m = OffloadManager(
        PolicyIndex(8, LRUPolicy()), block_tokens=BLOCK_TOKENS, record_bytes=100,
        store_mode="lazy", write_policies=("write_through",),
    )  # fmt: skip
    session = OffloadSession(m)
    hashes = {block: bytes([block]) * 8 for block in range(1, 5)}  # block 0: vLLM's null block
    for request_id, blocks, salt in (("a", [1, 2, 3], SALT_A), ("b", [4], None)):
        mine = [hashes[block] for block in blocks]
        session.arrived(request_id, mine, len(blocks) * BLOCK_TOKENS + 1, salt=salt)
        prefetches = m.build_plan().promotions  # the lower tier has none of them
        assert [promotion.salt for promotion in prefetches] == [salt]
        m.process(WorkerReport(promoted={p.batch_id: (1, 0) for p in prefetches}))
        m.allocated(request_id, mine, [blocks], 0, 0)
        tokens = len(blocks) * BLOCK_TOKENS + 1  # every block full and computed
        m.scheduled(
            request_id, num_computed_tokens=tokens, new_block_ids=[blocks], block_hashes=mine
        )
        m.finished(request_id, tokens)  # the engine offers its blocks from the frontier
    offered = [LazyCandidate(block_hash, 0, block) for block, block_hash in hashes.items()]
    (store,) = m.build_plan(offered).stores
    assert store.device_blocks == (1, 2, 3, 4)
    assert store.salts == (SALT_A, SALT_A, SALT_A, None)
    m.process(WorkerReport(done={store.batch_id: 1}))
    writes = {write.salt: len(write.block_hashes) for write in m.build_plan().write_throughs}
    assert writes == {SALT_A: 3, None: 1}
