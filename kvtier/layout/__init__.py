"""Layout resolvers: engine KV tensors to ``[num_blocks, bytes_per_block]`` block regions."""

from kvtier.layout.base import (
    BlockRegion,
    KVCaches,
    KVLayout,
    LayoutError,
    LayoutResolver,
    RecordRegion,
    RegionFormat,
)

__all__ = [
    "BlockRegion",
    "KVCaches",
    "KVLayout",
    "LayoutError",
    "LayoutResolver",
    "RecordRegion",
    "RegionFormat",
]
