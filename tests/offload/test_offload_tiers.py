"""The tier chain below the host tier: demotion on eviction, promotion on lookup, faults miss."""

from __future__ import annotations

import threading
import time

import pytest

import kvtier.offload.tier_mover
from kvtier.config.model import PrefetchConfig
from kvtier.index.base import BlockKey, EventKind
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace, hash_token_blocks
from kvtier.offload import OffloadManager, OffloadWorker, Promotion, TransferPlan, WorkerReport
from kvtier.offload.moves import READ_TRIES
from kvtier.tiers import HostTier, TierSpec
from kvtier.tiers.chain import TierChain
from tests.offload.conftest import (
    BLOCK_TOKENS,
    PROMPT_BLOCKS,
    evict_to_the_tier,
    prompt,
    serve,
    store,
    torch_backend,
)
from tests.support.engine import EngineSpec, OffloadedEngine, SyntheticEngine
from tests.support.tiers import MemoryTier


class Fleet:
    """Engines that share one store per rank (as engines sharing a Redis would)."""

    def __init__(
        self, world_size: int = 1, *, record_events: bool = False, **tier_settings: object
    ) -> None:
        self.world_size = world_size
        self.record_events = record_events
        self.stores: list[dict[BlockKey, bytes]] = [{} for _ in range(world_size)]
        self.tier_settings = tier_settings
        self.tiers: list[MemoryTier] = []

    def engine(
        self, *, namespace: str = "", model: str = "model-a", prefetch: PrefetchConfig | None = None
    ) -> OffloadedEngine:
        spec = EngineSpec(num_blocks=24, block_tokens=BLOCK_TOKENS)
        record_bytes = SyntheticEngine(spec).layout.record_bytes
        chains = []
        for rank in range(self.world_size):
            keys = KeyNamespace(model, "layout", rank, self.world_size, namespace)
            tier = MemoryTier(
                TierSpec(record_bytes, keys), store=self.stores[rank], **self.tier_settings
            )
            self.tiers.append(tier)
            chains.append(TierChain([("memory", tier)], report_blocks=self.record_events))
        # The host tier holds one prompt: a second prompt evicts (demotes) the first.
        index = PolicyIndex(PROMPT_BLOCKS + 1, LRUPolicy())
        return OffloadedEngine(
            spec,
            index,
            torch_backend,
            world_size=self.world_size,
            chains=chains,
            record_events=self.record_events,
            prefetch=prefetch,
        )


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_evicted_prefix_is_demoted_then_promoted_back_with_its_bytes(world_size: int) -> None:
    fleet = Fleet(world_size)
    engine = fleet.engine()
    serve(engine, 1, 2)  # prompt 2 evicts prompt 1 from the host tier
    engine.step()  # the step after an eviction hands the evicted blocks to the workers
    demoted = engine.manager.stats().demoted_blocks
    assert demoted >= 1
    # each rank's tier thread writes them: on a loaded machine after the step returned
    deadline = time.monotonic() + 10
    while not all(len(store) == demoted for store in fleet.stores):
        stored = [len(store) for store in fleet.stores]
        assert time.monotonic() < deadline, f"ranks stored {stored} of {demoted} demoted blocks"
        time.sleep(0.001)
    for rank_engine in engine.engines:
        rank_engine.drop_cache()
    serve(engine, 1)
    stats = engine.manager.stats()
    # what prompt 2 evicted comes back from the lower tier, the rest is still in host memory
    assert stats.promoted_blocks == demoted
    assert engine.stats.tier_hit_blocks == PROMPT_BLOCKS
    assert engine.stats.verified_blocks == PROMPT_BLOCKS
    assert engine.mismatches == []
    counts = stats.tiers["memory"]
    assert counts["hits"] == demoted * world_size
    assert counts["bytes_read"] == demoted * world_size * engine.workers[0].tier.record_bytes
    engine.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_demoted_block_is_announced_once_with_its_tokens_when_every_rank_stored_it(
    world_size: int,
) -> None:
    fleet = Fleet(world_size, record_events=True)
    engine = fleet.engine()
    serve(engine, 1, 2)  # prompt 2 evicts prompt 1 from the host tier
    engine.step()  # the step after an eviction hands the evicted blocks to the workers
    demoted = engine.manager.stats().demoted_blocks
    assert demoted >= 1
    deadline = time.monotonic() + 10
    while sum(event.tier is not None for event in engine.events) < demoted:
        assert time.monotonic() < deadline, "the demotions were never announced"
        engine.step()  # reports what landed
        time.sleep(0.001)
    for _ in range(3):
        engine.step()
    demoted = engine.manager.stats().demoted_blocks
    lower = [event for event in engine.events if event.tier is not None]
    assert [event.kind for event in lower] == [EventKind.STORED] * demoted
    assert {event.tier for event in lower} == {"memory"}
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    tokens = prompt(1)
    for event in lower:
        position = hashes.index(event.block_hash)
        assert event.token_ids == tuple(
            tokens[position * BLOCK_TOKENS : (position + 1) * BLOCK_TOKENS]
        )
        assert event.parent_hash == (hashes[position - 1] if position else None)
    engine.close()


def test_a_second_engine_on_the_same_store_gets_the_first_ones_blocks() -> None:
    fleet = Fleet()
    first = fleet.engine()
    serve(first, 1, 2)
    first.close()
    second = fleet.engine()
    serve(second, 1)
    assert second.stats.tier_hit_blocks == second.manager.stats().promoted_blocks >= 1
    assert second.mismatches == []
    second.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_rank_writes_back_what_its_host_tier_kept_when_it_closes(world_size: int) -> None:
    fleet = Fleet(world_size)
    first = fleet.engine()
    serve(first, 1)
    first.close()
    assert first.manager.stats().evicted_blocks == 0
    assert [len(store) for store in fleet.stores] == [PROMPT_BLOCKS] * world_size
    second = fleet.engine()
    serve(second, 1)
    assert second.manager.stats().promoted_blocks == PROMPT_BLOCKS
    assert second.stats.verified_blocks == PROMPT_BLOCKS and second.mismatches == []
    second.close()


@pytest.mark.parametrize(
    ("engine_settings", "fault"),
    [({"namespace": "tenant-b"}, None), ({"model": "model-b"}, None), ({}, "checksum")],
)
def test_records_of_another_tenant_or_model_or_corrupted_are_misses(
    engine_settings: dict[str, str], fault: str | None
) -> None:
    fleet = Fleet()
    first = fleet.engine()
    serve(first, 1, 2)
    first.close()
    if fault is not None:
        for key, record in fleet.stores[0].items():
            fleet.stores[0][key] = record[:-1] + bytes([record[-1] ^ 0xFF])
    # read at the lookup, every block at once (a prefetch reads as many as its share allows)
    second = fleet.engine(**engine_settings, prefetch=PrefetchConfig(policy="off"))
    serve(second, 1)
    assert second.stats.tier_hit_blocks == 0
    assert second.stats.requests == 1
    counts = second.manager.stats().tiers.get("memory", {})
    if fault is None:
        # its probe found no record under its own keys: nothing was read
        assert "hits" not in counts and "misses" not in counts
    else:
        # its probe found the records, their reads failed their checks
        assert counts["misses"] >= 1
        # the store holds both prompts (prompt 2's written as the first engine closed)
        assert len(fleet.stores[0]) == 2 * PROMPT_BLOCKS
        assert counts[f"errors.{fault}"] == PROMPT_BLOCKS
    second.close()


def test_a_stalled_tier_drops_stores_and_misses_at_its_deadline_without_blocking() -> None:
    fleet = Fleet(get_deadline_s=0.05, queue_depth=1)
    engine = fleet.engine()
    (tier,) = fleet.tiers
    tier.gate.clear()
    serve(engine, 1, 2, 3, 4)
    counts = engine.manager.stats().tiers["memory"]
    assert counts["queue_drops"] >= 1
    assert counts["deadline_misses"] >= 1
    assert engine.stats.requests == 4 and engine.mismatches == []
    engine.close()


def test_a_promotion_no_worker_reports_answers_the_lookup_at_the_report_deadline() -> None:
    now = [0.0]
    index = PolicyIndex(8, LRUPolicy())
    manager = OffloadManager(
        index,
        block_tokens=BLOCK_TOKENS,
        record_bytes=64,
        write_policies=("write_back",),
        report_deadline_s=5.0,
        clock=lambda: now[0],
    )
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    assert manager.lookup("r", hashes, 0, len(prompt(1))) is None
    (probe,) = manager.build_plan().promotions
    assert probe.block_hashes == tuple(hashes[:PROMPT_BLOCKS]) and probe.host_slots == ()
    manager.process(WorkerReport(promoted={probe.batch_id: (1, PROMPT_BLOCKS)}))
    assert manager.lookup("r", hashes, 0, len(prompt(1))) is None
    (promotion,) = manager.build_plan().promotions
    assert promotion.block_hashes == tuple(hashes[:PROMPT_BLOCKS])
    assert manager.lookup("r", hashes, 0, len(prompt(1))) is None
    now[0] = 6.0
    manager.process(None)
    assert manager.lookup("r", hashes, 0, len(prompt(1))) == 0
    assert manager.stats().expired_promotions == 1
    # the late answer still makes the blocks it found readable
    manager.process(WorkerReport(promoted={promotion.batch_id: (1, 2)}))
    assert index.lookup(manager.namespace.keys(hashes)) == 2


def small_manager() -> OffloadManager:
    """A manager over an eight-slot host tier and one write-back tier below it."""
    return OffloadManager(
        PolicyIndex(8, LRUPolicy()),
        block_tokens=BLOCK_TOKENS,
        record_bytes=64,
        write_policies=("write_back",),
    )


def promote(manager: OffloadManager, found: int) -> None:
    """The workers answer the next plan's probe with ``found`` blocks held, then find them."""
    (probe,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, found)}))
    (read,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={read.batch_id: (1, found)}))


def test_a_block_no_lower_tier_holds_evicts_nothing_from_the_host_tier() -> None:
    manager = small_manager()
    held = hash_token_blocks(prompt(2), BLOCK_TOKENS)[:PROMPT_BLOCKS]
    store(manager, "a", held)
    new = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    assert manager.lookup("r", new, 0, len(prompt(1))) is None
    (probe,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, 0)}))
    assert manager.build_plan().promotions == ()
    assert manager.lookup("r", new, 0, len(prompt(1))) == 0
    assert manager.stats().evicted_blocks == 0
    assert manager.index.lookup(manager.namespace.keys(held)) == PROMPT_BLOCKS


def test_blocks_this_engine_wrote_down_are_read_without_a_probe() -> None:
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    evict_to_the_tier(manager, wanted[:PROMPT_BLOCKS])
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    (read,) = manager.build_plan().promotions
    assert len(read.host_slots) == PROMPT_BLOCKS, "read at once, not probed first"
    manager.process(WorkerReport(promoted={read.batch_id: (1, PROMPT_BLOCKS)}))
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == PROMPT_BLOCKS * BLOCK_TOKENS


def test_a_lookup_promotes_again_what_the_engine_lost_while_it_waited() -> None:
    """The engine held the first two blocks when the request was first looked up, and
    evicted them before its promotion of the rest was answered: they are promoted too."""
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    evict_to_the_tier(manager, wanted[:PROMPT_BLOCKS])
    tokens, hit = len(prompt(1)), PROMPT_BLOCKS * BLOCK_TOKENS
    assert manager.lookup("r", wanted, 2 * BLOCK_TOKENS, tokens) is None
    (rest,) = manager.build_plan().promotions
    assert rest.block_hashes == tuple(wanted[2:PROMPT_BLOCKS])
    manager.process(WorkerReport(promoted={rest.batch_id: (1, 3)}))
    assert manager.lookup("r", wanted, 2 * BLOCK_TOKENS, tokens) == hit - 2 * BLOCK_TOKENS
    assert manager.lookup("r", wanted, 0, tokens) is None
    (first,) = manager.build_plan().promotions
    assert first.block_hashes[:2] == tuple(wanted[:2]) and len(first.host_slots) == 2
    manager.process(WorkerReport(promoted={first.batch_id: (1, 2)}))
    assert manager.lookup("r", wanted, 0, tokens) == hit
    # from the same block on, nothing is asked again
    manager.index.discard(manager.namespace.keys(wanted[:1]))
    assert manager.lookup("r", wanted, 0, tokens) == 0


def test_the_host_hits_of_a_lookup_that_waits_are_kept_for_its_request() -> None:
    """A lookup finds the first two blocks in the host tier and waits for the promotion of
    the rest; stores meanwhile fill the tier, and evict none of the two."""
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    evict_to_the_tier(manager, wanted[:PROMPT_BLOCKS])
    store(manager, "b", wanted[:2])
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    (read,) = manager.build_plan().promotions
    for seed in (2, 3):
        store(manager, str(seed), hash_token_blocks(prompt(seed), BLOCK_TOKENS)[:PROMPT_BLOCKS])
    manager.process(WorkerReport(promoted={read.batch_id: (1, 3)}))
    hit = PROMPT_BLOCKS * BLOCK_TOKENS
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == hit
    manager.allocated("r", wanted, [list(range(PROMPT_BLOCKS + 1))], 0, hit)
    assert manager.index.stats().pinned == PROMPT_BLOCKS, "its load's pins, not the lookup's"


def test_the_host_hits_kept_for_waiting_lookups_stay_within_the_share() -> None:
    """Two lookups find their first three blocks in the host tier and wait for the rest; the
    share (half of eight slots) keeps the first lookup's hits, not the second's."""
    manager = small_manager()
    wanted = {seed: hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (11, 12)}
    for hashes in wanted.values():
        evict_to_the_tier(manager, hashes[:PROMPT_BLOCKS])
    for seed, hashes in wanted.items():
        store(manager, f"b{seed}", hashes[:3])
    for seed, hashes in wanted.items():
        assert manager.lookup(f"r{seed}", hashes, 0, len(prompt(seed))) is None
    assert manager.index.stats().pinned == 3
    prefetches = manager.moves.prefetches
    assert (prefetches.share, prefetches.kept) == (4, 3)
    manager.finished("r11")
    assert (prefetches.kept, manager.index.stats().pinned) == (0, 0)


def test_the_promotion_of_a_prefix_tail_does_not_evict_its_head() -> None:
    """The host tier holds the prefix's first two blocks, and every other slot is pinned:
    the reservation for the three blocks read from below would evict the two."""
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    evict_to_the_tier(manager, wanted[:PROMPT_BLOCKS])
    store(manager, "b", wanted[:2])
    for seed in (2, 3):
        hashes = hash_token_blocks(prompt(seed), BLOCK_TOKENS)[:3]
        store(manager, str(seed), hashes)
        manager.index.pin(manager.namespace.keys(hashes))
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    assert manager.index.lookup(manager.namespace.keys(wanted[:2])) == 2


def test_after_a_reset_blocks_written_down_before_it_are_probed_first() -> None:
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    evict_to_the_tier(manager, wanted[:PROMPT_BLOCKS])
    manager.reset()
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    (probe,) = manager.build_plan().promotions
    assert probe.host_slots == ()


def test_promoted_blocks_stay_for_their_request_until_it_is_allocated() -> None:
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    promote(manager, PROMPT_BLOCKS)
    store(manager, "b", hash_token_blocks(prompt(2), BLOCK_TOKENS)[:PROMPT_BLOCKS])  # full
    store(manager, "c", hash_token_blocks(prompt(3), BLOCK_TOKENS)[:PROMPT_BLOCKS])
    hit = PROMPT_BLOCKS * BLOCK_TOKENS
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == hit
    manager.allocated("r", wanted, [list(range(PROMPT_BLOCKS + 1))], 0, hit)
    assert manager.index.stats().pinned == PROMPT_BLOCKS, "its load's pins, not the promotion's"


def fill_pinned(manager: OffloadManager) -> list[list[BlockKey]]:
    """Fill the eight-slot host tier with two prompts' first four blocks, pinned; their keys."""
    pinned = []
    for seed in (2, 3):
        hashes = hash_token_blocks(prompt(seed), BLOCK_TOKENS)[:4]
        store(manager, str(seed), hashes)
        pinned.append(manager.namespace.keys(hashes))
        manager.index.pin(pinned[-1])
    return pinned


def probe_found_all(manager: OffloadManager, wanted: list[bytes]) -> None:
    """Request ``r`` looks ``wanted`` up and the workers answer its probe: every block held."""
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    (probe,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, PROMPT_BLOCKS)}))


def test_a_read_without_a_free_slot_is_tried_again_at_the_next_plans() -> None:
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    pinned = fill_pinned(manager)
    probe_found_all(manager, wanted)
    assert manager.build_plan().promotions == (), "every host slot is pinned"
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None, "it waits for room"
    for keys in pinned:  # the loads that pinned them ended
        manager.index.unpin(keys)
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    (read,) = manager.build_plan().promotions
    assert len(read.host_slots) == PROMPT_BLOCKS
    manager.process(WorkerReport(promoted={read.batch_id: (1, PROMPT_BLOCKS)}))
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == PROMPT_BLOCKS * BLOCK_TOKENS


def test_a_read_waiting_for_room_takes_freed_slots_before_the_steps_stores() -> None:
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    pinned = fill_pinned(manager)
    probe_found_all(manager, wanted)
    for keys in pinned:
        manager.index.unpin(keys)
    computed = hash_token_blocks(prompt(4), BLOCK_TOKENS)[:4]  # a running request's blocks
    manager.scheduled(
        "s", num_computed_tokens=0, new_block_ids=[list(range(4))], block_hashes=computed
    )
    manager.scheduled("s", num_computed_tokens=4 * BLOCK_TOKENS)
    plan = manager.build_plan()
    (read,) = plan.promotions
    assert len(read.host_slots) == PROMPT_BLOCKS, "the waiting request's hits first"
    assert sum(len(store) for store in plan.stores) == 8 - PROMPT_BLOCKS


def test_blocks_another_request_brought_in_while_probing_are_hits_at_once() -> None:
    manager = small_manager()
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    (probe,) = manager.build_plan().promotions
    store(manager, "s", wanted[:3])  # the prefix's first blocks, computed meanwhile
    manager.process(WorkerReport(promoted={probe.batch_id: (1, PROMPT_BLOCKS)}))
    (read,) = manager.build_plan(idle=True).promotions
    assert read.block_hashes == tuple(wanted[3:PROMPT_BLOCKS]), "only the rest is read"
    manager.process(WorkerReport(promoted={read.batch_id: (1, PROMPT_BLOCKS - 3)}))
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == PROMPT_BLOCKS * BLOCK_TOKENS


def test_a_read_that_never_finds_a_free_slot_gives_up_after_its_tries() -> None:
    manager = small_manager()
    fill_pinned(manager)
    wanted = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    probe_found_all(manager, wanted)
    for _ in range(3 * READ_TRIES):  # steps that compute nothing follow at once: not counted
        assert manager.build_plan(idle=True).promotions == ()
        assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    for _ in range(READ_TRIES):
        assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
        assert manager.stats().unread_blocks == 0
        assert manager.build_plan().promotions == ()
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == 0
    assert not manager.moves.has_work
    assert manager.stats().unread_blocks == PROMPT_BLOCKS


def test_a_promotion_makes_room_with_other_blocks_than_the_prefix_it_completes() -> None:
    manager = small_manager()
    wanted, other = (hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (1, 2))
    store(manager, "a", wanted[:3])  # the prefix's first blocks, the least recently used
    store(manager, "b", other[:5])  # and the tier is full
    assert manager.lookup("r", wanted, 0, len(prompt(1))) is None
    plan = manager.build_plan(idle=True)
    assert plan.idle, "workers wait for the probe in a step without work"
    (probe,) = plan.promotions
    assert probe.block_hashes == tuple(wanted[3:PROMPT_BLOCKS]) and probe.host_slots == ()
    assert manager.index.stats().writing == 0, "a probe reserves no slot"
    manager.process(WorkerReport(promoted={probe.batch_id: (1, 2)}))
    plan = manager.build_plan(idle=True)
    assert plan.idle, "workers wait for the promotion in a step without work"
    (promotion,) = plan.promotions
    assert promotion.block_hashes == tuple(wanted[3:PROMPT_BLOCKS])
    manager.process(WorkerReport(promoted={promotion.batch_id: (1, 2)}))
    assert manager.lookup("r", wanted, 0, len(prompt(1))) == PROMPT_BLOCKS * BLOCK_TOKENS
    assert not manager.build_plan(idle=True).idle, "nothing to wait for"


def test_impossible_promotion_reports_are_rejected() -> None:
    manager = OffloadManager(
        PolicyIndex(8, LRUPolicy()),
        block_tokens=BLOCK_TOKENS,
        record_bytes=64,
        write_policies=("write_back",),
    )
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.lookup("r", hashes, 0, len(prompt(1)))
    (promotion,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={promotion.batch_id: (1, 99), 12345: (1, 0)}))
    assert manager.stats().rejected_reports == 2
    assert manager.lookup("r", hashes, 0, len(prompt(1))) is None


def test_reports_merge_promotions_by_the_fewest_blocks_found() -> None:
    merged = WorkerReport.merge_all(
        [
            WorkerReport(promoted={3: (1, 4)}, tier_counts={"disk": {"hits": 4}}),
            WorkerReport(promoted={3: (1, 2)}, tier_counts={"disk": {"hits": 2, "misses": 2}}),
        ]
    )
    assert merged.promoted == {3: (2, 2)}
    assert merged.tier_counts == {"disk": {"hits": 6, "misses": 2}}


def test_a_worker_without_tiers_refuses_a_plan_with_promotions() -> None:
    layout = SyntheticEngine(EngineSpec(num_blocks=4, block_tokens=BLOCK_TOKENS)).layout
    worker = OffloadWorker(layout, HostTier(2, layout.record_bytes), torch_backend)
    assert worker.chain is None
    with pytest.raises(ValueError, match="lower tiers"):
        worker.bind(TransferPlan(promotions=(Promotion(0, 0, (b"h",), (0,)),)))
    worker.close()


@pytest.mark.parametrize("idle", [True, False])
def test_in_an_idle_step_a_worker_waits_for_a_lower_tier_read_in_flight(
    idle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.offload.tier_mover, "IDLE_FETCH_WAIT_S", 30.0)
    fleet = Fleet()
    engine = fleet.engine()
    worker = engine.workers[0]
    (tier,) = fleet.tiers
    tier.gate.clear()
    opener = threading.Timer(0.05, tier.gate.set) if idle else None
    started = time.monotonic()
    worker.bind(TransferPlan(promotions=(Promotion(7, 0, (b"h",), (0,)),), idle=idle))
    if opener is not None:
        opener.start()
    worker.get_finished()
    report = worker.take_report()
    if opener is not None:
        assert report is not None and report.promoted == {7: (1, 0)}
        assert time.monotonic() - started < 10, "the wait ends with the read, not at its bound"
        opener.join()
    else:
        assert report is None or not report.promoted, "a step with work does not wait"
    tier.gate.set()
    engine.close()


def test_the_engine_steps_until_the_tiers_finished_the_puts_handed_to_them() -> None:
    """A served engine steps while the session has work. A put still running in a tier
    after the step that handed it is such work: without a later step its stores and drops
    never reach the scheduler's counters, and records handed to the tier go uncounted."""
    fleet = Fleet(get_deadline_s=0.05)
    engine = fleet.engine()
    (tier,) = fleet.tiers
    tier.gate.clear()
    serve(engine, 1, 2)  # the second prompt evicts the first: its blocks go down the chain
    session, manager = engine.session, engine.manager
    assert manager.stats().demoted_blocks > 0
    for _ in range(3):
        engine.step()
    assert session.has_pending_work, "the tier still runs a put"
    assert manager.stats().tier_gauges["memory"]["queued"] > 0
    tier.gate.set()
    deadline = time.monotonic() + 10
    while session.has_pending_work:
        assert time.monotonic() < deadline, "the engine kept stepping after the tier finished"
        engine.step()
        time.sleep(0.001)
    stats = manager.stats()
    counts = stats.tiers["memory"]
    counted = sum(counts.get(name, 0) for name in ("stores", "drops", "held"))
    assert counted == stats.demoted_blocks, counts
    assert stats.tier_gauges["memory"] == {"queued": 0, "state": 0}
    engine.close()
