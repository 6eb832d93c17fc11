"""``kvtier simulate --tiers``: replays through a host tier and tiers below it."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.simulate import run
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.simulator.generate import generate_trace
from kvtier.simulator.replay import replay
from kvtier.simulator.tiers import parse_tiers
from tests.simulator.conftest import parse


def test_parse_gives_host_capacities_and_every_lower_combination() -> None:
    assert parse_tiers("host=10/20,disk=100/200,redis=1000") == (
        [10, 20],
        [(("disk", 100), ("redis", 1000)), (("disk", 200), ("redis", 1000))],
    )
    assert parse_tiers("host=10") == ([10], [()])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("disk=100", "start with the host tier"),
        ("host=10,disk", "is not NAME=BLOCKS"),
        ("host=10,disk=x", "whole numbers of blocks"),
        ("host=10,disk=0", "at least one block"),
        ("host=10,disk=5,disk=6", "'disk' is given twice"),
    ],
)
def test_bad_tiers_are_usage_errors(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tiers(text)
    assert run(parse("synthetic:chat", "--tiers", text)) == 2
    assert message in capsys.readouterr().err


def test_a_disk_below_the_host_tier_serves_what_the_host_evicted() -> None:
    trace = generate_trace("chat", 300, seed=1)
    alone = replay(trace, PolicyIndex(100, LRUPolicy()), policy_name="lru")
    chained = replay(
        trace, PolicyIndex(100, LRUPolicy()), policy_name="lru", lower_tiers=[("disk", 5000)]
    )
    ((name, from_disk),) = chained.lower_hits
    assert name == "disk" and from_disk > 0
    assert chained.tier_hits > alone.tier_hits


def test_command_reports_where_hits_came_from(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["synthetic:chat", "--synthetic-requests", "200", "--policies", "lru", "--no-belady"]
    assert run(parse(*argv, "--tiers", "host=50/100,disk=3000")) == 0
    table = capsys.readouterr().out
    assert "| 50 | disk=3000 | lru |" in table and "| 100 | disk=3000 | lru |" in table
    assert ", disk " in table
    assert run(parse(*argv, "--tiers", "host=50,disk=3000", "--json")) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["lower_tiers"] == [["disk", 3000]]
    assert row["lower_hits"][0][0] == "disk" and row["lower_hits"][0][1] > 0
