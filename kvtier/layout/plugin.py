"""Built-in layout resolvers: ``flash_attn``, ``block_first``, ``mamba`` and ``auto``."""

from __future__ import annotations

import kvtier
from kvtier.hookspecs import Register
from kvtier.layout import resolvers


@kvtier.hookimpl
def register_layout_resolvers(register: Register) -> None:
    register("auto", resolvers.build_auto, resolvers.AutoLayoutConfig)
    register("flash_attn", resolvers.build_per_layer, resolvers.FlashAttnLayoutConfig)
    register("block_first", resolvers.build_per_layer, resolvers.BlockFirstLayoutConfig)
    register("mamba", resolvers.build_per_layer, resolvers.MambaLayoutConfig)
