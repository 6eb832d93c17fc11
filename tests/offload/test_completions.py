"""Request completions alone: which requests are done, and how their failed loads are named."""

from __future__ import annotations

from kvtier.copy.base import Direction
from kvtier.offload import LoadFailures, Transfer, TransferPlan
from kvtier.offload.completions import RequestCompletions


def load(batch_id: int, blocks: tuple[int, ...], request: str) -> Transfer:
    return Transfer(batch_id, Direction.LOAD, 0, blocks, tuple(range(len(blocks))), request)


def test_requests_finish_when_none_of_their_batches_is_in_flight() -> None:
    requests = RequestCompletions(num_groups=1)
    plan = TransferPlan(
        loads=(load(0, (1,), "r"), load(1, (2,), "r"), load(2, (3,), "now")),
        holds={"q": (1,)},
        same_step=frozenset({"now"}),
    )
    assert requests.bind(plan) == [plan.loads[2]], "same-step loads go back to be copied"
    inflight = {0: None, 1: None, 2: None}
    assert requests.take_finished(inflight.keys()) == (set(), set())
    del inflight[1]
    requests.ended(plan.loads[1], True)
    assert requests.take_finished(inflight.keys()) == ({"q"}, set())
    del inflight[0], inflight[2]
    requests.ended(plan.loads[0], True)
    requests.ended(plan.loads[2], True)
    assert requests.take_finished(inflight.keys()) == (set(), {"r"}), "never the same-step one"
    assert requests.take_finished(inflight.keys()) == (set(), set()), "each named once"
    assert requests.idle


def test_failed_loads_are_blocks_with_one_group_and_requests_with_several() -> None:
    for groups, expected in (
        (1, LoadFailures(blocks=frozenset({4, 5, 6}))),
        (2, LoadFailures(requests=frozenset({"r", "u"}))),
    ):
        requests = RequestCompletions(num_groups=groups)
        plan = TransferPlan(loads=(load(0, (4, 5), "r"),), unavailable={"u": (6,)})
        requests.bind(plan)
        requests.ended(plan.loads[0], False)
        assert not requests.idle
        _, loaded = requests.take_finished({}.keys())
        assert requests.take_load_failures(loaded) == expected
        assert requests.take_load_failures(loaded) == LoadFailures()
        assert requests.idle


def test_a_failed_same_step_load_is_blocks_alone() -> None:
    requests = RequestCompletions(num_groups=1)
    plan = TransferPlan(loads=(load(0, (4,), "now"),), same_step=frozenset({"now"}))
    requests.bind(plan)
    requests.ended(plan.loads[0], False)
    assert requests.take_finished({}.keys()) == (set(), set()), "the engine runs it already"
    assert requests.take_failed_load_blocks() == {4}
    assert requests.idle
