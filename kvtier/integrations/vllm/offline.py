"""Offline vLLM engines with and without kvtier, as the tests, the demo and the benchmark run them.

Everything here drives ``vllm.LLM`` with token-id prompts and greedy sampling,
so runs with and without the connector can be compared token for token.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

from kvtier.integrations.serve import transfer_config_fields

logger = logging.getLogger(__name__)

CPU_BLOCK_TOKENS = 32
"""vLLM's CPU attention needs blocks of a multiple of 32 tokens."""


def kv_transfer_config(kvtier_config: Mapping[str, Any]) -> KVTransferConfig:
    """vLLM's transfer config that loads kvtier with ``kvtier_config`` as its extra config."""
    return KVTransferConfig(**transfer_config_fields(kvtier_config))


def engine_kwargs(
    model_dir: str | Path,
    *,
    kvtier: Mapping[str, Any] | None,
    num_device_blocks: int | None = None,
    max_model_len: int = 2048,
    block_tokens: int = CPU_BLOCK_TOKENS,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a small token-id model, optionally with kvtier.

    Args:
        model_dir: A checkpoint directory (see :mod:`kvtier.integrations.checkpoints`).
        kvtier: kvtier's config (``kv_connector_extra_config``), or ``None`` for no connector.
        num_device_blocks: Size of vLLM's own KV cache in blocks; vLLM sizes it if ``None``.
        max_model_len: Longest sequence, in tokens.
        block_tokens: Tokens per KV block.
        **overrides: Any other ``vllm.LLM`` argument.
    """
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": block_tokens,
        "max_model_len": max_model_len,
        "dtype": "bfloat16",
        "seed": 0,
        "gpu_memory_utilization": 0.3,
        "disable_log_stats": False,
        "num_gpu_blocks_override": num_device_blocks,
    }
    if kvtier is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(kvtier)
    kwargs.update(overrides)
    return kwargs


def greedy(max_tokens: int) -> SamplingParams:
    """Deterministic sampling that returns token ids only."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)


def generate(
    llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int, *, use_tqdm: bool = False
) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (token ids), in prompt order."""
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts], greedy(max_tokens), use_tqdm=use_tqdm
    )
    return [list(output.outputs[0].token_ids) for output in outputs]


def settle(llm: LLM, timeout_s: float = 30.0) -> None:
    """Let the engine finish the work it does after the last request returned.

    Finished requests whose last blocks are still being stored hold their
    device blocks until the stores are reported, one engine step later. A
    served (multiprocess) engine keeps stepping on its own; an in-process one
    only steps when asked, so this steps it until the scheduler is idle.

    Raises:
        TimeoutError: The engine still had work after ``timeout_s``.
    """
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    deadline = time.monotonic() + timeout_s
    if core is None:
        # Multiprocess engine: its busy loop drains on its own; give it a moment.
        time.sleep(0.2)
        return
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still had requests after {timeout_s} s")
        llm.llm_engine.step()


def reset_device_cache(llm: LLM, timeout_s: float = 30.0) -> None:
    """Empty vLLM's own prefix cache (not kvtier's), once held blocks are released.

    Raises:
        TimeoutError: vLLM still refused after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    settle(llm, timeout_s)
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM's prefix cache could not be reset within {timeout_s} s")
        settle(llm, timeout_s)


def metric_values(llm: LLM) -> dict[str, float]:
    """Current value of every counter and gauge vLLM exports, by Prometheus name (unlabelled)."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            values[metric.name] = values.get(metric.name, 0.0) + float(value)
    return values


def shutdown(llm: LLM) -> None:
    """Stop an engine and release vLLM's process-wide connector, so another engine can start.

    vLLM keeps one worker-side connector per process; an in-process engine
    that is only garbage-collected leaves it behind for the next engine.
    """
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
