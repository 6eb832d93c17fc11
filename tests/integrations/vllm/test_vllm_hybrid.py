"""End to end on a hybrid model: sliding-window and full attention layers, two kv-cache groups.

A random-weight Gemma3-style model (layers alternate ``sliding_attention`` and
``full_attention``) gives vLLM two kv-cache groups. Every kvtier run is
compared with vanilla vLLM run the same way (device cache, scheduler limits,
prompts and their order), and counts what each group stored and loaded.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvtier.integrations.checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.integrations.vllm.conftest import BLOCK, MIB, manager_of, random_prompts, start_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]

SPEC = TinyGemma3Spec()
WINDOW_BLOCKS = -(-SPEC.sliding_window // BLOCK)
"""Blocks before a hit point that a sliding-window layer reads (its window, in whole blocks)."""
SLIDING, FULL = 0, 1
"""vLLM's kv-cache groups of the model, in its order."""

DEVICE: dict[str, object] = {
    "dtype": "float32",
    "num_device_blocks": 28,
    "max_model_len": 256,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
}
"""One device cache for every engine of the module: small enough to evict and to preempt
(about a dozen blocks per group), and a token budget that prefills REPEAT_PROMPTS in one step."""

REPEAT_PROMPTS = random_prompts(random.Random(21), 3, 70, 160)
FILLER_PROMPTS = [random_prompts(random.Random(22 + i), 1, 100, 120) for i in range(4)]
"""One short prompt a step: lazy mode stores a block at vLLM's eviction frontier in the step
before it is reused, and a step that took the whole device cache at once would leave none."""
PREEMPT_PROMPTS = random_prompts(random.Random(24), 6, 90, 180)
MAX_TOKENS = 6
PREEMPT_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), SPEC))


def _repeat(llm) -> tuple[list[list[int]], list[list[int]]]:  # noqa: ANN001
    """REPEAT_PROMPTS, then again after vLLM's own prefix cache was emptied."""
    from kvtier.integrations.vllm.offline import generate, reset_device_cache

    cold = generate(llm, REPEAT_PROMPTS, max_tokens=MAX_TOKENS)
    reset_device_cache(llm)
    return cold, generate(llm, REPEAT_PROMPTS, max_tokens=MAX_TOKENS)


def _flushed(llm) -> tuple[list[list[int]], list[list[int]]]:  # noqa: ANN001
    """REPEAT_PROMPTS, then again after long fillers pushed them out of the device cache."""
    from kvtier.integrations.vllm.offline import generate, settle

    cold = generate(llm, REPEAT_PROMPTS, max_tokens=MAX_TOKENS)
    for fillers in FILLER_PROMPTS:
        generate(llm, fillers, max_tokens=1)
    settle(llm)
    return cold, generate(llm, REPEAT_PROMPTS, max_tokens=MAX_TOKENS)


def _preempting(llm) -> tuple[list[list[int]], float]:  # noqa: ANN001
    from kvtier.integrations.vllm.offline import generate, metric_values

    before = metric_values(llm).get("vllm:num_preemptions", 0)
    got = generate(llm, PREEMPT_PROMPTS, max_tokens=PREEMPT_TOKENS)
    return got, metric_values(llm).get("vllm:num_preemptions", 0) - before


@dataclass(frozen=True)
class Vanilla:
    repeat: tuple[list[list[int]], list[list[int]]]
    flushed: tuple[list[list[int]], list[list[int]]]
    preempt: list[list[int]]
    preemptions: float


@pytest.fixture(scope="module")
def vanilla(model_dir: str) -> Vanilla:
    """vLLM without the connector, through every scenario the kvtier engines run."""
    from kvtier.integrations.vllm.offline import shutdown

    llm = start_engine(model_dir, None, **DEVICE)
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups] == [
            "SlidingWindowSpec",
            "FullAttentionSpec",
        ]
        repeat = _repeat(llm)
        flushed = _flushed(llm)
        preempt, preemptions = _preempting(llm)
    finally:
        shutdown(llm)
    return Vanilla(repeat, flushed, preempt, preemptions)


class GroupCounts:
    """Blocks the connector's plans stored and loaded, per kv-cache group."""

    def __init__(self, llm: object) -> None:
        self.stored: Counter[int] = Counter()
        self.loaded: Counter[int] = Counter()
        manager = manager_of(llm)
        build_plan = manager.build_plan

        def counting_build_plan(*args: object, **kwargs: object) -> object:
            plan = build_plan(*args, **kwargs)
            for transfer in plan.stores:
                self.stored[transfer.group] += len(transfer.device_blocks)
            for transfer in plan.loads:
                self.loaded[transfer.group] += len(transfer.device_blocks)
            return plan

        manager.build_plan = counting_build_plan


def _engine_with_counts(model_dir: str, store_mode: str) -> Iterator[tuple[object, GroupCounts]]:
    from kvtier.integrations.vllm.offline import shutdown

    llm = start_engine(model_dir, {"cpu_bytes": 64 * MIB, "store_mode": store_mode}, **DEVICE)
    try:
        yield llm, GroupCounts(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="class")
def eager(model_dir: str, vanilla: Vanilla) -> Iterator[tuple[object, GroupCounts]]:
    yield from _engine_with_counts(model_dir, "eager")


@pytest.fixture(scope="class")
def lazy(model_dir: str, vanilla: Vanilla) -> Iterator[tuple[object, GroupCounts]]:
    yield from _engine_with_counts(model_dir, "lazy")


def _window_stores(prompts: list[list[int]], max_tokens: int) -> int:
    """Sliding-window blocks eager mode stores: the window at the prompt's end, then each
    block decoding completes (a request may stop, or be preempted, at any step)."""
    total = 0
    for prompt in prompts:
        prompt_blocks = len(prompt) // BLOCK
        end_blocks = (len(prompt) + max_tokens - 1) // BLOCK
        total += min(WINDOW_BLOCKS, prompt_blocks) + end_blocks - prompt_blocks
    return total


class TestEager:
    def test_hits_in_both_groups_give_vanillas_tokens(
        self, vanilla: Vanilla, eager: tuple[object, GroupCounts]
    ) -> None:
        llm, counts = eager
        cold, warm = _repeat(llm)
        assert (cold, warm) == vanilla.repeat
        full_blocks = sum(len(p) // BLOCK for p in REPEAT_PROMPTS)
        assert counts.stored[FULL] == sum(
            (len(p) + MAX_TOKENS - 1) // BLOCK for p in REPEAT_PROMPTS
        )
        assert counts.stored[SLIDING] == _window_stores(REPEAT_PROMPTS, MAX_TOKENS)
        assert counts.loaded[FULL] == full_blocks
        assert counts.loaded[SLIDING] > 0
        assert manager_of(llm).stats().hit_tokens == full_blocks * BLOCK

    def test_preemption_keeps_outputs_identical(
        self, vanilla: Vanilla, eager: tuple[object, GroupCounts]
    ) -> None:
        llm, _ = eager
        got, preemptions = _preempting(llm)
        assert vanilla.preemptions > 0, "the baseline was meant to preempt"
        assert preemptions > 0, "nothing was preempted"
        assert got == vanilla.preempt


class TestLazy:
    def test_blocks_flushed_from_the_device_come_back_in_both_groups(
        self, vanilla: Vanilla, lazy: tuple[object, GroupCounts]
    ) -> None:
        llm, counts = lazy
        cold, warm = _flushed(llm)
        assert (cold, warm) == vanilla.flushed
        assert counts.loaded[FULL] > 0 and counts.loaded[SLIDING] > 0
        assert manager_of(llm).stats().load_failures == 0
        assert counts.stored[SLIDING] < counts.stored[FULL], "windows only"

    def test_preemption_keeps_outputs_identical(
        self, vanilla: Vanilla, lazy: tuple[object, GroupCounts]
    ) -> None:
        llm, _ = lazy
        got, preemptions = _preempting(llm)
        assert preemptions > 0, "nothing was preempted"
        assert got == vanilla.preempt
