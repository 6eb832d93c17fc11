"""What the offload tests share with the fault-injection tests: a small two-region layout;
and among the lower-tier tests: prompts, the torch copy backend, serving until idle,
storing a request's blocks and evicting them down the chain."""

from __future__ import annotations

import random
import time

import torch

from kvtier.copy.base import CopyBackend
from kvtier.keys import hash_token_blocks
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import BlockRegion, KVLayout
from kvtier.offload import OffloadManager, WorkerReport
from kvtier.plugins import default_registry
from tests.support.engine import OffloadedEngine

NUM_BLOCKS = 8
BLOCK_BYTES = 16


def make_layout() -> KVLayout:
    """A K and a V region of ``NUM_BLOCKS`` blocks of ``BLOCK_BYTES``, each byte numbered."""
    kv = torch.arange(2 * NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64).remainder(251)
    kv = kv.to(torch.uint8).reshape(2, NUM_BLOCKS, BLOCK_BYTES)
    return KVLayout((BlockRegion("k", kv[0]), BlockRegion("v", kv[1])), "flash_attn")


BLOCK_TOKENS = 4
PROMPT_BLOCKS = 5


def torch_backend(layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
    return default_registry().build(COPY_BACKEND, COPY_BACKEND_CONFIG, layout, host_buffer)


COPY_BACKEND_CONFIG = default_registry().get(COPY_BACKEND, "torch").config_model()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(PROMPT_BLOCKS * BLOCK_TOKENS + 1)]


def serve(engine: OffloadedEngine, *seeds: int) -> None:
    for seed in seeds:
        engine.submit(prompt(seed))
        # lookups wait for the tiers' threads: step by time, not by a count of steps
        deadline = time.monotonic() + 10
        while not engine.idle:
            assert time.monotonic() < deadline, "the engine did not drain"
            engine.step()
            time.sleep(0.001)


def store(manager: OffloadManager, request_id: str, hashes: list[bytes]) -> None:
    """A request computes the blocks of ``hashes`` and the workers store them."""
    manager.scheduled(
        request_id,
        num_computed_tokens=0,
        new_block_ids=[list(range(len(hashes)))],
        block_hashes=hashes,
    )
    manager.scheduled(request_id, num_computed_tokens=len(hashes) * BLOCK_TOKENS)
    plan = manager.build_plan()
    manager.process(WorkerReport(done={t.batch_id: 1 for t in plan.stores}))
    manager.finished(request_id)


def evict_to_the_tier(manager: OffloadManager, hashes: list[bytes]) -> None:
    """Store ``hashes``, then two prompts that evict them: they are written down the chain."""
    store(manager, "a", hashes)
    for seed in (2, 3):
        store(manager, str(seed), hash_token_blocks(prompt(seed), BLOCK_TOKENS)[:PROMPT_BLOCKS])
    manager.build_plan()  # hands the last evicted blocks to the workers
    assert manager.index.lookup(manager.namespace.keys(hashes)) == 0
