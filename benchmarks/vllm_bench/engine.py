"""What the vLLM benchmarks share: the random-weight model, the engines' environment, random
prompts, and timing a batch by wall and CPU time."""

from __future__ import annotations

import os
import random
import resource
import time

from kvtier.integrations.checkpoints import TinyLlamaSpec

MODEL = TinyLlamaSpec(
    num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024
)
BLOCK_TOKENS = 32


def engine_env(*, throughput_process: bool = False) -> None:
    """Settings for the engines of this process, before torch loads its OpenMP runtime.

    The TTFT, busy and lower-tier parts run their engine in the benchmark's own
    process with OpenMP's default wait policy, as vLLM runs. A throughput engine
    process (``throughput_process``) shares the cores with the benchmark's other
    processes, and its OpenMP threads sleep as soon as they wait: threads that spin
    made whole rounds 10 to 20 times slower whenever another process (the idle
    engine of the other arm included) held one of the two cores.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM logs to stdout, which carries the JSON result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if throughput_process:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    """``tokens`` random token ids of the model's vocabulary."""
    return [rng.randrange(MODEL.vocab_size) for _ in range(tokens)]


def timed_generate(llm: object, prompts: list[list[int]], max_tokens: int) -> float:
    """Wall seconds of one ``generate`` of ``prompts``."""
    from kvtier.integrations.vllm.offline import generate

    started = time.perf_counter()
    generate(llm, prompts, max_tokens)  # type: ignore[arg-type]
    return time.perf_counter() - started


def cpu_s() -> float:
    """CPU seconds of every thread of this process and of its reaped children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
