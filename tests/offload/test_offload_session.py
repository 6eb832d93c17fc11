"""The request session: what an engine decides around the manager's rules, for every driver."""

from __future__ import annotations

from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.offload import OffloadManager, OffloadSession, TransferPlan, WorkerReport
from kvtier.offload.control import RequestControl
from tests.support.faults import ManualClock

BT = 4
RECORD_BYTES = 100
HASHES = [bytes([i]) * 8 for i in range(16)]


def stored(blocks: int, **options: object) -> OffloadSession:
    """A session whose tier holds the first ``blocks`` of :data:`HASHES`."""
    manager = OffloadManager(
        PolicyIndex(16, LRUPolicy()),
        block_tokens=BT,
        record_bytes=RECORD_BYTES,
        cost_guard=bool(options.pop("cost_guard", False)),
        clock=options.pop("clock", ManualClock()),  # type: ignore[arg-type]
    )
    session = OffloadSession(manager, **options)  # type: ignore[arg-type]
    ids = [list(range(blocks))]
    session.allocated("writer", HASHES[:blocks], ids, 0)
    session.scheduled("writer", num_computed_tokens=blocks * BT, new_block_ids=ids)
    session.process(done(session.plan()))
    assert session.finished("writer", blocks * BT) is False
    return session


def done(plan: TransferPlan) -> WorkerReport:
    return WorkerReport(done={t.batch_id: 1 for t in (*plan.stores, *plan.loads)})


def test_a_hit_within_the_same_step_budget_stops_one_token_short_and_is_not_awaited() -> None:
    session = stored(4, same_step_bytes=3 * RECORD_BYTES, last_block=True)
    # the whole last block is a hit for the engine that recomputes the last token itself...
    assert session.lookup("big", HASHES[:4], 0, 4 * BT) == (4 * BT, True)
    # ...and a hit that fits the budget loads in the step that runs it, one token short
    assert session.lookup("small", HASHES[:2], 0, 2 * BT) == (2 * BT - 1, False)
    assert session.lookup("late", HASHES[:2], 0, 2 * BT) == (2 * BT, True), "budget spent"
    session.allocated("small", HASHES[:2], [[0, 1]], 2 * BT - 1)
    plan = session.plan()
    assert plan.same_step == {"small"}
    assert session.lookup("next", HASHES[:2], 0, 2 * BT) == (2 * BT - 1, False), "new budget"
    assert not session.requests["small"].awaited


def test_without_last_block_the_last_tokens_block_is_never_a_hit() -> None:
    session = stored(4)
    assert session.lookup("a", HASHES[:4], 0, 4 * BT) == (3 * BT, True)
    assert session.lookup("b", HASHES[:4], 0, 4 * BT + 1) == (4 * BT, True)


def test_a_request_finished_while_its_load_is_awaited_is_freed_by_the_engine() -> None:
    session = stored(4)
    tokens, _ = session.lookup("r", HASHES[:4], 0, 4 * BT + 1)
    assert tokens is not None
    session.allocated("r", HASHES[:4], [[4, 5, 6, 7]], tokens)
    assert session.requests["r"].awaited
    session.plan()
    assert session.finished("r", 0) is False, "the engine frees its blocks at the load's end"
    assert "r" not in session.requests


def test_the_progress_or_the_engine_says_when_a_load_is_over() -> None:
    session = stored(4)
    for request_id, heard in (("told", ["told"]), ("progress", None)):
        tokens, _ = session.lookup(request_id, HASHES[:4], 0, 4 * BT + 1)
        assert tokens is not None
        session.allocated(request_id, HASHES[:4], [[4, 5, 6, 7]], tokens)
        progress = session.process(done(session.plan()), heard)
        assert request_id in progress.loaded_requests
        assert not session.requests[request_id].awaited


def test_the_control_of_the_first_lookup_holds_until_the_request_finished() -> None:
    session = stored(4)
    refused = RequestControl(load=False)
    assert session.lookup("r", HASHES[:4], 0, 4 * BT + 1, refused) == (0, False)
    assert session.lookup("r", HASHES[:4], 0, 4 * BT + 1) == (0, False)
    session.finished("r")
    assert session.lookup("r", HASHES[:4], 0, 4 * BT + 1) == (4 * BT, True)


def test_an_allocation_starts_where_the_last_lookup_did() -> None:
    session = stored(4)
    tokens, _ = session.lookup("r", HASHES[:4], BT, 4 * BT + 1)
    assert tokens == 3 * BT
    session.allocated("r", HASHES[:4], [[8, 9, 10, 11]], tokens, num_computed_tokens=0)
    (load,) = session.plan().loads
    assert list(load.device_blocks) == [9, 10, 11]


def test_steps_are_timed_from_their_plan_to_their_end_for_the_cost_guard() -> None:
    clock = ManualClock()
    session = stored(1, cost_guard=True, clock=clock)  # the manager's clock times the steps
    timed: list[tuple[int, float]] = []
    session.manager.guard.step_timed = lambda tokens, seconds: timed.append((tokens, seconds))  # type: ignore[method-assign]
    session.plan(scheduled_tokens=10)
    clock.advance(0.5)
    session.plan(scheduled_tokens=20)
    clock.advance(0.25)
    session.step_ended()
    session.step_ended()
    session.step_ended()
    session.plan()  # not counted
    session.step_ended()
    assert timed == [(10, 0.75), (20, 0.25)]


def test_events_name_the_tokens_of_the_allocated_requests() -> None:
    manager = OffloadManager(
        PolicyIndex(16, LRUPolicy()), block_tokens=BT, record_bytes=1, record_events=True
    )
    session = OffloadSession(manager)
    tokens = list(range(2 * BT))
    session.allocated("r", HASHES[:2], [[0, 1]], 0, token_ids=tokens)
    session.scheduled("r", num_computed_tokens=2 * BT, new_block_ids=[[0, 1]])
    session.process(done(session.plan()))
    events = session.take_events()
    assert [list(event.token_ids) for event in events] == [tokens[:BT], tokens[BT:]]
    assert session.finished("r", 2 * BT) is False
    assert session.tokens.num_requests == 1, "kept until the next events are described"
    assert session.take_events() == [] and session.tokens.num_requests == 0
