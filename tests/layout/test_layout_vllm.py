"""The layout contract on KV-cache views built by vLLM's own allocator code (vLLM 0.32 and 0.33).

vLLM places every layer's pages in one raw int8 buffer
(``KVCacheTensor``: ``offset + layer * layer_stride + block * block_stride``)
and views it per layer with ``create_kv_cache_views`` in one of its
``KVCacheLayout`` stride orders. These tests build exactly those views and
check that ``auto`` resolves each of them: every stride order, and the shapes
the GPU backends of vLLM 0.33 allocate (FlashAttention's default ``LBNHC``,
FlashInfer's ``LBHNC`` / ``BLHNC`` on Blackwell, MLA's single 576-wide head,
the block-outermost cross-layer packing, and blocks split into smaller
kernel blocks, which the connector regroups per scheduler block).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.layout.base import KVLayout, LayoutResolver
from kvtier.layout.resolvers import AutoResolver
from kvtier.testing.contracts_layout import LayoutCase, LayoutResolverContract, mamba_state_views
from tests.support.vllm_steps import kv_cache_tensor_strides

kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
KVCacheLayout = kv_cache_layout.KVCacheLayout

pytestmark = pytest.mark.vllm033

NUM_BLOCKS, NUM_LAYERS, HEADS = 6, 3, 2


def _views(
    spec: object,
    order: object,
    names: list[str],
    raw: torch.Tensor | None = None,
    heads: int = 1,
    kernel_block_size: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    page = spec.page_size_bytes  # type: ignore[attr-defined]
    layer_stride, block_stride = kv_cache_tensor_strides(
        order.name,  # type: ignore[attr-defined]
        page,
        len(names),
        NUM_BLOCKS,
        heads,
    )
    size = len(names) * NUM_BLOCKS * page
    tensor = kv_cache_interface.KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8) if raw is None else raw
    views = kv_cache_interface.create_kv_cache_views(
        raw, spec, NUM_BLOCKS, order, tensor, kernel_block_size=kernel_block_size
    )
    return raw, views


def _attention_case(order: object, dtype: torch.dtype) -> LayoutCase:
    spec = kv_cache_interface.FullAttentionSpec(
        block_size=16, num_kv_heads=HEADS, head_size=32, dtype=dtype
    )
    names = [f"layers.{index}.attn" for index in range(NUM_LAYERS)]
    _, views = _views(spec, order, names, heads=HEADS)
    return LayoutCase(
        f"attention_{order.name}_{str(dtype).removeprefix('torch.')}",  # type: ignore[attr-defined]
        dict(zip(names, views, strict=True)),
        NUM_BLOCKS,
        tuple((view, 0) for view in views),
        frozenset({"block_first", "auto"}),
    )


def _mla_case() -> LayoutCase:
    spec = kv_cache_interface.MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )
    names = [f"layers.{index}.attn" for index in range(NUM_LAYERS)]
    _, views = _views(spec, KVCacheLayout.LBHNC, names)
    return LayoutCase(
        "mla",
        dict(zip(names, views, strict=True)),
        NUM_BLOCKS,
        tuple((view, 0) for view in views),
        frozenset({"block_first", "auto"}),
    )


MAMBA_SHAPES = ((3, 40), (2, 8, 4))
MAMBA_DTYPES = (torch.bfloat16, torch.float32)


def _mamba_spec(page_bytes: int) -> object:
    return kv_cache_interface.MambaSpec(
        block_size=16, shapes=MAMBA_SHAPES, dtypes=MAMBA_DTYPES, page_size_padded=page_bytes
    )


def _mamba_case(order: object, states: bool) -> LayoutCase:
    names = [f"layers.{index}.mixer" for index in range(NUM_LAYERS)]
    _, pages = _views(_mamba_spec(1024), order, names)
    caches: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    tensors: list[tuple[torch.Tensor, int]] = []
    for name, page in zip(names, pages, strict=True):
        if states:
            caches[name] = mamba_state_views(page, MAMBA_SHAPES, MAMBA_DTYPES)
            tensors.extend((state, 0) for state in caches[name])
        else:
            caches[name] = page
            tensors.append((page, 0))
    kind = "states" if states else "pages"
    return LayoutCase(
        f"mamba_{kind}_{order.name}",  # type: ignore[attr-defined]
        caches,
        NUM_BLOCKS,
        tuple(tensors),
        frozenset({"mamba", "auto"}),
    )


def _hybrid_case() -> LayoutCase:
    """Attention and Mamba groups overlaying one allocation with equal (padded) pages."""
    attention = kv_cache_interface.FullAttentionSpec(
        block_size=16, num_kv_heads=HEADS, head_size=32, dtype=torch.bfloat16
    )
    attention_names = [f"layers.{index}.attn" for index in range(NUM_LAYERS)]
    mamba_names = [f"layers.{index}.mixer" for index in range(NUM_LAYERS)]
    raw, attention_views = _views(attention, KVCacheLayout.BLHNC, attention_names, heads=HEADS)
    mamba = _mamba_spec(attention.page_size_bytes)
    _, pages = _views(mamba, KVCacheLayout.BLHNC, mamba_names, raw=raw)
    caches: dict[str, torch.Tensor | list[torch.Tensor]] = dict(
        zip(attention_names, attention_views, strict=True)
    )
    tensors = [(view, 0) for view in attention_views]
    for name, page in zip(mamba_names, pages, strict=True):
        caches[name] = mamba_state_views(page, MAMBA_SHAPES, MAMBA_DTYPES)
        tensors.extend((state, 0) for state in caches[name])
    return LayoutCase("hybrid_overlay", caches, NUM_BLOCKS, tuple(tensors), frozenset({"auto"}))


def _gpu_case(
    name: str,
    spec: object,
    order: object,
    heads: int,
    kernel_block_size: int | None = None,
) -> LayoutCase:
    """A GPU backend's allocation, seen as the connector sees it (per scheduler block)."""
    from kvtier.integrations.vllm.worker import manager_block_views

    names = [f"model.layers.{index}.self_attn.attn" for index in range(NUM_LAYERS)]
    _, views = _views(spec, order, names, heads=heads, kernel_block_size=kernel_block_size)
    caches = manager_block_views(dict(zip(names, views, strict=True)), NUM_BLOCKS)
    return LayoutCase(
        name,
        caches,
        NUM_BLOCKS,
        tuple((caches[name], 0) for name in names),  # type: ignore[misc]
        frozenset({"block_first", "auto"}),
    )


def _llama_8b(block_size: int = 16, dtype: torch.dtype = torch.bfloat16) -> object:
    """Llama-3-8B's attention on one rank: 8 KV heads of 128."""
    return kv_cache_interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=8, head_size=128, dtype=dtype
    )


def _deepseek_mla(block_size: int) -> object:
    """DeepSeek's MLA latent cache: one 576-wide head (512 latent + 64 rotary)."""
    return kv_cache_interface.MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )


GPU_BUILDERS = {
    # FlashAttention declares no layout: vLLM's default preference puts LBNHC (NHD) first.
    "gpu_flash_attn_LBNHC": lambda: _gpu_case(
        "gpu_flash_attn_LBNHC", _llama_8b(), KVCacheLayout.LBNHC, 8
    ),
    "gpu_flash_attn_fp8_LBNHC": lambda: _gpu_case(
        "gpu_flash_attn_fp8_LBNHC", _llama_8b(dtype=torch.float8_e4m3fn), KVCacheLayout.LBNHC, 8
    ),
    # FlashInfer's trtllm-gen kernels on Blackwell take head-major blocks: LBHNC or BLHNC.
    "gpu_flashinfer_LBHNC": lambda: _gpu_case(
        "gpu_flashinfer_LBHNC", _llama_8b(), KVCacheLayout.LBHNC, 8
    ),
    # The cross-layer layout: each block's pages of every layer side by side.
    "gpu_cross_layer_BLHNC": lambda: _gpu_case(
        "gpu_cross_layer_BLHNC", _llama_8b(), KVCacheLayout.BLHNC, 8
    ),
    "gpu_mla_flashmla_LBNHC": lambda: _gpu_case(
        "gpu_mla_flashmla_LBNHC", _deepseek_mla(64), KVCacheLayout.LBNHC, 1
    ),
    # 128-token scheduler blocks split into the 64-token kernel blocks FlashInfer and FlashMLA take.
    "gpu_flashinfer_kernel_blocks": lambda: _gpu_case(
        "gpu_flashinfer_kernel_blocks", _llama_8b(128), KVCacheLayout.LBHNC, 8, 64
    ),
    "gpu_mla_kernel_blocks": lambda: _gpu_case(
        "gpu_mla_kernel_blocks", _deepseek_mla(128), KVCacheLayout.LBNHC, 1, 64
    ),
}


BUILDERS = {
    **{
        f"attention_{order.name}_{dtype}": (
            lambda o=order, d=dtype: _attention_case(o, getattr(torch, d))
        )
        for order in KVCacheLayout
        for dtype in ("bfloat16", "float8_e4m3fn")
    },
    "mla": _mla_case,
    **{
        f"mamba_{kind}_{order.name}": (lambda o=order, s=kind == "states": _mamba_case(o, s))
        for order in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
        for kind in ("pages", "states")
    },
    "hybrid_overlay": _hybrid_case,
    **GPU_BUILDERS,
}


class TestAutoOnVllmViews(LayoutResolverContract):
    @pytest.fixture
    def resolver(self) -> LayoutResolver:
        return AutoResolver()

    @pytest.fixture(params=sorted(BUILDERS))
    def case(self, request: pytest.FixtureRequest) -> LayoutCase:
        return BUILDERS[request.param]()


def _resolve(case: LayoutCase) -> KVLayout:
    return AutoResolver().resolve(case.kv_caches)


@pytest.mark.parametrize(
    "order, regions",
    [
        (KVCacheLayout.LBHNC, NUM_LAYERS),
        (KVCacheLayout.LBNHC, NUM_LAYERS),
        (KVCacheLayout.LHBNC, NUM_LAYERS * HEADS),
        (KVCacheLayout.BLHNC, 1),
        (KVCacheLayout.BLNHC, 1),
        (KVCacheLayout.BHLNC, 1),
    ],
)
def test_block_outermost_packings_become_one_region(order: object, regions: int) -> None:
    layout = _resolve(_attention_case(order, torch.bfloat16))
    assert len(layout.regions) == regions
    assert layout.record_bytes == NUM_LAYERS * 16 * HEADS * 32 * 2 * 2


def test_hybrid_overlay_is_one_region_of_the_attention_pages() -> None:
    layout = _resolve(_hybrid_case())
    assert layout.kind == "block_first+mamba"
    assert len(layout.regions) == 1
    assert layout.record_bytes == NUM_LAYERS * 16 * HEADS * 32 * 2 * 2


def test_mamba_pages_exclude_the_padding() -> None:
    layout = _resolve(_mamba_case(KVCacheLayout.BLHNC, states=False))
    content = 3 * 40 * 2 + 2 * 8 * 4 * 4
    assert [region.bytes_per_block for region in layout.regions] == [content] * NUM_LAYERS
    assert {region.block_stride_bytes for region in layout.regions} == {NUM_LAYERS * 1024}


@pytest.mark.parametrize("name", sorted(GPU_BUILDERS))
def test_gpu_layouts_hold_each_scheduler_block_whole(name: str) -> None:
    case = GPU_BUILDERS[name]()
    layout = _resolve(case)
    assert layout.num_blocks == NUM_BLOCKS
    first = next(iter(case.kv_caches.values()))
    assert isinstance(first, torch.Tensor)
    page = first[0].numel() * first.element_size()
    assert layout.record_bytes == NUM_LAYERS * page


def test_kernel_block_views_need_regrouping() -> None:
    names = [f"model.layers.{index}.self_attn.attn" for index in range(NUM_LAYERS)]
    _, views = _views(_llama_8b(128), KVCacheLayout.LBHNC, names, heads=8, kernel_block_size=64)
    assert views[0].shape[0] == 2 * NUM_BLOCKS, "vLLM views kernel blocks, not its own blocks"
    layout = AutoResolver().resolve(dict(zip(names, views, strict=True)))
    assert layout.num_blocks == 2 * NUM_BLOCKS
