"""Write policies of the tiers below the host tier: when blocks go down, once per tier."""

from __future__ import annotations

import pytest

from kvtier.index.base import BlockKey
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace
from kvtier.models import WritePolicy
from kvtier.offload import OffloadManager
from kvtier.tiers import TierSpec
from kvtier.tiers.chain import TierChain
from tests.offload.conftest import BLOCK_TOKENS, PROMPT_BLOCKS, serve, torch_backend
from tests.support.engine import EngineSpec, OffloadedEngine, SyntheticEngine
from tests.support.tiers import MemoryTier


class Stores:
    """Lower tiers that outlive the engines over them: one dict per tier, one rank."""

    def __init__(self, *policies: WritePolicy, **tier_settings: object) -> None:
        self.policies = policies
        self.stores: list[dict[BlockKey, bytes]] = [{} for _ in policies]
        self.tier_settings = tier_settings
        self.tiers: list[MemoryTier] = []
        """The tiers of the latest engine, in chain order."""

    def engine(self) -> OffloadedEngine:
        spec = EngineSpec(num_blocks=24, block_tokens=BLOCK_TOKENS)
        record_bytes = SyntheticEngine(spec).layout.record_bytes
        keys = KeyNamespace("model-a", "layout", 0, 1)
        self.tiers = [
            MemoryTier(TierSpec(record_bytes, keys), store=store, **self.tier_settings)
            for store in self.stores
        ]
        chain = TierChain([(f"tier{i}", tier) for i, tier in enumerate(self.tiers)], self.policies)
        # The host tier holds one prompt: a second prompt evicts the first.
        index = PolicyIndex(PROMPT_BLOCKS + 1, LRUPolicy())
        return OffloadedEngine(spec, index, torch_backend, chains=[chain])


def writes(tier: MemoryTier) -> list[BlockKey]:
    """Every key the tier wrote, once per write."""
    return [key for op, keys in tier.batches if op == "write" for key in keys]


def drain(engine: OffloadedEngine) -> None:
    """Step until the last reports' writes are handed to the tiers, then wait for them."""
    for _ in range(3):
        engine.step()
    for worker in engine.workers:
        assert worker.chain is not None
        for _, tier in worker.chain.tiers:
            # one I/O thread takes writes in order: this delete ends after them
            tier.delete([tier.keys.key(b"drain")]).result()


def reuse(engine: OffloadedEngine, seed: int) -> None:
    """Serve ``seed``'s prompt again from the host tier (the engine's own cache dropped)."""
    for rank_engine in engine.engines:
        rank_engine.drop_cache()
    serve(engine, seed)


def test_write_through_writes_each_stored_block_at_once_and_never_again() -> None:
    stores = Stores("write_through")
    engine = stores.engine()
    serve(engine, 1)
    drain(engine)
    (tier,) = stores.tiers
    assert len(stores.stores[0]) == PROMPT_BLOCKS, "written while the host tier still holds it"
    serve(engine, 2)  # evicts prompt 1: nothing more to write of it
    engine.close()
    stats = engine.manager.stats()
    assert stats.demoted_blocks == 0
    assert sorted(writes(tier)) == sorted(stores.stores[0]), "each block written once"
    assert len(stores.stores[0]) == 2 * PROMPT_BLOCKS
    # the last report made the last stores readable and no plan followed: the close wrote them
    (flushed,) = engine.workers[0].flush_counts.values()
    assert stats.written_through_blocks + flushed["flushed_blocks"] == 2 * PROMPT_BLOCKS
    assert flushed["flush_skipped_blocks"] == 0


def test_write_through_admitted_writes_a_block_at_its_first_reuse_only() -> None:
    stores = Stores("write_through_admitted")
    engine = stores.engine()
    serve(engine, 1)
    drain(engine)
    assert stores.stores[0] == {}, "stored once, not reused yet"
    reuse(engine, 1)
    drain(engine)
    (tier,) = stores.tiers
    assert len(stores.stores[0]) == PROMPT_BLOCKS
    reuse(engine, 1)
    serve(engine, 2)  # never reused: never written, not even evicting prompt 1
    engine.close()
    assert sorted(writes(tier)) == sorted(stores.stores[0])
    assert len(stores.stores[0]) == PROMPT_BLOCKS
    assert engine.manager.stats().written_through_blocks == PROMPT_BLOCKS
    assert engine.manager.stats().demoted_blocks == 0


def test_write_back_writes_on_eviction_and_a_graceful_close_writes_the_rest() -> None:
    stores = Stores("write_back")
    engine = stores.engine()
    serve(engine, 1)
    drain(engine)
    assert stores.stores[0] == {}
    serve(engine, 2)
    drain(engine)
    demoted = engine.manager.stats().demoted_blocks
    assert len(stores.stores[0]) == demoted > 0
    engine.close()
    (tier,) = stores.tiers
    kept = PROMPT_BLOCKS + 1  # the host tier's slots: what was still in it at the close
    assert engine.workers[0].flush_counts == {
        "tier0": {"flushed_blocks": kept, "flush_skipped_blocks": 0}
    }
    assert demoted + kept == 2 * PROMPT_BLOCKS
    assert sorted(writes(tier)) == sorted(stores.stores[0]), "each block written once"
    assert engine.manager.stats().written_through_blocks == 0


def test_a_flush_past_its_deadline_skips_the_blocks_and_counts_them() -> None:
    stores = Stores("write_back")
    engine = stores.engine()
    serve(engine, 1)
    drain(engine)
    (worker,) = engine.workers
    worker.flush_deadline_s = 0
    engine.close()
    assert worker.flush_counts == {
        "tier0": {"flushed_blocks": 0, "flush_skipped_blocks": PROMPT_BLOCKS}
    }
    assert stores.stores[0] == {}


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_restarted_engine_finds_every_block_the_host_tier_kept(policy: WritePolicy) -> None:
    """The host tier never evicted the prompt: only the policy brings it below."""
    stores = Stores(policy)
    first = stores.engine()
    serve(first, 1)
    reuse(first, 1)
    first.close()
    assert first.manager.stats().evicted_blocks == 0
    second = stores.engine()
    serve(second, 1)
    assert second.manager.stats().promoted_blocks == PROMPT_BLOCKS
    assert second.stats.tier_hit_blocks == second.stats.verified_blocks == PROMPT_BLOCKS
    assert second.mismatches == []
    second.close()


def test_a_chain_writes_each_tier_by_its_policy_and_each_block_once() -> None:
    stores = Stores("write_back", "write_through")
    engine = stores.engine()
    serve(engine, 1, 2, 3)
    engine.close()
    local, shared = stores.tiers
    every = 3 * PROMPT_BLOCKS
    assert len(stores.stores[0]) == len(stores.stores[1]) == every
    assert len(writes(local)) == len(writes(shared)) == every
    stats, flushed = engine.manager.stats(), engine.workers[0].flush_counts
    assert stats.written_through_blocks + flushed["tier1"]["flushed_blocks"] == every
    assert stats.demoted_blocks + flushed["tier0"]["flushed_blocks"] == every


def test_promoted_blocks_go_to_the_write_back_tiers_that_lacked_them_only() -> None:
    """A second engine with an empty disk finds a prompt in the shared tier: the disk
    gets it (at the close), the shared tier is not written again."""
    stores = Stores("write_back", "write_through")
    first = stores.engine()
    serve(first, 1)
    first.close()
    stores.stores[0].clear()  # another machine's disk
    second = stores.engine()
    serve(second, 1)
    second.close()
    local, shared = stores.tiers
    assert second.manager.stats().promoted_blocks == PROMPT_BLOCKS
    assert writes(shared) == []
    assert len(writes(local)) == len(stores.stores[0]) == PROMPT_BLOCKS
    assert second.stats.verified_blocks == PROMPT_BLOCKS and second.mismatches == []


def test_a_reset_forgets_the_blocks_a_close_would_have_written() -> None:
    stores = Stores("write_back")
    engine = stores.engine()
    serve(engine, 1)
    drain(engine)
    engine.manager.reset()
    engine.step()  # the plan tells the worker the blocks left
    engine.close()
    assert engine.workers[0].flush_counts == {}
    assert stores.stores[0] == {}


def test_a_full_queue_drops_write_throughs_counted_and_the_engine_goes_on() -> None:
    stores = Stores("write_through", queue_depth=1, get_deadline_s=0.05)
    engine = stores.engine()
    (tier,) = stores.tiers
    tier.gate.clear()
    serve(engine, 1, 2, 3, 4)
    tier.gate.set()
    engine.close()
    counts = engine.manager.stats().tiers["tier0"]
    assert counts["queue_drops"] >= 1
    assert engine.stats.requests == 4 and engine.mismatches == []


def test_stores_name_their_blocks_only_when_a_tier_writes_back() -> None:
    for policies, named in (
        ((), False),
        (("write_through_admitted",), False),
        (("write_through",), True),
        (("write_back",), True),
    ):
        manager = OffloadManager(
            PolicyIndex(8, LRUPolicy()),
            block_tokens=BLOCK_TOKENS,
            record_bytes=64,
            write_policies=policies,
        )
        hashes = [bytes([i]) * 8 for i in range(2)]
        manager.scheduled("r", num_computed_tokens=0, new_block_ids=[[0, 1]], block_hashes=hashes)
        manager.scheduled("r", num_computed_tokens=2 * BLOCK_TOKENS)
        (store,) = manager.build_plan().stores
        assert store.block_hashes == (tuple(hashes) if named else ())
