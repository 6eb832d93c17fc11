"""Time to first token: a cold prompt, a vLLM prefix-cache hit (device hit) and a kvtier hit
(tier hit), in eager and lazy store mode, against the fastest contiguous host copy of the
prompt's KV bytes timed in the same run."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

from stats import grouped_median_ci, summary

from vllm_bench.engine import BLOCK_TOKENS, MODEL, random_prompt, timed_generate
from vllm_bench.patches import Probes

TARGETS = {
    "tier_hit_over_device_hit_max": 1.5,
    "tier_hit_over_cold_max": 0.05,
    "tier_hit_extra_s_max": "1.5 x copy_limit_s + 0.0003",
}


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
    timed_generate(llm, [random_prompt(rng, prompt_tokens)], 1)  # warm-up
    times: dict[str, list[float]] = {"cold": [], "device_hit": [], "tier_hit": []}
    breakdown: dict[str, list[dict[str, Any]]] = {"device_hit": [], "tier_hit": []}

    def timed(kind: str, prompt: list[int]) -> None:
        if probes:
            probes.take()
        times[kind].append(timed_generate(llm, [prompt], 1))
        if probes and kind in breakdown:
            breakdown[kind].append(probes.take())

    for _ in range(repeats):
        prompt = random_prompt(rng, prompt_tokens)
        timed("cold", prompt)
        settle(llm)
        for pair in range(pairs):
            order = ("device_hit", "tier_hit") if pair % 2 == 0 else ("tier_hit", "device_hit")
            for kind in order:
                if kind == "tier_hit":
                    if lazy and pair == 0:
                        # One more prompt's blocks bring this one's to the front of vLLM's
                        # free queue, within the window lazy mode stores.
                        timed_generate(llm, [random_prompt(rng, prompt_tokens)], 1)
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
    extra_low_s, extra_high_s = grouped_median_ci(by_prompt)["ci95"]
    report: dict[str, Any] = {
        "ttft_s": {kind: summary(ttft[kind]) for kind in best},
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


def run(model_dir: Path, args: argparse.Namespace, probes: Probes | None) -> dict[str, Any]:
    """The TTFT part's fields: eager at the top level, lazy under ``lazy``."""
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
    return {
        "prompt_kv_bytes": prompt_bytes,
        "copy_limit_s": limit_s,
        "copy_limit_timings_s": limits,
        "copy_bandwidth_bytes_per_s": prompt_bytes / limit_s,
        **ttft_report(eager, limit_s),
        "lazy": ttft_report(lazy, limit_s),
    }
