"""Served check of the lossy record codecs: greedy tokens and logprobs against uncompressed hits.

For each codec (``none``, then ``fp8`` and ``int8``), one vLLM CPU engine with
a disk tier under a small host tier serves the prompts and writes their blocks
to disk as it shuts down; a second engine, same config, serves the same
prompts again, so that every prompt's prefix is a disk hit decoded through
the codec. Its greedy tokens and the logprob of each chosen token are compared
with those of the ``none`` arm (uncompressed hits), position by position:
``tokens_equal`` counts positions whose token is the same (after a first
difference the two continuations usually part), ``prompts_identical`` the
prompts whose whole output is, and ``first_logprob_abs_delta`` the difference
of the first generated token's logprob, the one computed from the prefix's
KV alone, so the most direct measure of a codec's error. The model is the
vLLM benchmarks' random-weight Llama (``vllm_bench.engine.MODEL``). Prints one
JSON object; vLLM logs to stderr.

    python benchmarks/codec_served.py --prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_bench.engine import BLOCK_TOKENS, MODEL, engine_env, random_prompt

from kvtier.integrations.checkpoints import write_tiny_llama

CODECS = ("none", "fp8", "int8")
PROMPT_BLOCKS = 6


def serve(
    model_dir: str, kvtier: dict[str, Any], prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their logprobs of each prompt, one at a time; blocks promoted."""
    from vllm import LLM, SamplingParams

    from kvtier.integrations.vllm.offline import engine_kwargs, settle, shutdown

    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier=kvtier,
            num_device_blocks=len(prompts) * (PROMPT_BLOCKS + 2) * 2,
            max_model_len=(PROMPT_BLOCKS + 2) * BLOCK_TOKENS + max_tokens,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    tokens, logprobs = [], []
    try:
        for prompt in prompts:
            (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            completion = output.outputs[0]
            tokens.append(list(completion.token_ids))
            logprobs.append(
                [
                    chosen[token].logprob
                    for token, chosen in zip(completion.token_ids, completion.logprobs, strict=True)
                ]
            )
            settle(llm)
        promoted = _promoted(llm)
    finally:
        shutdown(llm)
    return tokens, logprobs, promoted


def _promoted(llm: Any) -> int:  # noqa: ANN401
    """Blocks the engine's kvtier manager promoted from the tiers below host memory."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.manager
    return int(manager.stats().promoted_blocks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts served")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--seed", type=int, default=7, help="seed of the prompts")
    args = parser.parse_args()
    engine_env()
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, PROMPT_BLOCKS * BLOCK_TOKENS + 5) for _ in range(args.prompts)]
    record_bytes = MODEL.kv_bytes_per_token() * BLOCK_TOKENS
    report: dict[str, Any] = {
        "model": {"num_layers": MODEL.num_layers, "num_kv_heads": MODEL.num_kv_heads},
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "codecs": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-codec-served-") as scratch:
        model_dir = str(write_tiny_llama(Path(scratch) / "model", MODEL))
        baseline: tuple[list[list[int]], list[list[float]]] | None = None
        for codec in CODECS:
            disk: dict[str, Any] = {
                "type": "disk",
                "path": str(Path(scratch) / f"disk-{codec}"),
                "capacity_bytes": 4 * args.prompts * PROMPT_BLOCKS * record_bytes,
            }
            if codec != "none":
                disk["codec"] = codec
            config = {"cpu_bytes": 4 * PROMPT_BLOCKS * record_bytes, "tiers": [disk]}
            serve(model_dir, config, prompts, args.max_tokens)
            tokens, logprobs, promoted = serve(model_dir, config, prompts, args.max_tokens)
            if baseline is None:
                baseline = tokens, logprobs
            expected, expected_logprobs = baseline
            positions = sum(len(output) for output in expected)
            equal = sum(
                a == b
                for ours, theirs in zip(tokens, expected, strict=True)
                for a, b in zip(ours, theirs, strict=False)
            )
            deltas = [
                abs(ours[0] - theirs[0])
                for ours, theirs in zip(logprobs, expected_logprobs, strict=True)
            ]
            report["codecs"][codec] = {
                "promoted_blocks": promoted,
                "tokens_equal": equal,
                "tokens": positions,
                "tokens_equal_share": round(equal / positions, 4),
                "prompts_identical": sum(
                    ours == theirs for ours, theirs in zip(tokens, expected, strict=True)
                ),
                "first_logprob_abs_delta": {
                    "max": round(max(deltas), 5),
                    "mean": round(statistics.fmean(deltas), 5),
                },
            }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
