"""What the offload tests share with the fault-injection tests: a small two-region layout."""

from __future__ import annotations

import torch

from kvtier.layout.base import BlockRegion, KVLayout

NUM_BLOCKS = 8
BLOCK_BYTES = 16


def make_layout() -> KVLayout:
    """A K and a V region of ``NUM_BLOCKS`` blocks of ``BLOCK_BYTES``, each byte numbered."""
    kv = torch.arange(2 * NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64).remainder(251)
    kv = kv.to(torch.uint8).reshape(2, NUM_BLOCKS, BLOCK_BYTES)
    return KVLayout((BlockRegion("k", kv[0]), BlockRegion("v", kv[1])), "flash_attn")
