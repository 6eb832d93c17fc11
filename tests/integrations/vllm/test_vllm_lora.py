"""LoRA adapters through kvtier: hits per adapter, none across adapters, events that name them.

Two LoRA adapters for the random-weight Llama are written at test time. One
prompt runs under adapter A, then B, then the base model, on a host tier that
holds one prompt's blocks above a disk tier: each run pushes the one before to
disk. After vLLM's own cache is emptied, the prompt comes back under A and then
B, and each is served by kvtier from its own adapter's blocks (vLLM hashes the
adapter's name into every block hash). vLLM without kvtier, with the same
adapters and the same device cache, answers the same tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec
from kvtier.tiers.disk import SUPERBLOCK_BYTES, DiskTier
from tests.integrations.vllm.conftest import BLOCK, random_prompts, start_engine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engine_environment")]

SPEC = TinyLlamaSpec()
RECORD_BYTES = SPEC.kv_bytes_per_token() * BLOCK
PROMPT_BLOCKS = 3
(PROMPT,) = random_prompts(
    random.Random(5), 1, PROMPT_BLOCKS * BLOCK + 5, PROMPT_BLOCKS * BLOCK + 6
)
CHUNKS = [tuple(PROMPT[i * BLOCK : (i + 1) * BLOCK]) for i in range(PROMPT_BLOCKS)]
LORA_RANK = 8
RUNS = [("a", False), ("b", False), (None, False), ("a", True), ("b", True)]
"""The prompt's runs: under which adapter (``None``: the base model), and whether vLLM's own
cache is emptied first."""
ENGINE: dict[str, Any] = {  # the same device cache in both arms
    "num_device_blocks": 32,
    "max_model_len": 256,
    "max_num_seqs": 2,
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": LORA_RANK,
}


def write_adapter(directory: Path, seed: int) -> Path:
    """A random LoRA of rank 8 on every layer's query and value projections, in PEFT's format."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": SPEC.hidden_size, "v_proj": SPEC.num_kv_heads * SPEC.head_dim}
    weights = {}
    for layer in range(SPEC.num_layers):
        for module, out_features in shapes.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (
                ("A", (LORA_RANK, SPEC.hidden_size)),
                ("B", (out_features, LORA_RANK)),
            ):
                weights[f"{name}.lora_{part}.weight"] = torch.randn(shape, generator=generator) / 2
    directory.mkdir(parents=True)
    save_file(weights, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "target_modules": list(shapes),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's requests of the two adapters, by name."""
    from vllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("lora")
    return {
        name: LoRARequest(name, lora_id, str(write_adapter(root / name, seed=lora_id)))
        for lora_id, name in enumerate("ab", start=1)
    }


@dataclass
class Arm:
    """What one engine answered over :data:`RUNS`."""

    outputs: list[list[int]]
    cached_tokens: list[int]
    """Per run, the prompt's tokens vLLM did not compute (its own hits and kvtier's)."""
    events: list[Any]
    """Every KV-cache event the engine published, vLLM's and kvtier's, in order."""


def run_arm(
    model_dir: str, adapters: dict[str, Any], kvtier: dict[str, Any] | None, **options: Any
) -> Arm:
    from kvtier.integrations.vllm.offline import greedy, reset_device_cache, settle, shutdown

    llm = start_engine(model_dir, kvtier, **ENGINE, **options)
    arm = Arm([], [], [])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduler.kv_event_publisher.publish = lambda batch: arm.events.extend(batch.events)
    try:
        for adapter, emptied in RUNS:
            if emptied:
                reset_device_cache(llm)
            lora = adapters[adapter] if adapter is not None else None
            (output,) = llm.generate(
                [{"prompt_token_ids": PROMPT}], greedy(3), lora_request=lora, use_tqdm=False
            )
            arm.outputs.append(list(output.outputs[0].token_ids))
            arm.cached_tokens.append(output.num_cached_tokens)
            settle(llm)
    finally:
        shutdown(llm)
    return arm


@pytest.fixture(scope="module")
def vanilla(model_dir: str, adapters: dict[str, Any]) -> Arm:
    return run_arm(model_dir, adapters, None)


@pytest.fixture(scope="module")
def tiered(
    model_dir: str, adapters: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Arm]:
    from vllm.config import KVEventsConfig

    disk = {
        "type": "disk",
        "path": str(tmp_path_factory.mktemp("lora-disk")),
        "capacity_bytes": SUPERBLOCK_BYTES + 16 * DiskTier.slot_bytes_for(RECORD_BYTES),
    }
    yield run_arm(
        model_dir,
        adapters,
        {"cpu_bytes": PROMPT_BLOCKS * RECORD_BYTES, "tiers": [disk]},
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )


Lora = tuple[int | None, str | None]


def stored(arm: Arm, locality: str | None, ownership: str | None = None) -> list[tuple[Any, Lora]]:
    """The prompt's block stores in one place, as (block hash, LoRA id and name): vLLM's
    device cache (``locality`` ``None``), kvtier's host tier (``LOCAL``), or the disk tier
    (``LOCAL``, ``disk``). vLLM's own events may name several blocks each."""
    blocks = []
    for event in arm.events:
        if type(event).__name__ != "BlockStored":
            continue
        if (event.locality, event.ownership) != (locality, ownership):
            continue
        for position, block_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[position * BLOCK : (position + 1) * BLOCK])
            if tokens in CHUNKS:
                blocks.append((block_hash, (event.lora_id, event.lora_name)))
    return blocks


def lora_of(blocks: list[tuple[Any, Lora]]) -> dict[Any, Lora]:
    """The LoRA fields of stored blocks, by block hash (failing if a hash has two)."""
    seen: dict[Any, Lora] = {}
    for block_hash, lora in blocks:
        assert seen.setdefault(block_hash, lora) == lora, "one hash, one adapter"
    return seen


def test_each_adapter_hits_its_own_blocks_and_never_anothers(tiered: Arm, vanilla: Arm) -> None:
    full = PROMPT_BLOCKS * BLOCK
    assert tiered.cached_tokens == [0, 0, 0, full, full], (
        "B and the base model miss A's blocks; A and B hit their own once vLLM's cache is empty"
    )
    assert vanilla.cached_tokens == [0, 0, 0, 0, 0]


def test_outputs_are_vanillas_and_each_adapter_changes_them(tiered: Arm, vanilla: Arm) -> None:
    assert tiered.outputs == vanilla.outputs
    under_a, under_b, base = tiered.outputs[:3]
    assert under_a != base and under_b != base and under_a != under_b, "the adapters are loaded"


def test_kv_events_of_every_tier_name_the_adapter_that_computed_the_block(tiered: Arm) -> None:
    device = lora_of(stored(tiered, None))
    host_events = stored(tiered, "LOCAL")
    host, on_disk = lora_of(host_events), lora_of(stored(tiered, "LOCAL", "disk"))
    by_lora: dict[Lora, set[Any]] = {}
    for block_hash, lora in device.items():
        by_lora.setdefault(lora, set()).add(block_hash)
    assert {lora: len(hashes) for lora, hashes in by_lora.items()} == {
        (1, "a"): PROMPT_BLOCKS,
        (2, "b"): PROMPT_BLOCKS,
        (None, None): PROMPT_BLOCKS,
    }, "vLLM hashes the same prompt apart under each adapter"
    assert host == device, "kvtier's host tier names the adapter vLLM names"
    a_blocks, b_blocks = by_lora[(1, "a")], by_lora[(2, "b")]
    assert a_blocks | b_blocks <= on_disk.keys(), "A's and B's blocks were pushed to disk"
    assert {on_disk[block_hash] for block_hash in a_blocks} == {(1, "a")}
    assert {on_disk[block_hash] for block_hash in b_blocks} == {(2, "b")}
    promoted = [block_hash for block_hash, _ in host_events if block_hash in a_blocks]
    assert len(promoted) == 2 * PROMPT_BLOCKS, "A's blocks came back up from disk, announced"
