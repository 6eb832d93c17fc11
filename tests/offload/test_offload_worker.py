"""The worker side: plan execution, completion tracking, flushes, failures and validation."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from kvtier.config import load_config
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, Direction
from kvtier.keys import KeyNamespace
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout, LayoutError
from kvtier.offload import (
    FailureCause,
    LoadFailures,
    OffloadWorker,
    Transfer,
    TransferPlan,
    WorkerReport,
)
from kvtier.plugins import default_registry
from kvtier.tiers import HostTier, TierSpec
from kvtier.tiers.chain import TierChain
from tests.offload.conftest import make_layout, torch_backend
from tests.support.faults import FlakyBackend, ManualClock
from tests.support.tiers import MemoryTier


def make_worker(
    layout: KVLayout,
    *,
    delay_polls: int = 0,
    fail: bool = False,
    num_slots: int = 4,
    clock: ManualClock | None = None,
    **faults: Callable[[CopyBatch], bool],
) -> tuple[OffloadWorker, list[FlakyBackend]]:
    backends: list[FlakyBackend] = []
    registry = default_registry()
    config = registry.get(COPY_BACKEND, "torch").config_model()

    def factory(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
        inner = registry.build(COPY_BACKEND, config, layout, host_buffer)
        backend = FlakyBackend(
            inner,
            layout,
            host_buffer,
            fail=(lambda batch: fail),
            delay_polls=delay_polls,
            **faults,  # type: ignore[arg-type]
        )
        backends.append(backend)
        return backend

    tier = HostTier(num_slots, layout.record_bytes)
    if clock is None:
        return OffloadWorker(layout, tier, factory), backends
    worker = OffloadWorker(
        layout,
        tier,
        factory,
        copy_deadline_s=1.0,
        close_timeout_s=2.0,
        clock=clock,
        sleep=clock.sleep,
    )
    return worker, backends


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


def test_same_step_loads_are_copied_before_the_forward_and_never_named_as_loaded() -> None:
    layout = make_layout()
    worker, _ = make_worker(layout, delay_polls=2)
    original = block_bytes(layout, 2)
    worker.bind(TransferPlan(stores=(store(0, (2,), (1,)),)))
    worker.get_finished()
    worker.flush()
    worker.take_report()
    worker.bind(
        TransferPlan(
            loads=(load(1, (6,), (1,), "now"), load(2, (7,), (1,), "later")),
            same_step=frozenset({"now"}),
        )
    )
    worker.load_same_step()
    assert block_bytes(layout, 6) == original, "copied before the step's forward"
    assert worker.num_inflight == 0, "the asynchronous load waits for get_finished"
    assert worker.take_report() == WorkerReport(done={1: 1})
    assert worker.get_finished() == (set(), set())
    worker.flush()
    assert worker.get_finished() == (set(), {"later"})
    assert worker.take_report() == WorkerReport(done={2: 1})
    assert worker.take_failed_load_blocks() == set()


def test_failed_same_step_loads_are_blocks_alone() -> None:
    worker, _ = make_worker(make_layout(), fail=True)
    worker.bind(
        TransferPlan(
            loads=(load(0, (4, 5), (2, 3), "now"),),
            unavailable={"now": (6,)},
            same_step=frozenset({"now"}),
        )
    )
    worker.load_same_step()
    _, loaded = worker.get_finished()
    assert loaded == set()
    assert worker.take_report() == WorkerReport(failed={0: 1})
    assert worker.take_load_failures(loaded) == LoadFailures(blocks=frozenset({4, 5, 6}))
    worker.bind(TransferPlan())
    assert worker.get_finished() == (set(), set()), "the request is never named afterwards"


def test_a_same_step_load_not_copied_before_the_forward_fails_its_blocks() -> None:
    layout = make_layout()
    worker, backends = make_worker(layout)
    before = block_bytes(layout, 6)
    worker.bind(TransferPlan(loads=(load(0, (6,), (1,), "now"),), same_step=frozenset({"now"})))
    assert worker.get_finished() == (set(), set())
    assert backends[0].submitted == 0, "too late to copy: the forward read the block already"
    assert block_bytes(layout, 6) == before
    assert worker.take_report() == WorkerReport(failed={0: 1})
    assert worker.take_failed_load_blocks() == {6}
    assert worker.failure_counts == {FailureCause.LOAD_NOT_STARTED: 1}


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
    assert worker.failure_counts == {FailureCause.COPY_ERROR: 2}


def test_unavailable_blocks_fail_without_a_copy() -> None:
    worker, backends = make_worker(make_layout())
    worker.bind(TransferPlan(unavailable={"r": (6, 7)}))
    assert worker.get_finished() == (set(), {"r"})
    assert worker.take_failed_load_blocks() == {6, 7}
    assert backends[0].submitted == 0


def test_with_one_group_load_failures_are_blocks() -> None:
    worker, _ = make_worker(make_layout(), fail=True)
    worker.bind(TransferPlan(loads=(load(0, (4, 5), (2, 3), "r"),), unavailable={"u": (6,)}))
    _, loaded = worker.get_finished()
    assert loaded == {"r", "u"}
    assert worker.take_load_failures(loaded) == LoadFailures(blocks=frozenset({4, 5, 6}))
    assert worker.take_load_failures(set()) == LoadFailures()


def test_with_several_groups_load_failures_are_requests_once_their_loads_end() -> None:
    layout = make_layout()
    worker, backends = make_worker(layout, delay_polls=1)
    two_groups = OffloadWorker(
        [layout, layout], HostTier(4, layout.record_bytes), lambda lay, buf: backends[0]
    )
    backends[0].fail = lambda batch: 4 in batch.device_blocks
    two_groups.bind(
        TransferPlan(
            loads=(
                Transfer(0, Direction.LOAD, 1, (4,), (2,), "r"),
                Transfer(1, Direction.LOAD, 0, (5,), (3,), "ok"),
            ),
            unavailable={"u": (6,)},
        )
    )
    _, loaded = two_groups.get_finished()
    assert loaded == {"u"}, "loads still running are not finished"
    assert two_groups.take_load_failures(loaded) == LoadFailures(requests=frozenset({"u"}))
    two_groups.bind(TransferPlan())
    _, loaded = two_groups.get_finished()
    assert loaded == {"r", "ok"}
    assert two_groups.take_load_failures(loaded) == LoadFailures(requests=frozenset({"r"}))


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
    with pytest.raises(ValueError, match="host slot -1"):
        worker.bind(TransferPlan(stores=(store(0, (1, 2, 3), (0, -1, 9)),)))
    with pytest.raises(ValueError, match="device block 99"):
        worker.bind(TransferPlan(stores=(store(0, (1, 99, -2), (1, 2, 3)),)))
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


def is_store(batch: CopyBatch) -> bool:
    return batch.direction is Direction.STORE


def test_a_hung_copy_is_abandoned_at_its_deadline_and_reported_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = make_layout()
    clock = ManualClock()
    worker, backends = make_worker(layout, clock=clock, hang=lambda batch: True)
    worker.bind(
        TransferPlan(
            stores=(store(0, (1,), (0,)), store(1, (2,), (1,))),
            loads=(load(2, (4, 5), (2, 3), "r"),),
            holds={"q": (0, 1)},
        )
    )
    assert worker.get_finished() == (set(), set())
    clock.advance(0.9)
    assert worker.get_finished() == (set(), set()) and worker.num_inflight == 3
    clock.advance(0.2)
    with caplog.at_level(logging.DEBUG, logger="kvtier.offload.copies"):
        assert worker.get_finished() == ({"q"}, {"r"})
    assert worker.take_failed_load_blocks() == {4, 5}, "the engine recomputes the load"
    assert worker.take_report() == WorkerReport(abandoned={0: 1, 1: 1, 2: 1})
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, "one warning for three abandoned copies"
    assert "still running after 1.0 s" in warned[0].message
    assert worker.failure_counts == {FailureCause.COPY_DEADLINE: 3}
    assert worker.num_inflight == 0 and worker.num_abandoned == 3
    assert backends[0].release_hung() == 3
    worker.bind(TransferPlan())
    worker.get_finished()
    assert worker.take_report() == WorkerReport(settled={0: 1, 1: 1, 2: 1})
    assert worker.num_abandoned == 0


def test_flush_waits_for_a_hung_copy_only_until_its_deadline() -> None:
    layout = make_layout()
    clock = ManualClock()
    worker, _ = make_worker(layout, clock=clock, hang=is_store)
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),), loads=(load(1, (4,), (2,), "r"),)))
    worker.get_finished()
    worker.bind(TransferPlan(flush=True))
    worker.handle_preemptions()
    assert 1.0 <= clock() < 1.1 and worker.num_inflight == 0
    assert worker.take_report() == WorkerReport(done={1: 1}, abandoned={0: 1})


def test_close_gives_up_on_a_hung_copy_and_keeps_the_host_tier() -> None:
    layout = make_layout()
    clock = ManualClock()
    worker, backends = make_worker(layout, clock=clock, hang=is_store)
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),), loads=(load(1, (4,), (2,), "r"),)))
    worker.get_finished()
    worker.close()
    assert 2.0 <= clock() < 2.1, "close waits close_timeout_s, not forever"
    assert worker.num_abandoned == 1
    assert worker.failure_counts == {FailureCause.COPY_DEADLINE: 1}, "its deadline came first"
    assert worker.tier.buffer.numel() > 0, "memory a copy may still write is not freed"
    backends[0].release_hung()
    worker.close()


def test_close_frees_the_tier_when_every_copy_ends() -> None:
    layout = make_layout()
    clock = ManualClock()
    worker, _ = make_worker(layout, clock=clock, delay_polls=3)
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),)))
    worker.get_finished()
    worker.close()
    assert clock() < 0.1 and worker.num_abandoned == 0


def test_backend_bugs_fail_their_batch_and_the_rest_of_the_plan_still_runs() -> None:
    layout = make_layout()
    original = block_bytes(layout, 3)
    worker, backends = make_worker(
        layout,
        clock=ManualClock(),
        submit_bug=lambda batch: list(batch.device_blocks) == [1],
        poll_bug=lambda batch: list(batch.device_blocks) == [2],
    )
    worker.bind(
        TransferPlan(
            stores=(store(0, (1,), (0,)), store(1, (2,), (1,)), store(2, (3,), (2,))),
            loads=(load(3, (5,), (2,), "r"),),
        )
    )
    assert worker.get_finished() == (set(), {"r"})
    assert backends[0].submitted == 3, "batches after the one that raised were submitted"
    # the copy that raised while polled is over by the next poll, in the same call
    assert worker.take_report() == WorkerReport(
        done={2: 1, 3: 1}, failed={0: 1}, abandoned={1: 1}, settled={1: 1}
    )
    assert worker.failure_counts == {FailureCause.BACKEND_ERROR: 2}
    assert block_bytes(layout, 5) == original


def test_deadlines_are_checked() -> None:
    layout = make_layout()
    with pytest.raises(ValueError, match="copy_deadline_s"):
        OffloadWorker(
            layout, HostTier(2, layout.record_bytes), lambda lay, buf: None, copy_deadline_s=0
        )  # type: ignore[arg-type,return-value]


def test_quiet_waits_until_every_part_is_idle() -> None:
    worker, _ = make_worker(make_layout(), delay_polls=1)
    worker.bind(TransferPlan(stores=(store(0, (1,), (0,)),), loads=(load(1, (2,), (1,), "r"),)))
    assert worker.get_finished() == (set(), set())
    assert worker.take_report() is None
    assert not worker.idle and not worker.quiet, "copies run, a request waits"
    worker.bind(TransferPlan())
    assert worker.get_finished() == (set(), {"r"})
    assert worker.take_report() == WorkerReport(done={0: 1, 1: 1})
    assert worker.idle and worker.quiet
    worker.bind(TransferPlan())
    assert worker.get_finished() == (set(), set()) and worker.take_report() is None


def test_a_worker_with_lower_tiers_is_idle_but_never_quiet() -> None:
    layout = make_layout()
    keys = KeyNamespace("model", "layout", 0, 1)
    chain = TierChain([("memory", MemoryTier(TierSpec(layout.record_bytes, keys)))])
    worker, _ = make_worker(layout)
    with_tiers = OffloadWorker(layout, HostTier(4, layout.record_bytes), torch_backend, chain=chain)
    for each in (worker, with_tiers):
        each.bind(TransferPlan())
        each.get_finished()
        assert each.take_report() is None and each.idle
    assert worker.quiet and not with_tiers.quiet, "the tiers' threads count on their own"
    with_tiers.close()
    assert not with_tiers.idle, "closed"
