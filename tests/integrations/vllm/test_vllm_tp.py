"""End to end with tensor parallelism: two vLLM CPU workers, each with its own shard of the tier.

vLLM's CPU build runs TP=2 with the ``mp`` executor and one core per worker
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Workers are spawned processes, so the
test reads what each rank did from files its copy backend writes
(:class:`tests.support.faults.RankFaultsBackend`, loaded through an entry
point the workers find on ``sys.path``); the scheduler, and so the offload
manager, stays in this process. Outputs are compared with vanilla vLLM at
TP=2 run the same way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvtier.plugins
from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
from tests.integrations.vllm.conftest import BLOCK, MIB, manager_of, random_prompts, start_engine
from tests.support.faults import install_rank_faults, read_rank_counts

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]

SPEC = TinyLlamaSpec(num_layers=4)
RANKS = 2
RECORD_BYTES_PER_RANK = SPEC.kv_bytes_per_token() * BLOCK // RANKS
"""Each rank holds half of the KV heads, so half of every block."""
CPU_BYTES_PER_RANK = 3 * MIB + RECORD_BYTES_PER_RANK // 2
"""Not a whole number of records, and not ``CPU_BYTES / RANKS``: what each rank must allocate
is the whole records that fit in it."""
CPU_BYTES = 64 * MIB

PARALLEL: dict[str, object] = {
    "tensor_parallel_size": RANKS,
    "distributed_executor_backend": "mp",
    "num_device_blocks": 128,
    "max_model_len": 1024,
}
PROMPTS = random_prompts(random.Random(31), 4, 80, 250)
FAULT_PROMPTS = random_prompts(random.Random(32), 3, 80, 250)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4"), SPEC))


@pytest.fixture(scope="module", autouse=True)
def _one_core_per_worker() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(rank) for rank in range(RANKS)))
        yield


@dataclass(frozen=True)
class Vanilla:
    prompts: list[list[int]]
    fault_prompts: list[list[int]]


@pytest.fixture(scope="module")
def vanilla(model_dir: str) -> Vanilla:
    from kvtier.integrations.vllm.offline import generate, shutdown

    llm = start_engine(model_dir, None, **PARALLEL)
    try:
        return Vanilla(
            generate(llm, PROMPTS, max_tokens=MAX_TOKENS),
            generate(llm, FAULT_PROMPTS, max_tokens=MAX_TOKENS),
        )
    finally:
        shutdown(llm)


@dataclass(frozen=True)
class Tiered:
    llm: object
    ranks_dir: Path


@pytest.fixture(scope="module")
def tiered(
    model_dir: str, vanilla: Vanilla, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tiered]:
    """kvtier at TP=2, every rank's copies going through a ``rank-faults`` backend."""
    from kvtier.integrations.vllm.offline import shutdown

    plugin_dir = tmp_path_factory.mktemp("rank-faults-plugin")
    ranks_dir = tmp_path_factory.mktemp("ranks")
    install_rank_faults(plugin_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(plugin_dir))  # spawned workers start with this sys.path
        patch.setattr(kvtier.plugins, "_default_registry", None)
        llm = start_engine(
            model_dir,
            {
                "cpu_bytes": CPU_BYTES,
                "cpu_bytes_per_rank": CPU_BYTES_PER_RANK,
                "copy": {"type": "rank-faults", "directory": str(ranks_dir)},
            },
            **PARALLEL,
        )
        try:
            yield Tiered(llm, ranks_dir)
        finally:
            shutdown(llm)


def _full_blocks(prompts: list[list[int]]) -> int:
    return sum(len(prompt) // BLOCK for prompt in prompts)


def test_every_rank_holds_cpu_bytes_per_rank(tiered: Tiered) -> None:
    slots = CPU_BYTES_PER_RANK // RECORD_BYTES_PER_RANK
    assert slots != CPU_BYTES // RANKS // RECORD_BYTES_PER_RANK
    counts = read_rank_counts(tiered.ranks_dir)
    assert sorted(counts) == list(range(RANKS))
    for rank in range(RANKS):
        assert counts[rank]["host_slots"] == slots
        assert counts[rank]["host_bytes"] == slots * RECORD_BYTES_PER_RANK
    manager = manager_of(tiered.llm)
    assert manager.world_size == RANKS and manager.index.num_slots == slots


def test_tier_hits_on_every_rank_give_vanillas_tokens(vanilla: Vanilla, tiered: Tiered) -> None:
    from kvtier.integrations.vllm.offline import generate, reset_device_cache

    cold = generate(tiered.llm, PROMPTS, max_tokens=MAX_TOKENS)
    reset_device_cache(tiered.llm)
    before = read_rank_counts(tiered.ranks_dir)
    warm = generate(tiered.llm, PROMPTS, max_tokens=MAX_TOKENS)
    after = read_rank_counts(tiered.ranks_dir)
    assert cold == vanilla.prompts
    assert warm == vanilla.prompts
    blocks = _full_blocks(PROMPTS)
    for rank in range(RANKS):
        assert after[rank]["loaded_blocks"] - before[rank]["loaded_blocks"] == blocks, rank
    stats = manager_of(tiered.llm).stats()
    assert stats.loaded_blocks == blocks
    assert stats.hit_tokens == blocks * BLOCK
    assert stats.loaded_bytes == blocks * RECORD_BYTES_PER_RANK * RANKS


def test_a_load_failing_on_one_rank_is_recomputed_on_every_rank(
    vanilla: Vanilla, tiered: Tiered
) -> None:
    """Rank 1's loads fail (their device blocks filled with noise); rank 0's succeed."""
    from kvtier.integrations.vllm.offline import generate, reset_device_cache

    manager = manager_of(tiered.llm)
    cold = generate(tiered.llm, FAULT_PROMPTS, max_tokens=MAX_TOKENS)
    reset_device_cache(tiered.llm)
    before, stats_before = read_rank_counts(tiered.ranks_dir), manager.stats()
    failing = tiered.ranks_dir / "fail-loads-rank1"
    failing.touch()
    try:
        warm = generate(tiered.llm, FAULT_PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        failing.unlink()
    after, stats = read_rank_counts(tiered.ranks_dir), manager.stats()
    assert cold == vanilla.fault_prompts
    assert warm == vanilla.fault_prompts
    blocks = _full_blocks(FAULT_PROMPTS)
    assert after[0]["loaded_blocks"] - before[0]["loaded_blocks"] == blocks
    assert after[1]["failed_load_blocks"] - before[1]["failed_load_blocks"] == blocks
    assert stats.hit_tokens - stats_before.hit_tokens == blocks * BLOCK
    assert stats.load_failures - stats_before.load_failures == blocks
    assert stats.loaded_blocks == stats_before.loaded_blocks, "no load may count as done"
