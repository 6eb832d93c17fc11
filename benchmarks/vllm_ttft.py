"""Time to first token on vLLM (CPU): cold prefill vs vLLM prefix-cache hit vs kvtier tier hit.

Also measures the first token of a prefix found only in a disk tier or a Redis
tier below a host tier too small to keep it (promoted, then loaded), and
throughput at a 0% hit rate with and without the connector, so the cost of
storing every block is visible. All arms run the same random-weight model; the
output is JSON with ratios against the peers and a verdict against each target.
The Redis arm needs ``redis-server`` on the PATH and is left out without it.

    python benchmarks/vllm_ttft.py [--prompt-tokens 4096] [--repeats 7]
        [--hit-pairs 10] [--throughput-method swap|pairs] [--breakdown]

On a shared machine other processes slow some timings down many times over,
so every timing is reported; the headline TTFT ratios use the best (least
disturbed) timing of each arm, in eager and in lazy store mode, and the verdict
the median difference between a tier hit and the device hit timed next to it
(``--hit-pairs`` pairs per prompt), next to the physical limit: the prompt's
KV bytes over the bandwidth of the fastest contiguous host copy of as many
bytes, timed in the same run before, between and after the two modes' hits.

Throughput (``--throughput-method swap``, the default) runs engines with kvtier, one process
at a time, each of which takes turns between rounds with kvtier, the do-nothing connector of
``null_connector.py`` and no connector at all (:class:`ConnectorSwitch`), and times one
batch of new prompts per round: a kvtier round, then the other two kinds in alternating
order. Rounds next to each other in one process share its speed (where its memory landed,
how its threads share the cores with other processes), so their ratios do not carry the few
percent by which two engine processes differ on a shared 2-core machine, and the interval
narrows faster per minute than with pairs of processes. In lazy store mode an untimed kvtier
round comes first: lazy stores take the cached blocks at vLLM's eviction frontier, and the
other kinds' rounds leave theirs unstored. What a swap cannot see is a cost kvtier adds to
its process for the whole run rather than per round; ``--throughput-method pairs`` measures
that too: pairs of engines, one with and one without the connector (or, with
``--throughput-baseline null``, with the do-nothing connector), each in its own process,
time one batch per round in ABBA order (without, with, with, without, ...), and each pair
runs :data:`ROUNDS_PER_PAIR` rounds and is replaced by a fresh pair. Every round gives one
ratio by wall time and one by CPU time (every thread of the engine's process, and its
children); the JSON holds their median and a 95% interval of that median from a two-level
bootstrap (processes, then rounds within each process).

``--breakdown`` wraps the connector's methods, the host copies and vLLM's
engine step and scheduler (in the benchmark's processes only; without the flag
nothing is wrapped) and reports where the time goes, per arm.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvtier.config.model import DEFAULT_SAME_STEP_LOAD_BYTES
from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

MODEL = TinyLlamaSpec(
    num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024
)
BLOCK_TOKENS = 32

ROUNDS_PER_PAIR = 30
"""Default rounds per pair of throughput engines. A round of the default shape lasts about
a quarter of a second, and its ratio wanders by 10 to 14% (standard deviation) on a shared
2-core machine, while pairs of processes differ by about 2.5% beyond that; starting a
pair costs some 20 s. Thirty rounds spend about as long measuring as starting, which
gives the narrowest interval per minute (six rounds needed about twice the minutes)."""

TARGETS = {
    "tier_hit_over_device_hit_max": 1.5,
    "tier_hit_over_cold_max": 0.05,
    "tier_hit_extra_s_max": "1.5 x copy_limit_s + 0.0003",
    "disk_hit_over_cold_max": 0.25,
    "redis_hit_over_cold_max": 0.25,
    "zero_hit_throughput_ratio_median_min": 0.98,
    "zero_hit_throughput_ratio_ci95_low_min": 0.97,
}


def _engine_env(*, throughput_process: bool = False) -> None:
    """Settings for the engines of this process, before torch loads its OpenMP runtime.

    The TTFT, busy and lower-tier parts run their engine in the benchmark's own
    process with OpenMP's default wait policy, as vLLM runs. A throughput engine
    process (``throughput_process``) shares the cores with the benchmark's other
    processes, and its OpenMP threads sleep as soon as they wait: threads that spin
    made whole rounds 10 to 20 times slower whenever another process (the idle
    engine of the other arm included) held one of the two cores.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM logs to stdout, which carries the JSON result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if throughput_process:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(MODEL.vocab_size) for _ in range(tokens)]


def _timed(llm: object, prompts: list[list[int]], max_tokens: int) -> float:
    from kvtier.integrations.vllm.offline import generate

    started = time.perf_counter()
    generate(llm, prompts, max_tokens)  # type: ignore[arg-type]
    return time.perf_counter() - started


def _cpu_s() -> float:
    """CPU seconds of every thread of this process and of its reaped children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _timed_by(method: Callable[..., Any], record: Callable[[float], None]) -> Callable[..., Any]:
    """``method``, handing the seconds each call took to ``record``."""

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record(time.perf_counter() - started)

    return timed


class Probes:
    """Where an engine's time goes: connector calls, host copies, engine steps.

    :meth:`install` wraps the methods at class level, so it must run before the
    engine is built; only a process that installs probes pays for them.
    """

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self.steps: list[dict[str, float]] = []

    def install(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from kvtier.copy.torch_backend import TorchCopyBackend
        from kvtier.integrations.vllm.connector import KVTierConnector

        for name, method in list(vars(KVTierConnector).items()):
            if callable(method) and not name.startswith("_"):
                setattr(KVTierConnector, name, self._timer(f"connector.{name}", method))
        # on CPU a submit is the whole copy, its checks of the ids included
        TorchCopyBackend.submit = self._timer("copy", TorchCopyBackend.submit)
        for name in ("step", "step_with_batch_queue"):
            setattr(EngineCore, name, self._step_timer(getattr(EngineCore, name)))
        Scheduler.schedule = self._schedule_probe(self._timer("vllm.schedule", Scheduler.schedule))
        Scheduler.update_from_output = self._timer(
            "vllm.update_from_output", Scheduler.update_from_output
        )
        # vLLM's CPU model runner inherits the forward from this one
        GPUModelRunner._model_forward = self._timer("vllm.forward", GPUModelRunner._model_forward)

    def take(self) -> dict[str, Any]:
        """The breakdown since the last call, then start over."""
        steps, calls = self.steps, self.calls
        self.steps, self.calls = [], {}
        ran = [step for step in steps if step.get("tokens", 0) > 0]

        def mean(key: str, of: list[dict[str, float]]) -> float:
            return statistics.fmean(step.get(key, 0.0) for step in of) if of else 0.0

        return {
            "steps": len(steps),
            "steps_with_tokens": len(ran),
            "step_s": sum(step.get("seconds", 0.0) for step in steps),
            "mean_batch_requests": mean("requests", ran),
            "mean_batch_tokens": mean("tokens", ran),
            "min_free_device_blocks": min((s["free_blocks"] for s in steps), default=0),
            "mean_free_device_blocks": mean("free_blocks", steps),
            "steps_with_requests_waiting_for_loads": sum(s["waiting_for_loads"] > 0 for s in steps),
            "steps_with_finished_requests_held": sum(s["finished_held"] > 0 for s in steps),
            "finished_request_steps_held": sum(s["finished_held"] for s in steps),
            "calls": {
                name: {"count": len(times), "total_s": sum(times), "max_s": max(times)}
                for name, times in sorted(calls.items())
            },
            "connector_total_s": sum(
                sum(times) for name, times in calls.items() if name.startswith("connector.")
            ),
        }

    def _timer(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def record(seconds: float) -> None:
            self.calls.setdefault(name, []).append(seconds)

        return _timed_by(method, record)

    def _step_timer(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def record(seconds: float) -> None:
            if self.steps:
                self.steps[-1]["seconds"] = seconds

        return _timed_by(method, record)

    def _schedule_probe(self, method: Callable[..., Any]) -> Callable[..., Any]:
        from vllm.v1.request import RequestStatus

        @functools.wraps(method)
        def probed(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            output = method(scheduler, *args, **kwargs)
            requests = scheduler.requests.values()
            self.steps.append(
                {
                    "requests": len(output.num_scheduled_tokens),
                    "tokens": output.total_num_scheduled_tokens,
                    "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                    "waiting_for_loads": sum(
                        r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests
                    ),
                    "finished_held": sum(r.is_finished() for r in requests),
                }
            )
            return output

        return probed


def measure_ttft(
    model_dir: Path,
    prompt_tokens: int,
    repeats: int,
    pairs: int,
    store_mode: str,
    probes: Probes | None,
) -> dict[str, Any]:
    """Seconds to the first token of each kind of prefix, for ``repeats`` prompts.

    Each prompt is timed once cold, then ``pairs`` times as a device hit and
    as a tier hit, the two one after the other and in alternating order
    (device first, tier first, device first, ...), so that whatever drifts
    between them falls on both alike. A tier hit follows an emptying of vLLM's
    cache, and leaves the prompt's blocks in it for the next device hit. In
    eager mode the prompt's blocks are stored as they are computed; in lazy
    mode they are stored only as the engine is about to evict them, so before
    the prompt's first tier hit a filler prompt pushes them to the front of
    vLLM's free queue. Later tier hits find the blocks still in the tier.
    """
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs, reset_device_cache, settle, shutdown

    lazy = store_mode == "lazy"
    prompt_blocks = prompt_tokens // BLOCK_TOKENS
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier={"cpu_bytes": "1GiB", "store_mode": store_mode},
            num_device_blocks=(2 if lazy else 4) * prompt_blocks + 8,
            max_model_len=prompt_tokens + BLOCK_TOKENS,
        )
    )
    rng = random.Random(0)
    _timed(llm, [_prompt(rng, prompt_tokens)], 1)  # warm-up
    times: dict[str, list[float]] = {"cold": [], "device_hit": [], "tier_hit": []}
    breakdown: dict[str, list[dict[str, Any]]] = {"device_hit": [], "tier_hit": []}

    def timed(kind: str, prompt: list[int]) -> None:
        if probes:
            probes.take()
        times[kind].append(_timed(llm, [prompt], 1))
        if probes and kind in breakdown:
            breakdown[kind].append(probes.take())

    for _ in range(repeats):
        prompt = _prompt(rng, prompt_tokens)
        timed("cold", prompt)
        settle(llm)
        for pair in range(pairs):
            order = ("device_hit", "tier_hit") if pair % 2 == 0 else ("tier_hit", "device_hit")
            for kind in order:
                if kind == "tier_hit":
                    if lazy and pair == 0:
                        # One more prompt's blocks bring this one's to the front of vLLM's
                        # free queue, within the window lazy mode stores.
                        _timed(llm, [_prompt(rng, prompt_tokens)], 1)
                    reset_device_cache(llm)
                timed(kind, prompt)
                settle(llm)
    shutdown(llm)
    result: dict[str, Any] = {**times, "pairs_per_prompt": pairs}
    if probes:
        # The hit that made the best time, as the least disturbed one.
        result["breakdown_of_best"] = {
            kind: rounds[times[kind].index(min(times[kind]))] for kind, rounds in breakdown.items()
        }
        result["tier_hit_copy_s"] = [
            repeat["calls"].get("copy", {}).get("total_s", 0.0) for repeat in breakdown["tier_hit"]
        ]
        result["tier_hit_extra_by_part_s"] = extra_by_part(
            breakdown["device_hit"], breakdown["tier_hit"], times["device_hit"], times["tier_hit"]
        )
    return result


def extra_by_part(
    device: list[dict[str, Any]],
    tier: list[dict[str, Any]],
    device_ttft: list[float],
    tier_ttft: list[float],
) -> dict[str, float]:
    """Where a tier hit's extra time goes: per wrapped method, the median over pairs of its
    seconds in the tier hit less its seconds in the device hit timed next to it; the same
    for the engine steps (``step``) and for the rest of the first token's time, outside
    the steps (``outside_steps``)."""
    names = sorted({name for rounds in (device, tier) for one in rounds for name in one["calls"]})

    def total(one: dict[str, Any], name: str) -> float:
        return one["calls"].get(name, {}).get("total_s", 0.0)

    pairs = list(zip(device, tier, device_ttft, tier_ttft, strict=True))
    parts = {
        name: statistics.median(total(t, name) - total(d, name) for d, t, _, _ in pairs)
        for name in names
    }
    parts["step"] = statistics.median(t["step_s"] - d["step_s"] for d, t, _, _ in pairs)
    parts["outside_steps"] = statistics.median(
        (t_ttft - t["step_s"]) - (d_ttft - d["step_s"]) for d, t, d_ttft, t_ttft in pairs
    )
    return parts


BUSY_BACKGROUND = (8, 256)
"""Requests decoding while a busy tier hit arrives, and their prompt tokens."""


def measure_busy_ttft(
    model_dir: Path, hit_tokens: int, repeats: int, same_step_load_bytes: int
) -> dict[str, list[float]]:
    """Seconds and engine steps to the first token of a tier hit that arrives while other
    requests decode, with the given same-step budget (0: every hit loads a step ahead).

    Each repeat stores a new prompt, empties vLLM's cache, starts the background
    requests and lets them decode a few steps, then adds the prompt and steps the
    engine until its first token; the background requests are then aborted.
    """
    from vllm import LLM

    from kvtier.integrations.vllm.offline import (
        engine_kwargs,
        generate,
        greedy,
        reset_device_cache,
        settle,
        shutdown,
    )

    count, background_tokens = BUSY_BACKGROUND
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier={"cpu_bytes": "1GiB", "same_step_load_bytes": same_step_load_bytes},
            num_device_blocks=2 * (hit_tokens + count * (background_tokens + 64)) // BLOCK_TOKENS,
            max_model_len=hit_tokens + BLOCK_TOKENS,
        )
    )
    engine = llm.llm_engine
    rng = random.Random(3)
    seconds: list[float] = []
    steps: list[float] = []
    for repeat in range(repeats):
        prompt = _prompt(rng, hit_tokens)
        generate(llm, [prompt], 1)
        reset_device_cache(llm)
        background = [f"background-{repeat}-{i}" for i in range(count)]
        for request_id in background:
            engine.add_request(
                request_id, {"prompt_token_ids": _prompt(rng, background_tokens)}, greedy(10**6)
            )
        for _ in range(4):  # their prefills, then decodes
            engine.step()
        hit_id = f"hit-{repeat}"
        started = time.perf_counter()
        engine.add_request(hit_id, {"prompt_token_ids": prompt}, greedy(1))
        taken = 0
        while not any(
            output.request_id == hit_id and output.outputs[0].token_ids for output in engine.step()
        ):
            taken += 1
        seconds.append(time.perf_counter() - started)
        steps.append(taken + 1)
        engine.abort_request(background)
        settle(llm)
    shutdown(llm)
    return {"seconds": seconds, "steps": steps}


def busy_report(arms: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Medians per arm, and the same-step arm's TTFT over the other's."""
    count, background_tokens = BUSY_BACKGROUND
    medians = {name: statistics.median(arm["seconds"]) for name, arm in arms.items()}
    return {
        "background_requests": count,
        "background_prompt_tokens": background_tokens,
        "ttft_s": {name: _summary(arm["seconds"]) for name, arm in arms.items()},
        "ttft_rounds_s": {name: arm["seconds"] for name, arm in arms.items()},
        "steps_to_first_token": {
            name: statistics.median(arm["steps"]) for name, arm in arms.items()
        },
        "same_step_over_a_step_ahead": medians["same_step"] / medians["a_step_ahead"],
    }


def measure_lower_tier_ttft(
    model_dir: Path, prompt_tokens: int, repeats: int, tier: dict[str, object]
) -> dict[str, list[float]]:
    """Seconds to the first token of a cold prompt and of the same prompt served from ``tier``.

    The host tier holds about one prompt: a second prompt evicts the first one's
    blocks, which are demoted to ``tier``; with vLLM's own cache emptied, the
    first prompt's blocks can then only come from ``tier``.
    """
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs, reset_device_cache, shutdown

    record_bytes = MODEL.kv_bytes_per_token() * BLOCK_TOKENS
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier={
                "cpu_bytes": 3 * prompt_tokens // 2 // BLOCK_TOKENS * record_bytes,
                "tiers": [tier],
            },
            num_device_blocks=4 * prompt_tokens // BLOCK_TOKENS,
            max_model_len=2 * prompt_tokens,
        )
    )
    rng = random.Random(2)
    _timed(llm, [_prompt(rng, prompt_tokens)], 1)  # warm-up
    cold, hit = [], []
    for _ in range(repeats):
        prompt = _prompt(rng, prompt_tokens)
        cold.append(_timed(llm, [prompt], 1))
        _timed(llm, [_prompt(rng, prompt_tokens)], 1)  # evicts (demotes) the first prompt
        reset_device_cache(llm)
        time.sleep(1.0)  # the tier writes on its own threads
        hit.append(_timed(llm, [prompt], 1))
    shutdown(llm)
    return {"cold": cold, "hit": hit}


COPY_LIMIT_SPAN_BYTES = 512 << 20
"""Memory the copy-limit copies cycle through: far more than any CPU cache, so each copy
reads and writes main memory, as a tier hit's copy does."""


def copy_limit_s(num_bytes: int, repeats: int = 20) -> float:
    """Seconds of the fastest of ``repeats`` contiguous host copies of ``num_bytes`` (torch).

    Each repeat copies between its own pair of buffers, every page written
    beforehand: a copy between buffers still in the CPU's cache from the last
    repeat, or into pages touched for the first time, would set the limit
    many times too low or too high.
    """
    import torch

    pairs = max(1, min(repeats, COPY_LIMIT_SPAN_BYTES // (2 * num_bytes)))
    buffers = [
        (torch.ones(num_bytes, dtype=torch.uint8), torch.zeros(num_bytes, dtype=torch.uint8))
        for _ in range(pairs)
    ]
    best = math.inf
    for repeat in range(repeats):
        source, target = buffers[repeat % pairs]
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return best


def _summary(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values)}


def ttft_report(ttft: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """Ratios and the tier hit's extra time against the copy limit, for one store mode."""
    best = {kind: min(ttft[kind]) for kind in ("cold", "device_hit", "tier_hit")}
    # Each pair times its device hit and its tier hit a moment apart: their difference
    # is what the tier adds, while a step's time alone wanders by tens of milliseconds.
    differences = [t - d for t, d in zip(ttft["tier_hit"], ttft["device_hit"], strict=True)]
    extra_s = statistics.median(differences)
    extra_max_s = 1.5 * limit_s + 0.0003
    pairs = ttft.get("pairs_per_prompt", 1)
    by_prompt = [differences[start : start + pairs] for start in range(0, len(differences), pairs)]
    extra_low_s, extra_high_s = median_interval(by_prompt)
    report: dict[str, Any] = {
        "ttft_s": {kind: _summary(ttft[kind]) for kind in best},
        "ttft_rounds_s": {kind: ttft[kind] for kind in best},
        "tier_hit_over_device_hit": best["tier_hit"] / best["device_hit"],
        "tier_hit_over_cold": best["tier_hit"] / best["cold"],
        "tier_hit_over_device_hit_median_of_rounds": statistics.median(
            t / d for t, d in zip(ttft["tier_hit"], ttft["device_hit"], strict=True)
        ),
        "tier_hit_extra_s": extra_s,
        "tier_hit_extra_best_s": best["tier_hit"] - best["device_hit"],
        "hit_pairs_per_prompt": pairs,
        "tier_hit_extra_max_s": extra_max_s,
        "tier_hit_extra_ok": extra_s <= extra_max_s,
        "tier_hit_extra_ci95_s": [extra_low_s, extra_high_s],
        "tier_hit_extra_verdict": (
            "met"
            if extra_high_s <= extra_max_s
            else "missed"
            if extra_low_s > extra_max_s
            else "undetermined"
        ),
    }
    if "breakdown_of_best" in ttft:
        report["breakdown_of_best"] = ttft["breakdown_of_best"]
        report["tier_hit_copy_s"] = ttft["tier_hit_copy_s"]
        report["tier_hit_copy_over_limit"] = statistics.median(ttft["tier_hit_copy_s"]) / limit_s
        report["tier_hit_extra_by_part_s"] = ttft["tier_hit_extra_by_part_s"]
    return report


BOOTSTRAP_RESAMPLES = 4000


def _percentiles_95(medians: list[float]) -> list[float]:
    """The 2.5th and 97.5th percentiles of bootstrap medians."""
    ordered = sorted(medians)
    last = len(ordered) - 1
    return [ordered[int(0.025 * last)], ordered[int(math.ceil(0.975 * last))]]


def median_interval(groups: list[list[float]]) -> list[float]:
    """A 95% interval of the median of the values of ``groups``, from a two-level bootstrap.

    Each of :data:`BOOTSTRAP_RESAMPLES` resamplings (with replacement, fixed
    seed) draws groups, then values within each drawn group, so a group whose
    values share an offset (one pair of engine processes, one prompt) weighs
    on the interval as one sample, not as many; the interval is the 2.5th and
    97.5th percentiles of the resamplings' medians.
    """
    rng = random.Random(0)
    return _percentiles_95(
        [
            statistics.median(
                value
                for group in rng.choices(groups, k=len(groups))
                for value in rng.choices(group, k=len(group))
            )
            for _ in range(BOOTSTRAP_RESAMPLES)
        ]
    )


def ratio_interval(with_kvtier: list[list[float]], without: list[list[float]]) -> dict[str, Any]:
    """Median of the per-round ratios ``with / without`` and a 95% interval of it.

    Both arguments hold one list of rounds per pair of engine processes; the
    interval resamples pairs, then rounds within them (:func:`median_interval`),
    so a pair whose processes were steadily faster or slower counts as one sample.
    """
    pairs = [
        [w / o for w, o in zip(pair_with, pair_without, strict=True)]
        for pair_with, pair_without in zip(with_kvtier, without, strict=True)
    ]
    ratios = [ratio for pair in pairs for ratio in pair]
    low, high = median_interval(pairs)
    median = statistics.median(ratios)
    return {
        "rounds": ratios,
        "pair_medians": [statistics.median(pair) for pair in pairs],
        "median": median,
        "ci95": [low, high],
        "ok": median >= TARGETS["zero_hit_throughput_ratio_median_min"]
        and low >= TARGETS["zero_hit_throughput_ratio_ci95_low_min"],
    }


def _throughput_engine(
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


def _throughput_round(
    llm: Any, rng: random.Random, shape: tuple[int, int, int], probes: Probes | None
) -> tuple[float, float, dict[str, Any] | None]:
    """One batch of new prompts: tokens per wall second, per CPU second, and its breakdown.

    Work the engine does after the batch returned (stores still in flight) finishes
    outside the timed batch, as between bursts of requests.
    """
    from kvtier.integrations.vllm.offline import generate, settle

    prompts, prompt_tokens, output_tokens = shape
    batch = [_prompt(rng, prompt_tokens) for _ in range(prompts)]
    if probes:
        probes.take()
    wall, cpu = time.perf_counter(), _cpu_s()
    generate(llm, batch, output_tokens)
    wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    settle(llm)
    tokens = prompts * (prompt_tokens + output_tokens)
    return tokens / wall, tokens / cpu, probes.take() if probes else None


def _serve_arm(
    conn: Connection,
    model_dir: Path,
    kvtier: dict[str, Any] | None,
    shape: tuple[int, int, int],
    breakdown: bool,
    null_connector: bool,
) -> None:
    """One throughput engine, in a process of its own: a batch per ``"run"``, until ``"stop"``."""
    _engine_env(throughput_process=True)
    probes = Probes() if breakdown else None
    if probes:
        probes.install()
    from kvtier.integrations.vllm.offline import shutdown

    llm = _throughput_engine(model_dir, kvtier, shape, null_connector)
    rng = random.Random(1)  # both arms draw the same prompts, round by round
    # A warm-up batch of the rounds' shape: the first batch of that size touches vLLM's
    # KV-cache pages for the first time, which made every pair's first round 20-30% slower.
    _throughput_round(llm, rng, shape, None)
    conn.send("ready")
    breakdowns = []
    while conn.recv() == "run":
        *speeds, round_breakdown = _throughput_round(llm, rng, shape, probes)
        if round_breakdown is not None:
            breakdowns.append(round_breakdown)
        conn.send(tuple(speeds))
    shutdown(llm)
    conn.send(breakdowns)


SWAP_KINDS = ("kvtier", "null", "none")
"""The connectors one engine of ``--throughput-method swap`` takes turns with: kvtier, the
do-nothing connector of ``null_connector.py``, and none."""


class ConnectorSwitch:
    """Takes kvtier out of an in-process engine between rounds, and puts it back.

    vLLM reaches its connector through two references: the scheduler's
    ``connector`` attribute and the worker side's process-wide connector agent
    (``has_kv_transfer_group()`` is whether it is set). With both ``None`` the
    scheduler and the model runner take the paths they take in an engine
    started without a connector; with both set to a :class:`NullConnector`
    they run vLLM's connector plumbing with nothing behind it. The scheduler's
    two connector-only statistics follow the connector. Swapping is safe only
    between rounds, when no request is alive and kvtier has nothing in flight:
    :meth:`use` checks both.
    """

    def __init__(self, llm: Any) -> None:
        from null_connector import NullConnector
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "--throughput-method swap needs an in-process engine "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        scheduler = core.scheduler
        self._scheduler, self._state = scheduler, kv_transfer_state
        kept = ("connector", "connector_prefix_cache_stats", "_kv_fetch_stages")
        missing = [name for name in kept if not hasattr(scheduler, name)]
        if not hasattr(kv_transfer_state, "_KV_CONNECTOR_AGENT"):
            missing.append("kv_transfer_state._KV_CONNECTOR_AGENT")
        if missing or scheduler.connector is None:
            raise RuntimeError(
                f"this vLLM keeps its connector elsewhere ({', '.join(missing) or 'no connector'}"
                "); use --throughput-method pairs"
            )
        self.kvtier = scheduler.connector
        stats = (scheduler.connector_prefix_cache_stats, scheduler._kv_fetch_stages)
        null = [
            NullConnector(scheduler.vllm_config, role, scheduler.kv_cache_config)
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
        ]
        self._kinds = {
            "kvtier": (self.kvtier, kv_transfer_state._KV_CONNECTOR_AGENT, *stats),
            "null": (*null, *stats),
            "none": (None, None, None, None),
        }

    def use(self, kind: str) -> None:
        """Run the next rounds with ``kind`` (one of :data:`SWAP_KINDS`)."""
        scheduler = self._scheduler
        if scheduler.has_requests() or not self.kvtier.manager.settled:
            raise RuntimeError("connectors can only be swapped between rounds")
        (
            scheduler.connector,
            self._state._KV_CONNECTOR_AGENT,
            scheduler.connector_prefix_cache_stats,
            scheduler._kv_fetch_stages,
        ) = self._kinds[kind]


def _serve_swapped(
    conn: Connection,
    model_dir: Path,
    kvtier: dict[str, Any],
    shape: tuple[int, int, int],
    triples: int,
    breakdown: bool,
) -> None:
    """One engine with kvtier, in a process of its own, running ``triples`` rounds of each of
    :data:`SWAP_KINDS`; sends each kind's speeds, round by round, and its breakdowns."""
    _engine_env(throughput_process=True)
    probes = Probes() if breakdown else None
    if probes:
        probes.install()
    from kvtier.integrations.vllm.offline import shutdown

    llm = _throughput_engine(model_dir, kvtier, shape)
    switch = ConnectorSwitch(llm)
    rng = random.Random(1)
    for kind in SWAP_KINDS:  # warm-up, as in _serve_arm
        switch.use(kind)
        _throughput_round(llm, rng, shape, None)
    speeds: dict[str, list[tuple[float, float]]] = {kind: [] for kind in SWAP_KINDS}
    breakdowns: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SWAP_KINDS}
    for triple in range(triples):
        switch.use("kvtier")
        if kvtier["store_mode"] == "lazy":
            # Lazy stores take the cached blocks at vLLM's eviction frontier, which the
            # other kinds' rounds left unstored: this untimed round stores them, so the
            # timed one stores what one round of a lazy engine does (about its own blocks).
            _throughput_round(llm, rng, shape, None)
        others = SWAP_KINDS[1:] if triple % 2 == 0 else SWAP_KINDS[:0:-1]
        for kind in ("kvtier", *others):
            switch.use(kind)
            *speed, round_breakdown = _throughput_round(llm, rng, shape, probes)
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
            target=_serve_swapped, args=(sender, model_dir, kvtier, shape, triples, breakdown)
        )
        process.start()
        sender.close()
        try:
            process_speeds, process_breakdowns = _receive(receiver, process)
        finally:
            process.join(timeout=60)
        for kind in SWAP_KINDS:
            speeds[kind].append(process_speeds[kind])
            breakdowns[kind] += process_breakdowns[kind]
    return speeds, breakdowns


def _receive(conn: Connection, process: multiprocessing.process.BaseProcess) -> Any:
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
            target=_serve_arm, args=(child, model_dir, kvtier, shape, breakdown, null_connector)
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
        return _receive(self._conn, self._process)


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


def _merge_breakdowns(rounds: list[dict[str, Any]]) -> dict[str, Any]:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lazy-repeats", type=int, default=5)
    parser.add_argument(
        "--hit-pairs",
        type=int,
        default=10,
        help="device hits and tier hits timed per TTFT prompt (each repeat's prompt)",
    )
    parser.add_argument("--lower-tier-repeats", type=int, default=3)
    parser.add_argument("--busy-hit-tokens", type=int, default=1024)
    parser.add_argument(
        "--busy-repeats", type=int, default=6, help="repeats per engine of each busy arm"
    )
    parser.add_argument(
        "--throughput-method",
        choices=("swap", "pairs"),
        default="swap",
        help="one engine per process taking turns with kvtier, a do-nothing connector and "
        "none (default), or pairs of engine processes with and without kvtier",
    )
    parser.add_argument(
        "--throughput-processes", type=int, default=6, help="swap: engine processes"
    )
    parser.add_argument(
        "--throughput-triples",
        type=int,
        default=50,
        help="swap: rounds of each connector kind per process",
    )
    parser.add_argument("--throughput-pairs", type=int, default=6, help="pairs: pairs")
    parser.add_argument(
        "--throughput-rounds", type=int, default=ROUNDS_PER_PAIR, help="pairs: rounds per pair"
    )
    parser.add_argument("--throughput-prompts", type=int, default=4)
    parser.add_argument("--throughput-prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--throughput-store-mode", choices=("eager", "lazy"), default="eager")
    parser.add_argument(
        "--throughput-baseline",
        choices=("none", "null"),
        default="none",
        help="pairs: the arm without kvtier: no connector (default), or a connector that "
        "does nothing",
    )
    parser.add_argument(
        "--only",
        choices=("ttft", "busy", "lower-tiers", "throughput"),
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="report time per connector call, copy and step"
    )
    args = parser.parse_args()
    parts = set(args.only or ("ttft", "busy", "lower-tiers", "throughput"))
    _engine_env()
    probes = Probes() if args.breakdown else None
    if probes and "ttft" in parts:
        probes.install()
    result: dict[str, Any] = {
        "model": {
            "layers": MODEL.num_layers,
            "hidden": MODEL.hidden_size,
            "kv_heads": MODEL.num_kv_heads,
            "head_dim": MODEL.head_dim,
        },
        "prompt_tokens": args.prompt_tokens,
        "load_average_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as scratch:
        model_dir = write_tiny_llama(Path(scratch) / "model", MODEL)
        if "ttft" in parts:
            prompt_bytes = MODEL.kv_bytes_per_token() * args.prompt_tokens
            # The limit is timed before, between and after the two modes' hits, under what
            # the machine did then too: the fastest copy of all is the limit.
            limits = [copy_limit_s(prompt_bytes)]
            eager = measure_ttft(
                model_dir, args.prompt_tokens, args.repeats, args.hit_pairs, "eager", probes
            )
            limits.append(copy_limit_s(prompt_bytes))
            lazy = measure_ttft(
                model_dir, args.prompt_tokens, args.lazy_repeats, args.hit_pairs, "lazy", probes
            )
            limits.append(copy_limit_s(prompt_bytes))
            limit_s = min(limits)
            result["prompt_kv_bytes"] = prompt_bytes
            result["copy_limit_s"] = limit_s
            result["copy_limit_timings_s"] = limits
            result["copy_bandwidth_bytes_per_s"] = prompt_bytes / limit_s
            result.update(ttft_report(eager, limit_s))
            result["lazy"] = ttft_report(lazy, limit_s)
        if "busy" in parts:
            budgets = {"a_step_ahead": 0, "same_step": DEFAULT_SAME_STEP_LOAD_BYTES}
            busy: dict[str, dict[str, list[float]]] = {
                name: {"seconds": [], "steps": []} for name in budgets
            }
            for order in (list(budgets), list(budgets)[::-1]):  # an engine per arm, twice
                for name in order:
                    arm = measure_busy_ttft(
                        model_dir, args.busy_hit_tokens, args.busy_repeats, budgets[name]
                    )
                    for key, values in arm.items():
                        busy[name][key] += values
            result["busy"] = {"hit_prompt_tokens": args.busy_hit_tokens} | busy_report(busy)
        if "lower-tiers" in parts:
            lower = measure_lower_tiers(model_dir, Path(scratch), args)
            result["lower_tier_ttft_s"] = {
                name: {kind: _summary(values) for kind, values in arms.items()}
                for name, arms in lower.items()
            }
            for name, arms in lower.items():
                result[f"{name}_hit_over_cold"] = min(arms["hit"]) / min(arms["cold"])
        if "throughput" in parts:
            result.update(throughput_report(model_dir, args))
    result["load_average_end"] = os.getloadavg()
    result["targets"] = TARGETS
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


def _speeds(rounds: list[list[tuple[float, float]]], kind: int) -> list[list[float]]:
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
        speeds = {arm: _speeds(rounds, kind) for arm, rounds in arms.items()}
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
        merged = {arm: _merge_breakdowns(rounds) for arm, rounds in breakdown_arms.items()}
        result["zero_hit_breakdown"] = merged
        # The connector's own share of the engine's step time: what other processes on the
        # machine cannot blur the way they blur whole rounds.
        result["zero_hit_connector_share_of_step_s"] = (
            merged["with"]["connector_total_s"] / merged["with"]["step_s"]
        )
    return result


def measure_lower_tiers(
    model_dir: Path, scratch: Path, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """Cold and hit TTFT for a disk tier and, where ``redis-server`` is installed, a Redis one."""
    from kvtier.testing.redis_server import RedisServer, redis_server_binary

    lower: dict[str, dict[str, list[float]]] = {}
    disk = {"type": "disk", "path": str(scratch / "disk"), "capacity_bytes": "4GiB"}
    lower["disk"] = measure_lower_tier_ttft(
        model_dir, args.prompt_tokens, args.lower_tier_repeats, disk
    )
    if redis_server_binary() is not None:
        server = RedisServer(scratch / "redis").start()
        try:
            redis = {"type": "redis", "url": server.url}
            lower["redis"] = measure_lower_tier_ttft(
                model_dir, args.prompt_tokens, args.lower_tier_repeats, redis
            )
        finally:
            server.stop()
    return lower


if __name__ == "__main__":
    sys.exit(main())
