"""Throughput at a 0% hit rate with and without the connector: one engine per process swapping
its connector between rounds (kvtier, a do-nothing connector, none), or pairs of engine
processes with and without kvtier; per-round ratios by wall and CPU time, with a 95% interval of
their median."""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stats import grouped_median_ci

from vllm_bench.engine import BLOCK_TOKENS, cpu_s, engine_env, random_prompt
from vllm_bench.patches import ConnectorSwitch, Probes

ROUNDS_PER_PAIR = 30
"""Default rounds per pair of throughput engines. A round of the default shape lasts about
a quarter of a second, and its ratio wanders by 10 to 14% (standard deviation) on a shared
2-core machine, while pairs of processes differ by about 2.5% beyond that; starting a
pair costs some 20 s. Thirty rounds spend about as long measuring as starting, which
gives the narrowest interval per minute (six rounds needed about twice the minutes)."""

TARGETS = {
    "zero_hit_throughput_ratio_median_min": 0.98,
    "zero_hit_throughput_ratio_ci95_low_min": 0.97,
}


def ratio_interval(with_kvtier: list[list[float]], without: list[list[float]]) -> dict[str, Any]:
    """Median of the per-round ratios ``with / without`` and a 95% interval of it.

    Both arguments hold one list of rounds per pair of engine processes; the
    interval is that of the pairs' medians (:func:`stats.grouped_median_ci`), so a
    pair whose processes were steadily faster or slower counts as one sample.
    """
    pairs = [
        [w / o for w, o in zip(pair_with, pair_without, strict=True)]
        for pair_with, pair_without in zip(with_kvtier, without, strict=True)
    ]
    ratios = [ratio for pair in pairs for ratio in pair]
    low, high = grouped_median_ci(pairs)["ci95"]
    median = statistics.median(ratios)
    return {
        "rounds": ratios,
        "pair_medians": [statistics.median(pair) for pair in pairs],
        "median": median,
        "ci95": [low, high],
        "ok": median >= TARGETS["zero_hit_throughput_ratio_median_min"]
        and low >= TARGETS["zero_hit_throughput_ratio_ci95_low_min"],
    }


def throughput_engine(
    model_dir: Path,
    kvtier: dict[str, Any] | None,
    shape: tuple[int, int, int],
    null_connector: bool = False,
) -> Any:
    """An in-process engine for the throughput rounds. Without kvtier, ``null_connector``
    gives it the do-nothing connector of ``null_connector.py`` instead of no connector."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.integrations.vllm.offline import engine_kwargs

    prompts, prompt_tokens, output_tokens = shape
    overrides: dict[str, Any] = {}
    if kvtier is None and null_connector:
        overrides["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector",
            kv_connector_module_path="null_connector",
            kv_role="kv_both",
        )
    return LLM(
        **engine_kwargs(
            model_dir,
            kvtier=kvtier,
            num_device_blocks=prompts * (prompt_tokens + output_tokens) // BLOCK_TOKENS + 64,
            max_model_len=2 * prompt_tokens,
            **overrides,
        )
    )


def throughput_round(
    llm: Any, rng: random.Random, shape: tuple[int, int, int], probes: Probes | None
) -> tuple[float, float, dict[str, Any] | None]:
    """One batch of new prompts: tokens per wall second, per CPU second, and its breakdown.

    Work the engine does after the batch returned (stores still in flight) finishes
    outside the timed batch, as between bursts of requests.
    """
    from kvtier.integrations.vllm.offline import generate, settle

    prompts, prompt_tokens, output_tokens = shape
    batch = [random_prompt(rng, prompt_tokens) for _ in range(prompts)]
    if probes:
        probes.take()
    wall, cpu = time.perf_counter(), cpu_s()
    generate(llm, batch, output_tokens)
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    settle(llm)
    tokens = prompts * (prompt_tokens + output_tokens)
    return tokens / wall, tokens / cpu, probes.take() if probes else None


def serve_arm(
    conn: Connection,
    model_dir: Path,
    kvtier: dict[str, Any] | None,
    shape: tuple[int, int, int],
    breakdown: bool,
    null_connector: bool,
) -> None:
    """One throughput engine, in a process of its own: a batch per ``"run"``, until ``"stop"``."""
    engine_env(throughput_process=True)
    probes = Probes() if breakdown else None
    if probes:
        probes.install()
    from kvtier.integrations.vllm.offline import shutdown

    llm = throughput_engine(model_dir, kvtier, shape, null_connector)
    rng = random.Random(1)  # both arms draw the same prompts, round by round
    # A warm-up batch of the rounds' shape: the first batch of that size touches vLLM's
    # KV-cache pages for the first time, which made every pair's first round 20-30% slower.
    throughput_round(llm, rng, shape, None)
    conn.send("ready")
    breakdowns = []
    while conn.recv() == "run":
        *speeds, round_breakdown = throughput_round(llm, rng, shape, probes)
        if round_breakdown is not None:
            breakdowns.append(round_breakdown)
        conn.send(tuple(speeds))
    shutdown(llm)
    conn.send(breakdowns)


SWAP_KINDS = ("kvtier", "null", "none")
"""The connectors one engine of ``--throughput-method swap`` takes turns with: kvtier, the
do-nothing connector of ``null_connector.py``, and none."""


def serve_swapped(
    conn: Connection,
    model_dir: Path,
    kvtier: dict[str, Any],
    shape: tuple[int, int, int],
    triples: int,
    breakdown: bool,
) -> None:
    """One engine with kvtier, in a process of its own, running ``triples`` rounds of each of
    :data:`SWAP_KINDS`; sends each kind's speeds, round by round, and its breakdowns."""
    engine_env(throughput_process=True)
    probes = Probes() if breakdown else None
    if probes:
        probes.install()
    from kvtier.integrations.vllm.offline import shutdown

    llm = throughput_engine(model_dir, kvtier, shape)
    switch = ConnectorSwitch(llm)
    rng = random.Random(1)
    for kind in SWAP_KINDS:  # warm-up, as in serve_arm
        switch.use(kind)
        throughput_round(llm, rng, shape, None)
    speeds: dict[str, list[tuple[float, float]]] = {kind: [] for kind in SWAP_KINDS}
    breakdowns: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SWAP_KINDS}
    for triple in range(triples):
        switch.use("kvtier")
        if kvtier["store_mode"] == "lazy":
            # Lazy stores take the cached blocks at vLLM's eviction frontier, which the
            # other kinds' rounds left unstored: this untimed round stores them, so the
            # timed one stores what one round of a lazy engine does (about its own blocks).
            throughput_round(llm, rng, shape, None)
        others = SWAP_KINDS[1:] if triple % 2 == 0 else SWAP_KINDS[:0:-1]
        for kind in ("kvtier", *others):
            switch.use(kind)
            *speed, round_breakdown = throughput_round(llm, rng, shape, probes)
            speeds[kind].append(tuple(speed))  # type: ignore[arg-type]
            if round_breakdown is not None:
                breakdowns[kind].append(round_breakdown)
    switch.use("kvtier")  # vLLM's shutdown closes the connector it started with
    shutdown(llm)
    conn.send((speeds, breakdowns))


def measure_swapped_throughput(
    model_dir: Path,
    processes: int,
    triples: int,
    shape: tuple[int, int, int],
    store_mode: str,
    breakdown: bool,
) -> tuple[dict[str, list[list[tuple[float, float]]]], dict[str, list[dict[str, Any]]]]:
    """Per engine process, per kind of :data:`SWAP_KINDS`, each round's tokens per wall and
    CPU second; and each kind's breakdowns. Processes run one after the other."""
    speeds: dict[str, list[list[tuple[float, float]]]] = {kind: [] for kind in SWAP_KINDS}
    breakdowns: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SWAP_KINDS}
    context = multiprocessing.get_context("spawn")
    kvtier = {"cpu_bytes": "1GiB", "store_mode": store_mode}
    for _ in range(processes):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=serve_swapped, args=(sender, model_dir, kvtier, shape, triples, breakdown)
        )
        process.start()
        sender.close()
        try:
            process_speeds, process_breakdowns = receive(receiver, process)
        finally:
            process.join(timeout=60)
        for kind in SWAP_KINDS:
            speeds[kind].append(process_speeds[kind])
            breakdowns[kind] += process_breakdowns[kind]
    return speeds, breakdowns


def receive(conn: Connection, process: multiprocessing.process.BaseProcess) -> Any:
    """The next message of a throughput engine's process; its exit code if it died instead."""
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(
            f"the throughput engine's process exited with {process.exitcode}; "
            "its traceback is in the log above"
        ) from None


class Arm:
    """A throughput engine in its own process, driven round by round."""

    def __init__(
        self,
        model_dir: Path,
        kvtier: dict[str, Any] | None,
        shape: tuple[int, int, int],
        breakdown: bool,
        null_connector: bool = False,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=serve_arm, args=(child, model_dir, kvtier, shape, breakdown, null_connector)
        )
        self._process.start()
        child.close()

    def wait_ready(self) -> None:
        self._receive()

    def run(self) -> tuple[float, float]:
        """Tokens per wall second and per CPU second of one batch of new prompts."""
        self._conn.send("run")
        return self._receive()

    def close(self) -> list[dict[str, Any]]:
        """Stop the engine; the breakdown of each round (empty without ``--breakdown``)."""
        breakdowns = []
        if self._process.is_alive():
            self._conn.send("stop")
            breakdowns = self._receive()
        self._process.join(timeout=60)
        return breakdowns

    def _receive(self) -> Any:
        return receive(self._conn, self._process)


def measure_throughput(
    model_dir: Path,
    pairs: int,
    rounds: int,
    shape: tuple[int, int, int],
    store_mode: str,
    breakdown: bool,
    null_connector: bool = False,
) -> tuple[dict[bool, list[list[tuple[float, float]]]], dict[bool, list[dict[str, Any]]]]:
    """Per pair of engine processes, per round, each arm's tokens per wall and CPU second
    (ABBA order); and the breakdown of every round. With ``null_connector`` the arm
    without kvtier runs vLLM's connector plumbing with a connector that does nothing."""
    kvtier = {"cpu_bytes": "1GiB", "store_mode": store_mode}
    results: dict[bool, list[list[tuple[float, float]]]] = {False: [], True: []}
    breakdowns: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        arms = {
            with_kvtier: Arm(
                model_dir, kvtier if with_kvtier else None, shape, breakdown, null_connector
            )
            for with_kvtier in order
        }
        for with_kvtier in order:
            results[with_kvtier].append([])
        try:
            for arm in arms.values():
                arm.wait_ready()
            for round_index in range(rounds):
                for with_kvtier in order if round_index % 2 == 0 else order[::-1]:
                    results[with_kvtier][-1].append(arms[with_kvtier].run())
        finally:
            for with_kvtier, arm in arms.items():
                breakdowns[with_kvtier] += arm.close()
    return results, breakdowns


def merge_breakdowns(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round breakdowns as sums (counts, seconds) and means (batch sizes, free blocks)."""
    if not rounds:
        return {}
    merged: dict[str, Any] = {}
    for key in rounds[0]:
        if key == "calls":
            continue
        values = [r[key] for r in rounds]
        merged[key] = (
            statistics.fmean(values)
            if key.startswith("mean_")
            else min(values)
            if key.startswith("min_")
            else sum(values)
        )
    calls: dict[str, dict[str, float]] = {}
    for r in rounds:
        for name, call in r["calls"].items():
            into = calls.setdefault(name, {"count": 0, "total_s": 0.0, "max_s": 0.0})
            into["count"] += call["count"]
            into["total_s"] += call["total_s"]
            into["max_s"] = max(into["max_s"], call["max_s"])
    merged["calls"] = calls
    merged["rounds"] = len(rounds)
    return merged


def speeds_of(rounds: list[list[tuple[float, float]]], kind: int) -> list[list[float]]:
    """Tokens per second by wall (``kind`` 0) or CPU time (1), one list per process."""
    return [[r[kind] for r in process] for process in rounds]


def throughput_report(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The 0%-hit throughput part's fields, by ``--throughput-method``."""
    shape = (args.throughput_prompts, args.throughput_prompt_tokens, args.output_tokens)
    result: dict[str, Any] = {
        "zero_hit_method": args.throughput_method,
        "zero_hit_store_mode": args.throughput_store_mode,
        "zero_hit_shape": dict(
            zip(("prompts", "prompt_tokens", "output_tokens"), shape, strict=True)
        ),
    }
    if args.throughput_method == "swap":
        rounds, breakdowns = measure_swapped_throughput(
            model_dir,
            args.throughput_processes,
            args.throughput_triples,
            shape,
            args.throughput_store_mode,
            args.breakdown,
        )
        kinds = {"with": "kvtier", "without": "none", "null": "null"}
        arms = {arm: rounds[kind] for arm, kind in kinds.items()}
        breakdown_arms = {arm: breakdowns[kind] for arm, kind in kinds.items()}
        result["zero_hit_baseline"] = "no_connector"
    else:
        by_arm, by_arm_breakdowns = measure_throughput(
            model_dir,
            args.throughput_pairs,
            args.throughput_rounds,
            shape,
            args.throughput_store_mode,
            args.breakdown,
            null_connector=args.throughput_baseline == "null",
        )
        arms = {"with": by_arm[True], "without": by_arm[False]}
        breakdown_arms = {"with": by_arm_breakdowns[True], "without": by_arm_breakdowns[False]}
        result["zero_hit_baseline"] = (
            "null_connector" if args.throughput_baseline == "null" else "no_connector"
        )
    for kind, name in enumerate(("wall", "cpu")):
        speeds = {arm: speeds_of(rounds, kind) for arm, rounds in arms.items()}
        result[f"zero_hit_tokens_per_{name}_s"] = speeds
        result[f"zero_hit_throughput_ratio_{name}"] = ratio_interval(
            speeds["with"], speeds["without"]
        )
        if "null" in speeds:
            # Not targets: where kvtier's cost lies, in vLLM's plumbing or kvtier's own calls.
            for field, over, under in (
                ("null_over_none", "null", "without"),
                ("kvtier_over_null", "with", "null"),
            ):
                split = ratio_interval(speeds[over], speeds[under])
                del split["ok"]
                result[f"zero_hit_{field}_{name}"] = split
    walls = result["zero_hit_tokens_per_wall_s"]
    result["zero_hit_throughput_ratio_best"] = max(map(max, walls["with"])) / max(
        map(max, walls["without"])
    )
    if args.breakdown:
        merged = {arm: merge_breakdowns(rounds) for arm, rounds in breakdown_arms.items()}
        result["zero_hit_breakdown"] = merged
        # The connector's own share of the engine's step time: what other processes on the
        # machine cannot blur the way they blur whole rounds.
        result["zero_hit_connector_share_of_step_s"] = (
            merged["with"]["connector_total_s"] / merged["with"]["step_s"]
        )
    return result
