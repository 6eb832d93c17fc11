"""Contract tests for layout resolvers, and engine KV tensors shaped like real engines'.

A :class:`LayoutCase` is a set of engine tensors (what an engine hands to a
resolver) together with the logical tensors whose blocks hold data and which
dimension of each indexes blocks. The case builders below allocate tensors
shaped and strided exactly like vLLM's: FlashAttention in NHD and HND order,
FlashInfer, MLA, the CPU backend (in both of vLLM's packings of a shared raw
buffer), cross-layer blocks, Mamba state lists inside padded pages, shared
layers and a hybrid attention + Mamba buffer.

:class:`LayoutResolverContract` checks what every resolver must guarantee:
uint8 ``[num_blocks, bytes_per_block]`` row views of the engine's own memory
(no copies), regions that never overlap and together cover exactly the
engine's bytes, row ``i`` of every region holding block ``i``, and a
deterministic result. To run it against your resolver, subclass it in a test
module and provide two fixtures::

    import pytest
    from kvtier.testing.contracts_layout import LayoutResolverContract, flash_attn_case

    class TestMyResolver(LayoutResolverContract):
        @pytest.fixture
        def resolver(self):
            return MyResolver()

        @pytest.fixture(params=["float16", "bfloat16"])
        def case(self, request):
            return flash_attn_case(dtype=getattr(torch, request.param))

The tests write into the case's tensors, so a case fixture must build fresh
tensors each time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from kvtier.layout.base import KVCaches, KVLayout, LayoutError, LayoutResolver

MLA_DIM = 576
"""Elements per token of an MLA latent cache (512 latent + 64 rotary)."""

ONE_BYTE_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.uint8)
"""One-byte element types KV caches use (fp8 and raw bytes)."""

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, *ONE_BYTE_DTYPES)
"""Every element type the cases are built in."""


@dataclass(frozen=True)
class LayoutCase:
    """Engine tensors and what a correct layout of them must satisfy."""

    name: str
    """Short description, used as a test id."""
    kv_caches: KVCaches
    """What the engine hands to a resolver."""
    num_blocks: int
    """Blocks the layout must have."""
    block_tensors: tuple[tuple[torch.Tensor, int], ...]
    """Logical tensors holding data, each with the dimension that indexes blocks."""
    resolvers: frozenset[str]
    """Built-in resolvers that must resolve this case."""

    def __str__(self) -> str:
        return self.name


def _layers(count: int) -> list[str]:
    return [f"model.layers.{index}.attn" for index in range(count)]


def _tensor(shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed tensor of any dtype, made as bytes (fp8 has no ``zeros`` on every build)."""
    element = dtype.itemsize
    raw = torch.zeros((*shape[:-1], shape[-1] * element), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def flash_attn_case(
    num_blocks: int = 12,
    block_tokens: int = 16,
    num_heads: int = 2,
    head_dim: int = 8,
    num_layers: int = 3,
    dtype: torch.dtype = torch.float16,
    order: str = "NHD",
    device: str = "cpu",
) -> LayoutCase:
    """vLLM FlashAttention: ``(2, nb, bs, H, D)`` per layer, stored NHD or HND."""
    caches: dict[str, torch.Tensor] = {}
    for name in _layers(num_layers):
        if order == "NHD":
            tensor = _tensor((2, num_blocks, block_tokens, num_heads, head_dim), dtype, device)
        elif order == "HND":
            physical = _tensor((2, num_blocks, num_heads, block_tokens, head_dim), dtype, device)
            tensor = physical.permute(0, 1, 3, 2, 4)
        else:
            raise ValueError(f"order must be 'NHD' or 'HND', got {order!r}")
        caches[name] = tensor
    return LayoutCase(
        f"flash_attn_{order.lower()}_{_dtype_name(dtype)}",
        caches,
        num_blocks,
        tuple((tensor, 1) for tensor in caches.values()),
        frozenset({"flash_attn", "auto"}),
    )


def block_first_case(
    kind: str,
    num_blocks: int = 12,
    block_tokens: int = 16,
    num_heads: int = 2,
    head_dim: int = 8,
    num_layers: int = 3,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
) -> LayoutCase:
    """One ``(num_blocks, ...)`` tensor per layer.

    Args:
        kind: ``"flashinfer"`` ``(nb, 2, bs, H, D)``, ``"mla"`` ``(nb, bs, 576)``
            or ``"cpu"`` (vLLM's CPU backend, ``(nb, H, bs, 2 * D)``).
        num_blocks: Blocks per layer.
        block_tokens: Tokens per block.
        num_heads: KV heads.
        head_dim: Elements per head.
        num_layers: Layers.
        dtype: Element type.
        device: Torch device.
    """
    shapes = {
        "flashinfer": (num_blocks, 2, block_tokens, num_heads, head_dim),
        "mla": (num_blocks, block_tokens, MLA_DIM),
        "cpu": (num_blocks, num_heads, block_tokens, 2 * head_dim),
    }
    if kind not in shapes:
        raise ValueError(f"kind must be one of {sorted(shapes)}, got {kind!r}")
    caches = {name: _tensor(shapes[kind], dtype, device) for name in _layers(num_layers)}
    return LayoutCase(
        f"{kind}_{_dtype_name(dtype)}",
        caches,
        num_blocks,
        tuple((tensor, 0) for tensor in caches.values()),
        frozenset({"block_first", "auto"}),
    )


def vllm_cpu_packed_case(
    block_outermost: bool,
    num_blocks: int = 10,
    block_tokens: int = 16,
    num_heads: int = 2,
    head_dim: int = 8,
    num_layers: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> LayoutCase:
    """vLLM's CPU backend views ``(nb, H, bs, 2 * D)`` of one shared raw int8 buffer.

    Each layer's view starts ``layer * layer_stride`` bytes in, block ``b`` at
    ``b * block_stride``: layer-outermost (``block_stride`` is one page, layers
    follow each other) or block-outermost (``block_stride`` is ``L`` pages, a
    block's layers sit side by side), as vLLM's ``allocate_kv_cache`` does.
    """
    element = dtype.itemsize
    page = num_heads * block_tokens * 2 * head_dim * element
    if block_outermost:
        layer_stride, block_stride = page, num_layers * page
    else:
        layer_stride, block_stride = num_blocks * page, page
    raw = torch.zeros(num_layers * num_blocks * page, dtype=torch.int8, device=device)
    caches: dict[str, torch.Tensor] = {}
    inner = (block_tokens * 2 * head_dim * element, 2 * head_dim * element, 1)
    for index, name in enumerate(_layers(num_layers)):
        view = torch.as_strided(
            raw,
            (num_blocks, num_heads, block_tokens, 2 * head_dim * element),
            (block_stride, *inner),
            storage_offset=index * layer_stride,
        )
        caches[name] = view.view(dtype)
    packing = "block_outer" if block_outermost else "layer_outer"
    return LayoutCase(
        f"vllm_cpu_{packing}_{_dtype_name(dtype)}",
        caches,
        num_blocks,
        tuple((tensor, 0) for tensor in caches.values()),
        frozenset({"block_first", "auto"}),
    )


def cross_layer_case(
    num_blocks: int = 12,
    block_tokens: int = 16,
    num_heads: int = 2,
    head_dim: int = 8,
    num_layers: int = 3,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
) -> LayoutCase:
    """One ``(nb, L, 2, bs, H, D)`` tensor; layer ``l`` gets the ``[:, l]`` view."""
    shared = _tensor((num_blocks, num_layers, 2, block_tokens, num_heads, head_dim), dtype, device)
    caches = {name: shared[:, index] for index, name in enumerate(_layers(num_layers))}
    return LayoutCase(
        f"cross_layer_{_dtype_name(dtype)}",
        caches,
        num_blocks,
        ((shared, 0),),
        frozenset({"block_first", "auto"}),
    )


def mamba_state_views(
    pages: torch.Tensor, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]
) -> list[torch.Tensor]:
    """Slice ``[nb, ...]`` int8 pages into per-state views, packed one after another.

    This is how vLLM's Mamba layers unpack the page view of their KV-cache
    allocation (conv state first, then ssm state, each ``(nb, *shape)``).
    """
    rows = pages.reshape(pages.shape[0], -1)
    states, offset = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        states.append(rows[:, offset : offset + nbytes].view(dtype).view(-1, *shape))
        offset += nbytes
    return states


def mamba_case(
    num_blocks: int = 10,
    num_layers: int = 2,
    conv_shape: tuple[int, ...] = (3, 40),
    conv_dtype: torch.dtype = torch.bfloat16,
    ssm_shape: tuple[int, ...] = (2, 8, 4),
    ssm_dtype: torch.dtype = torch.float32,
    page_padded_bytes: int = 1024,
    raw_pages: bool = False,
    device: str = "cpu",
) -> LayoutCase:
    """Mamba layers: conv then ssm state, packed in one padded page per block and layer.

    All layers share one raw buffer, block-outermost (a block's layer pages
    side by side), as vLLM allocates hybrid caches. With ``raw_pages`` each
    layer is its ``[nb, 1, 1, content_bytes]`` int8 page view (strided by the
    padded page), which is what vLLM hands to KV connectors; otherwise it is
    the list of state views its Mamba layers unpack from that page.
    """
    shapes, dtypes = (conv_shape, ssm_shape), (conv_dtype, ssm_dtype)
    content = sum(
        math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    if content > page_padded_bytes:
        raise ValueError(f"{content} bytes of states do not fit in a {page_padded_bytes}-byte page")
    raw = torch.zeros(num_blocks * num_layers * page_padded_bytes, dtype=torch.int8, device=device)
    caches: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    block_tensors: list[tuple[torch.Tensor, int]] = []
    for index, name in enumerate(_layers(num_layers)):
        page_view = torch.as_strided(
            raw,
            (num_blocks, 1, 1, content),
            (num_layers * page_padded_bytes, content, content, 1),
            storage_offset=index * page_padded_bytes,
        )
        if raw_pages:
            caches[name] = page_view
            block_tensors.append((page_view, 0))
        else:
            states = mamba_state_views(page_view, shapes, dtypes)
            caches[name] = states
            block_tensors.extend((state, 0) for state in states)
    return LayoutCase(
        "mamba_raw_pages" if raw_pages else "mamba_states",
        caches,
        num_blocks,
        tuple(block_tensors),
        frozenset({"mamba", "auto"} | ({"block_first"} if raw_pages else set())),
    )


def shared_layers_case(dtype: torch.dtype = torch.float16, device: str = "cpu") -> LayoutCase:
    """FlashAttention layers where layers share tensors or views of the same bytes."""
    base = flash_attn_case(num_layers=2, dtype=dtype, device=device)
    first, second = base.kv_caches.values()
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
    caches = {
        "model.layers.0.attn": first,
        "model.layers.1.attn": first,
        "model.layers.2.attn": second,
        "model.layers.3.attn": second.view(second.shape),
    }
    return LayoutCase(
        f"shared_layers_{_dtype_name(dtype)}",
        caches,
        base.num_blocks,
        base.block_tensors,
        frozenset({"flash_attn", "auto"}),
    )


def hybrid_overlay_case(num_blocks: int = 8, device: str = "cpu") -> LayoutCase:
    """An attention layer and a Mamba layer addressing the same pages of one buffer.

    vLLM lets KV-cache groups of a hybrid model overlay one allocation, each
    block owned by one group at a time; both layers' bytes of block ``b`` are
    then one region, counted once.
    """
    heads, tokens, head_dim = 2, 16, 8
    page = heads * tokens * 2 * head_dim * 2
    raw = torch.zeros(num_blocks * page, dtype=torch.int8, device=device)
    attention = raw.view(num_blocks, heads, tokens, 2 * head_dim * 2).view(torch.float16)
    pages = raw.view(num_blocks, page)
    states = mamba_state_views(pages, [(3, 24), (2, 4, 8)], [torch.float16, torch.float32])
    return LayoutCase(
        "hybrid_overlay",
        {"model.layers.0.attn": attention, "model.layers.1.mixer": states},
        num_blocks,
        ((attention, 0), *((state, 0) for state in states)),
        frozenset({"auto"}),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def all_cases(device: str = "cpu") -> list[Callable[[], LayoutCase]]:
    """Builders of every case above, in every dtype where the dtype matters.

    Builders rather than cases, so each test gets fresh tensors.
    """
    builders: list[Callable[[], LayoutCase]] = []
    for dtype in DTYPES:
        for order in ("NHD", "HND"):
            builders.append(partial(flash_attn_case, dtype=dtype, order=order, device=device))
        for kind in ("flashinfer", "mla", "cpu"):
            builders.append(partial(block_first_case, kind, dtype=dtype, device=device))
        builders.append(partial(cross_layer_case, dtype=dtype, device=device))
    for outer in (False, True):
        builders.append(partial(vllm_cpu_packed_case, outer, device=device))
    for raw_pages in (False, True):
        builders.append(partial(mamba_case, raw_pages=raw_pages, device=device))
    builders.append(partial(shared_layers_case, device=device))
    builders.append(partial(hybrid_overlay_case, device=device))
    return builders


def _byte_offsets(tensor: torch.Tensor) -> torch.Tensor:
    """Storage byte offsets of every byte of ``tensor``."""
    element = tensor.element_size()
    offsets = torch.tensor([tensor.storage_offset() * element], dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        step = torch.arange(size, dtype=torch.int64) * stride * element
        offsets = (offsets[:, None] + step[None, :]).reshape(-1)
    return (offsets[:, None] + torch.arange(element, dtype=torch.int64)[None, :]).reshape(-1)


def _coverage(tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per storage address, how many times each byte is covered by ``tensors``."""
    counts: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in counts:
            counts[key] = torch.zeros(storage.nbytes(), dtype=torch.int64)
        counts[key].index_add_(
            0,
            _byte_offsets(tensor),
            torch.ones(tensor.numel() * tensor.element_size(), dtype=torch.int64),
        )
    return counts


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous uint8 copy of ``tensor``'s bytes, in logical order."""
    dense = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    dense.copy_(tensor)
    return dense.reshape(-1).view(torch.uint8)


def _block_byte(block: int) -> int:
    return (block * 37 + 11) % 251 + 1


class LayoutResolverContract:
    """Tests every layout resolver must pass; needs ``resolver`` and ``case`` fixtures."""

    @pytest.fixture
    def layout(self, resolver: LayoutResolver, case: LayoutCase) -> KVLayout:
        return resolver.resolve(case.kv_caches)

    def test_regions_are_byte_rows(self, layout: KVLayout, case: LayoutCase) -> None:
        assert layout.num_blocks == case.num_blocks
        for region in layout.regions:
            assert region.view.dtype == torch.uint8
            assert region.view.dim() == 2
            assert region.bytes_per_block == 1 or region.view.stride(1) == 1
            assert region.block_stride_bytes >= region.bytes_per_block or region.num_blocks == 1
        assert layout.record_offsets[0] == 0
        assert layout.record_bytes == sum(region.bytes_per_block for region in layout.regions)

    def test_regions_view_engine_memory(self, layout: KVLayout, case: LayoutCase) -> None:
        storages = {tensor.untyped_storage().data_ptr() for tensor, _ in case.block_tensors}
        for region in layout.regions:
            assert region.view.untyped_storage().data_ptr() in storages, region.name
            assert region.view.device == case.block_tensors[0][0].device

    def test_regions_cover_engine_bytes_once(self, layout: KVLayout, case: LayoutCase) -> None:
        regions = _coverage([region.view for region in layout.regions])
        engine = _coverage([tensor for tensor, _ in case.block_tensors])
        assert regions.keys() == engine.keys()
        for key, counts in regions.items():
            assert int(counts.max()) <= 1, "two regions hold the same byte"
            assert torch.equal(counts > 0, engine[key] > 0), "regions and engine bytes differ"

    def test_row_i_holds_block_i(self, layout: KVLayout, case: LayoutCase) -> None:
        for region in layout.regions:
            for block in range(region.num_blocks):
                region.view[block].fill_(_block_byte(block))
        for tensor, block_dim in case.block_tensors:
            for block in range(case.num_blocks):
                contents = _bytes_of(tensor.select(block_dim, block))
                assert bool((contents == _block_byte(block)).all()), (tensor.shape, block)

    def test_deterministic(
        self, resolver: LayoutResolver, case: LayoutCase, layout: KVLayout
    ) -> None:
        again = resolver.resolve(case.kv_caches)
        assert again.fingerprint == layout.fingerprint
        assert [r.name for r in again.regions] == [r.name for r in layout.regions]
        assert [r.data_ptr for r in again.regions] == [r.data_ptr for r in layout.regions]

    def test_rejects_empty_input(self, resolver: LayoutResolver) -> None:
        with pytest.raises(LayoutError):
            resolver.resolve({})
