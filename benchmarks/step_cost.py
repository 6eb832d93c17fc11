"""What kvtier adds to each engine step: vLLM's real scheduler and both connector halves, no model.

Four engines of :class:`tests.support.vllm_steps.VllmSteps` take the same
requests and step in turn (the order rotates every step): one without a KV
connector (``none``), one with the do-nothing connector of
``null_connector.py`` (``null``), one with kvtier (``kvtier``), whose
copies move no bytes (``no_copy.py``: on a GPU the copy
engine's time is the device's), and one with vLLM's own ``OffloadingConnector``
over a CPU pool of as many blocks as kvtier's host tier (``vllm_offload``),
whose copies finish at once and move no bytes either (``instant_offload.py``).
Each engine runs:

1. past prompts (``max_tokens`` 1) whose first halves later requests repeat,
   then vLLM's own prefix cache is emptied, so a repeat is a tier hit or a
   prefill, never a device hit;
2. ``running`` requests of ``context`` tokens (lengths staggered within a
   block) until every one decodes;
3. ``--steps`` measured steps; in each, requests finish (as at their length
   cap) and are replaced by new ones at a rate that fills a quarter of the
   token budget with prefill: ``max_num_batched_tokens / (4 * context)`` per step.

Per step it records vLLM's ``schedule()`` + ``update_from_output()`` seconds
in each engine; in the three engines with a connector, the seconds of each
scheduler-side connector call and the worker half's seconds in its calls (the
do-nothing connector's are the floor: what vLLM's calls cost a connector that
answers at once); and in the kvtier and vLLM offloading engines the blocks the
step's connector metadata asks the workers to store or load. A
step is *quiet* when kvtier's plan asks the workers for nothing and they report
nothing; *changed* requests are those a step starts, finishes, preempts or
completes a block of. JSON goes to stdout; ``--plot`` draws cost against
running and changed requests.

    python benchmarks/step_cost.py --running 16,64,256 --context 2048,8192 > step-cost.json
    python benchmarks/step_cost.py --from step-cost.json --plot docs/img/step-cost.png
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stats import median_ci

ARMS = ("none", "null", "kvtier", "vllm_offload")
CONNECTOR_ARMS = ("null", "kvtier", "vllm_offload")
"""The engines whose connector calls are timed: the do-nothing connector's are what any
connector costs in the same calls, the floor under the others'."""
MOVING_ARMS = ("kvtier", "vllm_offload")
"""The engines whose moved blocks are counted."""
NULL_CONNECTOR = ("NullConnector", "null_connector")
SCHEDULER_CALLS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished_all_groups",
    "update_connector_output",
    "get_kv_connector_stats",
    "take_events",
)
"""The scheduler-side connector calls vLLM's scheduler makes in a step (both connectors
declare hybrid-model support, so a finished request comes through
``request_finished_all_groups``), and ``on_new_request`` when a request is added (counted in
the step that follows); each is timed in the kvtier and vLLM offloading engines."""

GOALS = {
    "connector_fraction_at_256": 0.05,
    "quiet_step_s": 50e-6,
    "growth_exponent": 1.0,
}
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
"""``--clock``: the stepping thread's CPU time (the default: on a machine other work keeps
busy, wall time counts the time the thread waited for a core), or wall time."""
BLOCK_TOKENS = 16
TOKENS = 1000


@dataclass(frozen=True)
class Case:
    running: int
    context: int
    store_mode: str
    prefix_hit: float
    tiers: str

    def name(self) -> str:
        return (
            f"{self.running}x{self.context} {self.store_mode} "
            f"{int(self.prefix_hit * 100)}% {self.tiers}"
        )


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


class Engine:
    """One arm: a model-free vLLM engine and the per-step times it took."""

    def __init__(self, arm: str, model_dir: Path, extra: dict[str, Any], spec: Any) -> None:
        """``extra``: the connector's ``kv_connector_extra_config``."""
        from instant_offload import OFFLOADING_CONNECTOR

        from tests.support.vllm_steps import KVTIER_CONNECTOR, VllmSteps

        connector = {
            "none": None,
            "null": NULL_CONNECTOR,
            "kvtier": KVTIER_CONNECTOR,
            "vllm_offload": OFFLOADING_CONNECTOR,
        }[arm]
        self.arm = arm
        self.steps = VllmSteps(model_dir, extra, spec, connector=connector)
        self.calls: dict[str, list[float]] = {}
        self.moved = (0, 0)
        """Blocks the last step's connector metadata asks the workers to store, and to load."""
        if arm in CONNECTOR_ARMS:
            self._time_connector(counts_blocks=arm in MOVING_ARMS)
        self.ids: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.measured_from = 0
        """How many of the engine's connector stats came before the measured steps."""

    def _time_connector(self, counts_blocks: bool) -> None:
        from vllm_bench.patches import timed_by

        connector = self.steps.connector
        for name in SCHEDULER_CALLS:
            method = getattr(connector, name)
            setattr(connector, name, timed_by(method, self._recorder(name), self.steps.spec.clock))
        if not counts_blocks:
            return
        build = connector.build_connector_meta

        def build_and_count(scheduler_output: Any) -> Any:
            metadata = build(scheduler_output)
            self.moved = moved_blocks(metadata)  # outside the timed call
            return metadata

        connector.build_connector_meta = build_and_count

    def _recorder(self, name: str) -> Callable[[float], None]:
        def record(seconds: float) -> None:
            self.calls.setdefault(name, []).append(seconds)

        return record

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.ids.append(self.steps.add(prompt, max_tokens))

    def finish(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.steps.scheduler.finish_requests(request_id, RequestStatus.FINISHED_LENGTH_CAPPED)

    def step(self, record: bool) -> None:
        """One step; with ``record``, its times (and the calls of the requests added since
        the last step) go to :attr:`records`."""
        output = self.steps.step()
        calls, self.calls = self.calls, {}
        if not record:
            return
        step_s = self.steps.step_s
        entry: dict[str, Any] = {
            "scheduler_s": step_s["schedule"] + step_s["update"],
            "changed": changed_requests(output, self.steps.scheduler),
        }
        if self.arm in CONNECTOR_ARMS:
            entry["worker_s"] = step_s["worker"]
            entry["calls"] = {name: sum(times) for name, times in calls.items()}
            entry["call_counts"] = {name: len(times) for name, times in calls.items()}
        if self.arm in MOVING_ARMS:
            entry["stored"], entry["loaded"] = self.moved
        if self.arm == "kvtier":
            entry["quiet"] = output.kv_connector_metadata.plan.empty
        self.records.append(entry)

    def counter(self, name: str) -> float:
        """A kvtier counter summed over the measured steps."""
        return sum(stats.get(name, 0) for stats in self.steps.connector_stats[self.measured_from :])

    def decoding(self) -> bool:
        scheduler = self.steps.scheduler
        return not scheduler.waiting and all(
            request.num_computed_tokens >= request.num_prompt_tokens
            for request in scheduler.running
        )


def moved_blocks(metadata: Any) -> tuple[int, int]:
    """Blocks a step's connector metadata (kvtier's plan, or vLLM's offloading jobs) asks the
    workers to store, and to load."""
    plan = getattr(metadata, "plan", None)
    if plan is not None:
        return (
            sum(len(transfer.device_blocks) for transfer in plan.stores),
            sum(len(transfer.device_blocks) for transfer in plan.loads),
        )
    return (
        sum(len(job.src_spec.block_ids) for job in metadata.store_jobs.values()),
        sum(len(job.dst_spec.block_ids) for job in metadata.load_jobs.values()),
    )


def changed_requests(output: Any, scheduler: Any) -> int:
    """Requests the step started, finished, preempted or completed a block of."""
    cached = output.scheduled_cached_reqs
    scheduled = output.num_scheduled_tokens
    completing = sum(
        1
        for i, req_id in enumerate(cached.req_ids)
        if (cached.num_computed_tokens[i] + scheduled.get(req_id, 0)) // BLOCK_TOKENS
        > cached.num_computed_tokens[i] // BLOCK_TOKENS
    )
    return (
        len(output.scheduled_new_reqs)
        + len(output.finished_req_ids)
        + len(output.preempted_req_ids or ())
        + completing
    )


def set_token_budget(engine: Engine, tokens: int) -> None:
    """Change vLLM's token budget per step of a running engine (the scheduler reads both)."""
    scheduler = engine.steps.scheduler
    scheduler.max_num_scheduled_tokens = tokens
    scheduler.scheduler_config.max_num_batched_tokens = tokens


def kvtier_config(
    case: Case,
    device_blocks: int,
    record_bytes: int,
    scratch: Path,
    policy: str,
    host_size: float = 2.0,
) -> dict[str, Any]:
    """kvtier's config for a case: a host tier of ``host_size`` times the device cache, copies
    stubbed."""
    config: dict[str, Any] = {
        "cpu_bytes": int(host_size * device_blocks) * record_bytes,
        "store_mode": case.store_mode,
        "copy": {"type": "none"},
        "index": {"type": policy},
    }
    if case.tiers == "host+disk":
        config["tiers"] = [
            {
                "type": "disk",
                "path": str(scratch / "disk"),
                "capacity_bytes": 4 * device_blocks * record_bytes,
            }
        ]
    return config


def run_case(
    case: Case, args: argparse.Namespace, model_dir: Path, scratch: Path
) -> dict[str, Any]:
    """Build the four engines, feed them the same requests, step them in turn."""
    from instant_offload import offloading_config

    from kvtier.config import load_config
    from kvtier.integrations.checkpoints import TinyLlamaSpec
    from tests.support.vllm_steps import StepsSpec

    budget = args.max_num_batched_tokens
    arrival_rate = 0.0 if args.decode_only else budget / (4 * case.context)
    arrivals = math.ceil(arrival_rate * args.steps) + 1
    hit = int(case.context * case.prefix_hit)
    # Tokens a request may generate: while the others prefill (at most this many steps),
    # then while measured. Requests never reach it: the benchmark finishes them.
    decode_room = -(-case.running * case.context // budget) + args.steps + BLOCK_TOKENS
    blocks_per_request = -(-(case.context + decode_room) // BLOCK_TOKENS)
    # The running set and the arrivals' blocks past their repeated halves: the running set
    # then evicts the past prompts' first halves from vLLM's cache.
    device_blocks = (
        case.running * blocks_per_request
        + arrivals * (blocks_per_request - hit // BLOCK_TOKENS)
        + 2
    )
    model = TinyLlamaSpec(**MODEL)
    spec = StepsSpec(
        num_blocks=device_blocks,
        block_tokens=BLOCK_TOKENS,
        max_num_batched_tokens=budget,
        max_num_seqs=case.running + arrivals + 1,
        max_model_len=case.context + decode_room,
        model=model,
        write_blocks=False,
        clock=CLOCKS[args.clock],
    )
    record_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2 * BLOCK_TOKENS
    config = kvtier_config(case, device_blocks, record_bytes, scratch, args.policy, args.host_size)
    host_blocks = load_config(config).host_slots(record_bytes)
    extra = {
        arm: offloading_config(host_blocks, record_bytes, args.offload_policy)
        if arm == "vllm_offload"
        else config
        for arm in ARMS
    }
    # vLLM's offloading connector asks for this layout of the KV tensors (no bytes move)
    offload_spec = dataclasses.replace(spec, layout="LBHNC")
    engines = [
        Engine(arm, model_dir, extra[arm], offload_spec if arm == "vllm_offload" else spec)
        for arm in ARMS
    ]
    rng = random.Random(0)
    try:
        past = [[rng.randrange(TOKENS) for _ in range(case.context)] for _ in range(arrivals)]
        for engine in engines:
            for prompt in past:
                engine.add(prompt, 1)
            engine.steps.run(max_steps=10 * len(past) * case.context // budget + 100)
            engine.ids.clear()
        max_tokens = decode_room
        stagger = 1 if args.decode_only else BLOCK_TOKENS
        prompts = [
            [rng.randrange(TOKENS) for _ in range(case.context - rng.randrange(stagger))]
            for _ in range(case.running)
        ]
        warmup = 0
        for engine in engines:
            for prompt in prompts:
                engine.add(prompt, max_tokens)
            if args.decode_only:  # every prompt in one step, so that all decode in step
                set_token_budget(engine, case.running * case.context)
        while not all(engine.decoding() for engine in engines) or warmup == 0:
            for engine in engines:
                engine.step(record=False)
            warmup += 1
        for engine in engines:
            set_token_budget(engine, budget)
            running = len(engine.steps.scheduler.running)
            assert running == case.running, f"{engine.arm}: {running} requests run"
        for engine in engines:
            engine.measured_from = len(engine.steps.connector_stats)
        due = 0.0
        arrived = 0
        for step in range(args.steps):
            due += arrival_rate
            while due >= 1 and arrived < len(past):
                due -= 1
                fresh = [rng.randrange(TOKENS) for _ in range(case.context - hit)]
                prompt = past[arrived][:hit] + fresh
                for engine in engines:
                    engine.finish(engine.ids.pop(0))
                    engine.add(prompt, max_tokens)
                arrived += 1
            turn = step % len(engines)
            order = engines[turn:] + engines[:turn]
            for engine in order:
                engine.step(record=True)
        report = case_report(case, engines, warmup=warmup, arrivals=arrived)
        report["decode_only"] = args.decode_only
        report["host_blocks"] = host_blocks
        return report
    finally:
        for engine in engines:
            engine.steps.close()


MODEL = {
    "num_layers": 1,
    "hidden_size": 32,
    "num_heads": 1,
    "num_kv_heads": 1,
    "max_position_embeddings": 1 << 17,
}
"""The smallest model vLLM's CPU build takes: 2 KiB records, so the host tier stays small."""


def case_report(
    case: Case, engines: Sequence[Engine], *, warmup: int, arrivals: int
) -> dict[str, Any]:
    """Medians and intervals per arm, all steps and quiet / busy steps apart."""
    none, null, kvtier, offload = engines
    records = kvtier.records
    quiet = [record["quiet"] for record in records]

    def split(values: Sequence[float]) -> dict[str, Any]:
        return {
            "all": median_ci(values),
            "quiet": median_ci([v for v, q in zip(values, quiet, strict=True) if q]),
            "busy": median_ci([v for v, q in zip(values, quiet, strict=True) if not q]),
        }

    def scheduler_s(engine: Engine) -> list[float]:
        return [record["scheduler_s"] for record in engine.records]

    def connector_s_of(engine: Engine) -> list[float]:
        return [sum(record["calls"].values()) for record in engine.records]

    def total_s_of(engine: Engine) -> list[float]:
        return [sum(record["calls"].values()) + record["worker_s"] for record in engine.records]

    connector_s, kvtier_s = connector_s_of(kvtier), total_s_of(kvtier)
    offload_connector_s, offload_s = connector_s_of(offload), total_s_of(offload)
    added = [k - n for k, n in zip(scheduler_s(kvtier), scheduler_s(none), strict=True)]
    base = statistics.median(scheduler_s(none))

    def calls(engine: Engine) -> dict[str, Any]:
        return {
            name: {
                "count": sum(record["call_counts"].get(name, 0) for record in engine.records),
                "per_step_s": median_ci(
                    [record["calls"].get(name, 0.0) for record in engine.records]
                ),
            }
            for name in SCHEDULER_CALLS
        }

    def moved(engine: Engine) -> list[int]:
        return [record["stored"] + record["loaded"] for record in engine.records]

    def blocks(engine: Engine) -> dict[str, int]:
        stored = sum(record["stored"] for record in engine.records)
        loaded = sum(record["loaded"] for record in engine.records)
        steps = sum(1 for count in moved(engine) if count)
        return {"stored": stored, "loaded": loaded, "moving_steps": steps}

    def per_block_us(seconds: Sequence[float], blocks: Sequence[int]) -> dict[str, Any]:
        """Seconds per block moved, in µs, over the steps that moved any."""
        return median_ci([s * 1e6 / b for s, b in zip(seconds, blocks, strict=True) if b])

    def run_per_block_us(seconds: Sequence[float], blocks: Sequence[int]) -> float | None:
        """Every measured step's seconds over every block moved, in µs: a connector that
        moves blocks in fewer, larger steps is judged on its whole run."""
        return sum(seconds) * 1e6 / sum(blocks) if sum(blocks) else None

    changed = [record["changed"] for record in records]
    return {
        "running": case.running,
        "context_tokens": case.context,
        "store_mode": case.store_mode,
        "prefix_hit": case.prefix_hit,
        "tiers": case.tiers,
        "warmup_steps": warmup,
        "steps": len(records),
        "quiet_steps": sum(quiet),
        "arrivals": arrivals,
        "changed_requests": {"median": statistics.median(changed), "max": max(changed)},
        "hit_tokens": kvtier.counter("hit_tokens"),
        "stored_blocks": kvtier.counter("stored_blocks"),
        "evicted_blocks": kvtier.counter("evicted_blocks"),
        "loaded_blocks": kvtier.counter("loaded_blocks"),
        "scheduler_s": {engine.arm: split(scheduler_s(engine)) for engine in engines},
        "added_s": split(added),
        "added_fraction": statistics.median(added) / base,
        "connector_s": split(connector_s),
        "connector_fraction": statistics.median(connector_s) / base,
        "worker_s": split([record["worker_s"] for record in records]),
        "kvtier_s": split(kvtier_s),
        "calls": calls(kvtier),
        "moved_blocks": {"kvtier": blocks(kvtier), "vllm_offload": blocks(offload)},
        "per_block_us": {
            "kvtier": per_block_us(kvtier_s, moved(kvtier)),
            "vllm_offload": per_block_us(offload_s, moved(offload)),
        },
        "run_per_block_us": {
            "kvtier": run_per_block_us(kvtier_s, moved(kvtier)),
            "vllm_offload": run_per_block_us(offload_s, moved(offload)),
        },
        "vllm_offload": {
            "connector_s": median_ci(offload_connector_s),
            "connector_fraction": statistics.median(offload_connector_s) / base,
            "worker_s": median_ci([record["worker_s"] for record in offload.records]),
            "total_s": median_ci(offload_s),
            "calls": calls(offload),
        },
        "null": {
            "connector_s": split(connector_s_of(null)),
            "worker_s": split([record["worker_s"] for record in null.records]),
            "total_s": split(total_s_of(null)),
            "calls": calls(null),
        },
        "per_step": {
            "changed": changed,
            "quiet": quiet,
            "kvtier_s": kvtier_s,
            "kvtier_moved": moved(kvtier),
            "vllm_offload_s": offload_s,
            "vllm_offload_moved": moved(offload),
        },
    }


def busy_steps(runs: Sequence[dict[str, Any]]) -> Iterator[tuple[int, float]]:
    """(requests changed, kvtier's seconds) of every busy step that changed a request."""
    for run in runs:
        per_step = run["per_step"]
        for changed, quiet, seconds in zip(
            per_step["changed"], per_step["quiet"], per_step["kvtier_s"], strict=True
        ):
            if not quiet and changed > 0:
                yield changed, seconds


def growth_exponent(runs: Sequence[dict[str, Any]]) -> float | None:
    """Least-squares slope of log(kvtier's seconds) on log(changed requests), busy steps."""
    points = [
        (math.log(changed), math.log(seconds))
        for changed, seconds in busy_steps(runs)
        if seconds > 0
    ]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return covariance / sum((x - mean_x) ** 2 for x, _ in points)


def goals(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each goal's worst case over the runs, and whether it is met."""
    at_256 = [run["connector_fraction"] for run in runs if run["running"] == 256]
    quiet = [
        (run["kvtier_s"]["quiet"]["median"], run["null"]["total_s"]["quiet"]["median"])
        for run in runs
        if run["kvtier_s"]["quiet"]["n"]
    ]
    exponent = growth_exponent(runs)
    worst_256 = max(at_256) if at_256 else None
    worst_quiet, worst_quiet_null = max(quiet) if quiet else (None, None)
    return {
        "targets": GOALS,
        "connector_fraction_at_256": worst_256,
        "connector_fraction_at_256_met": None
        if worst_256 is None
        else worst_256 <= GOALS["connector_fraction_at_256"],
        "quiet_step_s": worst_quiet,
        "quiet_step_met": None if worst_quiet is None else worst_quiet <= GOALS["quiet_step_s"],
        "quiet_step_null_s": worst_quiet_null,
        "growth_exponent": exponent,
        "growth_met": None if exponent is None else exponent <= GOALS["growth_exponent"],
    }


def plot(report: dict[str, Any], path: str) -> None:
    """kvtier's seconds per step against running requests, and against changed requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    figure, (by_running, by_changed) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = sorted({(run["decode_only"], run["context_tokens"], run["store_mode"]) for run in runs})
    for decode_only, context, mode in lines:
        chosen = sorted(
            (
                run
                for run in runs
                if (run["decode_only"], run["context_tokens"], run["store_mode"])
                == (decode_only, context, mode)
            ),
            key=lambda run: run["running"],
        )
        sizes = sorted({run["running"] for run in chosen})
        medians = [
            statistics.median(
                run["kvtier_s"]["all"]["median"] * 1e6 for run in chosen if run["running"] == n
            )
            for n in sizes
        ]
        base = [
            statistics.median(
                run["scheduler_s"]["none"]["all"]["median"] * 1e6
                for run in chosen
                if run["running"] == n
            )
            for n in sizes
        ]
        label = f"{context // 1024}K, {'decode only' if decode_only else 'arrivals'}, {mode}"
        (line,) = by_running.plot(sizes, medians, marker="o", label=f"kvtier, {label}")
        by_running.plot(sizes, base, linestyle=":", color=line.get_color())
        for run in chosen:
            steps = run["per_step"]
            busy = [
                (c, s * 1e6)
                for c, q, s in zip(steps["changed"], steps["quiet"], steps["kvtier_s"], strict=True)
                if not q and c > 0
            ]
            by_changed.scatter(
                [c for c, _ in busy], [s for _, s in busy], s=4, alpha=0.3, color=line.get_color()
            )
    for axes in (by_running, by_changed):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.grid(True, which="both", alpha=0.3)
    by_running.set_xlabel("running requests")
    by_running.set_ylabel("µs per step (median)")
    by_running.set_title("kvtier (solid) and vLLM's scheduler alone (dotted)")
    by_running.legend(fontsize=7)
    by_changed.set_xlabel("requests changed in the step")
    by_changed.set_ylabel("kvtier µs in the step")
    by_changed.set_title("kvtier per busy step (stores or loads)")
    changed = [c for run in runs for c in run["per_step"]["changed"] if c > 0]
    if changed:
        low, high = min(changed), max(changed)
        scale = statistics.median(s * 1e6 / c for c, s in busy_steps(runs))
        by_changed.plot([low, high], [low * scale, high * scale], color="black", label="linear")
        by_changed.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def merged(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' cases as one report, its goals judged over all of them."""
    runs = [run for report in reports for run in report["runs"]]
    return {**reports[0], "runs": runs, "goals": goals(runs)}


def parse_list(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    """Run the grid and print JSON; or merge earlier runs, print their goals and plot them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="16,64,256,1024", help="comma list of requests")
    parser.add_argument("--context", default="2048,8192,32768", help="comma list of tokens")
    parser.add_argument("--mode", default="eager,lazy", help="comma list of store modes")
    parser.add_argument("--hit", default="0,0.5", help="comma list of prefix-hit fractions")
    parser.add_argument("--tiers", default="host,host+disk", help="comma list: host, host+disk")
    parser.add_argument("--steps", type=int, default=64, help="measured steps per case")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="what a second is")
    parser.add_argument(
        "--policy", default="prefix_arc", help="the host tier's eviction policy (index.type)"
    )
    parser.add_argument(
        "--offload-policy",
        choices=("lru", "arc"),
        default="lru",
        help="the eviction policy of vLLM's offloading connector's CPU pool",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="vLLM's token budget per step"
    )
    parser.add_argument(
        "--host-size",
        type=float,
        default=2.0,
        help="the host tier (and vLLM's CPU pool) as a multiple of the device cache; under 1, "
        "the tiers are full and evict in the measured steps",
    )
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="no request arrives and all fill their blocks in the same steps (the others quiet)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 requests of 2K, host tier, 8 steps"
    )
    parser.add_argument(
        "--from", dest="sources", nargs="+", metavar="FILE.json", help="plot these runs, merged"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="also plot to FILE.png")
    args = parser.parse_args(argv)
    if args.sources:
        report = merged([json.loads(Path(source).read_text()) for source in args.sources])
        json.dump(report["goals"], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        if args.quick:
            args.running, args.context, args.tiers, args.steps = "16", "2048", "host", 8
        report = run_grid(args)
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    if args.plot:
        plot(report, args.plot)
    return 0


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from no_copy import no_copy_registry

    import kvtier.plugins
    from tests.support.vllm_steps import write_model_config

    kvtier.plugins._default_registry = no_copy_registry()
    cases = [
        Case(running, context, mode, hit, tiers)
        for running, context, mode, hit, tiers in itertools.product(
            parse_list(args.running, int),
            parse_list(args.context, int),
            parse_list(args.mode, str),
            parse_list(args.hit, float),
            parse_list(args.tiers, str),
        )
    ]
    started = load_average()
    runs = []
    with tempfile.TemporaryDirectory() as directory:
        from kvtier.integrations.checkpoints import TinyLlamaSpec

        scratch = Path(directory)
        model_dir = write_model_config(scratch / "model", TinyLlamaSpec(**MODEL))
        for number, case in enumerate(cases):
            clock = time.perf_counter()
            case_dir = scratch / f"case-{number}"
            case_dir.mkdir()
            run = run_case(case, args, model_dir, case_dir)
            run["load_average"] = load_average()
            runs.append(run)
            per_block, whole = run["per_block_us"], run["run_per_block_us"]
            print(
                f"{case.name()}: kvtier {run['kvtier_s']['all']['median'] * 1e6:.0f} us/step, "
                f"added {run['added_fraction']:+.1%}; do-nothing connector "
                f"{run['null']['total_s']['all']['median'] * 1e6:.0f} us/step; vLLM offloading "
                f"{run['vllm_offload']['total_s']['median'] * 1e6:.0f} us/step; per block "
                f"kvtier {_us(per_block['kvtier'])}, vLLM {_us(per_block['vllm_offload'])}; "
                f"over the run kvtier {_run_us(whole['kvtier'])}, "
                f"vLLM {_run_us(whole['vllm_offload'])} ({time.perf_counter() - clock:.0f} s)",
                file=sys.stderr,
            )
    return {
        "vllm": vllm.__version__,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "policy": args.policy,
        "offload_policy": args.offload_policy,
        "host_size": args.host_size,
        "clock": args.clock,
        "block_tokens": BLOCK_TOKENS,
        "load_average_start": started,
        "load_average_end": load_average(),
        "goals": goals(runs),
        "runs": runs,
    }


def _us(figure: dict[str, Any]) -> str:
    return _run_us(figure["median"])


def _run_us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} us"


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # no_copy and null_connector; tests.support
    raise SystemExit(main())
