"""The first token of a prefix found only in a tier below the host tier (disk; Redis, Mooncake
Store and S3 where their servers are installed), against the same prompt's cold prefill; and a
deliberately slow tier with and without the cost guard."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from stats import summary

from vllm_bench.engine import BLOCK_TOKENS, MODEL, random_prompt, timed_generate

TARGETS = {
    "disk_hit_over_cold_max": 0.25,
    "redis_hit_over_cold_max": 0.25,
    "mooncake_hit_over_cold_max": 0.25,
    "slow_guarded_hit_over_cold_max": 1.2,
}

GUARD_WARMUP_PROMPTS = 8
"""Cold prompts served before a slow-tier arm's repeats: each lookup reads the tier once, so
the cost guard has measured it (its warm-up, ``kvtier.offload.costguard.MIN_SAMPLES``) before
anything is timed, in both arms alike."""


def measure_lower_tier_ttft(
    model_dir: Path,
    prompt_tokens: int,
    repeats: int,
    tier: dict[str, object],
    *,
    cost_guard: bool = True,
    warmup_prompts: int = 1,
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
                "cost_guard": cost_guard,
            },
            num_device_blocks=4 * prompt_tokens // BLOCK_TOKENS,
            max_model_len=2 * prompt_tokens,
        )
    )
    rng = random.Random(2)
    for _ in range(warmup_prompts):
        timed_generate(llm, [random_prompt(rng, prompt_tokens)], 1)
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


@contextlib.contextmanager
def redis_tier(scratch: Path) -> Iterator[dict[str, object] | None]:
    from tests.support.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        yield None
        return
    server = RedisServer(scratch / "redis").start()
    try:
        yield {"type": "redis", "url": server.url}
    finally:
        server.stop()


@contextlib.contextmanager
def mooncake_tier(scratch: Path) -> Iterator[dict[str, object] | None]:
    from tests.support.mooncake_server import MooncakeStore, mooncake_binaries

    if mooncake_binaries() is None:
        yield None
        return
    store = MooncakeStore(scratch / "mooncake", segment_bytes=1 << 30).start()
    try:
        yield store.tier_settings()
    finally:
        store.stop()


@contextlib.contextmanager
def s3_tier(scratch: Path) -> Iterator[dict[str, object] | None]:
    """A bucket of moto's S3 server on loopback, with test credentials in the environment."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
        yield None
        return
    from tests.support.s3_server import MotoS3Server, aws_test_environment

    with mock.patch.dict(os.environ, aws_test_environment()):
        server = MotoS3Server().start()
        try:
            yield {
                "type": "s3",
                "bucket": server.create_bucket("kvtier-bench"),
                "endpoint_url": server.url,
                "addressing_style": "path",
                "timeout_s": 10.0,
                "get_deadline_s": 10.0,
            }
        finally:
            server.stop()


@contextlib.contextmanager
def memory_tier_plugin() -> Iterator[None]:
    """The process's plugins plus the tests' ``memory`` tier over a new, empty store."""
    import kvtier.plugins
    from tests.support.tiers import memory_tier_registry

    with mock.patch.object(kvtier.plugins, "_default_registry", memory_tier_registry()):
        yield


SHARED_TIERS: dict[str, Callable[[Path], contextlib.AbstractContextManager[Any]]] = {
    "redis": redis_tier,
    "mooncake": mooncake_tier,
    "s3": s3_tier,
}
"""Tiers whose servers run for the part, when installed; each yields ``None`` otherwise."""


def measure_lower_tiers(
    model_dir: Path, scratch: Path, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """Cold and hit TTFT for a disk tier, each installed shared tier, and a slow tier read in
    ``args.slow_tier_read_s`` without (``slow``) and with (``slow_guarded``) the cost guard."""
    lower: dict[str, dict[str, list[float]]] = {}

    def measure(name: str, tier: dict[str, object], **options: Any) -> None:
        lower[name] = measure_lower_tier_ttft(
            model_dir, args.prompt_tokens, args.lower_tier_repeats, tier, **options
        )

    measure("disk", {"type": "disk", "path": str(scratch / "disk"), "capacity_bytes": "4GiB"})
    for name, serve in SHARED_TIERS.items():
        with serve(scratch) as tier:
            if tier is not None:
                measure(name, tier)
    slow = {"type": "memory", "read_delay_s": args.slow_tier_read_s}
    for name, cost_guard in (("slow", False), ("slow_guarded", True)):
        with memory_tier_plugin():  # a store of its own: the arms' prompts are the same
            measure(name, slow, cost_guard=cost_guard, warmup_prompts=GUARD_WARMUP_PROMPTS)
    return lower


def lower_tier_report(lower: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """The part's fields from each tier's cold and hit TTFTs."""
    result: dict[str, Any] = {
        "lower_tier_ttft_s": {
            name: {kind: summary(values) for kind, values in arms.items()}
            for name, arms in lower.items()
        }
    }
    for name, arms in lower.items():
        result[f"{name}_hit_over_cold"] = min(arms["hit"]) / min(arms["cold"])
    return result


def run(model_dir: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The lower-tier part's fields: TTFT summaries per tier, and best hit over best cold."""
    result = lower_tier_report(measure_lower_tiers(model_dir, scratch, args))
    result["slow_tier_read_s"] = args.slow_tier_read_s
    return result
