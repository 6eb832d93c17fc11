"""End to end: real vLLM on CPU, a random-weight Llama, kvtier loaded by module path."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvtier.config import ConfigError  # noqa: E402
from kvtier.testing.models import TinyLlamaSpec, write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32
MIB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _in_process_engines() -> Iterator[None]:
    """One process for every engine: a few seconds per engine instead of half a minute."""
    saved = {
        k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")
    }
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), TinyLlamaSpec()))


def _engine(model_dir: str, kvtier: dict | None, **kwargs: object):  # noqa: ANN202
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs

    return LLM(**engine_kwargs(model_dir, kvtier=kvtier, **kwargs))


def _tier(llm):  # noqa: ANN001, ANN202
    """The scheduler connector's offload manager of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.manager


def _random_prompts(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    return [[rng.randrange(1000) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def _shared_prefix_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts that share one of a few prefixes, cut at random lengths, plus a private tail."""
    prefixes = _random_prompts(rng, 6, 200, 400)
    prompts = []
    for _ in range(count):
        prefix = rng.choice(prefixes)
        cut = rng.randrange(BLOCK, len(prefix))
        prompts.append(prefix[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(1, 48))])
    return prompts


CHURN_PROMPTS = _shared_prefix_prompts(random.Random(3), 240)
PREEMPT_PROMPTS = _random_prompts(random.Random(4), 24, 300, 600)


@pytest.fixture(scope="module")
def expected(model_dir: str) -> dict[str, list[list[int]]]:
    """Outputs of vLLM without the connector, with a device cache big enough for everything.

    Computed up front: vLLM keeps one worker connector per process, so engines
    with and without kvtier cannot be alive at the same time.
    """
    from kvtier.integrations.vllm.offline import generate, shutdown

    llm = _engine(model_dir, None, num_device_blocks=1024)
    try:
        return {
            "churn": generate(llm, CHURN_PROMPTS, max_tokens=4),
            "preempt": generate(llm, PREEMPT_PROMPTS, max_tokens=24),
        }
    finally:
        shutdown(llm)


def test_accuracy_from_the_tier(model_dir: str) -> None:
    from kvtier.integrations.vllm.offline import (
        generate,
        metric_values,
        reset_device_cache,
        shutdown,
    )

    llm = _engine(model_dir, {"cpu_bytes": 64 * MIB}, num_device_blocks=256)
    try:
        prompts = _random_prompts(random.Random(1), 8, 100, 600)
        cold = generate(llm, prompts, max_tokens=12)
        reset_device_cache(llm)
        before = metric_values(llm)
        warm = generate(llm, prompts, max_tokens=12)
        after = metric_values(llm)
        assert warm == cold
        full_blocks = sum(len(p) // BLOCK for p in prompts)
        hit_tokens = after["vllm:kvtier_hit_tokens"] - before.get("vllm:kvtier_hit_tokens", 0)
        assert hit_tokens == full_blocks * BLOCK
        assert after["vllm:kvtier_loaded_blocks"] - before.get("vllm:kvtier_loaded_blocks", 0) == (
            full_blocks
        )
        external = after["vllm:external_prefix_cache_hits"]
        assert external - before.get("vllm:external_prefix_cache_hits", 0) == hit_tokens
    finally:
        shutdown(llm)


def test_lazy_mode_serves_blocks_flushed_from_the_device(model_dir: str) -> None:
    from kvtier.integrations.vllm.offline import generate, settle, shutdown

    llm = _engine(
        model_dir,
        {"cpu_bytes": 64 * MIB, "store_mode": "lazy"},
        num_device_blocks=80,
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    try:
        rng = random.Random(2)
        prompts = _random_prompts(rng, 4, 200, 500)
        cold = generate(llm, prompts, max_tokens=8)
        tier = _tier(llm)
        for _ in range(3):  # filler requests push the prompts' blocks out of the device cache
            generate(llm, _random_prompts(rng, 4, 500, 600), max_tokens=1)
        settle(llm)
        assert tier.stats().stored_blocks > 0
        hits_before = tier.stats().hit_tokens
        warm = generate(llm, prompts, max_tokens=8)
        assert warm == cold
        assert tier.stats().hit_tokens - hits_before >= BLOCK * len(prompts)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def small_engine(model_dir: str, expected: dict[str, list[list[int]]]) -> Iterator[object]:
    """kvtier with a host tier smaller than the working set and a device cache that preempts."""
    from kvtier.integrations.vllm.offline import shutdown

    record_bytes = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
    llm = _engine(
        model_dir,
        {"cpu_bytes": 40 * record_bytes},
        num_device_blocks=48,
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    yield llm
    shutdown(llm)


def test_churn_through_a_small_tier(
    expected: dict[str, list[list[int]]], small_engine: object
) -> None:
    from kvtier.integrations.vllm.offline import generate, settle

    prompts = CHURN_PROMPTS
    got: list[list[int]] = []
    for start in range(0, len(prompts), 16):  # waves, so later waves hit what earlier ones stored
        got.extend(generate(small_engine, prompts[start : start + 16], max_tokens=4))
        settle(small_engine)
    assert got == expected["churn"]
    stats = _tier(small_engine).stats()
    assert stats.evicted_blocks > 0, "the tier was meant to be smaller than the working set"
    assert stats.loaded_blocks > 0
    assert stats.failed_loads == 0 and stats.failed_stores == 0


def test_preemption_keeps_outputs_identical(
    expected: dict[str, list[list[int]]], small_engine: object
) -> None:
    from kvtier.integrations.vllm.offline import generate, metric_values

    before = metric_values(small_engine).get("vllm:num_preemptions", 0)
    got = generate(small_engine, PREEMPT_PROMPTS, max_tokens=24)
    assert metric_values(small_engine)["vllm:num_preemptions"] > before, "nothing was preempted"
    assert got == expected["preempt"]


def test_bad_extra_config_fails_at_start_with_config_lines(model_dir: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _engine(model_dir, {"cpu_bytes": -1, "store_mode": "sometimes"}, num_device_blocks=256)
    lines = raised.value.lines
    assert any(line.startswith("explicit: cpu_bytes: ") for line in lines), lines
    assert any(line.startswith("explicit: store_mode: ") for line in lines), lines


def test_multiprocess_engine_accuracy(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduler and worker in different processes: the plan and reports cross by pickle."""
    from kvtier.integrations.vllm.offline import (
        generate,
        metric_values,
        reset_device_cache,
        shutdown,
    )

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = _engine(model_dir, {"cpu_bytes": 64 * MIB}, num_device_blocks=256)
    try:
        prompts = _random_prompts(random.Random(5), 4, 100, 400)
        cold = generate(llm, prompts, max_tokens=8)
        reset_device_cache(llm)
        warm = generate(llm, prompts, max_tokens=8)
        assert warm == cold
        assert metric_values(llm).get("vllm:kvtier_hit_tokens", 0) > 0
    finally:
        shutdown(llm)
