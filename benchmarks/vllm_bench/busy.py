"""A tier hit on a busy engine: the first token of a prompt whose blocks are all in the host
tier, arriving while other requests decode, loaded a step ahead or in the same step."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from stats import summary

from kvtier.config.model import DEFAULT_SAME_STEP_LOAD_BYTES
from vllm_bench.engine import BLOCK_TOKENS, random_prompt

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
        prompt = random_prompt(rng, hit_tokens)
        generate(llm, [prompt], 1)
        reset_device_cache(llm)
        background = [f"background-{repeat}-{i}" for i in range(count)]
        for request_id in background:
            engine.add_request(
                request_id,
                {"prompt_token_ids": random_prompt(rng, background_tokens)},
                greedy(10**6),
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
        "ttft_s": {name: summary(arm["seconds"]) for name, arm in arms.items()},
        "ttft_rounds_s": {name: arm["seconds"] for name, arm in arms.items()},
        "steps_to_first_token": {
            name: statistics.median(arm["steps"]) for name, arm in arms.items()
        },
        "same_step_over_a_step_ahead": medians["same_step"] / medians["a_step_ahead"],
    }


def run(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The busy part's fields: an engine per arm, twice, in alternating order."""
    budgets = {"a_step_ahead": 0, "same_step": DEFAULT_SAME_STEP_LOAD_BYTES}
    busy: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "steps": []} for name in budgets
    }
    for order in (list(budgets), list(budgets)[::-1]):
        for name in order:
            arm = measure_busy_ttft(
                model_dir, args.busy_hit_tokens, args.busy_repeats, budgets[name]
            )
            for key, values in arm.items():
                busy[name][key] += values
    return {"hit_prompt_tokens": args.busy_hit_tokens} | busy_report(busy)
