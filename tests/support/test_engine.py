"""The synthetic engine: tensors in every layout, deterministic values, byte-exact checks."""

from __future__ import annotations

import pytest
import torch

from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.kinds import COPY_BACKEND, LAYOUT_RESOLVER
from kvtier.layout.base import KVCaches, KVLayout, LayoutResolver
from kvtier.plugins import default_registry
from tests.support.engine import (
    LAYOUTS,
    EngineSpec,
    OffloadedEngine,
    SyntheticEngine,
    block_values,
    make_kv_caches,
)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_resolves_and_checks(layout: str) -> None:
    engine = SyntheticEngine(EngineSpec(layout=layout, num_blocks=6))
    assert engine.layout.num_blocks == 6
    engine.compute(2, b"key-a")
    assert engine.mismatches(2, b"key-a") == []
    assert engine.mismatches(2, b"key-b") != []
    assert engine.mismatches(3, b"key-a") != []


def test_storage_shared_by_layers_is_filled_once() -> None:
    caches, tensors = make_kv_caches(EngineSpec(layout="shared_layers", num_layers=4))
    assert len(caches) == 4 and len(tensors) == 2
    assert caches["layers.0.attn"] is caches["layers.1.attn"]


def test_hnd_tensors_have_the_logical_nhd_shape() -> None:
    caches, _ = make_kv_caches(EngineSpec(layout="flash_attn_hnd", num_kv_heads=2, head_dim=8))
    tensor = caches["layers.0.attn"]
    assert isinstance(tensor, torch.Tensor)
    assert tensor.shape[2:] == (4, 2, 8) and not tensor.is_contiguous()


def test_mamba_states_share_one_padded_page() -> None:
    caches, _ = make_kv_caches(EngineSpec(layout="mamba", num_blocks=3))
    conv, ssm = caches["layers.0.attn"]
    assert conv.untyped_storage().data_ptr() == ssm.untyped_storage().data_ptr()
    page = conv.stride(0) * conv.element_size()
    assert page % 256 == 0 and page > conv[0].nbytes + ssm[0].nbytes


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_values_are_exact_and_depend_on_key_tensor_and_position(dtype: torch.dtype) -> None:
    values = block_values(b"k", 0, (4, 8), dtype)
    assert values.dtype == dtype
    assert torch.equal(values.float(), values.float().round())
    assert torch.equal(
        values.view(torch.uint8), block_values(b"k", 0, (4, 8), dtype).view(torch.uint8)
    )
    assert not torch.equal(values.float(), block_values(b"k", 1, (4, 8), dtype).float())
    assert not torch.equal(values.float(), block_values(b"j", 0, (4, 8), dtype).float())
    assert len(set(values.float().flatten().tolist())) > 2


def test_free_list_and_prefix_cache() -> None:
    engine = SyntheticEngine(EngineSpec(num_blocks=4))
    blocks = engine.allocate(2)
    engine.compute(blocks[0], b"a")
    engine.compute(blocks[1], b"b")
    assert engine.prefix_hits([b"a", b"b", b"c"]) == 2
    engine.free(blocks)
    assert engine.num_free == 4
    assert engine.acquire_cached([b"a"]) == [blocks[0]]
    assert engine.num_free == 3
    assert engine.eviction_frontier(4) == [(b"b", blocks[1])]
    assert engine.eviction_frontier(4) == [], "a block is offered once"
    engine.drop_cache()
    assert engine.prefix_hits([b"b"]) == 0 and engine.prefix_hits([b"a"]) == 1
    with pytest.raises(MemoryError):
        engine.allocate(4)


class _DropsLastRegion(LayoutResolver):
    """A broken resolver: forgets the V half of every FlashAttention layer."""

    def resolve(self, kv_caches: KVCaches) -> KVLayout:
        registration = default_registry().get(LAYOUT_RESOLVER, "flash_attn")
        layout = registration.factory(registration.config_model()).resolve(kv_caches)
        return KVLayout(layout.regions[:-1], layout.kind)


def test_a_wrong_layout_is_caught_by_the_round_trip() -> None:
    registry = default_registry()
    config = registry.get(COPY_BACKEND, "torch").config_model()
    engine = OffloadedEngine(
        EngineSpec(num_blocks=12, num_layers=1),
        PolicyIndex(8, LRUPolicy()),
        lambda layout, host: registry.build(COPY_BACKEND, config, layout, host),
        resolver=_DropsLastRegion(),
    )
    tokens = list(range(13))
    engine.submit(tokens)
    engine.drain()
    engine.engine.drop_cache()
    engine.submit(tokens)
    engine.drain()
    assert engine.stats.tier_hit_blocks == 3
    assert engine.mismatches and all("layers.0.attn" in line for line in engine.mismatches)
