"""Lazy-mode store protection: which device blocks the engine keeps while lazy stores read them."""

from __future__ import annotations

from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.offload import DeviceBlock, LazyCandidate, OffloadManager, WorkerReport
from kvtier.offload.protection import LazyStoreGuard


def manager(store_mode: str) -> OffloadManager:
    return OffloadManager(
        PolicyIndex(8, LRUPolicy()), block_tokens=4, record_bytes=64, store_mode=store_mode
    )  # type: ignore[arg-type]


def test_lazy_stores_protect_their_blocks_until_the_stores_are_over() -> None:
    m = manager("lazy")
    guard = LazyStoreGuard(m)
    plan = m.build_plan([LazyCandidate(b"a" * 8, 0, 4), LazyCandidate(b"b" * 8, 0, 5)])
    assert guard.protect(plan) == [DeviceBlock(0, 4), DeviceBlock(0, 5)]
    assert guard.num_protected == 2
    (store,) = plan.stores
    progress = m.process(WorkerReport(failed={store.batch_id: 1}))
    assert guard.release(progress) == [DeviceBlock(0, 4), DeviceBlock(0, 5)]
    assert guard.num_protected == 0
    assert guard.release(progress) == [], "a block is let go once per protection"


def test_a_block_protected_twice_is_let_go_twice() -> None:
    m = manager("lazy")
    guard = LazyStoreGuard(m)
    first = m.build_plan([LazyCandidate(b"a" * 8, 0, 4)])
    second = m.build_plan([LazyCandidate(b"c" * 8, 0, 4)])
    guard.protect(first)
    guard.protect(second)
    assert guard.release(m.process(WorkerReport(done={first.stores[0].batch_id: 1}))) == [
        DeviceBlock(0, 4)
    ]
    assert guard.num_protected == 1
    progress = m.process(WorkerReport(done={second.stores[0].batch_id: 1}))
    assert guard.release(progress) == [DeviceBlock(0, 4)]
    assert guard.num_protected == 0


def test_eager_stores_need_no_protection() -> None:
    m = manager("eager")
    guard = LazyStoreGuard(m)
    m.scheduled("r", num_computed_tokens=8, new_block_ids=[[1, 2]], block_hashes=[b"x", b"y"])
    plan = m.build_plan()
    assert plan.stores, "the request's blocks are stored"
    assert guard.protect(plan) == []
    progress = m.process(WorkerReport(done={plan.stores[0].batch_id: 1}))
    assert guard.release(progress) == []
