"""Byte spans: the arithmetic that turns strided engine tensors into block regions.

A *span* is ``num_blocks`` rows of ``bytes_per_block`` contiguous bytes, row
``i`` starting ``block_stride_bytes * i`` bytes after the span's start, inside
one storage. The resolvers work in three steps:

1. :func:`tensor_spans` reads one tensor's shape and strides and returns the
   spans that hold its bytes, given which dimension indexes blocks. Dimensions
   inside a block that are not densely packed (K/V or head dimensions placed
   outside the block in memory) become separate spans.
2. :func:`merge_spans` counts shared storage once: spans of one storage with the
   same block stride that overlap or touch are merged, so several layers
   holding one tensor, views of the same bytes, or layers packed side by side
   inside each block all become a single span.
3. :func:`spans_to_layout` builds the uint8 views (``Tensor.set_`` on the
   untyped storage: views, never copies) and the :class:`KVLayout`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvtier.layout.base import BlockRegion, KVLayout, LayoutError, RegionFormat

MAX_SPANS_PER_TENSOR = 4096
"""Most spans one tensor may split into before resolving fails as too fragmented."""


@dataclass(frozen=True)
class Span:
    """``num_blocks`` rows of ``bytes_per_block`` contiguous bytes inside one storage."""

    name: str
    storage: torch.UntypedStorage
    offset_bytes: int
    block_stride_bytes: int
    num_blocks: int
    bytes_per_block: int
    format: RegionFormat | None = None
    """What a block's bytes hold, when the reader of the tensor knows."""

    @property
    def storage_key(self) -> tuple[str, int]:
        """Identifies the storage: its device and base address."""
        return (str(self.storage.device), int(self.storage.data_ptr()))

    @property
    def end_bytes(self) -> int:
        """Offset just past the bytes of block 0."""
        return self.offset_bytes + self.bytes_per_block

    @property
    def extent_end_bytes(self) -> int:
        """Offset just past the bytes of the last block."""
        last_block = (self.num_blocks - 1) * self.block_stride_bytes
        return self.offset_bytes + last_block + self.bytes_per_block


def describe(tensor: torch.Tensor) -> str:
    """Shape, strides and dtype of ``tensor``, for error messages."""
    return f"shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}, dtype {tensor.dtype}"


_KV_HALVES = -1
"""Stands for the K and V halves of a last dimension that packs both (vLLM's CPU cache)."""


def tensor_spans(
    name: str,
    tensor: torch.Tensor,
    block_dim: int,
    scale_dims: Collection[int] | None = None,
    kv_in_last_dim: bool = False,
) -> list[Span]:
    """Return the spans holding ``tensor``'s bytes, with ``block_dim`` indexing blocks.

    The other dimensions, together with the element bytes, must tile each block
    as a dense box in some order; dimensions that do not fit in the box (they
    are strided past it) each split the tensor into separate spans.

    Args:
        name: Name used for the spans and in errors (the engine's layer name).
        tensor: An engine tensor of any dtype; it is only inspected.
        block_dim: The dimension of ``tensor`` that indexes blocks.
        scale_dims: The dimensions that index K and V, heads or layers, which
            give the spans a :class:`RegionFormat`; ``None`` gives them none
            (their bytes are not attention KV, or their meaning is unknown).
        kv_in_last_dim: The last dimension holds K, then V, in two halves.

    Returns:
        The spans, named ``name`` or ``name[i,j]`` after the indices of the
        dimensions that split the tensor.

    Raises:
        LayoutError: If the tensor is empty, broadcast, has overlapping blocks
            or splits into more than :data:`MAX_SPANS_PER_TENSOR` spans.
    """
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0 or not -tensor.dim() <= block_dim < tensor.dim():
        raise LayoutError(
            f"{name}: cannot take dimension {block_dim} as the block dimension of a tensor "
            f"with {describe(tensor)}"
        )
    block_dim %= tensor.dim()
    if tensor.numel() == 0:
        raise LayoutError(f"{name}: the tensor is empty ({describe(tensor)})")
    element_bytes = tensor.element_size()
    num_blocks = int(tensor.shape[block_dim])
    block_stride = int(tensor.stride(block_dim)) * element_bytes
    inner: list[tuple[int, int, int]] = []  # (stride_bytes, size, dim) of dims inside a block
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
        if dim == block_dim or size == 1:
            continue
        if stride == 0:
            raise LayoutError(
                f"{name}: dimension {dim} is broadcast (stride 0), so the tensor does not own "
                f"its bytes ({describe(tensor)}); pass the tensor that owns the KV cache"
            )
        inner.append((int(stride) * element_bytes, int(size), dim))
    inner.sort(reverse=True)
    dense_bytes = element_bytes
    box: list[tuple[int, int]] = []  # (size, dim) of the dense box, innermost first
    while inner and inner[-1][0] == dense_bytes:
        stride, size, dim = inner.pop()
        dense_bytes *= size
        box.append((size, dim))
    region_format = (
        None if scale_dims is None else _region_format(tensor, box, set(scale_dims), kv_in_last_dim)
    )
    outer = inner  # strided past the dense box: each index is its own span
    count = math.prod(size for _, size, _ in outer)
    if count > MAX_SPANS_PER_TENSOR:
        raise LayoutError(
            f"{name}: a block's bytes are scattered over {count} pieces ({describe(tensor)}); "
            f"at most {MAX_SPANS_PER_TENSOR} are supported. Use a layout whose blocks are "
            "contiguous per layer"
        )
    if num_blocks > 1 and block_stride < dense_bytes:
        raise LayoutError(
            f"{name}: blocks 0 and 1 overlap (block stride {block_stride} bytes, "
            f"{dense_bytes} bytes per block; {describe(tensor)}); is dimension {block_dim} "
            "really the block dimension?"
        )
    storage = tensor.untyped_storage()
    base = int(tensor.storage_offset()) * element_bytes
    spans = []
    order = sorted(outer, key=lambda item: item[2])  # name pieces in logical dim order
    for index in itertools.product(*(range(size) for _, size, _ in order)):
        offset = base + sum(i * stride for i, (stride, _, _) in zip(index, order, strict=True))
        suffix = f"[{','.join(map(str, index))}]" if index else ""
        spans.append(
            Span(
                f"{name}{suffix}",
                storage,
                offset,
                block_stride,
                num_blocks,
                dense_bytes,
                region_format,
            )
        )
    return spans


def _region_format(
    tensor: torch.Tensor, box: list[tuple[int, int]], scale_dims: set[int], kv_in_last_dim: bool
) -> RegionFormat:
    """The format of one block of ``tensor``, whose dense box is ``box`` (innermost first)."""
    last = tensor.dim() - 1
    if kv_in_last_dim and box and box[0][1] == last and box[0][0] % 2 == 0:
        size = box[0][0]
        box = [(size // 2, last), (2, _KV_HALVES), *box[1:]]
        scale_dims = scale_dims | {_KV_HALVES}
    ordered = box[::-1] or [(1, last)]
    return RegionFormat(
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=tuple(size for size, _ in ordered),
        scale_axes=tuple(axis for axis, (_, dim) in enumerate(ordered) if dim in scale_dims),
    )


def _merged_name(members: list[Span]) -> str:
    names = list(dict.fromkeys(span.name for span in members))
    if len(names) == 1:
        return names[0]
    return f"{names[0]}..{names[-1]}"


def merge_spans(spans: list[Span]) -> list[Span]:
    """Count shared storage once: merge spans that overlap or touch within each block.

    Spans of one storage with the same block stride and block count whose
    block-0 byte ranges overlap or are adjacent become one span, provided the
    result still fits in one block stride. The result keeps the order in which
    each merged span's first member appeared.

    Raises:
        LayoutError: If two spans of one storage overlap in a way no single
            region can express (different block strides, or a merged block
            larger than the block stride).
    """
    groups: dict[tuple[tuple[str, int], int, int], list[tuple[int, Span]]] = {}
    for position, span in enumerate(spans):
        key = (span.storage_key, span.block_stride_bytes, span.num_blocks)
        groups.setdefault(key, []).append((position, span))
    merged: list[tuple[int, Span]] = []
    for members in groups.values():
        members.sort(key=lambda item: (item[1].offset_bytes, -item[1].bytes_per_block))
        run: list[tuple[int, Span]] = [members[0]]
        run_end = members[0][1].end_bytes
        for position, span in members[1:]:
            start = run[0][1].offset_bytes
            fits = span.num_blocks == 1 or max(run_end, span.end_bytes) - start <= (
                span.block_stride_bytes
            )
            if span.offset_bytes <= run_end and fits:
                run.append((position, span))
                run_end = max(run_end, span.end_bytes)
                continue
            if span.offset_bytes < run_end:
                raise LayoutError(
                    f"{run[-1][1].name} and {span.name} share bytes but cannot form one region "
                    f"(together {max(run_end, span.end_bytes) - start} bytes per block, block "
                    f"stride {span.block_stride_bytes}); resolve them separately"
                )
            merged.append(_close_run(run, run_end))
            run, run_end = [(position, span)], span.end_bytes
        merged.append(_close_run(run, run_end))
    _check_disjoint([span for _, span in merged])
    merged.sort(key=lambda item: item[0])
    return [span for _, span in merged]


def _close_run(run: list[tuple[int, Span]], run_end: int) -> tuple[int, Span]:
    first = run[0][1]
    span = Span(
        _merged_name([member for _, member in run]),
        first.storage,
        first.offset_bytes,
        first.block_stride_bytes,
        first.num_blocks,
        run_end - first.offset_bytes,
        _merged_format([member for _, member in run], run_end),
    )
    return (min(position for position, _ in run), span)


def _merged_format(members: list[Span], run_end: int) -> RegionFormat | None:
    """The format of merged spans: views of the same bytes keep theirs; pieces of one format
    side by side (the layers of a block) stack along a new outer axis with a scale of its
    own; anything else has none."""
    pieces = {member.offset_bytes: member for member in members}
    first = members[0]
    size = first.bytes_per_block
    start = min(pieces)
    known = first.format
    if known is None or any(
        piece.format != known or piece.bytes_per_block != size for piece in pieces.values()
    ):
        return None
    if sorted(pieces) != [start + index * size for index in range(len(pieces))]:
        return None
    if run_end - start != len(pieces) * size:
        return None
    if len(pieces) == 1:
        return known
    return RegionFormat(
        known.dtype,
        (len(pieces), *known.shape),
        (0, *(axis + 1 for axis in known.scale_axes)),
    )


def _check_disjoint(spans: list[Span]) -> None:
    """Reject spans of one storage with different block strides whose extents overlap."""
    by_storage: dict[tuple[str, int], list[Span]] = {}
    for span in spans:
        by_storage.setdefault(span.storage_key, []).append(span)
    for members in by_storage.values():
        members.sort(key=lambda span: span.offset_bytes)
        furthest = members[0]
        for span in members[1:]:
            overlapping = span.offset_bytes < furthest.extent_end_bytes
            if overlapping and span.block_stride_bytes != furthest.block_stride_bytes:
                raise LayoutError(
                    f"{furthest.name} (block stride {furthest.block_stride_bytes} bytes) and "
                    f"{span.name} (block stride {span.block_stride_bytes} bytes) use the same "
                    "memory with different block sizes; resolve each KV-cache group on its own"
                )
            if span.extent_end_bytes > furthest.extent_end_bytes:
                furthest = span


def span_view(span: Span) -> torch.Tensor:
    """The ``[num_blocks, bytes_per_block]`` uint8 view of ``span``'s bytes (no copy)."""
    view = torch.empty(0, dtype=torch.uint8, device=span.storage.device)
    view.set_(
        span.storage,
        span.offset_bytes,
        (span.num_blocks, span.bytes_per_block),
        (span.block_stride_bytes, 1),
    )
    return view


def spans_to_layout(spans: list[Span], kind: str) -> KVLayout:
    """Merge ``spans`` and build the :class:`KVLayout` of their views.

    Raises:
        LayoutError: If the spans cannot be merged or disagree on the block count.
    """
    merged = merge_spans(spans)
    counts = {span.num_blocks for span in merged}
    if len(counts) > 1:
        first = merged[0]
        odd = next(span for span in merged if span.num_blocks != first.num_blocks)
        raise LayoutError(
            f"{odd.name} has {odd.num_blocks} blocks but {first.name} has {first.num_blocks}; "
            "every tensor of one layout must index the same blocks"
        )
    regions = tuple(BlockRegion(span.name, span_view(span), span.format) for span in merged)
    return KVLayout(regions=regions, kind=kind)
