"""``kvtier bench codec``: record codecs measured on KV from a real model run.

The benchmark runs a causal language model through ``transformers`` on CPU
over ``--tokens`` prompt tokens, takes the K and V it computed, lays them out
as vLLM's FlashAttention cache does (``(2, num_blocks, block_tokens,
kv_heads, head_dim)`` per layer), resolves that layout like a worker would and
cuts it into block records. With no ``--model`` it writes kvtier's
random-weight Llama (:mod:`kvtier.integrations.checkpoints`) and runs that:
its KV is real-shaped and really computed, but its weights are random, so
its values are not those of a trained model; point ``--model`` at a trained
checkpoint to measure those.

For each codec (a registered name, with ``:key=value`` settings) it reports
the compression ratio (record bytes over stored bytes, a record the codec
cannot shrink counted at full size), encode and decode GB/s of record bytes on
one core (torch and the compressors held to one thread, timed in the thread's
CPU seconds so that other processes on a busy machine do not count; best of
``--repeats``), and for a lossy codec the largest and the mean absolute error
over every KV head of every layer, K and V apart, with the head where the
largest occurred; ``--json`` lists every head.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.cli.common import check_output_file, format_table
from kvtier.codecs.base import Codec, CodecSpec
from kvtier.kinds import RECORD_CODEC
from kvtier.layout.resolvers import PerLayerResolver
from kvtier.plugins import PluginError, default_registry

DEFAULT_CODECS = "lossless,fp8,int8"
BENCH_MODEL = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1024,
}
"""The random-weight Llama written when no ``--model`` is given: head_dim 64, 4 KV heads."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of ``kvtier bench codec``."""
    parser.add_argument(
        "--codecs",
        default=DEFAULT_CODECS,
        help="codecs to measure, comma separated, each NAME or NAME:KEY=VALUE[:KEY=VALUE]",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory or name (default: kvtier's random Llama)",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens run")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt's token ids")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is shown")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--output", default=None, help="also write the JSON report to this file")


@dataclass(frozen=True)
class ModelKV:
    """Block records of one model run, and the cache they were cut from."""

    model: str
    caches: dict[str, torch.Tensor]
    """Per layer, ``(2, num_blocks, block_tokens, kv_heads, head_dim)``."""
    spec: CodecSpec
    records: list[bytes]


def model_kv(args: argparse.Namespace) -> ModelKV:
    """Run the model over the prompt and cut its KV cache into block records."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codec-") as scratch:
        if args.model is None:
            from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

            source = str(write_tiny_llama(Path(scratch) / "model", TinyLlamaSpec(**BENCH_MODEL)))
            name = "kvtier random Llama " + ", ".join(f"{k}={v}" for k, v in BENCH_MODEL.items())
        else:
            source = name = args.model
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(
        1, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed)
    )
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    blocks = args.tokens // args.block_tokens
    tokens = blocks * args.block_tokens
    caches: dict[str, torch.Tensor] = {}
    for number, layer in enumerate(cache.layers):
        # (1, kv_heads, tokens, head_dim) -> (blocks, block_tokens, kv_heads, head_dim)
        halves = [
            part[0, :, :tokens]
            .reshape(part.shape[1], blocks, args.block_tokens, -1)
            .permute(1, 2, 0, 3)
            .contiguous()
            for part in (layer.keys, layer.values)
        ]
        caches[f"layers.{number}"] = torch.stack(halves)
    layout = PerLayerResolver("flash_attn").resolve(caches)
    records = [
        b"".join(region.view[block].numpy().tobytes() for region in layout.regions)
        for block in range(blocks)
    ]
    return ModelKV(name, caches, CodecSpec(layout.record_bytes, layout.record_regions), records)


def parse_codec(text: str) -> dict[str, Any]:
    """``NAME:KEY=VALUE:...`` as a codec config mapping."""
    name, *settings = text.split(":")
    config: dict[str, Any] = {"type": name}
    for setting in settings:
        key, _, value = setting.partition("=")
        config[key] = int(value) if value.isdigit() else value
    return config


def _best_seconds(action: Any, repeats: int) -> float:
    """The least CPU time of this thread that ``action`` took: on a busy machine, what one
    core of its own would take, where wall-clock time would count the other processes."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        action()
        best = min(best, time.thread_time() - start)
    return best


def measure(codec: Codec, kv: ModelKV, repeats: int) -> dict[str, Any]:
    """Ratio, one-core speeds and, for a lossy codec, errors per head of ``codec`` on ``kv``."""
    records = [memoryview(record) for record in kv.records]
    raw = sum(len(record) for record in records)
    encoded = [bytes(codec.encode(record)) for record in records]
    kept = [
        form if len(form) < len(record) else None
        for form, record in zip(encoded, records, strict=True)
    ]
    stored = sum(
        len(form) if form is not None else len(record)
        for form, record in zip(kept, records, strict=True)
    )
    encode_s = _best_seconds(lambda: [codec.encode(record) for record in records], repeats)
    forms = [memoryview(form) for form in kept if form is not None]
    decode_s = _best_seconds(lambda: [codec.decode(form) for form in forms], repeats)
    decoded_bytes = len(forms) * kv.spec.record_bytes
    result: dict[str, Any] = {
        "ratio": round(raw / stored, 3),
        "stored_as_is": sum(form is None for form in kept),
        "encode_gbps": round(raw / encode_s / 1e9, 3),
        "decode_gbps": round(decoded_bytes / decode_s / 1e9, 3) if forms else None,
        "lossless": codec.error_bound.lossless,
    }
    decoded = b"".join(
        bytes(codec.decode(memoryview(form))) if form is not None else bytes(record)
        for form, record in zip(kept, records, strict=True)
    )
    if codec.error_bound.lossless:
        result["exact"] = decoded == b"".join(kv.records)
        return result
    result["heads"] = head_errors(kv, decoded)
    worst = max(result["heads"], key=lambda head: head["max_abs_error"])
    result["max_abs_error"] = worst["max_abs_error"]
    result["worst_head"] = {key: worst[key] for key in ("layer", "kv", "head")}
    result["mean_abs_error"] = round(
        sum(head["mean_abs_error"] for head in result["heads"]) / len(result["heads"]), 6
    )
    return result


def head_errors(kv: ModelKV, decoded: bytes) -> list[dict[str, Any]]:
    """Largest and mean absolute error of each layer's K and V heads, with their magnitude."""
    offset = 0
    rows = []
    blocks = len(kv.records)
    record = torch.frombuffer(bytearray(decoded), dtype=torch.uint8).reshape(blocks, -1)
    for layer, cache in kv.caches.items():
        for half, name in enumerate("KV"):
            original = cache[half]
            width = original[0].numel() * original.element_size()
            got = record[:, offset : offset + width].contiguous().view(original.dtype)
            got = got.reshape(original.shape)
            offset += width
            error = (got.float() - original.float()).abs()
            for head in range(original.shape[2]):
                rows.append(
                    {
                        "layer": layer,
                        "kv": name,
                        "head": head,
                        "max_abs_value": round(float(original[:, :, head].abs().max()), 6),
                        "max_abs_error": round(float(error[:, :, head].max()), 6),
                        "mean_abs_error": round(float(error[:, :, head].mean()), 6),
                    }
                )
    return rows


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table or JSON.

    Returns:
        0 on success, 1 if a codec cannot be built or the report written, 2 for invalid
        arguments.
    """
    if args.tokens < args.block_tokens or args.block_tokens < 1 or args.repeats < 1:
        print(
            "kvtier bench codec: --tokens must be at least --block-tokens, both and --repeats "
            "positive",
            file=sys.stderr,
        )
        return 2
    if args.output is not None:
        check_output_file(args.output)
    torch.set_num_threads(1)
    registry = default_registry()
    configs = {}
    for text in args.codecs.split(","):
        config = parse_codec(text)
        try:  # checked before the model runs, so a typo fails at once
            registration = registry.get(RECORD_CODEC, config["type"])
            configs[text] = registration.config_model.model_validate(config)
        except (PluginError, ValueError) as exc:
            print(f"kvtier bench codec: {text}: {exc}", file=sys.stderr)
            return 1
    kv = model_kv(args)
    results = []
    for text, config in configs.items():
        try:
            codec = registry.build(RECORD_CODEC, config, kv.spec)
        except (ImportError, ValueError) as exc:
            print(f"kvtier bench codec: {text}: {exc}", file=sys.stderr)
            return 1
        results.append({"codec": text, **measure(codec, kv, args.repeats)})
    report = {
        "benchmark": "codec",
        "model": kv.model,
        "tokens": len(kv.records) * args.block_tokens,
        "block_tokens": args.block_tokens,
        "record_bytes": kv.spec.record_bytes,
        "records": len(kv.records),
        "threads": 1,
        "statistic": (
            "GB/s of record bytes per CPU second of one thread, best of repeats; errors over "
            "every value of a head"
        ),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text if args.json else _table(report))
    if args.output is not None:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            print(
                f"kvtier bench codec: cannot write {args.output}: {exc.strerror}", file=sys.stderr
            )
            return 1
    return 0


def _table(report: dict[str, Any]) -> str:
    heading = (
        f"{report['model']}: {report['records']} records of {report['record_bytes']} bytes "
        f"({report['block_tokens']} tokens each), GB/s per CPU second of one core, best of repeats"
    )
    rows = [["CODEC", "RATIO", "ENCODE GB/S", "DECODE GB/S", "MAX ABS ERR", "MEAN ABS ERR"]]
    for result in report["results"]:
        lossless = result["lossless"]
        rows.append(
            [
                result["codec"],
                str(result["ratio"]),
                str(result["encode_gbps"]),
                str(result["decode_gbps"]),
                "0 (exact)" if lossless else str(result["max_abs_error"]),
                "0 (exact)" if lossless else str(result["mean_abs_error"]),
            ]
        )
    return f"{heading}\n{format_table(rows)}"
