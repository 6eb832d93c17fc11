"""``kvtier simulate --fleet``: engines with their own host tiers over shared lower tiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.simulate import run
from kvtier.index.base import BlockIndex
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.simulator.fleet import (
    fleet_sizes,
    replay_fleet,
    route,
    simulate_fleet,
    size_shared_tier,
)
from kvtier.simulator.generate import generate_trace
from kvtier.simulator.policies import parse_policy
from kvtier.simulator.replay import LowerWrites, replay
from kvtier.simulator.report import summarize_fleet
from kvtier.simulator.traces import TraceRequest
from tests.simulator.conftest import parse, requests_of


def lru(slots: int) -> BlockIndex:
    return PolicyIndex(slots, LRUPolicy())


# Prefixes 1 and 2 hash to different engines of two, 2 and 4 to the same one.
SHARED_PREFIX = requests_of([1, 11, 12], [2, 21, 22], [4, 41, 42], [1, 11, 12, 13])


def test_prefix_affinity_sends_a_prefix_where_it_was_served() -> None:
    pick = route("prefix_affinity", 2)
    first, second, third, again = SHARED_PREFIX
    assert pick(0, first) != pick(1, second) == pick(2, third)
    assert pick(3, again) == pick(0, first)
    assert [route("round_robin", 3)(position, first) for position in range(4)] == [0, 1, 2, 0]
    assert pick(5, TraceRequest(0.0, ())) == 1, "a request without blocks goes in turn"


def test_round_robin_second_engine_hits_the_shared_tier_on_the_firsts_prefix() -> None:
    # Engine 0 serves [1 11 12], then [4 41 42] pushes it out of its 3-block host tier into
    # the shared tier, where engine 1 finds it for [1 11 12 13] (never the last block).
    result = replay_fleet(
        SHARED_PREFIX,
        lru,
        engines=2,
        routing="round_robin",
        host_blocks=3,
        shared_tiers=[("redis", 100)],
        policy_name="lru",
    )
    assert result.blocks == 13
    assert result.host_hits == 0
    assert result.shared_hits == (("redis", 3),)
    assert result.hit_rate == pytest.approx(3 / 13)
    assert result.busiest_engine_requests == 2


def test_prefix_affinity_gives_host_hits_instead() -> None:
    result = replay_fleet(
        SHARED_PREFIX,
        lru,
        engines=2,
        routing="prefix_affinity",
        host_blocks=3,
        shared_tiers=[("redis", 100)],
        policy_name="lru",
    )
    assert result.host_hits == 3
    assert result.shared_hits == (("redis", 0),)
    # Engine 1 evicted [2 21 22] for [4 41 42], engine 0 one block for 13: all that was
    # written to the shared tier.
    assert result.shared_written == (("redis", 4),)


def test_write_through_puts_every_stored_block_in_the_shared_tier_at_once() -> None:
    trace = requests_of([1, 2, 3], [1, 2, 3, 4])
    result = replay_fleet(
        trace,
        lru,
        engines=2,
        routing="round_robin",
        host_blocks=10,
        shared_tiers=[("redis", 100)],
        policy_name="lru",
        lower_writes="store",
    )
    # Nothing was evicted, yet engine 1 finds engine 0's blocks; it stores only block 4.
    assert result.shared_hits == (("redis", 3),)
    assert result.shared_written == (("redis", 4),)
    assert result.evicted == 0


@pytest.mark.parametrize("lower_writes", ["eviction", "store"])
def test_one_engine_is_the_plain_replay(lower_writes: LowerWrites) -> None:
    trace = generate_trace("chat", 300, seed=2)
    alone = replay(
        trace,
        lru(100),
        policy_name="lru",
        lower_tiers=[("disk", 400)],
        lower_writes=lower_writes,
    )
    fleet = replay_fleet(
        trace,
        lru,
        engines=1,
        routing="prefix_affinity",
        host_blocks=100,
        shared_tiers=[("disk", 400)],
        policy_name="lru",
        lower_writes=lower_writes,
    )
    assert alone.lower_hits[0][1] > 0
    assert fleet.shared_hits == alone.lower_hits
    assert fleet.host_hits == alone.tier_hits - alone.lower_hits[0][1]
    assert fleet.hit_rate == alone.hit_rate
    assert (fleet.stored, fleet.evicted, fleet.blocks) == (
        alone.stored,
        alone.evicted,
        alone.blocks,
    )


def test_shared_traffic_per_second_of_trace_time() -> None:
    trace = [
        TraceRequest(1000.0 * position, request.keys)
        for position, request in enumerate(SHARED_PREFIX)
    ]
    [fleet_run] = simulate_fleet(
        trace, parse_policy("lru"), [3], [(("redis", 100),)], [2], ["round_robin"]
    )
    summary = summarize_fleet("t", trace, [fleet_run], block_bytes=1000)
    assert summary["trace_seconds"] == 3.0
    [row] = summary["fleets"]
    [traffic] = row["shared_traffic"]
    written = row["shared_written"][0][1]
    assert traffic["read_blocks"] == 3
    assert traffic["read_bytes_per_s"] == 1000.0
    assert traffic["written_bytes_per_s"] == pytest.approx(written * 1000 / 3)
    assert row["sizing"] is None
    unscaled = summarize_fleet("t", trace, [fleet_run])
    assert unscaled["fleets"][0]["shared_traffic"][0]["read_bytes_per_s"] is None
    assert unscaled["fleets"][0]["shared_traffic"][0]["read_blocks_per_s"] == 1.0


def test_sizing_finds_the_smallest_capacity_that_reaches_the_target() -> None:
    replayed: list[int] = []

    def rate(capacity: int) -> float:
        replayed.append(capacity)
        return 0.5 if capacity >= 437 else 0.5 * capacity / 1000

    sizing = size_shared_tier(rate, 10_000, "redis", 0.9, precision=0.0)
    assert sizing.capacity_blocks == 437
    assert sizing.unbounded_hit_rate == 0.5 and sizing.hit_rate == 0.5
    assert [capacity for capacity, _ in sizing.replays] == replayed
    assert len(replayed) < 20
    coarse = size_shared_tier(rate, 10_000, "redis", 0.9)
    assert 437 <= coarse.capacity_blocks <= 437 * 1.05 + 1
    with pytest.raises(ValueError, match="fraction in"):
        size_shared_tier(rate, 10_000, "redis", 0.0)


def test_sizing_replays_the_fleet_below_an_unbounded_shared_tier() -> None:
    trace = generate_trace("chat", 100, seed=1)
    [fleet_run] = simulate_fleet(
        trace,
        parse_policy("lru"),
        [30],
        [(("redis", 3000),)],
        [2],
        ["round_robin"],
        target_fraction=0.9,
    )
    sizing = fleet_run.sizing
    assert sizing is not None
    distinct = len({key for request in trace for key in request.keys})
    assert sizing.replays[0] == (distinct, sizing.unbounded_hit_rate)
    assert sizing.hit_rate >= 0.9 * sizing.unbounded_hit_rate
    assert sizing.capacity_blocks < distinct
    # A tier this size holds every block, as the unbounded one does.
    assert fleet_run.result.hit_rate == sizing.unbounded_hit_rate


def test_fleet_sizes_double_up_to_the_largest() -> None:
    assert fleet_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert fleet_sizes(6) == [1, 2, 4, 6]
    assert fleet_sizes(1) == [1]


def test_command_sweeps_fleets_and_sizes_the_shared_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "fleet.png"
    argv = ["synthetic:chat", "--synthetic-requests", "40", "--policies", "lru"]
    fleet = ["--fleet", "2", "--fleet-sweep", "--routing", "round_robin,prefix_affinity"]
    assert (
        run(
            parse(
                *argv,
                *fleet,
                "--tiers",
                "host=40,redis=2000",
                "--shared-target",
                "0.9",
                "--block-bytes",
                "1MiB",
                "--json",
                "--plot",
                str(plot),
            )
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["block_bytes"] == 1 << 20 and summary["trace_seconds"] > 0
    rows = {(row["engines"], row["routing"]): row for row in summary["fleets"]}
    assert set(rows) == {(n, r) for n in (1, 2) for r in ("round_robin", "prefix_affinity")}
    row = rows[(2, "round_robin")]
    assert row["shared_tiers"] == [["redis", 2000]] and row["lower_writes"] == "eviction"
    assert row["busiest_engine_requests"] == 20
    assert row["shared_traffic"][0]["tier"] == "redis"
    assert row["sizing"]["tier"] == "redis" and row["sizing"]["target_fraction"] == 0.9
    assert rows[(1, "round_robin")]["hit_rate"] == rows[(1, "prefix_affinity")]["hit_rate"]
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert run(parse(*argv, "--fleet", "2", "--tiers", "host=40,redis=2000")) == 0
    table = capsys.readouterr().out
    assert "| 2 | round_robin | 40 | redis=2000 |" in table
    assert "blocks/s" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fleet", "0", "--tiers", "host=10,redis=100"], "--fleet must be from 1 to 1024"),
        (["--fleet", "2"], "--fleet needs the shared tiers below the host tier"),
        (["--fleet", "2", "--tiers", "host=10"], "--fleet needs the shared tiers"),
        (["--fleet-sweep"], "--fleet-sweep needs --fleet N"),
        (["--routing", "prefix_affinity"], "--routing needs --fleet N"),
        (
            ["--fleet", "2", "--tiers", "host=10,redis=100", "--routing", "random"],
            "--routing 'random': choose round_robin or prefix_affinity",
        ),
        (
            ["--fleet", "2", "--tiers", "host=10,redis=100", "--shared-target", "1.5"],
            "--shared-target is a fraction of the unbounded hit rate in (0, 1]",
        ),
        (
            ["--fleet", "2", "--tiers", "host=10,redis=100", "--policies", "lru,arc"],
            "--fleet replays one host tier policy; 2 were given (lru, arc)",
        ),
        (
            ["--fleet", "2", "--tiers", "host=10,redis=100", "--trace-state", "5"],
            "--trace-state is not recorded in a fleet replay",
        ),
        (
            ["--device-blocks", "5", "--store-mode", "lazy", "--lower-writes", "store"],
            "use it with --store-mode eager",
        ),
        (["--fleet", "2", "--tiers", "host=10,redis=100", "--block-bytes", "0"], "positive"),
    ],
)
def test_fleet_usage_errors_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(parse("synthetic:chat", *argv)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("kvtier simulate: ")
