"""Per-request control: the kvtier entry of ``kv_transfer_params`` and what the planner does."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kvtier.config import load_config
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.offload import LazyCandidate, OffloadManager, TransferPlan, WorkerReport
from kvtier.offload.control import RequestControl, RequestControlError, request_control
from tests.support.faults import ManualClock

BT = 4
HASHES = [bytes([i]) * 8 for i in range(16)]


def manager(num_slots: int = 8, **kwargs: object) -> OffloadManager:
    options: dict[str, object] = {"block_tokens": BT, "record_bytes": 100, **kwargs}
    return OffloadManager(PolicyIndex(num_slots, LRUPolicy()), **options)  # type: ignore[arg-type]


def done(plan: TransferPlan) -> WorkerReport:
    return WorkerReport(done={t.batch_id: 1 for t in (*plan.stores, *plan.loads)})


def run(
    m: OffloadManager,
    request_id: str,
    hashes: list[bytes],
    control: RequestControl | None = None,
    first_block: int = 0,
) -> TransferPlan:
    """Allocate a request with ``control``, compute all its blocks; return the plan that
    stores them (already reported done)."""
    blocks = list(range(first_block, first_block + len(hashes)))
    m.allocated(request_id, hashes, [blocks], 0, 0, control=control)
    m.scheduled(
        request_id, num_computed_tokens=0, new_block_ids=[blocks], block_hashes=hashes, resumed=True
    )
    m.scheduled(request_id, num_computed_tokens=len(hashes) * BT)
    plan = m.build_plan()
    m.process(done(plan))
    return plan


def stored(plan: TransferPlan) -> list[int]:
    return [block for store in plan.stores for block in store.device_blocks]


# ---------------------------------------------------------------------- the model


def test_parameters_without_a_kvtier_entry_ask_for_nothing() -> None:
    assert request_control(None) is None
    assert request_control({"do_remote_prefill": True}) is None
    assert request_control(["kvtier"]) is None
    assert request_control({"kvtier": {}}) == RequestControl()
    assert request_control({"kvtier": MappingProxyType({"load": False})}) == RequestControl(
        load=False
    )


def test_a_valid_entry_is_read_whole() -> None:
    control = request_control(
        {
            "kvtier": {
                "store": True,
                "load": False,
                "store_max_tokens": 9,
                "pin_s": 30,
                "priority": "high",
            },
            "other_connector": {"x": 1},
        }
    )
    assert control == RequestControl(load=False, store_max_tokens=9, pin_s=30.0, priority="high")
    assert control is not None and control.store_limit(BT) == 2
    assert RequestControl(store=False, store_max_tokens=9).store_limit(BT) == 0
    assert RequestControl().store_limit(BT) is None


@pytest.mark.parametrize(
    ("entry", "line"),
    [
        (
            "no",
            "kv_transfer_params: kvtier: must be an object with some of the keys load, pin_s, "
            "priority, store, store_max_tokens (got 'no')",
        ),
        (
            {"store": "no"},
            "kv_transfer_params: kvtier.store: Input should be a valid boolean (got 'no')",
        ),
        (
            {"pin_s": 0},
            "kv_transfer_params: kvtier.pin_s: Input should be greater than 0 (got 0)",
        ),
        (
            {"pin_s": 86400},
            "kv_transfer_params: kvtier.pin_s: Input should be less than or equal to 3600 "
            "(got 86400)",
        ),
        (
            {"store_max_tokens": -1},
            "kv_transfer_params: kvtier.store_max_tokens: Input should be greater than or "
            "equal to 0 (got -1)",
        ),
        (
            {"priority": "urgent"},
            "kv_transfer_params: kvtier.priority: Input should be 'low', 'normal' or 'high' "
            "(got 'urgent')",
        ),
        (
            {"pin": 5, "load": 1},
            "kv_transfer_params: kvtier.load: Input should be a valid boolean (got 1); "
            "kv_transfer_params: kvtier.pin: unknown key; valid keys here: load, pin_s, "
            "priority, store, store_max_tokens (got 5)",
        ),
    ],
)
def test_an_invalid_entry_is_one_line_naming_each_problem(entry: object, line: str) -> None:
    with pytest.raises(RequestControlError) as caught:
        request_control({"kvtier": entry})
    assert str(caught.value) == line
    assert "\n" not in str(caught.value)


def test_the_pin_settings_are_validated_with_the_config() -> None:
    config = load_config({"pin_share": 0.5, "pin_max_s": 60})
    assert (config.pin_share, config.pin_max_s) == (0.5, 60.0)
    for values, line in [
        ({"pin_share": 1.5}, "pin_share: Input should be less than or equal to 1 (got 1.5)"),
        ({"pin_max_s": 0}, "pin_max_s: Input should be greater than 0 (got 0)"),
    ]:
        with pytest.raises(ValueError) as caught:
            load_config(values)
        assert line in str(caught.value)


# ------------------------------------------------------------------- the planner


def test_do_not_load_gets_no_hit_and_other_requests_still_do() -> None:
    m = manager()
    run(m, "a", HASHES[:3])
    assert m.lookup("b", HASHES[:3], 0, 99, RequestControl(load=False)) == 0
    assert m.lookup("c", HASHES[:3], 0, 99, RequestControl(store=False)) == 3 * BT
    assert m.lookup("d", HASHES[:3], 0, 99) == 3 * BT


def test_do_not_store_stores_nothing_and_does_not_hold_the_request() -> None:
    m = manager()
    assert stored(run(m, "a", HASHES[:3], RequestControl(store=False))) == []
    assert m.index.stats().readable == 0 and m.stats().stored_blocks == 0
    assert m.finished("a", 3 * BT) is False, "no store left: the blocks are free at once"
    assert stored(run(m, "b", HASHES[:3])) == [0, 1, 2]


def test_store_at_most_n_tokens_stores_the_leading_full_blocks_only() -> None:
    m = manager()
    plan = run(m, "a", HASHES[:5], RequestControl(store_max_tokens=2 * BT + 3))
    assert stored(plan) == [0, 1]
    assert m.lookup("b", HASHES[:5], 0, 99) == 2 * BT
    assert m.finished("a", 5 * BT) is False
    assert stored(run(m, "c", HASHES[:1], RequestControl(store_max_tokens=0))) == []


def test_lazy_mode_skips_the_blocks_a_request_may_not_store_once_it_gave_them_back() -> None:
    m = manager(store_mode="lazy")
    m.allocated("a", HASHES[:3], [[0, 1, 2]], 0, 0, control=RequestControl(store_max_tokens=BT))
    m.scheduled("a", num_computed_tokens=3 * BT, new_block_ids=[[0, 1, 2]], block_hashes=HASHES[:3])
    m.allocated("b", HASHES[5:6], [[3]], 0, 0, control=RequestControl(store=False))
    m.scheduled("b", num_computed_tokens=BT, new_block_ids=[[3]], block_hashes=HASHES[5:6])
    m.finished("a", 3 * BT)
    m.preempted(["b"])
    offered = [LazyCandidate(HASHES[i], 0, i) for i in range(3)]
    offered.append(LazyCandidate(HASHES[5], 0, 3))
    (store,) = m.build_plan(offered).stores
    assert store.device_blocks == (0,)
    reused = m.build_plan([LazyCandidate(HASHES[7], 0, 1)])
    assert reused.stores[0].device_blocks == (1,), "a block reused for other tokens is stored"


def test_a_pin_keeps_the_prompt_until_it_expires() -> None:
    clock = ManualClock()
    m = manager(num_slots=4, clock=clock, pin_share=0.5)
    run(m, "a", HASHES[:2], RequestControl(pin_s=10))
    assert m.index.stats().pinned == 2
    # Two more blocks fill the tier; two others would have to evict the pinned ones.
    run(m, "b", HASHES[2:4], first_block=2)
    run(m, "c", HASHES[4:6], first_block=4)
    assert m.lookup("x", HASHES[:2], 0, 99) == 2 * BT
    assert m.lookup("x", HASHES[2:4], 0, 99) == 0
    clock.advance(10)
    m.process(None)
    assert m.index.stats().pinned == 0
    run(m, "d", HASHES[6:8], first_block=6)
    run(m, "e", HASHES[8:10], first_block=8)
    assert m.lookup("x", HASHES[:2], 0, 99) == 0, "expired pins are evicted like any block"


def test_a_pin_is_cut_to_pin_max_s_and_renewed_by_a_later_request() -> None:
    clock = ManualClock()
    m = manager(clock=clock, pin_max_s=5)
    run(m, "a", HASHES[:2], RequestControl(pin_s=60))
    clock.advance(4)
    m.allocated("b", HASHES[:2], [[8, 9]], 0, 0, control=RequestControl(pin_s=3))
    clock.advance(2)
    m.process(None)
    assert m.index.stats().pinned == 2, "the second request's pin runs past the first's"
    clock.advance(1)
    m.process(None)
    assert m.index.stats().pinned == 0


def test_pins_never_hold_more_than_their_share() -> None:
    clock = ManualClock()
    m = manager(num_slots=8, clock=clock, pin_share=0.25)
    run(m, "a", HASHES[:4], RequestControl(pin_s=10))
    assert m.index.stats().pinned == 2
    assert m.pins.wanted["a"][0] == tuple(m.namespace.keys(HASHES[2:4]))
    # Six more blocks: the two pinned stay, every other slot is still open to stores.
    plan = run(m, "b", HASHES[4:10], first_block=4)
    assert stored(plan) == [4, 5, 6, 7, 8, 9]
    assert m.lookup("x", HASHES[:2], 0, 99) == 2 * BT
    off = manager(pin_share=0)
    run(off, "a", HASHES[:2], RequestControl(pin_s=10))
    assert off.index.stats().pinned == 0 and not off.pins.active


def test_a_pin_waits_for_its_blocks_to_be_stored() -> None:
    clock = ManualClock()
    m = manager(clock=clock)
    m.allocated("a", HASHES[:2], [[0, 1]], 0, 0, control=RequestControl(pin_s=10))
    assert m.index.stats().pinned == 0
    run(m, "b", HASHES[:2], first_block=2)
    assert m.index.stats().pinned == 2
    clock.advance(10)
    m.process(None)
    assert m.index.stats().pinned == 0 and not m.pins.active


def test_a_reset_drops_every_pin() -> None:
    m = manager(clock=ManualClock())
    run(m, "a", HASHES[:2], RequestControl(pin_s=10))
    m.finished("a")
    assert m.reset() is True
    assert m.lookup("x", HASHES[:2], 0, 99) == 0 and not m.pins.active


def test_priority_orders_eviction_before_recency() -> None:
    m = manager(num_slots=3)
    run(m, "normal", HASHES[:1])
    run(m, "high", HASHES[1:2], RequestControl(priority="high"), first_block=1)
    run(m, "low", HASHES[2:3], RequestControl(priority="low"), first_block=2)
    run(m, "d", HASHES[3:4], first_block=3)
    assert m.lookup("x", HASHES[2:3], 0, 99) == 0, "the low block goes first, though newest"
    assert m.lookup("x", HASHES[:1], 0, 99) == BT
    run(m, "e", HASHES[4:5], first_block=4)
    run(m, "f", HASHES[5:6], first_block=5)
    assert m.lookup("x", HASHES[:1], 0, 99) == 0
    assert m.lookup("x", HASHES[3:4], 0, 99) == 0, "then the normal ones, oldest first"
    assert m.lookup("x", HASHES[1:2], 0, 99) == BT, "the high block goes last, though oldest"


def test_a_load_gives_its_blocks_the_requests_priority() -> None:
    m = manager(num_slots=2)
    run(m, "a", HASHES[:1])
    run(m, "b", HASHES[1:2], first_block=1)
    assert m.lookup("c", HASHES[1:2], 0, 99) == BT
    m.allocated("c", HASHES[1:2], [[7]], 0, BT, control=RequestControl(priority="low"))
    m.process(done(m.build_plan()))
    run(m, "d", HASHES[2:3], first_block=2)
    assert m.lookup("x", HASHES[1:2], 0, 99) == 0, "the low block went, not the older one"
    assert m.lookup("x", HASHES[:1], 0, 99) == BT
