"""The tier mover alone: promotions into slots, idle, and the write-back ledger's flush."""

from __future__ import annotations

import time

from kvtier.copy.base import Direction
from kvtier.keys import KeyNamespace
from kvtier.models import WritePolicy
from kvtier.offload import Demotion, Promotion, Transfer, TransferPlan
from kvtier.offload.tier_mover import TierMover
from kvtier.tiers import HostTier, TierSpec
from kvtier.tiers.chain import TierChain
from tests.support.faults import ManualClock
from tests.support.tiers import MemoryTier

RECORD_BYTES = 8


def rig(*policies: WritePolicy) -> tuple[TierMover, HostTier, list[MemoryTier], ManualClock]:
    """A mover over a four-slot host tier and one memory tier per policy."""
    keys = KeyNamespace("model", "layout", 0, 1)
    tiers = [MemoryTier(TierSpec(RECORD_BYTES, keys)) for _ in policies]
    chain = TierChain([(f"tier{i}", tier) for i, tier in enumerate(tiers)], list(policies))
    host = HostTier(4, RECORD_BYTES)
    clock = ManualClock()
    return TierMover(chain, host, clock=clock), host, tiers, clock


def fill(host: HostTier, slot: int, value: int) -> None:
    host.buffer[slot] = value


def test_a_promotion_keeps_the_mover_busy_until_it_is_reported() -> None:
    mover, host, (tier,), _ = rig("write_back")
    fill(host, 0, 7)
    mover.write_down(TransferPlan(demotions=(Demotion(0, (b"a",), (0,), (0,)),)))
    tier.delete([tier.keys.key(b"drain")]).result()  # the one I/O thread wrote before this
    assert mover.idle, "a write down is the tier's own work"
    tier.gate.clear()
    mover.promote((Promotion(5, 0, (b"a", b"b"), (2, 3)),))
    mover.poll(idle_step=False)
    assert not mover.idle, "the read is in flight"
    tier.gate.set()
    deadline = time.monotonic() + 10
    promoted: dict[int, tuple[int, int]] = {}
    while not promoted:
        assert time.monotonic() < deadline, "the read did not end"
        mover.poll(idle_step=True)
        assert not mover.idle, "read or not, the promotion is still to be reported"
        outcomes = mover.take_outcomes()
        if outcomes is not None:
            promoted = outcomes.promoted
    assert promoted == {5: (1, 1)}, "one leading block found"
    assert mover.idle
    assert set(host.buffer[2].tolist()) == {7}
    mover.close(flush_deadline_s=1.0)


def test_a_probe_reports_the_blocks_held_and_writes_no_slot() -> None:
    mover, host, (tier,), _ = rig("write_back")
    fill(host, 0, 7)
    mover.write_down(TransferPlan(demotions=(Demotion(0, (b"a",), (0,), (0,)),)))
    tier.delete([tier.keys.key(b"drain")]).result()  # the one I/O thread wrote before this
    fill(host, 0, 1)
    mover.promote((Promotion(6, 0, (b"a", b"b"), ()),))
    deadline = time.monotonic() + 10
    promoted: dict[int, tuple[int, int]] = {}
    while not promoted:
        assert time.monotonic() < deadline, "the probe did not end"
        mover.poll(idle_step=True)
        outcomes = mover.take_outcomes()
        if outcomes is not None:
            promoted = outcomes.promoted
    assert promoted == {6: (1, 1)}, "one leading block held"
    assert mover.idle
    assert set(host.buffer.numpy().reshape(-1).tolist()) <= {0, 1}, "no record was written"
    mover.close(flush_deadline_s=1.0)


def test_a_close_flushes_what_is_owed_and_nothing_written_or_replaced() -> None:
    mover, host, (back, through), _ = rig("write_back", "write_through")
    for slot in range(4):
        fill(host, slot, slot + 1)
    slots = (0, 1, 2, 3)
    stored = Transfer(0, Direction.STORE, 0, slots, slots, None, (b"a", b"b", b"c", b"d"))
    mover.owe_stored(stored)
    mover.forget((3,))  # a new copy replaces slot 3's block
    mover.write_down(TransferPlan(write_throughs=(Demotion(0, (b"a",), (0,), (1,)),)))
    mover.write_down(TransferPlan(demotions=(Demotion(0, (b"b",), (1,), (0,)),)))
    mover.close(flush_deadline_s=1.0)
    assert mover.flush_counts == {
        "tier0": {"flushed_blocks": 2, "flush_skipped_blocks": 0},
        "tier1": {"flushed_blocks": 1, "flush_skipped_blocks": 0},
    }
    flushed_back = [key for op, keys in back.batches if op == "write" for key in keys]
    flushed_through = [key for op, keys in through.batches if op == "write" for key in keys]
    group = 0
    assert sorted(flushed_back) == sorted(back.keys.keys([b"a", b"b", b"c"], group)), (
        "a and c were owed; b was demoted"
    )
    assert sorted(flushed_through) == sorted(through.keys.keys([b"a", b"c"], group)), (
        "a was written through by the plan, c was still owed"
    )


def test_a_flush_past_its_deadline_counts_the_blocks_it_skipped() -> None:
    mover, _, _, _ = rig("write_back")
    mover.owe_stored(Transfer(0, Direction.STORE, 0, (0, 1), (0, 1), None, (b"a", b"b")))
    mover.close(flush_deadline_s=0)
    assert mover.flush_counts == {"tier0": {"flushed_blocks": 0, "flush_skipped_blocks": 2}}


def test_without_flushed_tiers_nothing_is_owed() -> None:
    mover, _, _, _ = rig("write_through_admitted")
    mover.owe_stored(Transfer(0, Direction.STORE, 0, (0,), (0,), None, (b"a",)))
    mover.close(flush_deadline_s=1.0)
    assert mover.flush_counts == {}
