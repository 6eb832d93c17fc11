"""The first token of a prefix found only in a tier below the host tier (disk, and Redis where
``redis-server`` is installed), against the same prompt's cold prefill."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from vllm_bench.engine import BLOCK_TOKENS, MODEL, random_prompt, timed_generate
from vllm_bench.stats import summary

TARGETS = {"disk_hit_over_cold_max": 0.25, "redis_hit_over_cold_max": 0.25}


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
    timed_generate(llm, [random_prompt(rng, prompt_tokens)], 1)  # warm-up
    cold, hit = [], []
    for _ in range(repeats):
        prompt = random_prompt(rng, prompt_tokens)
        cold.append(timed_generate(llm, [prompt], 1))
        timed_generate(
            llm, [random_prompt(rng, prompt_tokens)], 1
        )  # evicts (demotes) the first prompt
        reset_device_cache(llm)
        time.sleep(1.0)  # the tier writes on its own threads
        hit.append(timed_generate(llm, [prompt], 1))
    shutdown(llm)
    return {"cold": cold, "hit": hit}


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


def run(model_dir: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The lower-tier part's fields: TTFT summaries per tier, and best hit over best cold."""
    lower = measure_lower_tiers(model_dir, scratch, args)
    result: dict[str, Any] = {
        "lower_tier_ttft_s": {
            name: {kind: summary(values) for kind, values in arms.items()}
            for name, arms in lower.items()
        }
    }
    for name, arms in lower.items():
        result[f"{name}_hit_over_cold"] = min(arms["hit"]) / min(arms["cold"])
    return result
