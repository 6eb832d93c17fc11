"""The served soak: its plan, fault schedule and checks, and a three-minute run under faults
that must give vanilla vLLM's outputs, hang nothing and see every tier used again."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.redis_server import redis_server_binary


@pytest.fixture(scope="module")
def soak(benchmarks_on_path: None) -> ModuleType:
    import soak

    return soak


def test_the_plan_sends_every_item_and_repeats_only_earlier_ones(soak: ModuleType) -> None:
    items, longs = soak.catalogue(0, 40, 1024)
    sends = soak.plan(0, items)
    names = [send.item.name for send in sends]
    assert names[::2] == [item.name for item in items]
    for position, name in enumerate(names[1::2]):
        assert names.index(name) <= 2 * position
    assert any(send.stream for send in sends) and not all(send.stream for send in sends)
    assert all(send.stream for send in sends if send.disconnect)
    assert any(send.disconnect for send in sends)
    assert {item.chat for item in items} == {True, False}
    assert all(len(item.prompt) == soak.LONG_BLOCKS * soak.BLOCK for item in longs)
    assert all(0 < token < 1024 for item in items for token in item.prompt)


def test_faults_follow_the_warmup_in_turn_and_each_leaves_time_to_recover(
    soak: ModuleType,
) -> None:
    faults = [soak.Fault(name, None, lambda: None, lambda: None) for name in ("a", "b", "c")]
    timeline = soak.schedule(faults, 45.0, 180.0)
    assert [fault.name for _, fault in timeline] == ["a", "b", "c", "a"]
    assert timeline[0][0] == 45.0
    for at, fault in timeline:
        assert at + fault.duration_s + soak.FAULT_GAP_S <= 180.0


def test_a_wrong_token_fails_and_a_closed_stream_is_held_to_what_it_read(
    soak: ModuleType,
) -> None:
    reference = {"c0": [5, 6, 7, 8]}

    def outcome(tokens: list[int], disconnected: bool = False) -> object:
        return soak.Outcome("c0", "completion", 0.0, 1.0, tokens, None, disconnected)

    assert soak.compare([outcome([5, 6, 7, 8]), outcome([5, 6], True)], reference)["ok"]
    assert not soak.compare([outcome([5, 6, 7, 9])], reference)["ok"]
    assert not soak.compare([outcome([5, 7], True)], reference)["ok"]
    assert not soak.compare([outcome([5, 6, 7])], reference)["ok"]


def test_a_tier_that_stores_nothing_after_its_fault_has_not_recovered(soak: ModuleType) -> None:
    def sample(t: float, stored: float) -> dict[str, object]:
        return {"t": t, "tiers": {"redis": {"stores": stored}}}

    run = soak.Soak(None, [], [], 0.0, 100.0)
    run.windows = [{"fault": "redis_kill", "tier": "redis", "begin_s": 10.0, "end_s": 20.0}]
    run.samples = [sample(20.0, 5.0), sample(23.0, 5.0), sample(26.0, 7.0)]
    (found,) = soak.recoveries(run)
    assert found["recovered_after_s"] == 6.0 and found["ok"]
    run.samples = [sample(20.0, 5.0), sample(60.0, 5.0)]
    (found,) = soak.recoveries(run)
    assert found["recovered_after_s"] is None and not found["ok"]


def test_every_tier_balances_exactly_counting_the_records_it_already_held(
    soak: ModuleType,
) -> None:
    counts = {
        "demoted_blocks": 10.0,
        "written_through_blocks": 7.0,
        "tiers": {
            "disk": {"stores": 3.0, "drops": 1.0, "held": 6.0},
            "redis": {"stores": 5.0, "drops": 1.0},
        },
    }
    disk = soak.balance(counts, "disk", "write_back")
    assert disk["ok"] and disk["uncounted"] == 0 and disk["held"] == 6.0
    redis = soak.balance(counts, "redis", "write_through")
    assert not redis["ok"] and redis["uncounted"] == 1.0


def test_queue_depths_states_and_read_buffers_come_from_the_metrics_per_interval(
    soak: ModuleType,
) -> None:
    def page(stores: int, queued: int, state: int) -> str:
        labels = 'model_name="m",engine="0",tier="redis"'
        return (
            "# TYPE vllm:kvtier_tier_stores_total counter\n"
            f"vllm:kvtier_tier_stores_total{{{labels}}} {stores}\n"
            "# TYPE vllm:kvtier_tier_read_buffer_bytes_total counter\n"
            f"vllm:kvtier_tier_read_buffer_bytes_total{{{labels}}} {stores << 20}\n"
            "# TYPE vllm:kvtier_tier_queued gauge\n"
            f"vllm:kvtier_tier_queued{{{labels}}} {queued}\n"
            "# TYPE vllm:kvtier_tier_state gauge\n"
            f"vllm:kvtier_tier_state{{{labels}}} {state}\n"
        )

    pages = [(5.0, page(3, 2, 0)), (12.0, page(4, 7, 1)), (19.0, page(9, 0, 0))]
    run = soak.Soak(None, [], [], 0.0, 20.0)
    run.samples = [
        {"t": t, "rss_bytes": 1, "rss_by_process": {}, "fds": 1, "threads": 1}
        | soak.parse_metrics(text)
        for t, text in pages
    ]
    (row,) = soak.intervals(run, 20.0)
    redis = row["tiers"]["redis"]
    assert (redis["stores"], redis["queued"], redis["queued_max"]) == (9.0, 0.0, 7.0)
    assert redis["state"] == "up" and redis["states_seen"] == ["up", "backing off"]
    assert row["read_buffers_mib"] == 9.0  # what the tiers keep, not what they added
    assert run.states() == {"redis": "up"}


@pytest.mark.vllm
def test_a_three_minute_soak_under_faults_is_correct_and_recovers(
    soak: ModuleType, tmp_path: Path
) -> None:
    """Correctness, no hang, recovery and counters; never speed, nor memory growth, which
    three minutes cannot tell from warm-up."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    report_path = tmp_path / "soak.json"
    soak.main(["--minutes", "3", "--output", str(report_path)])
    report = json.loads(report_path.read_text())
    checks = report["checks"]
    assert checks["no_hang"]["ok"], checks["no_hang"]
    assert report["errors"] == {}
    assert checks["outputs"]["ok"], checks["outputs"]
    assert checks["outputs"]["checked"] >= 100
    assert checks["recovery"]["ok"], checks["recovery"]
    assert checks["counters"]["ok"], checks["counters"]
    redis_states = {s for row in report["intervals"] for s in row["tiers"]["redis"]["states_seen"]}
    assert "backing off" in redis_states, "the state gauge shows Redis's outages"
    made = {window["fault"] for window in report["faults"] if "error" not in window}
    assert {"redis_kill", "redis_stall", "abort_burst"} <= made, report["faults"]
    if report["disk_full"] == "tmpfs filled":
        assert "disk_full" in made
    assert sum(row["disconnected"] for row in report["intervals"]) > 0
    assert sum(row["preemptions"] for row in report["intervals"]) > 0
