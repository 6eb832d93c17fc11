"""Time to first token and throughput of kvtier's vLLM connector on CPU, as one JSON object.

Four parts, each a module of ``vllm_bench``: ``ttft`` (a cold prefill, a vLLM prefix-cache hit
and a kvtier hit, in eager and lazy store mode, against the fastest host copy of the prompt's KV
bytes), ``busy`` (a tier hit arriving while other requests decode), ``lower-tiers`` (a hit found
only in a disk tier, or a Redis, Mooncake or S3 tier where their servers are installed, and a
slow tier with and without the cost guard) and ``throughput`` (a
0% hit rate with and without the connector). All run the same random-weight model; the output
holds every timing, ratios against the peers and a verdict against each target. vLLM logs to
stderr.

    python benchmarks/vllm_ttft.py [--only ttft|busy|lower-tiers|throughput ...] [--breakdown]

``--breakdown`` wraps the connector's methods, the host copies and vLLM's engine step,
scheduler and forward (in the benchmark's processes only; without the flag nothing is wrapped)
and reports where the time goes, per arm. docs/benchmarks/ has a page per part: the command,
the machine, today's figures and how to read them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_bench import busy, lower_tiers, throughput, ttft
from vllm_bench.engine import MODEL, engine_env
from vllm_bench.patches import Probes

from kvtier.integrations.checkpoints import write_tiny_llama

PARTS = ("ttft", "busy", "lower-tiers", "throughput")
TARGETS = {**ttft.TARGETS, **lower_tiers.TARGETS, **throughput.TARGETS}


def arguments() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--slow-tier-read-s",
        type=float,
        default=2.0,
        help="seconds each read of the slow tier takes (more than the prompt's cold prefill)",
    )
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
        "--throughput-rounds",
        type=int,
        default=throughput.ROUNDS_PER_PAIR,
        help="pairs: rounds per pair",
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
        choices=PARTS,
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="report time per connector call, copy and step"
    )
    return parser


def main() -> int:
    args = arguments().parse_args()
    parts = set(args.only or PARTS)
    engine_env()
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
            result.update(ttft.run(model_dir, args, probes))
        if "busy" in parts:
            result["busy"] = busy.run(model_dir, args)
        if "lower-tiers" in parts:
            result.update(lower_tiers.run(model_dir, Path(scratch), args))
        if "throughput" in parts:
            result.update(throughput.throughput_report(model_dir, args))
    result["load_average_end"] = os.getloadavg()
    result["targets"] = TARGETS
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support
    sys.exit(main())
