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
KV alone, so the most direct measure of a codec's error. ``recomputed``
compares the same way the ``none`` arm's first engine, which computed every
prompt (no hit), with its uncompressed hits: how far this model's greedy
tokens move when a prefix is loaded bit for bit instead of recomputed.
``runner_up_margin`` says how close the uncompressed hits' greedy choices
were: the chosen token's logprob less the runner-up's, at every position
(its median, and the share under each of ``MARGIN_BARS``). The
model is the vLLM benchmarks' random-weight Llama (``vllm_bench.engine.MODEL``).
Prints one JSON object; vLLM logs to stderr.

    python benchmarks/codec_served.py --prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_bench.engine import BLOCK_TOKENS, MODEL, engine_env, random_prompt

from kvtier.integrations.checkpoints import write_tiny_llama

CODECS = ("none", "fp8", "int8")
MARGIN_BARS = (0.01, 0.1)
"""Margins the report counts the positions under."""
PROMPT_BLOCKS = 6


@dataclass
class Served:
    """One engine's greedy outputs of the prompts."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    """The logprob of each chosen token."""
    margins: list[float]
    """At every position, the chosen token's logprob less the runner-up's."""
    promoted: int
    """Blocks promoted from the tiers below host memory."""


def serve(
    model_dir: str, kvtier: dict[str, Any], prompts: list[list[int]], max_tokens: int
) -> Served:
    """Serve each prompt greedily, one at a time."""
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
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    served = Served([], [], [], 0)
    try:
        for prompt in prompts:
            (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            completion = output.outputs[0]
            served.tokens.append(list(completion.token_ids))
            served.logprobs.append([])
            for token, ranked in zip(completion.token_ids, completion.logprobs, strict=True):
                chosen = ranked[token].logprob
                served.logprobs[-1].append(chosen)
                served.margins.append(
                    chosen - max(entry.logprob for other, entry in ranked.items() if other != token)
                )
            settle(llm)
        served.promoted = _promoted(llm)
    finally:
        shutdown(llm)
    return served


def _promoted(llm: Any) -> int:  # noqa: ANN401
    """Blocks the engine's kvtier manager promoted from the tiers below host memory."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.manager
    return int(manager.stats().promoted_blocks)


def compare(served: Served, expected: Served) -> dict[str, Any]:
    """Greedy tokens equal position by position, prompts whose output is the same, and the
    first generated token's logprob difference, of ``served`` against ``expected``."""
    positions = sum(len(output) for output in expected.tokens)
    pairs = list(zip(served.tokens, expected.tokens, strict=True))
    equal = sum(a == b for ours, theirs in pairs for a, b in zip(ours, theirs, strict=False))
    deltas = [
        abs(ours[0] - theirs[0])
        for ours, theirs in zip(served.logprobs, expected.logprobs, strict=True)
    ]
    return {
        "tokens_equal": equal,
        "tokens": positions,
        "tokens_equal_share": round(equal / positions, 4),
        "prompts_identical": sum(ours == theirs for ours, theirs in pairs),
        "first_logprob_abs_delta": {
            "max": round(max(deltas), 5),
            "mean": round(statistics.fmean(deltas), 5),
        },
    }


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
        baseline: Served | None = None
        for codec in CODECS:
            disk: dict[str, Any] = {
                "type": "disk",
                "path": str(Path(scratch) / f"disk-{codec}"),
                "capacity_bytes": 4 * args.prompts * PROMPT_BLOCKS * record_bytes,
            }
            if codec != "none":
                disk["codec"] = codec
            config = {"cpu_bytes": 4 * PROMPT_BLOCKS * record_bytes, "tiers": [disk]}
            computed = serve(model_dir, config, prompts, args.max_tokens)
            hits = serve(model_dir, config, prompts, args.max_tokens)
            if baseline is None:
                baseline = hits
                report["recomputed"] = compare(computed, baseline)
                report["runner_up_margin"] = {
                    "median": round(statistics.median(hits.margins), 5),
                    **{
                        f"share_below_{bar}": round(
                            sum(margin < bar for margin in hits.margins) / len(hits.margins), 4
                        )
                        for bar in MARGIN_BARS
                    },
                }
            report["codecs"][codec] = {"promoted_blocks": hits.promoted, **compare(hits, baseline)}
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
