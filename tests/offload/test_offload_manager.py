"""The scheduler-side offload manager, driven by hand with synthetic worker reports."""

from __future__ import annotations

import logging
import pickle

import pytest

from kvtier.config import load_config
from kvtier.copy.base import Direction
from kvtier.index.base import EventKind
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace
from kvtier.offload import (
    DeviceBlock,
    FailureCause,
    LazyCandidate,
    Observations,
    OffloadManager,
    Progress,
    Transfer,
    TransferPlan,
    WorkerReport,
)
from tests.support.faults import ManualClock

BT = 4
HASHES = [bytes([i]) * 8 for i in range(16)]


def manager(num_slots: int = 8, **kwargs: object) -> OffloadManager:
    options: dict[str, object] = {"block_tokens": BT, "record_bytes": 100, **kwargs}
    return OffloadManager(PolicyIndex(num_slots, LRUPolicy()), **options)  # type: ignore[arg-type]


def done(plan: TransferPlan, workers: int = 1) -> WorkerReport:
    return WorkerReport(done={t.batch_id: workers for t in (*plan.stores, *plan.loads)})


def store_blocks(
    m: OffloadManager, request_id: str, count: int, first_block: int = 0
) -> TransferPlan:
    """Run a request whose ``count`` blocks are computed; return the plan that stores them."""
    blocks = list(range(first_block, first_block + count))
    m.scheduled(
        request_id, num_computed_tokens=0, new_block_ids=[blocks], block_hashes=HASHES[:count]
    )
    m.scheduled(request_id, num_computed_tokens=count * BT)
    return m.build_plan()


def test_lookup_counts_whole_tier_blocks_and_never_the_last_token() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 4)))
    assert m.lookup("b", HASHES[:4], 0, 4 * BT + 1) == 4 * BT
    assert m.lookup("b", HASHES[:4], 0, 4 * BT) == 3 * BT
    assert m.lookup("b", HASHES[:4], BT, 4 * BT + 1) == 3 * BT
    assert m.lookup("b", [HASHES[9], *HASHES[1:4]], 0, 20) == 0
    assert m.lookup("b", [], 0, 20) == 0
    assert m.index.stats().pinned == 0


def test_stores_wait_for_computed_blocks_and_every_worker() -> None:
    m = manager(world_size=2)
    m.scheduled("a", num_computed_tokens=0, new_block_ids=[[5, 6, 7]], block_hashes=HASHES[:3])
    assert m.build_plan().stores == ()
    m.scheduled("a", num_computed_tokens=2 * BT + 1)
    plan = m.build_plan()
    (store,) = plan.stores
    assert store.device_blocks == (5, 6) and store.direction is Direction.STORE
    assert m.lookup("b", HASHES[:3], 0, 99) == 0
    progress = m.process(WorkerReport(done={store.batch_id: 1}))
    assert progress.stored_blocks == () and m.lookup("b", HASHES[:3], 0, 99) == 0
    progress = m.process(WorkerReport(done={store.batch_id: 1}))
    assert progress.stored_blocks == (DeviceBlock(0, 5), DeviceBlock(0, 6))
    assert m.lookup("b", HASHES[:3], 0, 99) == 2 * BT
    m.scheduled("a", num_computed_tokens=3 * BT)
    assert m.build_plan().stores[0].device_blocks == (7,)


def test_a_store_failed_on_one_worker_is_dropped() -> None:
    m = manager(world_size=2)
    (store,) = store_blocks(m, "a", 2).stores
    m.process(WorkerReport(done={store.batch_id: 1}, failed={store.batch_id: 1}))
    assert m.lookup("b", HASHES[:2], 0, 99) == 0
    assert m.index.stats().free == 8
    assert m.stats().store_failures == 2 and m.stats().stored_blocks == 0
    assert m.stats().failures == {FailureCause.STORE_DROPPED: 1}


def test_equal_blocks_of_two_requests_are_stored_once() -> None:
    m = manager()
    m.scheduled("a", num_computed_tokens=2 * BT, new_block_ids=[[0, 1]], block_hashes=HASHES[:2])
    m.scheduled("b", num_computed_tokens=2 * BT, new_block_ids=[[2, 3]], block_hashes=HASHES[:2])
    (store,) = m.build_plan().stores
    assert store.device_blocks == (0, 1)


def test_finished_request_is_held_until_its_stores_complete() -> None:
    m = manager()
    m.scheduled("a", num_computed_tokens=BT, new_block_ids=[[3, 4]], block_hashes=HASHES[:2])
    first = m.build_plan()
    assert m.finished("a", num_computed_tokens=2 * BT) is True
    plan = m.build_plan()
    assert plan.stores[0].device_blocks == (4,), "the last computed block is stored at finish"
    assert set(plan.holds["a"]) == {first.stores[0].batch_id, plan.stores[0].batch_id}
    assert m.process(done(first)).released_requests == ()
    assert m.process(done(plan)).released_requests == ("a",)
    assert m.num_requests == 0


def test_finished_request_without_copies_is_not_held() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 2)))
    assert m.finished("a") is False
    assert m.finished("unknown") is False
    assert m.num_requests == 0


def test_load_pins_slots_until_every_worker_finished() -> None:
    m = manager(world_size=2)
    m.process(done(store_blocks(m, "a", 3), workers=2))
    m.finished("a")
    m.allocated("b", HASHES[:3], [[10, 11, 12, 13]], 0, 3 * BT)
    assert m.index.stats().pinned == 3
    (load,) = m.build_plan().loads
    assert load.request_id == "b" and load.device_blocks == (10, 11, 12)
    assert load.host_slots == tuple(m.index.slot_of(m.namespace.key(h)) for h in HASHES[:3])
    assert m.process(WorkerReport(done={load.batch_id: 1})).loaded_requests == ()
    assert m.index.stats().pinned == 3
    progress = m.process(WorkerReport(done={load.batch_id: 1}))
    assert progress.loaded_requests == ("b",) and progress.failed_loads == {}
    assert m.index.stats().pinned == 0
    stats = m.stats()
    assert (stats.hit_tokens, stats.loaded_blocks, stats.loaded_bytes) == (3 * BT, 3, 600)


def test_a_load_reads_its_own_blocks_whatever_was_looked_up_last() -> None:
    # allocated() reuses the keys lookup() made only for the same hashes and first block
    m = manager()
    m.process(done(store_blocks(m, "a", 4)))
    m.finished("a")
    hashes = HASHES[:4]
    for looked_up, request_id, first, blocks, looked_up_hashes in (
        ("other", "b", 1, [10, 11, 12, 13], hashes),
        ("c", "c", 2, [20, 21, 22, 23], hashes),
        ("d", "d", 0, [30, 31, 32, 33], HASHES[8:12]),
        ("e", "e", 0, [40, 41, 42, 43], hashes),
    ):
        m.lookup(looked_up, looked_up_hashes, 0, 4 * BT + 1)
        m.allocated(request_id, hashes, [blocks], first * BT, (4 - first) * BT)
    loads = {load.request_id: load for load in m.build_plan().loads}
    for request_id, first, blocks in (
        ("b", 1, (11, 12, 13)),
        ("c", 2, (22, 23)),
        ("d", 0, (30, 31, 32, 33)),
        ("e", 0, (40, 41, 42, 43)),
    ):
        assert loads[request_id].device_blocks == blocks
        assert loads[request_id].host_slots == tuple(
            m.index.slot_of(m.namespace.key(h)) for h in HASHES[first:4]
        )


def test_a_same_step_load_is_marked_in_its_plan_only() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 3)))
    m.finished("a")
    m.allocated("b", HASHES[:3], [[10, 11, 12, 13]], 0, 2 * BT, same_step=True)
    m.allocated("c", HASHES[:3], [[20, 21, 22, 23]], 0, 3 * BT)
    plan = m.build_plan()
    assert plan.same_step == {"b"}
    assert {load.request_id: load.device_blocks for load in plan.loads} == {
        "b": (10, 11),
        "c": (20, 21, 22),
    }
    assert m.process(done(plan)).loaded_requests == ("b", "c")
    assert m.index.stats().pinned == 0
    assert (m.stats().loaded_blocks, m.stats().same_step_loaded_blocks) == (5, 2)
    m.scheduled("b", num_computed_tokens=3 * BT)
    assert m.build_plan().same_step == frozenset()


def test_a_same_step_load_needs_one_kv_cache_group() -> None:
    m = manager(num_groups=2)
    with pytest.raises(ValueError, match="one kv-cache group"):
        m.allocated("b", HASHES[:2], [[1, 2], [3, 4]], 0, 2 * BT, same_step=True)


def test_failed_load_is_a_recompute() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 2)))
    m.allocated("b", HASHES[:2], [[8, 9, 10]], 0, 2 * BT)
    (load,) = m.build_plan().loads
    progress = m.process(WorkerReport(failed={load.batch_id: 1}))
    assert progress.loaded_requests == ("b",)
    assert progress.failed_loads == {"b": (DeviceBlock(0, 8), DeviceBlock(0, 9))}
    assert m.stats().load_failures == 2 and m.index.stats().pinned == 0
    # blocks that could not be read are not offered again
    assert m.lookup("c", HASHES[:2], 0, 99) == 0
    assert m.index.stats().readable == 0


def test_a_request_whose_load_failed_is_not_offered_the_tier_again_until_it_finished() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 3)))
    m.allocated("b", HASHES[:3], [[8, 9, 10]], 0, 2 * BT)
    (load,) = m.build_plan().loads
    m.process(WorkerReport(failed={load.batch_id: 1}))
    assert m.lookup("c", HASHES[:3], 0, 99) == 0, "the failed blocks are discarded"
    m.process(done(store_blocks(m, "d", 3)))
    assert m.lookup("c", HASHES[:3], 0, 99) == 3 * BT
    assert m.lookup("b", HASHES[:3], 0, 99) == 0, "b recomputes instead of loading again"
    m.finished("b")
    assert m.lookup("b", HASHES[:3], 0, 99) == 3 * BT, "a new request may reuse the id"


def test_blocks_gone_before_allocation_are_reported_unavailable() -> None:
    m = manager(num_slots=2)
    m.process(done(store_blocks(m, "a", 2)))
    m.finished("a")
    assert m.lookup("b", HASHES[:2], 0, 99) == 2 * BT
    m.index.touch([m.namespace.key(HASHES[0])])
    m.scheduled("c", num_computed_tokens=BT, new_block_ids=[[20]], block_hashes=[HASHES[9]])
    m.process(done(m.build_plan()))
    m.allocated("b", HASHES[:2], [[30, 31]], 0, 2 * BT)
    plan = m.build_plan()
    assert plan.unavailable == {"b": (31,)}
    assert [load.device_blocks for load in plan.loads] == [(30,)]
    progress = m.process(done(plan))
    assert progress.failed_loads == {"b": (DeviceBlock(0, 31),)}
    assert progress.loaded_requests == ("b",)
    assert m.stats().load_failures == 1
    assert m.lookup("b", HASHES[:2], 0, 99) == 0, "b recomputes instead of loading again"


def test_request_with_no_loadable_block_still_finishes_loading() -> None:
    m = manager(num_slots=1)
    m.process(done(store_blocks(m, "a", 1)))
    m.scheduled("c", num_computed_tokens=BT, new_block_ids=[[20]], block_hashes=[HASHES[9]])
    m.process(done(m.build_plan()))
    m.allocated("b", HASHES[:1], [[30]], 0, BT)
    plan = m.build_plan()
    assert plan.loads == () and plan.unavailable == {"b": (30,)}
    progress = m.process(None)
    assert progress.loaded_requests == ("b",)
    assert progress.failed_loads == {"b": (DeviceBlock(0, 30),)}


def test_preemption_flushes_and_drops_queued_loads() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 2)))
    m.allocated("b", HASHES[:2], [[8, 9]], 0, 2 * BT)
    m.preempted(["b"])
    assert m.index.stats().pinned == 0
    plan = m.build_plan()
    assert plan.flush and plan.loads == ()
    assert m.build_plan().flush is False


def test_resumed_request_restarts_its_stores() -> None:
    m = manager()
    m.scheduled("a", num_computed_tokens=0, new_block_ids=[[0, 1]], block_hashes=HASHES[:2])
    m.preempted(["a"])
    m.scheduled(
        "a",
        num_computed_tokens=2 * BT,
        new_block_ids=[[6, 7]],
        block_hashes=HASHES[:2],
        resumed=True,
    )
    (store,) = m.build_plan().stores
    assert store.device_blocks == (6, 7)


def test_lazy_mode_stores_frontier_candidates_not_yet_in_the_tier() -> None:
    m = manager(store_mode="lazy")
    m.scheduled("a", num_computed_tokens=2 * BT, new_block_ids=[[0, 1]], block_hashes=HASHES[:2])
    assert m.build_plan().stores == ()
    plan = m.build_plan([LazyCandidate(HASHES[0], 0, 4), LazyCandidate(HASHES[1], 0, 5)])
    (store,) = plan.stores
    assert store.device_blocks == (4, 5)
    again = m.build_plan([LazyCandidate(HASHES[0], 0, 4), LazyCandidate(HASHES[2], 0, 6)])
    assert again.stores[0].device_blocks == (6,)
    progress = m.process(done(plan))
    assert progress.stored_blocks == (DeviceBlock(0, 4), DeviceBlock(0, 5))
    with pytest.raises(ValueError, match="group 3"):
        m.build_plan([LazyCandidate(HASHES[3], 3, 9)])


class FixedFrontier:
    """An eviction frontier that never changes, and counts the candidates it makes."""

    def __init__(self, blocks: dict[int, bytes]) -> None:
        self.held = blocks
        self.candidates = 0

    def signature(self) -> str:
        return "unchanged"

    def blocks(self) -> list[tuple[int, bytes]]:
        return list(self.held.items())

    def candidate(self, block_id: int, contents: object) -> LazyCandidate:
        self.candidates += 1
        assert isinstance(contents, bytes)
        return LazyCandidate(contents, 0, block_id)


def test_a_key_leaving_the_tier_offers_again_only_the_frontier_blocks_it_named() -> None:
    m = manager(num_slots=4, store_mode="lazy")
    frontier = FixedFrontier({10 + i: HASHES[i] for i in range(4)})
    first = m.build_plan(frontier=frontier)
    assert first.stores[0].device_blocks == (10, 11, 12, 13)
    m.process(done(first))
    assert m.build_plan(frontier=frontier).empty  # the same frontier, all held: not read
    assert frontier.candidates == 4
    # A fifth block takes the least recently used slot: block 10's contents leave the tier.
    evicting = m.build_plan([LazyCandidate(HASHES[9], 0, 20)], frontier=frontier)
    assert evicting.stores[0].device_blocks == (20,)
    m.process(done(evicting))
    again = m.build_plan(frontier=frontier)
    assert frontier.candidates == 5
    assert again.stores[0].device_blocks == (10,)


def test_lazy_stores_take_slots_in_the_prompts_order_when_all_fit() -> None:
    # The engine frees a request's blocks last first, so the frontier offers its
    # prompt backwards; with room for every candidate the slots count up along
    # the prompt (a later hit's load is then one run), the transfer keeps the
    # offered order.
    m = manager(store_mode="lazy")
    offered = [LazyCandidate(HASHES[i], 0, 10 + i) for i in (3, 2, 1, 0)]
    (store,) = m.build_plan(offered).stores
    assert store.device_blocks == (13, 12, 11, 10)
    assert store.host_slots == (3, 2, 1, 0)


def test_lazy_stores_without_room_for_all_keep_the_candidates_nearest_eviction() -> None:
    # Two free slots and two evictable blocks for five candidates: the four
    # nearest eviction are stored, in the offered order.
    m = manager(num_slots=4, store_mode="lazy")
    m.process(done(store_blocks(m, "a", 2)))
    offered = [LazyCandidate(HASHES[i], 0, 10 + i) for i in (7, 6, 5, 4, 3)]
    (store,) = m.build_plan(offered).stores
    assert store.device_blocks == (17, 16, 15, 14)


def test_stores_stop_when_every_slot_is_pinned_or_written() -> None:
    m = manager(num_slots=2)
    plan = store_blocks(m, "a", 4)
    assert plan.stores[0].device_blocks == (0, 1)
    assert m.build_plan().stores == ()
    m.process(done(plan))
    assert m.build_plan().stores[0].device_blocks == (2, 3)


def test_a_plan_stores_what_filled_since_the_last_one_in_the_order_requests_came() -> None:
    m = manager(num_slots=64)
    names = [f"r{i}" for i in range(40)]
    for i, name in enumerate(names):
        m.scheduled(name, num_computed_tokens=1, new_block_ids=[[i]], block_hashes=[HASHES[i % 16]])
    assert m.build_plan().empty
    for step in range(BT - 2):  # decode steps inside everyone's first block
        for name in names:
            m.scheduled(name, num_computed_tokens=2 + step)
        assert m.build_plan().empty
    m.scheduled("r30", num_computed_tokens=BT)
    m.scheduled("r3", num_computed_tokens=BT)
    (store,) = m.build_plan().stores
    assert store.device_blocks == (3, 30), "stores follow the requests' arrival"
    assert m.build_plan().empty, "a block is planned once"
    m.finished("r5", BT)
    plan = m.build_plan()
    assert plan.stores[0].device_blocks == (5,) and set(plan.holds) == {"r5"}
    assert m.build_plan().empty


def test_a_block_whose_hash_comes_late_is_stored_on_the_step_the_hash_comes() -> None:
    """The engine's hash list grows in place; a step that brings a hash and nothing else
    (no new block, no block filled) still makes the block a store candidate."""
    m = manager()
    hashes = [HASHES[0]]
    m.scheduled("a", num_computed_tokens=2 * BT, new_block_ids=[[1, 2]], block_hashes=hashes)
    (store,) = m.build_plan().stores
    assert store.device_blocks == (1,), "only the block with a hash"
    m.scheduled("a", num_computed_tokens=2 * BT + 1, block_hashes=hashes)
    assert m.build_plan().empty
    hashes.append(HASHES[1])
    m.scheduled("a", num_computed_tokens=2 * BT + 2, block_hashes=hashes)
    (store,) = m.build_plan().stores
    assert store.device_blocks == (2,)


def test_reset_waits_for_copies_and_drops_their_results() -> None:
    m = manager(record_events=True)
    m.process(done(store_blocks(m, "a", 2)))
    plan = store_blocks(m, "b", 4)
    assert m.reset() is False
    assert m.lookup("c", HASHES[:2], 0, 99) == 0
    m.scheduled("b", num_computed_tokens=4 * BT)
    assert m.build_plan().stores == ()
    m.process(done(plan))
    assert m.lookup("c", HASHES[:4], 0, 99) == 0
    assert m.reset() is True
    kinds = [event.kind for event in m.take_events()]
    assert kinds.count(EventKind.STORED) == 2 and kinds.count(EventKind.EVICTED) == 2
    assert m.stats().evicted_blocks == 2


def test_impossible_reports_are_logged_counted_and_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = manager(world_size=2)
    (store,) = store_blocks(m, "a", 2).stores
    bid = store.batch_id
    with caplog.at_level(logging.DEBUG, logger="kvtier.offload.manager"):
        for bad in (
            WorkerReport(done={42: 1}),
            WorkerReport(done={bid: -1}),
            WorkerReport(done={bid: 3}),
            WorkerReport(done={bid: 1}, failed={bid: 2}),
            WorkerReport(settled={bid: 1}),
        ):
            assert m.process(bad) == Progress()
    assert m.stats().rejected_reports == 5
    assert "batch 42" in caplog.text and "not in flight" in caplog.text
    assert "cannot be negative" in caplog.text and "world_size is 2" in caplog.text
    assert "only 0 abandoned it" in caplog.text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning for the cause, the rest at debug level"
    assert m.num_inflight_batches == 1 and m.index.stats().writing == 2
    progress = m.process([WorkerReport(done={bid: 1}), WorkerReport(done={bid: 1})])
    assert progress.stored_blocks == (DeviceBlock(0, 0), DeviceBlock(0, 1))
    assert m.lookup("b", HASHES[:2], 0, 99) == 2 * BT


def test_groups_get_their_own_keys_and_transfers() -> None:
    m = manager(num_groups=2, namespace=KeyNamespace("model"), null_block_id=0)
    m.scheduled(
        "a", num_computed_tokens=2 * BT, new_block_ids=[[1, 2], [0, 7]], block_hashes=HASHES[:2]
    )
    plan = m.build_plan()
    assert [(t.group, t.device_blocks) for t in plan.stores] == [(0, (1, 2)), (1, (7,))]
    m.process(done(plan))
    assert m.index.stats().readable == 3
    assert m.lookup("b", HASHES[:2], 0, 99) == 0, "group 1 lacks block 0 (a null block)"


def test_from_config_sizes_the_tier_per_rank() -> None:
    config = load_config({"cpu_bytes": 4000, "store_mode": "lazy"})
    m = OffloadManager.from_config(config, block_tokens=BT, record_bytes=100, world_size=4)
    assert m.index.num_slots == 10 and m.store_mode == "lazy" and m.world_size == 4


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        manager(block_tokens=0)
    with pytest.raises(ValueError, match="store_mode"):
        manager(store_mode="sometimes")
    m = manager()
    store_blocks(m, "a", 1)
    assert m.finished("a") is True
    with pytest.raises(ValueError, match="already finished"):
        m.allocated("a", HASHES[:1], [[1]], 0, 0)


def test_messages_pickle_and_reports_merge() -> None:
    plan = TransferPlan(
        stores=(Transfer(0, Direction.STORE, 0, (1, 2), (3, 4)),),
        loads=(Transfer(1, Direction.LOAD, 1, (5,), (6,), "r"),),
        flush=True,
        holds={"q": (0,)},
        unavailable={"r": (9,)},
    )
    assert pickle.loads(pickle.dumps(plan)) == plan
    merged = WorkerReport.merge_all(
        [WorkerReport(done={1: 1}), None, WorkerReport(done={1: 1}, failed={2: 1})]
    )
    assert merged == WorkerReport(done={1: 2}, failed={2: 1})
    assert WorkerReport().empty and TransferPlan().empty and not plan.empty
    with pytest.raises(ValueError, match="must be equal"):
        Transfer(0, Direction.STORE, 0, (1,), ())


def test_windowed_groups_store_load_and_require_only_their_last_blocks() -> None:
    m = manager(num_groups=2, group_windows=[None, 1])
    m.scheduled(
        "a",
        num_computed_tokens=3 * BT,
        new_block_ids=[[1, 2, 3], [4, 5, 6]],
        block_hashes=HASHES[:3],
    )
    plan = m.build_plan()
    assert [(t.group, t.device_blocks) for t in plan.stores] == [(0, (1, 2, 3)), (1, (6,))]
    m.process(done(plan))
    m.finished("a")
    assert m.lookup("b", HASHES[:3], 0, 99) == 3 * BT
    assert m.lookup("b", HASHES[:2], 0, 99) == 0, "group 1 holds no state after block 1"
    m.allocated("b", HASHES[:3], [[7, 8, 9], [0, 0, 10]], 0, 3 * BT)
    loads = m.build_plan().loads
    assert [(t.group, t.device_blocks) for t in loads] == [(0, (7, 8, 9)), (1, (10,))]


def test_a_window_shortens_the_hit_to_the_last_complete_window() -> None:
    m = manager(num_slots=16, num_groups=2, group_windows=[None, 2])
    m.scheduled(
        "a", num_computed_tokens=2 * BT, new_block_ids=[[1, 2], [3, 4]], block_hashes=HASHES[:2]
    )
    m.process(done(m.build_plan()))
    m.scheduled(
        "a",
        num_computed_tokens=5 * BT,
        new_block_ids=[[5, 6, 7], [8, 9, 10]],
        block_hashes=HASHES[:5],
    )
    m.process(done(m.build_plan()))
    assert m.index.stats().readable == 5 + 4, "group 1 skipped block 2, which left its window"
    assert m.lookup("b", HASHES[:5], 0, 99) == 5 * BT
    assert m.lookup("b", HASHES[:4], 0, 99) == 2 * BT
    assert m.lookup("b", HASHES[:4], BT, 99) == BT
    with pytest.raises(ValueError, match="group_windows"):
        manager(num_groups=2, group_windows=[None])
    with pytest.raises(ValueError, match="group_windows"):
        manager(group_windows=[0])


def test_a_reset_with_copies_in_flight_does_not_stop_storing() -> None:
    m = manager()
    m.process(done(store_blocks(m, "a", 2)))
    in_flight = store_blocks(m, "b", 4, first_block=10)
    assert m.reset() is False, "a store still holds its slots"
    assert m.reset() is False, "idempotent"
    m.scheduled("c", num_computed_tokens=BT, new_block_ids=[[20]], block_hashes=[HASHES[9]])
    (store,) = m.build_plan().stores
    assert store.device_blocks == (20,), "blocks computed after the reset are stored"
    m.process(done(in_flight))
    assert m.lookup("d", HASHES[:4], 0, 99) == 0, "a store in flight at the reset was dropped"
    m.process(WorkerReport(done={store.batch_id: 1}))
    assert m.lookup("d", [HASHES[9]], 0, 99) == BT
    assert m.stats().stored_blocks == 3 and m.index.stats().writing == 0
    m.scheduled("b", num_computed_tokens=5 * BT, new_block_ids=[[14]], block_hashes=HASHES[:5])
    (later,) = m.build_plan().stores
    assert later.device_blocks == (14,)


def test_a_reset_in_lazy_mode_keeps_storing_candidates() -> None:
    m = manager(store_mode="lazy")
    plan = m.build_plan([LazyCandidate(HASHES[0], 0, 4)])
    assert m.reset() is False
    again = m.build_plan([LazyCandidate(HASHES[1], 0, 5)])
    assert again.stores[0].device_blocks == (5,)
    m.process(done(plan))
    m.process(done(again))
    assert m.lookup("b", HASHES[1:2], 0, 99) == BT
    assert m.lookup("b", HASHES[:1], 0, 99) == 0


def test_a_reset_stops_serving_blocks_being_loaded_but_lets_their_loads_finish() -> None:
    m = manager(num_slots=4)
    m.process(done(store_blocks(m, "a", 3)))
    m.finished("a")
    m.allocated("b", HASHES[:2], [[8, 9]], 0, 2 * BT)
    (load,) = m.build_plan().loads
    m.allocated("c", HASHES[:1], [[7]], 0, BT)
    assert m.reset() is False
    assert m.lookup("d", HASHES[:3], 0, 99) == 0, "pinned blocks are no longer hits"
    plan = m.build_plan()
    assert plan.loads[0].host_slots == load.host_slots[:1], "a queued load still reads its slot"
    m.process(WorkerReport(done={load.batch_id: 1, plan.loads[0].batch_id: 1}))
    assert m.index.stats().free == 4 and m.reset() is True
    assert m.stats().loaded_blocks == 3
    m.scheduled("b", num_computed_tokens=2 * BT, new_block_ids=[[8, 9]], block_hashes=HASHES[:2])
    assert m.build_plan().stores == (), "what was loaded from before the reset is not stored again"


def test_a_batch_a_worker_never_reports_fails_at_the_report_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    m = manager(num_slots=4, world_size=2, report_deadline_s=5.0, clock=clock)
    m.process(done(store_blocks(m, "a", 2), workers=2))
    m.finished("a")
    m.allocated("b", HASHES[:2], [[8, 9, 10]], 0, 2 * BT)
    m.scheduled("c", num_computed_tokens=2 * BT, new_block_ids=[[20, 21]], block_hashes=HASHES[4:])
    plan = m.build_plan()
    (load,), (store,) = plan.loads, plan.stores
    assert m.finished("c") is True
    m.build_plan()
    report = WorkerReport(done={load.batch_id: 1, store.batch_id: 1})
    clock.advance(4.9)
    assert m.process(report).loaded_requests == ()
    clock.advance(0.2)
    with caplog.at_level(logging.DEBUG, logger="kvtier.offload.manager"):
        progress = m.process(None)
    assert progress.loaded_requests == ("b",)
    assert progress.failed_loads == {"b": (DeviceBlock(0, 8), DeviceBlock(0, 9))}
    assert progress.released_requests == ("c",)
    assert m.num_inflight_batches == 0 and m.num_quarantined_batches == 2
    stats = m.stats()
    assert (stats.expired_batches, stats.load_failures, stats.store_failures) == (2, 2, 2)
    assert stats.failures == {FailureCause.REPORT_DEADLINE: 2, FailureCause.STORE_DROPPED: 1}
    assert stats.quarantined_blocks == 4
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in warned if "report_deadline_s" in m]) == 1, "once, not per batch"
    assert m.lookup("e", HASHES[:2], 0, 99) == 0
    m.scheduled("f", num_computed_tokens=BT, new_block_ids=[[30]], block_hashes=[HASHES[12]])
    assert m.build_plan().stores == (), "no slot is reused while the silent worker may write it"
    m.process(WorkerReport(done={load.batch_id: 1, store.batch_id: 1}))
    assert m.num_quarantined_batches == 0 and m.stats().quarantined_blocks == 0
    assert m.index.stats().free == 4
    assert m.build_plan().stores[0].device_blocks == (30,)


def test_an_abandoned_copy_fails_its_batch_and_keeps_its_slots_until_it_settles() -> None:
    m = manager(num_slots=2)
    (store,) = store_blocks(m, "a", 2).stores
    assert m.finished("a") is True
    m.build_plan()
    progress = m.process(WorkerReport(abandoned={store.batch_id: 1}))
    assert progress.released_requests == ("a",) and len(progress.stored_blocks) == 2
    stats = m.stats()
    assert (stats.abandoned_copies, stats.store_failures, stats.quarantined_blocks) == (1, 2, 2)
    assert m.lookup("b", HASHES[:2], 0, 99) == 0
    m.scheduled("c", num_computed_tokens=BT, new_block_ids=[[5]], block_hashes=[HASHES[7]])
    assert m.build_plan().stores == ()
    m.process(WorkerReport(settled={store.batch_id: 1}))
    assert m.index.stats().free == 2 and m.stats().quarantined_blocks == 0
    assert m.build_plan().stores[0].device_blocks == (5,)
    with pytest.raises(ValueError, match="report_deadline_s"):
        manager(report_deadline_s=0)


def test_observations_time_each_batch_from_its_plan_to_its_last_report() -> None:
    clock = ManualClock()
    m = manager(world_size=2, clock=clock, record_observations=True)
    plan = store_blocks(m, "a", 3)
    clock.advance(0.25)
    m.process(WorkerReport(done={plan.stores[0].batch_id: 1}))
    clock.advance(0.5)
    m.process(done(plan, workers=1))
    m.allocated("b", HASHES[:3], [[8, 9, 10, 11]], 0, 2 * BT)
    m.allocated("c", HASHES[4:6], [[12, 13]], 0, 0)
    (load,) = m.build_plan().loads
    clock.advance(2.0)
    m.process(WorkerReport(done={load.batch_id: 1}, failed={load.batch_id: 1}))
    observed = m.take_observations()
    assert observed.store_seconds == [0.75] and observed.store_blocks == [3]
    assert observed.load_blocks == [2]
    assert observed.load_seconds == [], "a failed load is counted as a failure, not timed"
    assert observed.request_hit_tokens == [2 * BT, 0]
    assert m.take_observations() == Observations()


def test_a_request_hit_is_observed_once_per_admission() -> None:
    m = manager(record_observations=True)
    m.process(done(store_blocks(m, "a", 2)))
    m.allocated("b", HASHES[:2], [[8, 9, 10]], 0, 2 * BT)
    # vLLM allocates again once the load is over, with nothing more from the tier
    m.allocated("b", HASHES[:2], [[8, 9, 10]], 2 * BT, 0)
    m.preempted(["b"])
    m.allocated("b", HASHES[:2], [[4, 5, 6]], 0, BT)
    assert m.take_observations().request_hit_tokens == [2 * BT, BT]


def test_observations_are_kept_only_when_asked_for() -> None:
    m = manager()
    m.allocated("b", HASHES[:2], [[8, 9, 10]], 0, 0)
    m.process(done(store_blocks(m, "a", 2)))
    assert m.take_observations() == Observations()


def test_lazy_mode_stores_only_window_blocks_of_a_windowed_group() -> None:
    """Blocks that left the window before any step ended are never read back: not stored."""
    m = manager(num_slots=16, num_groups=2, group_windows=[None, 1], store_mode="lazy")
    m.scheduled(
        "a",
        num_computed_tokens=3 * BT,
        new_block_ids=[[1, 2, 3], [4, 5, 6]],
        block_hashes=HASHES[:3],
    )
    m.finished("a", 3 * BT)
    candidates = [LazyCandidate(HASHES[i], 0, 1 + i) for i in range(3)]
    candidates += [LazyCandidate(HASHES[i], 1, 4 + i) for i in range(3)]
    candidates.append(LazyCandidate(HASHES[9], 1, 5))  # block 5 now holds another prefix
    plan = m.build_plan(candidates)
    assert [(t.group, t.device_blocks) for t in plan.stores] == [(0, (1, 2, 3)), (1, (6,))]
    m.process(done(plan))
    assert m.lookup("b", HASHES[:3], 0, 99) == 3 * BT


class RecordingPolicy(LRUPolicy):
    """LRU that records the notifications the manager's index passes on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, ...]] = []

    def request_started(self, request_id: str) -> None:
        self.calls.append(("started", request_id))

    def request_finished(self, request_id: str) -> None:
        self.calls.append(("finished", request_id))

    def offered(self, key: bytes, parent: bytes | None, *, present: bool, lazy: bool) -> None:
        self.calls.append(("offered", present, lazy))

    def aborted(self, key: bytes) -> None:
        self.calls.append(("aborted",))


def test_the_policy_sees_request_boundaries_eager_and_lazy_offers_and_aborts() -> None:
    eager_policy = RecordingPolicy()
    m = OffloadManager(PolicyIndex(8, eager_policy), block_tokens=BT, record_bytes=100)
    (store,) = store_blocks(m, "a", 2).stores
    m.process(WorkerReport(failed={store.batch_id: 1}))
    m.finished("a")
    assert eager_policy.calls == [
        ("started", "a"),
        ("offered", False, False),
        ("offered", False, False),
        ("aborted",),
        ("aborted",),
        ("finished", "a"),
    ]
    lazy_policy = RecordingPolicy()
    m = OffloadManager(
        PolicyIndex(8, lazy_policy), block_tokens=BT, record_bytes=100, store_mode="lazy"
    )
    m.process(done(m.build_plan([LazyCandidate(HASHES[0], 0, 4)])))
    m.build_plan([LazyCandidate(HASHES[1], 0, 5)])
    assert lazy_policy.calls == [("offered", False, True), ("offered", False, True)]
