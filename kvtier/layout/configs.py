"""Config models of the built-in layout resolvers, importable without torch.

The resolvers (:mod:`kvtier.layout.resolvers`) are imported only when a layout is resolved.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier.models import PluginConfig


class FlashAttnLayoutConfig(PluginConfig):
    """Layers are ``(2, num_blocks, ...)`` tensors with K and V along dimension 0."""

    type: Literal["flash_attn"] = Field(
        default="flash_attn", description="Resolve (2, num_blocks, ...) K/V tensors."
    )


class BlockFirstLayoutConfig(PluginConfig):
    """Layers are ``(num_blocks, ...)`` tensors."""

    type: Literal["block_first"] = Field(
        default="block_first", description="Resolve (num_blocks, ...) tensors."
    )


class MambaLayoutConfig(PluginConfig):
    """Layers are lists of state tensors, each ``(num_blocks, ...)``, sharing one page per block."""

    type: Literal["mamba"] = Field(
        default="mamba", description="Resolve per-layer lists of (num_blocks, ...) state tensors."
    )


class AutoLayoutConfig(PluginConfig):
    """Infer each layer's layout from its shape and strides."""

    type: Literal["auto"] = Field(
        default="auto",
        description=(
            "Pick flash_attn, block_first or mamba per layer; when a tensor reads either as "
            "(2, num_blocks, ...) or as a 2-block (num_blocks, ...) cache, flash_attn wins."
        ),
    )
