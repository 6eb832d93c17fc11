"""The quiet marks skip no work: random step sequences give the same plans, reports, stats
and events with the marks as with them forced off (vLLM 0.32 and 0.33)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

import kvtier.plugins  # noqa: E402
from kvtier.copy.base import Direction  # noqa: E402
from tests.support.faults import flaky_copy_registry  # noqa: E402
from tests.support.vllm_steps import StepsSpec, VllmSteps, write_model_config  # noqa: E402

pytestmark = pytest.mark.vllm033

BLOCK = 16
STEPS = 600


class NeverQuiet:
    """Mixed in before a manager's or worker's class: its mark reads ``False`` whatever is set."""

    quiet = property(lambda self: False, lambda self, value: None)


def force_slow_paths(engine: VllmSteps) -> None:
    """Make ``engine``'s manager and offload worker take every call's full path."""
    for held in (engine.connector.manager, engine.worker.worker.offload):
        base = type(held)
        held.__class__ = type(f"NeverQuiet{base.__name__}", (NeverQuiet, base), {})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama-config"))


@pytest.fixture
def engines() -> Iterator[list[VllmSteps]]:
    built: list[VllmSteps] = []
    yield built
    for engine in built:
        engine.close()


def observable(engine: VllmSteps, output: Any) -> dict[str, Any]:
    """What a step of ``engine`` showed the engine and the world, timings left out."""
    manager = engine.connector.manager
    stats = [
        {name: value for name, value in payload.items() if not name.endswith("_seconds")}
        for payload in engine.connector_stats
    ]
    return {
        "plan": output.kv_connector_metadata.plan,
        "outputs": {request_id: list(tokens) for request_id, tokens in engine.outputs.items()},
        "finished": set(engine.finished),
        "stats": stats,
        "events": [batch.events for batch in engine.events],
        "tier": manager.stats(),
        "tracked": (manager.num_requests, manager.num_inflight_batches),
        "tokens": engine.connector.scheduler.session.tokens.num_requests,
        "loaded": engine.loaded_blocks,
        "failed": engine.failed_blocks,
        "preemptions": engine.preemptions,
    }


@pytest.mark.parametrize("store_mode", ["eager", "lazy"])
@pytest.mark.parametrize("seed", [0, 1, 3])  # 3 aborts requests while their loads run
def test_marks_skip_nothing_the_full_paths_do(
    model_dir: Path,
    engines: list[VllmSteps],
    monkeypatch: pytest.MonkeyPatch,
    store_mode: str,
    seed: int,
) -> None:
    rng = random.Random(seed)
    # a load into a device block id divisible by 2 fails (alike in both engines); every copy
    # takes a few polls, so batches stay in flight across steps
    failing = flaky_copy_registry(
        fail=lambda batch: batch.direction is Direction.LOAD and batch.device_blocks[0] % 2 == 0,
        delay_polls=2,
    )
    monkeypatch.setattr(kvtier.plugins, "_default_registry", failing)
    config = {
        "cpu_bytes": "1MiB",
        "store_mode": store_mode,
        "copy": {"type": "flaky"},
        "cost_guard": False,  # its decisions follow measured times, which differ per engine
        "same_step_load_bytes": 0 if seed else "16MiB",  # hits load a step ahead, or in it
    }
    spec = StepsSpec(num_blocks=32, max_num_seqs=6, max_num_batched_tokens=128, kv_events=True)
    marked, forced = (VllmSteps(model_dir, config, spec) for _ in range(2))
    engines.extend([marked, forced])
    force_slow_paths(forced)
    past = [[rng.randrange(1000) for _ in range(4 * BLOCK)] for _ in range(3)]
    # lazy mode stores blocks as vLLM's cache evicts them; a reset forgets them before
    resets = 0.2 if store_mode == "eager" else 0.1
    quiet = 0
    for step in range(STEPS):
        event = rng.random()
        if event < 0.1:
            # past prompts' first blocks (a tier hit once vLLM's cache lost them), new tokens;
            # in bursts that outgrow the device cache, so that vLLM preempts some
            for _ in range(rng.randint(1, 4)):
                prompt = rng.choice(past)[: rng.randrange(BLOCK, 4 * BLOCK)]
                prompt += [rng.randrange(1000) for _ in range(rng.randrange(1, 2 * BLOCK))]
                past.append(prompt)
                max_tokens = rng.randrange(1, 2 * BLOCK)
                for engine in (marked, forced):
                    engine.add(prompt, max_tokens)
        elif event < resets:
            for engine in (marked, forced):
                engine.scheduler.reset_prefix_cache()
        elif event < resets + 0.01:
            for engine in (marked, forced):
                engine.connector.reset_cache()
        elif event < resets + 0.05 and marked.scheduler.requests:
            # a client goes away between steps
            request_id = rng.choice(sorted(marked.scheduler.requests))
            for engine in (marked, forced):
                engine.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        quiet += marked.connector.manager.quiet and marked.worker.worker.offload.quiet
        seen = [observable(engine, engine.step()) for engine in (marked, forced)]
        assert seen[0] == seen[1], f"step {step}"
    assert marked.mismatches == forced.mismatches == []
    assert quiet > STEPS // 6, f"only {quiet} of {STEPS} steps began quiet"
    assert marked.loaded_blocks > 0 and marked.failed_blocks > 0
