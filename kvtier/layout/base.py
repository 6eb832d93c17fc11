"""The layout contract: engine KV tensors become ``[num_blocks, bytes_per_block]`` byte regions.

A :class:`LayoutResolver` is data-in, data-out: it reads shapes and strides,
allocates nothing and copies nothing. The :class:`KVLayout` it returns lists
one :class:`BlockRegion` per physical piece of memory, so that "block ``i``"
means the same thing in every region, and storage shared by several layers
appears once. A block's bytes across all regions form one host record of
``record_bytes``, regions in order.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations name torch, so plugin modules can import this without it
    import torch

KVCaches = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]
"""What engines hand over: layer name -> KV tensor, or a list of state tensors (Mamba)."""


class LayoutError(ValueError):
    """The tensors do not have a layout the resolver understands; the message names the tensor."""


@dataclass(frozen=True)
class RegionFormat:
    """What one block's bytes of a region hold, for record codecs that read the values.

    A lossy codec scales the values of each block separately along
    :attr:`scale_axes` (K and V, heads, layers): the values that share an index
    on every one of those axes share a scale.
    """

    dtype: str
    """The element type, as torch names it without ``torch.`` (``"bfloat16"``)."""
    shape: tuple[int, ...]
    """One block's elements, in memory order (outermost first)."""
    scale_axes: tuple[int, ...]
    """Axes of :attr:`shape` that index K and V, KV heads or layers."""


@dataclass(frozen=True)
class RecordRegion:
    """Where a region's bytes lie in a block record, and what they hold when known."""

    offset_bytes: int
    nbytes: int
    format: RegionFormat | None
    """``None`` when the resolver cannot tell (Mamba states, pieces of different shapes
    merged into one region)."""


@dataclass(frozen=True)
class BlockRegion:
    """One ``[num_blocks, bytes_per_block]`` byte view of engine memory.

    ``view`` is a uint8 tensor of that shape on the engine's device whose rows
    may be strided (``view.stride(0) >= bytes_per_block``) but whose columns are
    contiguous bytes.
    """

    name: str
    view: torch.Tensor
    format: RegionFormat | None = None
    """What a block's bytes hold, when the resolver knows."""

    @property
    def num_blocks(self) -> int:
        return int(self.view.shape[0])

    @property
    def bytes_per_block(self) -> int:
        return int(self.view.shape[1])

    @property
    def block_stride_bytes(self) -> int:
        return int(self.view.stride(0))

    @property
    def data_ptr(self) -> int:
        return int(self.view.data_ptr())


@dataclass(frozen=True)
class KVLayout:
    """The resolved layout of an engine's KV cache."""

    regions: tuple[BlockRegion, ...]
    kind: str

    def __post_init__(self) -> None:
        if not self.regions:
            raise LayoutError("a layout needs at least one region")
        counts = {region.num_blocks for region in self.regions}
        if len(counts) != 1:
            raise LayoutError(f"regions disagree on the number of blocks: {sorted(counts)}")

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def device(self) -> torch.device:
        return self.regions[0].view.device

    @cached_property
    def record_offsets(self) -> tuple[int, ...]:
        """Byte offset of each region inside one host record."""
        offsets, total = [], 0
        for region in self.regions:
            offsets.append(total)
            total += region.bytes_per_block
        return tuple(offsets)

    @cached_property
    def record_regions(self) -> tuple[RecordRegion, ...]:
        """Each region's place in a host record and what it holds, for record codecs."""
        return tuple(
            RecordRegion(offset, region.bytes_per_block, region.format)
            for offset, region in zip(self.record_offsets, self.regions, strict=True)
        )

    @property
    def record_bytes(self) -> int:
        """Bytes of one block across all regions: the size of a host slot."""
        return sum(region.bytes_per_block for region in self.regions)

    @cached_property
    def fingerprint(self) -> str:
        """A short stable hash of the layout's shape (not its addresses), for key namespacing."""
        digest = hashlib.sha256(self.kind.encode())
        for region in self.regions:
            digest.update(f"|{region.name}:{region.bytes_per_block}".encode())
        return digest.hexdigest()[:16]


class LayoutResolver(ABC):
    """Turns an engine's KV tensors into a :class:`KVLayout`."""

    @abstractmethod
    def resolve(self, kv_caches: KVCaches) -> KVLayout:
        """Resolve ``kv_caches``; raise :class:`LayoutError` naming the tensor it cannot map."""
