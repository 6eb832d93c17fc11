"""Time to first token on vLLM (CPU): cold prefill vs vLLM prefix-cache hit vs kvtier tier hit.

Also measures the first token of a prefix found only in a disk tier or a Redis
tier below a host tier too small to keep it (promoted, then loaded), and
throughput at a 0% hit rate with and without the connector, so the cost of
storing every block is visible. All arms run in one process on the same
random-weight model; the output is JSON with ratios against the peers. The
Redis arm needs ``redis-server`` on the PATH and is left out without it.

    python benchmarks/vllm_ttft.py [--prompt-tokens 4096] [--repeats 7] [--throughput-rounds 3]

On a shared machine other processes slow some repeats down many times over,
so every repeat is reported; the headline TTFT ratios use the best (least
disturbed) repeat of each arm. Throughput rounds run both arms back to back in
alternating order; the ratios are the median of per-round ratios (by wall time
and by this process's CPU time) and the ratio of the best rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

MODEL = TinyLlamaSpec(
    num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024
)


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(MODEL.vocab_size) for _ in range(tokens)]


def _timed(llm: object, prompts: list[list[int]], max_tokens: int) -> float:
    from kvtier.integrations.vllm.offline import generate

    started = time.perf_counter()
    generate(llm, prompts, max_tokens)  # type: ignore[arg-type]
    return time.perf_counter() - started


def measure_ttft(model_dir: Path, prompt_tokens: int, repeats: int) -> dict[str, list[float]]:
    """Seconds to the first token of each repeat, for each kind of prefix."""
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs, reset_device_cache, shutdown

    blocks = 4 * prompt_tokens // 32
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier={"cpu_bytes": "1GiB"},
            num_device_blocks=blocks,
            max_model_len=2 * prompt_tokens,
        )
    )
    rng = random.Random(0)
    _timed(llm, [_prompt(rng, prompt_tokens)], 1)  # warm-up
    cold, device, tier = [], [], []
    for _ in range(repeats):
        prompt = _prompt(rng, prompt_tokens)
        cold.append(_timed(llm, [prompt], 1))
        device.append(_timed(llm, [prompt], 1))
        reset_device_cache(llm)
        tier.append(_timed(llm, [prompt], 1))
    shutdown(llm)
    return {"cold": cold, "device_hit": device, "tier_hit": tier}


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

    record_bytes = MODEL.kv_bytes_per_token() * 32
    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier={"cpu_bytes": 3 * prompt_tokens // 2 // 32 * record_bytes, "tiers": [tier]},
            num_device_blocks=4 * prompt_tokens // 32,
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


def _summary(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values)}


def measure_throughput(
    model_dir: Path, with_kvtier: bool, prompts: int, prompt_tokens: int, output_tokens: int
) -> tuple[float, float]:
    """Tokens (prompt and output) per wall second and per CPU second, for unique prompts.

    Every prompt is new, so the hit rate is 0% and the connector only adds its
    stores. CPU seconds are this process's (vLLM runs in-process here), which
    other processes on the machine do not inflate the way they inflate wall time.
    """
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs, generate, shutdown

    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier={"cpu_bytes": "1GiB"} if with_kvtier else None,
            num_device_blocks=prompts * (prompt_tokens + output_tokens) // 32 + 64,
            max_model_len=2 * prompt_tokens,
        )
    )
    rng = random.Random(1)
    generate(llm, [_prompt(rng, prompt_tokens) for _ in range(2)], output_tokens)  # warm-up
    batch = [_prompt(rng, prompt_tokens) for _ in range(prompts)]
    wall, cpu = time.perf_counter(), time.process_time()
    generate(llm, batch, output_tokens)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutdown(llm)
    tokens = prompts * (prompt_tokens + output_tokens)
    return tokens / wall, tokens / cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lower-tier-repeats", type=int, default=3)
    parser.add_argument("--throughput-rounds", type=int, default=4)
    parser.add_argument("--throughput-prompts", type=int, default=16)
    parser.add_argument("--throughput-prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM logs to stdout, which carries the JSON result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as scratch:
        model_dir = write_tiny_llama(Path(scratch) / "model", MODEL)
        ttft = measure_ttft(model_dir, args.prompt_tokens, args.repeats)
        lower: dict[str, dict[str, list[float]]] = {}
        disk = {"type": "disk", "path": str(Path(scratch) / "disk"), "capacity_bytes": "4GiB"}
        lower["disk"] = measure_lower_tier_ttft(
            model_dir, args.prompt_tokens, args.lower_tier_repeats, disk
        )
        from kvtier.testing.redis_server import RedisServer, redis_server_binary

        if redis_server_binary() is not None:
            server = RedisServer(Path(scratch) / "redis").start()
            try:
                redis = {"type": "redis", "url": server.url}
                lower["redis"] = measure_lower_tier_ttft(
                    model_dir, args.prompt_tokens, args.lower_tier_repeats, redis
                )
            finally:
                server.stop()
        shape = (args.throughput_prompts, args.throughput_prompt_tokens, args.output_tokens)
        # Both arms every round, in alternating order, so load from other processes and
        # whatever the first engine of a process warms up fall on both alike.
        rounds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for round_index in range(args.throughput_rounds):
            for with_kvtier in (False, True) if round_index % 2 == 0 else (True, False):
                rounds[with_kvtier].append(measure_throughput(model_dir, with_kvtier, *shape))

    def ratio(kind: int) -> float:
        pairs = zip(rounds[True], rounds[False], strict=True)
        return statistics.median(tiered[kind] / plain[kind] for tiered, plain in pairs)

    best = {kind: min(values) for kind, values in ttft.items()}
    result = {
        "model": {
            "layers": MODEL.num_layers,
            "hidden": MODEL.hidden_size,
            "kv_heads": MODEL.num_kv_heads,
            "head_dim": MODEL.head_dim,
        },
        "prompt_tokens": args.prompt_tokens,
        "ttft_s": {kind: _summary(values) for kind, values in ttft.items()},
        "ttft_rounds_s": ttft,
        "tier_hit_over_device_hit": best["tier_hit"] / best["device_hit"],
        "tier_hit_over_cold": best["tier_hit"] / best["cold"],
        "tier_hit_over_device_hit_median_of_rounds": statistics.median(
            t / d for t, d in zip(ttft["tier_hit"], ttft["device_hit"], strict=True)
        ),
        "lower_tier_ttft_s": {
            name: {kind: _summary(values) for kind, values in arms.items()}
            for name, arms in lower.items()
        },
        **{
            f"{name}_hit_over_cold": min(arms["hit"]) / min(arms["cold"])
            for name, arms in lower.items()
        },
        "zero_hit_tokens_per_wall_s": {
            "without": [wall for wall, _ in rounds[False]],
            "with": [wall for wall, _ in rounds[True]],
        },
        "zero_hit_tokens_per_cpu_s": {
            "without": [cpu for _, cpu in rounds[False]],
            "with": [cpu for _, cpu in rounds[True]],
        },
        "zero_hit_throughput_ratio_wall": ratio(0),
        "zero_hit_throughput_ratio_cpu": ratio(1),
        "zero_hit_throughput_ratio_best": max(w for w, _ in rounds[True])
        / max(w for w, _ in rounds[False]),
        "targets": {
            "tier_hit_over_device_hit_max": 1.5,
            "tier_hit_over_cold_max": 0.05,
            "disk_hit_over_cold_max": 0.25,
            "redis_hit_over_cold_max": 0.25,
            "zero_hit_throughput_ratio_min": 0.97,
        },
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
