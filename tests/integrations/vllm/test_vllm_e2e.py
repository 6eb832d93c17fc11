"""End to end: real vLLM on CPU, a random-weight Llama, kvtier loaded by module path."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import pytest
from pydantic import Field

import kvtier
import kvtier.plugins
from kvtier.config import ConfigError, PluginConfig
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.integrations.checkpoints import TinyLlamaSpec
from kvtier.kinds import COPY_BACKEND
from kvtier.plugins import build_plugin_manager, collect, default_registry
from tests.integrations.vllm.conftest import BLOCK, MIB, manager_of, random_prompts, start_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]


def _shared_prefix_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts that share one of a few prefixes, cut at random lengths, plus a private tail."""
    prefixes = random_prompts(rng, 6, 200, 400)
    prompts = []
    for _ in range(count):
        prefix = rng.choice(prefixes)
        cut = rng.randrange(BLOCK, len(prefix))
        prompts.append(prefix[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(1, 48))])
    return prompts


CHURN_PROMPTS = _shared_prefix_prompts(random.Random(3), 240)
PREEMPT_PROMPTS = random_prompts(random.Random(4), 24, 300, 600)

SMALL_DEVICE: dict[str, int] = {
    "num_device_blocks": 48,
    "max_model_len": 1024,
    "max_num_batched_tokens": 1024,
    "max_num_seqs": 32,
}
"""vLLM's own cache and scheduler limits in the small-tier tests and in their baseline: a
device cache that holds three or four of PREEMPT_PROMPTS at a time, so decoding preempts."""


def _churn(llm) -> list[list[int]]:  # noqa: ANN001
    """CHURN_PROMPTS in waves of 16, settling in between, so later waves hit what earlier stored."""
    from kvtier.integrations.vllm.offline import generate, settle

    got: list[list[int]] = []
    for start in range(0, len(CHURN_PROMPTS), 16):
        got.extend(generate(llm, CHURN_PROMPTS[start : start + 16], max_tokens=4))
        settle(llm)
    return got


def _preempting_run(llm) -> tuple[list[list[int]], float]:  # noqa: ANN001
    """Outputs of PREEMPT_PROMPTS, submitted together, and the preemptions vLLM counted."""
    from kvtier.integrations.vllm.offline import generate, metric_values

    before = metric_values(llm).get("vllm:num_preemptions", 0)
    got = generate(llm, PREEMPT_PROMPTS, max_tokens=24)
    return got, metric_values(llm).get("vllm:num_preemptions", 0) - before


@dataclass(frozen=True)
class Baseline:
    """What vLLM without the connector answered under the small-tier tests' conditions."""

    churn: list[list[int]]
    preempt: list[list[int]]
    preemptions: float


@pytest.fixture(scope="module")
def vanilla_small(model_dir: str) -> Baseline:
    """vLLM without the connector, run exactly as ``small_engine`` is run.

    Same device cache, scheduler limits, prompts, waves and submission order, so the
    outputs may only differ by what kvtier does. A baseline with room for everything would
    not preempt, and would compare vLLM's recompute after a preemption with its original
    decode rather than kvtier with vLLM. Computed up front: vLLM keeps one worker connector
    per process, so engines with and without kvtier cannot be alive at the same time.
    """
    from kvtier.integrations.vllm.offline import shutdown

    llm = start_engine(model_dir, None, **SMALL_DEVICE)
    try:
        churn = _churn(llm)
        preempt, preemptions = _preempting_run(llm)
    finally:
        shutdown(llm)
    return Baseline(churn, preempt, preemptions)


@pytest.fixture(scope="class")
def eager_engine(model_dir: str) -> Iterator[object]:
    """kvtier in eager mode with room for everything, publishing KV-cache events."""
    from vllm.config import KVEventsConfig

    from kvtier.integrations.vllm.offline import shutdown

    llm = start_engine(
        model_dir,
        {"cpu_bytes": 64 * MIB},
        num_device_blocks=256,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    yield llm
    shutdown(llm)


class TestEagerEngine:
    """One eager-mode engine with room for everything; stopped before the next engine starts."""

    def test_accuracy_from_the_tier(self, eager_engine: object) -> None:
        from kvtier.integrations.vllm.offline import generate, metric_values, reset_device_cache

        prompts = random_prompts(random.Random(1), 8, 100, 600)
        cold = generate(eager_engine, prompts, max_tokens=12)
        reset_device_cache(eager_engine)
        before = metric_values(eager_engine)
        warm = generate(eager_engine, prompts, max_tokens=12)
        after = metric_values(eager_engine)
        assert warm == cold

        def grew(name: str) -> float:
            return after[name] - before.get(name, 0)

        full_blocks = sum(len(p) // BLOCK for p in prompts)
        assert grew("vllm:kvtier_hit_tokens") == full_blocks * BLOCK
        assert grew("vllm:kvtier_loaded_blocks") == full_blocks
        assert grew("vllm:external_prefix_cache_hits") == full_blocks * BLOCK

    def test_attention_layers_make_no_per_layer_call(
        self, eager_engine: object, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from kvtier.integrations.vllm.connector import KVTierConnector
        from kvtier.integrations.vllm.offline import generate, reset_device_cache

        calls: list[str] = []
        for hook in ("wait_for_layer_load", "save_kv_layer"):
            monkeypatch.setattr(
                KVTierConnector, hook, lambda self, name, *_, **__: calls.append(name)
            )
        prompts = random_prompts(random.Random(9), 2, 100, 200)
        cold = generate(eager_engine, prompts, max_tokens=4)
        reset_device_cache(eager_engine)
        assert generate(eager_engine, prompts, max_tokens=4) == cold
        assert calls == [], "vLLM called a per-layer hook"

    def test_block_completed_in_the_finishing_step_is_stored(self, eager_engine: object) -> None:
        """Output token 63 fills block 1 in the request's last step; the tier must still get it."""
        from kvtier.integrations.vllm.offline import generate, reset_device_cache, settle

        prompt = random_prompts(random.Random(6), 1, 60, 61)[0]
        (reply,) = generate(eager_engine, [prompt], max_tokens=5)  # computes KV of tokens 0..63
        settle(eager_engine)
        reset_device_cache(eager_engine)
        tier = manager_of(eager_engine)
        hits_before = tier.stats().hit_tokens
        extended = prompt + reply[:4] + [7, 8, 9]
        generate(eager_engine, [extended], max_tokens=1)
        assert tier.stats().hit_tokens - hits_before == 2 * BLOCK

    def test_kv_cache_events_name_stored_blocks(self, eager_engine: object) -> None:
        from kvtier.integrations.vllm.offline import generate, settle

        scheduler = eager_engine.llm_engine.engine_core.engine_core.scheduler
        published = []
        publish = scheduler.kv_event_publisher.publish
        scheduler.kv_event_publisher.publish = lambda batch: (
            published.append(batch) or publish(batch)
        )
        try:
            prompt = random_prompts(random.Random(7), 1, 3 * BLOCK + 5, 3 * BLOCK + 6)[0]
            generate(eager_engine, [prompt], max_tokens=1)
            settle(eager_engine)
        finally:
            scheduler.kv_event_publisher.publish = publish
        stored = [
            event
            for batch in published
            for event in batch.events
            if type(event).__name__ == "BlockStored" and event.medium == "CPU"
        ]
        assert [event.token_ids for event in stored] == [
            prompt[i * BLOCK : (i + 1) * BLOCK] for i in range(3)
        ]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]

    def test_reset_cache_empties_the_tier(self, eager_engine: object) -> None:
        from kvtier.integrations.vllm.offline import generate, reset_device_cache, settle

        prompts = random_prompts(random.Random(8), 2, 100, 200)
        generate(eager_engine, prompts, max_tokens=1)
        settle(eager_engine)
        tier = manager_of(eager_engine)
        assert tier.stats().used_blocks > 0
        assert eager_engine.reset_prefix_cache(reset_connector=True)
        assert tier.stats().used_blocks == 0
        reset_device_cache(eager_engine)
        hits_before = tier.stats().hit_tokens
        generate(eager_engine, prompts, max_tokens=1)
        assert tier.stats().hit_tokens == hits_before

    def test_per_request_control_stops_loads_and_stores(
        self, eager_engine: object, caplog: pytest.LogCaptureFixture
    ) -> None:
        from kvtier.integrations.vllm.offline import generate, reset_device_cache, settle

        tier = manager_of(eager_engine)
        prompts = random_prompts(random.Random(10), 4, 100, 300)
        full_blocks = sum(len(p) // BLOCK for p in prompts)
        stored = tier.stats().stored_blocks
        cold = _generate_with(eager_engine, prompts, {"kvtier": {"store": False}})
        settle(eager_engine)
        assert tier.stats().stored_blocks == stored, "a request that may not store stored"
        assert generate(eager_engine, prompts, max_tokens=4) == cold
        settle(eager_engine)
        assert tier.stats().stored_blocks == stored + full_blocks
        reset_device_cache(eager_engine)
        hits = tier.stats().hit_tokens
        assert _generate_with(eager_engine, prompts, {"kvtier": {"load": False}}) == cold
        assert tier.stats().hit_tokens == hits, "a request that may not load loaded"
        # An invalid entry is logged and the request served without control: it hits.
        reset_device_cache(eager_engine)
        with caplog.at_level("WARNING", logger="kvtier"):
            invalid = {"kvtier": {"load": False, "pin_s": -1}}
            assert _generate_with(eager_engine, prompts, invalid) == cold
        assert tier.stats().hit_tokens == hits + full_blocks * BLOCK
        assert (
            "kv_transfer_params: kvtier.pin_s: Input should be greater than 0 (got -1); "
            "served without kvtier control" in caplog.text
        )


def _generate_with(llm: object, prompts: list[list[int]], params: dict) -> list[list[int]]:
    """Greedy outputs of ``prompts``, each request carrying ``params`` as kv_transfer_params."""
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        detokenize=False,
        extra_args={"kv_transfer_params": params},
    )
    outputs = llm.generate(  # type: ignore[attr-defined]
        [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
    )
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_lazy_mode_serves_blocks_flushed_from_the_device(model_dir: str) -> None:
    from kvtier.integrations.vllm.offline import generate, settle, shutdown

    llm = start_engine(
        model_dir,
        {"cpu_bytes": 64 * MIB, "store_mode": "lazy"},
        num_device_blocks=80,
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    try:
        rng = random.Random(2)
        prompts = random_prompts(rng, 4, 200, 500)
        cold = generate(llm, prompts, max_tokens=8)
        tier = manager_of(llm)
        for _ in range(3):  # filler requests push the prompts' blocks out of the device cache
            generate(llm, random_prompts(rng, 4, 500, 600), max_tokens=1)
        settle(llm)
        assert tier.stats().stored_blocks > 0
        hits_before = tier.stats().hit_tokens
        warm = generate(llm, prompts, max_tokens=8)
        assert warm == cold
        assert tier.stats().hit_tokens - hits_before >= BLOCK * len(prompts)
    finally:
        shutdown(llm)


@pytest.fixture(scope="class")
def small_engine(model_dir: str, vanilla_small: Baseline) -> Iterator[object]:
    """kvtier with a host tier smaller than the working set and a device cache that preempts."""
    from kvtier.integrations.vllm.offline import shutdown

    record_bytes = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
    llm = start_engine(model_dir, {"cpu_bytes": 40 * record_bytes}, **SMALL_DEVICE)
    yield llm
    shutdown(llm)


class TestSmallTier:
    """A tier smaller than the working set and a device cache small enough to preempt."""

    def test_churn_through_a_small_tier(
        self, vanilla_small: Baseline, small_engine: object
    ) -> None:
        assert _churn(small_engine) == vanilla_small.churn
        stats = manager_of(small_engine).stats()
        assert stats.evicted_blocks > 0, "the tier was meant to be smaller than the working set"
        assert stats.loaded_blocks > 0
        assert stats.load_failures == 0 and stats.store_failures == 0

    def test_preemption_keeps_outputs_identical(
        self, vanilla_small: Baseline, small_engine: object
    ) -> None:
        got, preemptions = _preempting_run(small_engine)
        assert vanilla_small.preemptions > 0, "the baseline was meant to preempt"
        assert preemptions > 0, "nothing was preempted"
        assert got == vanilla_small.preempt


def test_bad_extra_config_fails_at_start_with_config_lines(model_dir: str) -> None:
    with pytest.raises(ConfigError) as raised:
        start_engine(model_dir, {"cpu_bytes": -1, "store_mode": "sometimes"}, num_device_blocks=256)
    lines = raised.value.lines
    assert any(line.startswith("explicit: cpu_bytes: ") for line in lines), lines
    assert any(line.startswith("explicit: store_mode: ") for line in lines), lines
    # vLLM repeats the error in every process's traceback; the lines are logged once instead.
    assert "store_mode" not in str(raised.value)


def test_host_tier_larger_than_memory_is_refused_before_it_is_allocated(model_dir: str) -> None:
    from kvtier.integrations.vllm.connector import ConfigRefused

    with pytest.raises(ConfigRefused) as raised:
        start_engine(model_dir, {"cpu_bytes": "4096TiB"}, num_device_blocks=256)
    (line,) = raised.value.lines
    assert line.startswith(f"explicit: cpu_bytes: the host tier needs {4096 * 2**40} bytes"), line
    assert "of memory available on this machine" in line
    assert "cpu_bytes" not in str(raised.value)


def test_multiprocess_engine_accuracy(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduler and worker in different processes: the plan and reports cross by pickle."""
    from vllm.v1.metrics.reader import Histogram

    from kvtier.integrations.vllm.offline import (
        generate,
        metric_values,
        reset_device_cache,
        shutdown,
    )

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = start_engine(model_dir, {"cpu_bytes": 64 * MIB}, num_device_blocks=256)
    try:
        idle = metric_values(llm)
        assert idle["vllm:kvtier_capacity_bytes"] == 64 * MIB, "published before any request"
        assert idle["vllm:kvtier_used_blocks"] == 0 and idle["vllm:kvtier_failures"] == 0
        prompts = random_prompts(random.Random(5), 4, 100, 400)
        cold = generate(llm, prompts, max_tokens=8)
        reset_device_cache(llm)
        warm = generate(llm, prompts, max_tokens=8)
        assert warm == cold
        assert metric_values(llm).get("vllm:kvtier_hit_tokens", 0) > 0
        # the histograms crossed from the engine process to this one with the other stats
        counts = {m.name: m.count for m in llm.get_metrics() if isinstance(m, Histogram)}
        for name in ("load_seconds", "store_seconds", "load_batch_blocks", "store_batch_blocks"):
            assert counts[f"vllm:kvtier_{name}"] > 0, name
        assert counts["vllm:kvtier_request_hit_tokens"] == 2 * len(prompts)
    finally:
        shutdown(llm)


class FlakyCopyConfig(PluginConfig):
    """A torch copy backend whose loads fail: the test's stand-in for a broken tier."""

    type: Literal["flaky"] = Field(default="flaky", description="Use the failing test backend.")


class _FailingLoads(CopyBackend):
    def __init__(self, inner: CopyBackend) -> None:
        self.inner = inner

    def submit(self, batch: CopyBatch) -> CopyHandle:
        if batch.direction is Direction.LOAD:
            raise CopyError(f"injected failure of a {len(batch)}-block load")
        return self.inner.submit(batch)

    def done(self, handle: CopyHandle) -> bool:
        return self.inner.done(handle)

    def wait(self, handle: CopyHandle) -> None:
        self.inner.wait(handle)

    def close(self) -> None:
        self.inner.close()


class _FlakyPlugin:
    @kvtier.hookimpl
    def register_copy_backends(self, register: Callable[..., None]) -> None:
        def build(config: FlakyCopyConfig, layout: object, host_buffer: object) -> CopyBackend:
            torch_backend = default_registry().get(COPY_BACKEND, "torch")
            return _FailingLoads(
                torch_backend.factory(torch_backend.config_model(), layout, host_buffer)
            )

        register("flaky", build, FlakyCopyConfig)


def test_failed_loads_are_recomputed(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.integrations.vllm.offline import generate, reset_device_cache, shutdown

    manager = build_plugin_manager()
    manager.register(_FlakyPlugin(), name="flaky-test-plugin")
    # The connector builds from the process's default registry; give it one with the plugin.
    monkeypatch.setattr(kvtier.plugins, "_default_registry", collect(manager))
    llm = start_engine(
        model_dir, {"cpu_bytes": 64 * MIB, "copy": {"type": "flaky"}}, num_device_blocks=256
    )
    try:
        prompts = random_prompts(random.Random(9), 4, 100, 400)
        cold = generate(llm, prompts, max_tokens=8)
        reset_device_cache(llm)
        warm = generate(llm, prompts, max_tokens=8)
        assert warm == cold
        stats = manager_of(llm).stats()
        assert stats.hit_tokens > 0, "the tier was meant to offer hits"
        assert stats.loaded_blocks == 0
        assert stats.load_failures == stats.hit_tokens // BLOCK
    finally:
        shutdown(llm)


def test_without_prefix_caching_the_connector_stands_aside(model_dir: str) -> None:
    from kvtier.integrations.vllm.offline import generate, shutdown

    llm = start_engine(
        model_dir, {"cpu_bytes": 64 * MIB}, num_device_blocks=256, enable_prefix_caching=False
    )
    try:
        prompts = random_prompts(random.Random(10), 2, 100, 200)
        assert generate(llm, prompts, max_tokens=4) == generate(llm, prompts, max_tokens=4)
        assert manager_of(llm) is None
    finally:
        shutdown(llm)
