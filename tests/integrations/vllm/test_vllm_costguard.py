"""The cost guard on real vLLM (CPU): reads of a deliberately slow lower tier are skipped once
measured, and tokens stay those of vanilla vLLM; reads of a fast one all go ahead."""

from __future__ import annotations

import random
from typing import Any

import pytest

import kvtier.plugins
from kvtier.integrations.checkpoints import TinyLlamaSpec
from kvtier.offload.costguard import MIN_SAMPLES
from tests.integrations.vllm.conftest import BLOCK, manager_of, start_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]

RECORD_BYTES = TinyLlamaSpec().kv_bytes_per_token() * BLOCK
PROMPTS = [
    [random.Random(seed).randrange(1000) for _ in range(4 * BLOCK + 5)]
    for seed in range(MIN_SAMPLES + 2)
]
"""Prompts of four full blocks: the host tier holds two of them, so serving them all demotes
most to the lower tier, and serving them again finds those there."""
DEVICE = {"num_device_blocks": 64, "max_model_len": 512, "max_num_seqs": 4}
WIDER = TinyLlamaSpec(
    num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1024
)
"""The lower-tier benchmark's model: its prefill of a block costs more than reading it back."""
READ_DELAY_S = 0.3
"""Each read or presence check of the slow tier: far above the tiny model's prefill of a few
blocks."""


def serve_one_by_one(llm: Any, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN401
    from kvtier.integrations.vllm.offline import generate, reset_device_cache, settle

    got = []
    for prompt in prompts:
        got.extend(generate(llm, [prompt], max_tokens=3))
        settle(llm)
        reset_device_cache(llm)  # the next hit can only come from kvtier
    return got


def test_reads_of_a_slow_tier_are_skipped_with_identical_tokens(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.integrations.vllm.offline import shutdown
    from tests.support.tiers import memory_tier_registry

    vanilla = start_engine(model_dir, None, **DEVICE)
    try:
        expected = serve_one_by_one(vanilla, PROMPTS)
    finally:
        shutdown(vanilla)
    monkeypatch.setattr(kvtier.plugins, "_default_registry", memory_tier_registry())
    slow = {"type": "memory", "read_delay_s": READ_DELAY_S}
    llm = start_engine(
        model_dir, {"cpu_bytes": 9 * RECORD_BYTES, "tiers": [slow], "cost_guard": True}, **DEVICE
    )
    try:
        assert serve_one_by_one(llm, PROMPTS) == expected  # demotes the early prompts
        assert serve_one_by_one(llm, PROMPTS) == expected  # and finds them in the tier
        stats = manager_of(llm).stats()
    finally:
        shutdown(llm)
    tier = stats.tiers["memory"]
    # the warm-up's presence checks (the first pass's lookups, which found nothing) measured
    # the tier; every later read was skipped, though the second pass's blocks were there
    assert "misses" not in tier and "hits" not in tier
    assert tier["guard_skipped_records"] > 0
    assert stats.promoted_blocks == 0


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.integrations.checkpoints import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("wider-llama"), WIDER))


def test_reads_of_a_fast_tier_all_go_ahead(
    wider_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.integrations.vllm.offline import shutdown
    from tests.support.tiers import memory_tier_registry

    monkeypatch.setattr(kvtier.plugins, "_default_registry", memory_tier_registry())
    record_bytes = WIDER.kv_bytes_per_token() * BLOCK
    fast = {"type": "memory", "read_delay_s": 0}
    llm = start_engine(
        wider_model_dir,
        {"cpu_bytes": 9 * record_bytes, "tiers": [fast], "cost_guard": True},
        **DEVICE,
    )
    try:
        serve_one_by_one(llm, PROMPTS)
        serve_one_by_one(llm, PROMPTS)
        stats = manager_of(llm).stats()
    finally:
        shutdown(llm)
    tier = stats.tiers["memory"]
    assert tier.get("guard_skipped_records", 0) == 0
    assert stats.guard_skipped_tokens == 0
    assert stats.promoted_blocks >= 4 * MIN_SAMPLES
