"""The copy executor alone: deadlines, abandoned copies settling, outcomes, idle and close."""

from __future__ import annotations

import pytest
import torch

from kvtier.copy.base import CopyBackend, CopyBatch, Direction
from kvtier.layout.base import KVLayout, LayoutError
from kvtier.offload import FailureCause, Transfer
from kvtier.offload.copies import BackendFactory, CopyExecutor
from kvtier.tiers import HostTier
from tests.offload.conftest import make_layout, torch_backend
from tests.support.faults import FlakyBackend, ManualClock


class Rig:
    """An executor over one layout and a four-slot tier, with a manual clock and a flaky
    backend; ``ended`` lists what ``on_end`` heard, ``closed`` the backends closed."""

    def __init__(self, **faults: object) -> None:
        self.layout = make_layout()
        self.tier = HostTier(4, self.layout.record_bytes)
        self.clock = ManualClock()
        self.ended: list[tuple[int, bool]] = []
        self.backends: list[FlakyBackend] = []
        self.closed: list[CopyBackend] = []
        self.copies = CopyExecutor(
            (self.layout,),
            self.tier,
            self.flaky(faults),
            copy_deadline_s=1.0,
            clock=self.clock,
            sleep=self.clock.sleep,
            on_end=lambda transfer, ok: self.ended.append((transfer.batch_id, ok)),
        )

    def flaky(self, faults: dict[str, object]) -> BackendFactory:
        def factory(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
            inner = torch_backend(layout, host_buffer)
            backend = FlakyBackend(inner, layout, host_buffer, **faults)  # type: ignore[arg-type]
            self.backends.append(backend)
            close = backend.close

            def closing() -> None:
                self.closed.append(backend)
                close()

            backend.close = closing  # type: ignore[method-assign]
            return backend

        return factory


def store(batch_id: int, block: int, slot: int) -> Transfer:
    return Transfer(batch_id, Direction.STORE, 0, (block,), (slot,))


def load(batch_id: int, block: int, slot: int) -> Transfer:
    return Transfer(batch_id, Direction.LOAD, 0, (block,), (slot,), "r")


def hangs(batch: CopyBatch) -> bool:
    return batch.direction is Direction.STORE


def test_a_copy_past_its_deadline_is_abandoned_then_settles_when_it_ends() -> None:
    rig = Rig(hang=hangs)
    copies = rig.copies
    copies.submit(store(0, 1, 0))
    copies.submit(load(1, 2, 1))
    copies.poll()
    assert list(copies.inflight) == [0] and rig.ended == [(1, True)]
    rig.clock.advance(0.99)
    copies.poll()
    assert copies.num_abandoned == 0, "not before its deadline"
    rig.clock.advance(0.01)
    copies.poll()
    assert list(copies.inflight) == [] and copies.num_abandoned == 1
    assert rig.ended == [(1, True), (0, False)], "an abandoned copy ends as failed, once"
    outcomes = copies.take_outcomes()
    assert (outcomes.done, outcomes.failed, outcomes.abandoned, outcomes.settled) == (
        {1: 1},
        {},
        {0: 1},
        {},
    )
    assert [blocks for blocks, _ in outcomes.load_times] == [1]
    assert copies.failure_counts == {FailureCause.COPY_DEADLINE: 1}
    assert not copies.idle, "an abandoned copy may still write its slots"
    rig.backends[0].release_hung()
    copies.poll()
    assert copies.take_outcomes().settled == {0: 1}
    assert rig.ended == [(1, True), (0, False)], "settling ends nothing twice"
    assert not copies.idle, "its failure is still to be taken"
    assert copies.take_failures() == {FailureCause.COPY_DEADLINE: 1}
    assert copies.idle


def test_wait_returns_at_the_deadline_and_with_until_waits_for_abandoned_copies() -> None:
    rig = Rig(hang=hangs)
    rig.copies.submit(store(0, 1, 0))
    rig.copies.wait()
    assert 1.0 <= rig.clock() < 1.1 and rig.copies.num_abandoned == 1
    rig.copies.wait(until=rig.clock() + 0.5)
    assert 1.5 <= rig.clock() < 1.6 and rig.copies.num_abandoned == 1


def test_copy_now_waits_for_its_own_copies_only() -> None:
    rig = Rig(delay_polls=3, hang=hangs)
    rig.copies.submit(store(0, 1, 0))
    rig.copies.copy_now([load(1, 2, 1)])
    assert list(rig.copies.inflight) == [0] and rig.ended == [(1, True)]
    assert rig.clock() < 0.01, "the forward waits at the shortest pause, not the deadline"


def test_a_failed_copy_ends_once_as_failed() -> None:
    rig = Rig(fail=lambda batch: True)
    rig.copies.submit(load(0, 2, 1))
    rig.copies.poll()
    assert rig.ended == [(0, False)]
    assert rig.copies.take_outcomes().failed == {0: 1}
    assert rig.copies.failure_counts == {FailureCause.COPY_ERROR: 1}


def test_close_abandons_what_still_runs_and_keeps_its_backend_open() -> None:
    rig = Rig(hang=hangs)
    rig.copies.submit(store(0, 1, 0))
    assert rig.copies.close(timeout_s=0.5) is False
    assert rig.copies.failure_counts == {FailureCause.CLOSE_TIMEOUT: 1}
    assert rig.closed == [], "the copy may still use it"
    rig.backends[0].release_hung()
    other = Rig()
    other.copies.submit(store(0, 1, 0))
    assert other.copies.close(timeout_s=0.5) is True
    assert other.closed == other.backends


def test_checks_name_what_does_not_exist() -> None:
    rig = Rig()
    with pytest.raises(ValueError, match="host slot 4"):
        rig.copies.check(store(0, 1, 4))
    with pytest.raises(ValueError, match="device block 8"):
        rig.copies.check(store(0, 8, 0))
    with pytest.raises(ValueError, match="copy_deadline_s"):
        CopyExecutor(
            (rig.layout,),
            rig.tier,
            torch_backend,
            copy_deadline_s=0,
            clock=rig.clock,
            sleep=rig.clock.sleep,
            on_end=lambda transfer, ok: None,
        )
    with pytest.raises(LayoutError, match="at least one layout"):
        CopyExecutor(
            (),
            rig.tier,
            torch_backend,
            copy_deadline_s=1,
            clock=rig.clock,
            sleep=rig.clock.sleep,
            on_end=lambda transfer, ok: None,
        )
