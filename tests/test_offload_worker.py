"""The worker side: plan execution, completion tracking, flushes, failures and validation."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import load_config
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, Direction
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import BlockRegion, KVLayout, LayoutError
from kvtier.offload import OffloadWorker, Transfer, TransferPlan, WorkerReport
from kvtier.plugins import default_registry
from kvtier.testing.faults import FlakyBackend
from kvtier.tiers import HostTier

NUM_BLOCKS = 8
BLOCK_BYTES = 16


def make_layout() -> KVLayout:
    kv = torch.arange(2 * NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64).remainder(251)
    kv = kv.to(torch.uint8).reshape(2, NUM_BLOCKS, BLOCK_BYTES)
    return KVLayout((BlockRegion("k", kv[0]), BlockRegion("v", kv[1])), "flash_attn")


def make_worker(
    layout: KVLayout, *, delay_polls: int = 0, fail: bool = False, num_slots: int = 4
) -> tuple[OffloadWorker, list[FlakyBackend]]:
    backends: list[FlakyBackend] = []
    registry = default_registry()
    config = registry.get(COPY_BACKEND, "torch").config_model()

    def factory(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
        inner = registry.build(COPY_BACKEND, config, layout, host_buffer)
        backend = FlakyBackend(
            inner, layout, host_buffer, fail=(lambda batch: fail), delay_polls=delay_polls
        )
        backends.append(backend)
        return backend

    tier = HostTier(num_slots, layout.record_bytes)
    return OffloadWorker(layout, tier, factory), backends


def store(batch_id: int, blocks: tuple[int, ...], slots: tuple[int, ...]) -> Transfer:
    return Transfer(batch_id, Direction.STORE, 0, blocks, slots)


def load(batch_id: int, blocks: tuple[int, ...], slots: tuple[int, ...], request: str) -> Transfer:
    return Transfer(batch_id, Direction.LOAD, 0, blocks, slots, request)


def block_bytes(layout: KVLayout, block: int) -> list[bytes]:
    return [bytes(region.view[block].tolist()) for region in layout.regions]


def test_store_then_load_moves_the_bytes() -> None:
    layout = make_layout()
    worker, _ = make_worker(layout)
    original = block_bytes(layout, 2)
    worker.bind(TransferPlan(stores=(store(0, (2,), (1,)),)))
    assert worker.get_finished() == (set(), set())
    assert worker.take_report() == WorkerReport(done={0: 1})
    assert worker.take_report() is None
    worker.bind(TransferPlan(loads=(load(1, (6,), (1,), "r"),)))
    assert worker.get_finished() == (set(), {"r"})
    assert block_bytes(layout, 6) == original
    worker.close()


def test_slow_copies_are_reported_when_they_finish() -> None:
    layout = make_layout()
    worker, _ = make_worker(layout, delay_polls=2)
    worker.bind(
        TransferPlan(
            stores=(store(0, (1,), (0,)),), loads=(load(1, (3,), (2,), "r"),), holds={"q": (0,)}
        )
    )
    assert worker.get_finished() == (set(), set())
    assert worker.num_inflight == 2
    worker.bind(TransferPlan())
    assert worker.get_finished() == (set(), set())
    worker.bind(TransferPlan())
    assert worker.get_finished() == ({"q"}, {"r"})
    assert worker.take_report() == WorkerReport(done={0: 1, 1: 1})


def test_flush_waits_for_everything_in_flight() -> None:
    layout = make_layout()
    worker, _ = make_worker(layout, delay_polls=5)
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),)))
    worker.get_finished()
    worker.bind(TransferPlan(flush=True, stores=(store(1, (2,), (1,)),)))
    worker.handle_preemptions()
    assert worker.num_inflight == 0
    assert worker.take_report() == WorkerReport(done={0: 1})
    worker.get_finished()
    assert worker.num_inflight == 1, "the new plan's copies are submitted after the flush"


def test_failed_copies_are_reported_and_loads_name_their_blocks() -> None:
    layout = make_layout()
    worker, backends = make_worker(layout, fail=True)
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),), loads=(load(1, (4, 5), (2, 3), "r"),)))
    assert worker.get_finished() == (set(), {"r"})
    assert worker.take_report() == WorkerReport(failed={0: 1, 1: 1})
    assert worker.take_failed_load_blocks() == {4, 5}
    assert worker.take_failed_load_blocks() == set()
    assert backends[0].failed == 2


def test_unavailable_blocks_fail_without_a_copy() -> None:
    worker, backends = make_worker(make_layout())
    worker.bind(TransferPlan(unavailable={"r": (6, 7)}))
    assert worker.get_finished() == (set(), {"r"})
    assert worker.take_failed_load_blocks() == {6, 7}
    assert backends[0].submitted == 0


def test_a_hold_on_completed_batches_is_released_at_once() -> None:
    worker, _ = make_worker(make_layout())
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),)))
    worker.get_finished()
    worker.bind(TransferPlan(holds={"q": (0,), "p": ()}))
    assert worker.get_finished() == ({"q", "p"}, set())


def test_plans_are_validated_against_the_tier_and_layout() -> None:
    worker, _ = make_worker(make_layout())
    with pytest.raises(ValueError, match="host slot 9"):
        worker.bind(TransferPlan(stores=(store(0, (1,), (9,)),)))
    with pytest.raises(ValueError, match="device block 99"):
        worker.bind(TransferPlan(stores=(store(0, (99,), (1,)),)))
    with pytest.raises(ValueError, match="group 2"):
        worker.bind(TransferPlan(stores=(Transfer(0, Direction.STORE, 2, (1,), (1,)),)))
    worker.bind(TransferPlan())
    with pytest.raises(RuntimeError, match="get_finished"):
        worker.bind(TransferPlan())


def test_layouts_must_match_the_tier_record() -> None:
    layout = make_layout()
    with pytest.raises(LayoutError, match="record"):
        OffloadWorker(layout, HostTier(2, layout.record_bytes + 1), lambda lay, buf: None)  # type: ignore[arg-type,return-value]


def test_groups_sharing_a_layout_share_a_backend() -> None:
    layout = make_layout()
    built: list[KVLayout] = []

    def factory(lay: KVLayout, buf: torch.Tensor) -> CopyBackend:
        built.append(lay)
        registry = default_registry()
        config = registry.get(COPY_BACKEND, "torch").config_model()
        return registry.build(COPY_BACKEND, config, lay, buf)

    worker = OffloadWorker([layout, layout], HostTier(2, layout.record_bytes), factory)
    assert len(built) == 1
    worker.bind(TransferPlan(stores=(Transfer(0, Direction.STORE, 1, (1,), (0,)),)))
    worker.get_finished()
    assert worker.take_report() == WorkerReport(done={0: 1})


def test_from_config_builds_the_registered_backend() -> None:
    layout = make_layout()
    config = load_config({"cpu_bytes": 10 * layout.record_bytes})
    worker = OffloadWorker.from_config(config, layout, world_size=2)
    assert worker.tier.num_slots == 5 and not worker.tier.pinned
    worker.bind(TransferPlan(stores=(store(0, (1,), (4,)),)))
    worker.get_finished()
    assert worker.take_report() == WorkerReport(done={0: 1})
    worker.close()
    worker.close()


def test_flaky_backend_corrupts_the_destination_of_a_failed_batch() -> None:
    layout = make_layout()
    host = torch.zeros((2, layout.record_bytes), dtype=torch.uint8)
    registry = default_registry()
    config = registry.get(COPY_BACKEND, "torch").config_model()
    inner = registry.build(COPY_BACKEND, config, layout, host)
    backend = FlakyBackend(inner, layout, host, fail=lambda batch: True)
    batch = CopyBatch(Direction.STORE, (1,), (0,))
    handle = backend.submit(batch)
    with pytest.raises(CopyError, match="injected failure"):
        backend.wait(handle)
    assert set(host[0].tolist()) == {0xA5}
