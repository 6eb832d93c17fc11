"""What the copy tests share: a layout's blocks as host records."""

from __future__ import annotations

import torch

from kvtier.layout.base import KVLayout


def records(layout: KVLayout, blocks: list[int]) -> torch.Tensor:
    """The bytes of ``blocks``, one row per block, its regions side by side as a host slot."""
    return torch.cat([region.view[blocks] for region in layout.regions], dim=1)
