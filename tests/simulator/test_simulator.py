"""Trace loading, generation, replay, the Belady bound and the ``kvtier simulate`` command."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from kvtier.cli import simulate as simulate_command
from kvtier.cli.simulate import run
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.index.prefix_arc import PrefixARCConfig
from kvtier.keys import hash_token_blocks
from kvtier.simulator import simulate
from kvtier.simulator.generate import WORKLOADS, generate_records, generate_trace
from kvtier.simulator.policies import PolicyError, parse_policy, split_unquoted
from kvtier.simulator.replay import replay
from kvtier.simulator.traces import TraceError, load_trace, mooncake_key
from tests.conftest import REPO_ROOT
from tests.simulator.conftest import parse, requests_of

MOONCAKE_TRACE = REPO_ROOT / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def write_lines(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_loads_both_formats(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 7, "token_ids": list(range(40))},
        ],
    )
    mooncake, tokens = load_trace(path, block_tokens=16)
    assert mooncake.keys == (mooncake_key(1), mooncake_key(2))
    assert tokens.timestamp_ms == 7.0
    assert list(tokens.keys) == hash_token_blocks(list(range(40)), 16)
    assert len(tokens.keys) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"timestamp": 0}', "needs 'hash_ids'"),
        ('{"hash_ids": [1, -2]}', "'hash_ids' must be a list of integers"),
        ('{"hash_ids": [1], "timestamp": "soon"}', "'timestamp' must be a number"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as caught:
        load_trace(path)
    assert f"{path}:2" in str(caught.value)


def test_replay_counts_hits_stores_and_evictions() -> None:
    trace = requests_of([1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3])
    result = replay(trace, PolicyIndex(4, LRUPolicy()), policy_name="lru")
    # [1 2 3] stored; [1 2] hit, 4 stored; 5 and 6 evict 3 and 1; then 1 misses, so 1, 2 and 3
    # are stored again, evicting 2, 4 and 5.
    assert result.blocks == 11
    assert result.tier_hits == 2
    assert result.stored == 9
    assert result.evicted == 5
    assert result.hit_rate == pytest.approx(2 / 11)


@pytest.mark.parametrize("world_size", [1, 2])
def test_replay_counts_only_hits_the_offload_manager_serves(world_size: int) -> None:
    trace = requests_of([1, 2], [1, 2], [1, 2, 3])
    result = replay(trace, PolicyIndex(8, LRUPolicy()), policy_name="lru", world_size=world_size)
    # The manager never loads a prompt's last block (the engine computes at least one
    # token): the repeated [1 2] gets 1 hit, not the 2 the bare index holds; [1 2 3] gets 2.
    assert result.tier_hits == 3
    assert result.stored == 3


def test_lazy_store_only_stores_what_the_device_cache_evicts() -> None:
    trace = generate_trace("chat", 300, seed=1)
    eager = replay(trace, PolicyIndex(500, LRUPolicy()), policy_name="lru", device_blocks=200)
    lazy = replay(
        trace,
        PolicyIndex(500, LRUPolicy()),
        policy_name="lru",
        device_blocks=200,
        store_mode="lazy",
    )
    assert eager.device_hits == lazy.device_hits > 0
    assert lazy.stored < eager.stored
    with pytest.raises(ValueError, match="device cache"):
        replay(trace, PolicyIndex(5, LRUPolicy()), policy_name="lru", store_mode="lazy")


def test_belady_bounds_every_policy() -> None:
    trace = generate_trace("rag", 400, seed=3)
    results = simulate(trace, ["lru", "arc", "s3fifo", "prefix_arc"], [300, 1500])
    for capacity in (300, 1500):
        rates = {r.policy: r.hit_rate for r in results if r.capacity_blocks == capacity}
        assert max(rate for name, rate in rates.items() if name != "belady") <= rates["belady"]


def test_generated_traces_are_deterministic_and_prefix_consistent() -> None:
    for workload in WORKLOADS:
        records = generate_records(workload, 200, seed=5)
        assert records == generate_records(workload, 200, seed=5)
        assert records != generate_records(workload, 200, seed=6)
        parents: dict[int, int | None] = {}
        for record in records:
            for parent, block in zip([None, *record["hash_ids"]], record["hash_ids"], strict=False):
                assert parents.setdefault(block, parent) == parent


def test_agent_trace_grows_long_contexts_on_shared_prompts_with_branches() -> None:
    chains = [record["hash_ids"] for record in generate_records("agent", 400, seed=0)]
    # Tasks share long system prompts: many requests start with the same 16 blocks.
    heads = [tuple(chain[:16]) for chain in chains]
    assert max(heads.count(head) for head in set(heads)) > 40
    # A step resends its task's context: most requests extend an earlier request's chain.
    seen: set[tuple[int, ...]] = set()
    extends = 0
    for chain in chains:
        extends += any(tuple(chain[:end]) in seen for end in range(17, len(chain)))
        seen.add(tuple(chain))
    assert extends > len(chains) // 2
    assert max(len(chain) for chain in chains) > 100
    # Retries branch inside a task: past any system prompt and task description (at most 68
    # blocks), some block is followed by two different blocks.
    children: dict[int, set[int]] = {}
    for chain in chains:
        for parent, child in zip(chain[68:], chain[69:], strict=False):
            children.setdefault(parent, set()).add(child)
    assert any(len(kids) > 1 for kids in children.values())


def test_command_prints_json_and_writes_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "rates.png"
    args = parse("synthetic:chat", "--synthetic-requests", "200", "--policies", "lru,prefix_arc")
    args.capacities = "100,400"
    args.json = True
    args.plot = str(plot)
    assert run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = {(row["policy"], row["capacity_blocks"]): row for row in summary["results"]}
    assert set(rows) == {(p, c) for p in ("lru", "prefix_arc", "belady") for c in (100, 400)}
    assert rows[("lru", 100)]["vs_lru"] == 1.0
    assert 0.0 < rows[("lru", 400)]["of_belady"] <= 1.0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_command_replays_a_policy_with_changed_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse(
        "synthetic:rag",
        "--synthetic-requests",
        "300",
        "--policies",
        "prefix_arc,prefix_arc:admission=all:history_factor=0",
        "--capacities",
        "50",
        "--no-belady",
        "--json",
    )
    assert run(args) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [row["policy"] for row in rows] == [
        "prefix_arc",
        "prefix_arc:admission=all:history_factor=0",
    ]
    assert rows[0]["stored"] != rows[1]["stored"]


def test_command_capacity_in_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "synthetic:rag",
        "--synthetic-requests",
        "50",
        "--policies",
        "lru",
        "--capacity-bytes",
        "1MiB",
        "--block-bytes",
        "4KiB",
        "--no-belady",
    )
    assert run(args) == 0
    assert "| 256 | lru |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["synthetic:chat", "--policies", "nope"],
            "kvtier simulate: --policies 'nope': index.type: unknown block index type; installed: ",
        ),
        (["synthetic:chat", "--policies", "lru:x"], "settings are KEY=VALUE, got 'x'"),
        (
            ["synthetic:chat", "--policies", "prefix_arc:admission=some"],
            "kvtier simulate: --policies 'prefix_arc:admission=some': index.admission: Input",
        ),
        (
            ["synthetic:chat", "--policies", "lru:size=3"],
            "kvtier simulate: --policies 'lru:size=3': index.size: unknown key; valid keys "
            "here: type (got '3')\n",
        ),
        (["synthetic:chat", "--policies", "lru:a='b,c"], "the quote ' is not closed"),
        (["synthetic:chat", "--trace-state", "0"], "--trace-state must be at least 1"),
        (["synthetic:chat", "--capacities", "10,x"], "--capacities must be whole numbers"),
        (["synthetic:chat", "--capacity-bytes", "1GiB"], "needs --block-bytes"),
        (["synthetic:other"], "unknown synthetic workload"),
        (["synthetic:chat", "--store-mode", "lazy"], "needs a device cache"),
        (["missing.jsonl"], "no such trace file"),
    ],
)
def test_command_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_plot_that_cannot_be_written_after_the_replay_is_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(summary: object, path: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(simulate_command, "plot_hit_rates", full_disk)
    plot = tmp_path / "rates.png"
    args = parse("synthetic:chat", "--synthetic-requests", "20", "--policies", "lru", "--no-belady")
    args.capacities = "10"
    args.plot = str(plot)
    assert run(args) == 1
    err = capsys.readouterr().err
    assert err == f"kvtier simulate: cannot write {plot}: No space left on device\n"


@pytest.mark.skipif(not MOONCAKE_TRACE.exists(), reason=f"{MOONCAKE_TRACE} is not present")
def test_default_policy_never_below_lru_on_the_mooncake_trace() -> None:
    trace = load_trace(MOONCAKE_TRACE)
    results = simulate(trace, ["lru", "prefix_arc"], [500, 1000, 4000, 32000], belady=False)
    rates = {(r.policy, r.capacity_blocks): r.hit_rate for r in results}
    for capacity in (500, 1000, 4000, 32000):
        assert rates[("prefix_arc", capacity)] >= rates[("lru", capacity)]
    assert rates[("prefix_arc", 1000)] >= 1.15 * rates[("lru", 1000)]
    assert rates[("prefix_arc", 4000)] >= 1.15 * rates[("lru", 4000)]


def test_a_misspelt_setting_gets_the_config_checkers_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(parse("synthetic:chat", "--policies", "prefix_arc:histroy_factor=2")) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvtier simulate: --policies 'prefix_arc:histroy_factor=2': index.histroy_factor: "
        "unknown key; valid keys here: admission, eviction, first_sight_memory_factor, "
        "history_factor, low_value_ratio, sample_rate, type (got '2')\n"
    )


def test_quoted_values_may_hold_separators() -> None:
    assert split_unquoted("a:k='x,y:z',b:k=\"1=2\"", ",", "--policies") == [
        "a:k='x,y:z'",
        'b:k="1=2"',
    ]
    spec = parse_policy("prefix_arc:history_factor='8':admission=\"all\"")
    assert spec.config == PrefixARCConfig(history_factor=8, admission="all")
    with pytest.raises(PolicyError, match="index.admission: Input should be 'adaptive' or 'all'"):
        parse_policy("prefix_arc:admission='all,adaptive'")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_policy_file_adds_policies_with_typed_settings(
    tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {"policies": ["lru", {"type": "prefix_arc", "history_factor": 0, "admission": "all"}]}
    file = tmp_path / f"policies{suffix}"
    file.write_text(json.dumps(data))  # JSON is YAML too
    args = parse("synthetic:rag", "--synthetic-requests", "100", "--policy-file", str(file))
    args.capacities, args.no_belady, args.json = "50", True, True
    assert run(args) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [row["policy"] for row in rows] == ["lru", "prefix_arc:history_factor=0:admission=all"]
    file.write_text(json.dumps({"policies": [{"type": "prefix_arc", "history_factor": "x"}]}))
    assert run(args) == 2
    assert capsys.readouterr().err.startswith(
        f"kvtier simulate: --policy-file {file} policies[0]: index.history_factor: Input should "
        "be a valid number"
    )
    file.write_text(json.dumps({"policy": ["lru"]}))
    assert run(args) == 2
    assert "expected a mapping with a non-empty 'policies' list" in capsys.readouterr().err


def test_trace_state_records_the_policys_counters_and_plots_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "state.png"
    args = parse("synthetic:chat", "--synthetic-requests", "120", "--policies", "lru,arc")
    args.capacities, args.no_belady, args.json = "60", True, True
    args.trace_state, args.plot = 50, str(plot)
    assert run(args) == 0
    captured = capsys.readouterr()
    rows = {row["policy"]: row for row in json.loads(captured.out)["results"]}
    assert rows["lru"]["state"] == [{"request": n} for n in (0, 50, 100, 120)]
    arc = rows["arc"]["state"]
    assert [sample["request"] for sample in arc] == [0, 50, 100, 120]
    assert arc[0]["t1"] == 0 and arc[-1]["t1"] + arc[-1]["t2"] == 60
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert captured.err == f"kvtier simulate: plot written to {plot}\n"
