"""``make demo``: vLLM on CPU serving a multi-turn chat workload, without and then with kvtier.

Run it with ``python examples/chat_demo.py``. It writes a small
random-weight Llama, then runs the same conversations twice in this process:
once on plain vLLM and once with ``KVTierConnector``. Every conversation
resends its whole history each turn, and all histories together are several
times larger than vLLM's KV cache, so plain vLLM keeps evicting and
recomputing them; with kvtier the evicted blocks come back from host memory.
The table compares prefix-cache hits, time to first token and total time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

DEMO_MODEL = TinyLlamaSpec(
    num_layers=4,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1024,
    initializer_range=0.2,
)
"""The demo's model: big enough that prefill dominates, small enough for two CPU cores."""

DTYPE = "float32"
"""Compute in float32: random weights give near-tied logits, and bfloat16 rounding differences
between computing a prefix and reusing its cached KV would otherwise flip some greedy tokens."""


@dataclass
class Workload:
    """Conversations that each start from their own document and then add turns."""

    conversations: int = 12
    turns: int = 4
    document_tokens: int = 1024
    user_tokens: int = 64
    reply_tokens: int = 16
    seed: int = 0

    def documents(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(DEMO_MODEL.vocab_size) for _ in range(self.document_tokens)]
            for _ in range(self.conversations)
        ]

    def user_turn(self, conversation: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{conversation}:{turn}")
        return [rng.randrange(DEMO_MODEL.vocab_size) for _ in range(self.user_tokens)]


@dataclass
class ArmResult:
    """What one run of the workload measured."""

    name: str
    ttft_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    device_hit_tokens: float = 0.0
    tier_hit_tokens: float = 0.0
    prompt_tokens: int = 0
    replies: list[list[int]] = field(default_factory=list)


def run_arm(
    name: str,
    model_dir: Path,
    workload: Workload,
    *,
    kvtier: dict[str, object] | None,
    device_blocks: int,
) -> ArmResult:
    """Serve every turn of every conversation on one engine and measure it."""
    from tqdm import tqdm
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs, greedy, metric_values, shutdown

    llm = LLM(
        **engine_kwargs(
            model_dir,
            kvtier=kvtier,
            num_device_blocks=device_blocks,
            max_model_len=4096,
            dtype=DTYPE,
        )
    )
    result = ArmResult(name)
    histories = workload.documents()
    before = metric_values(llm)
    total = workload.conversations * workload.turns
    started = time.perf_counter()
    with tqdm(total=total, desc=name, unit="req", file=sys.stdout) as progress:
        for turn in range(workload.turns):
            prompts = []
            for conversation, history in enumerate(histories):
                history.extend(workload.user_turn(conversation, turn))
                prompts.append({"prompt_token_ids": list(history)})
                result.prompt_tokens += len(history)
            outputs = llm.generate(prompts, greedy(workload.reply_tokens), use_tqdm=False)
            for history, output in zip(histories, outputs, strict=True):
                reply = list(output.outputs[0].token_ids)
                history.extend(reply)
                result.replies.append(reply)
                if output.metrics is not None:
                    result.ttft_s.append(output.metrics.first_token_latency)
            progress.update(len(prompts))
    result.total_s = time.perf_counter() - started
    after = metric_values(llm)
    result.device_hit_tokens = after.get("vllm:prefix_cache_hits", 0.0) - before.get(
        "vllm:prefix_cache_hits", 0.0
    )
    result.tier_hit_tokens = after.get("vllm:kvtier_hit_tokens", 0.0) - before.get(
        "vllm:kvtier_hit_tokens", 0.0
    )
    shutdown(llm)
    return result


def _percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def format_table(results: Sequence[ArmResult]) -> str:
    """A side-by-side table of the arms' measurements."""
    rows: list[tuple[str, list[str]]] = [
        ("prompt tokens", [f"{r.prompt_tokens:,}" for r in results]),
        ("prefix hit tokens: device", [f"{r.device_hit_tokens:,.0f}" for r in results]),
        ("prefix hit tokens: tier", [f"{r.tier_hit_tokens:,.0f}" for r in results]),
        ("TTFT p50 (ms)", [f"{1000 * statistics.median(r.ttft_s):,.0f}" for r in results]),
        ("TTFT p90 (ms)", [f"{1000 * _percentile(r.ttft_s, 0.9):,.0f}" for r in results]),
        ("total time (s)", [f"{r.total_s:,.1f}" for r in results]),
    ]
    header = ["", *(r.name for r in results)]
    widths = [max(len(header[0]), *(len(label) for label, _ in rows))]
    for column, result in enumerate(results, start=1):
        widths.append(max(len(result.name), *(len(values[column - 1]) for _, values in rows)))
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for label, values in rows:
        cells = [label, *values]
        lines.append(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
            )
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=Workload.conversations)
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument(
        "--device-blocks",
        type=int,
        default=192,
        help="vLLM's own KV cache, in 32-token blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where to write the model (default: a temp dir)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # The arms batch differently (a tier hit skips most of a prefill), and CPU attention that
    # splits KV across threads rounds a request according to its batch and the core count.
    os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
    workload = Workload(conversations=args.conversations, turns=args.turns)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as scratch:
        model_dir = write_tiny_llama(args.model_dir or Path(scratch) / "model", DEMO_MODEL)
        block_bytes = DEMO_MODEL.kv_bytes_per_token(dtype_bytes=4) * 32
        print(
            f"kvtier demo: {workload.conversations} conversations x {workload.turns} turns; "
            f"vLLM KV cache {args.device_blocks} blocks "
            f"({args.device_blocks * block_bytes / 2**20:.0f} MiB)",
            flush=True,
        )
        plain = run_arm("vLLM", model_dir, workload, kvtier=None, device_blocks=args.device_blocks)
        tiered = run_arm(
            "vLLM + kvtier",
            model_dir,
            workload,
            kvtier={"cpu_bytes": "1GiB"},
            device_blocks=args.device_blocks,
        )
    print()
    print(format_table([plain, tiered]))
    same = plain.replies == tiered.replies
    print(f"\nreplies identical in both runs: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
