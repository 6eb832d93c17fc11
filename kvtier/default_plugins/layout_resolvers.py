"""Built-in layout resolvers: ``flash_attn``, ``block_first``, ``mamba`` and ``auto``.

The resolvers (and torch) are imported only when a layout is resolved.
"""

from __future__ import annotations

from kvtier.api import LayoutResolverFactory, LazyFactory, Register, hookimpl
from kvtier.layout import configs

_PER_LAYER = LazyFactory("kvtier.layout.resolvers", "build_per_layer")


@hookimpl
def register_layout_resolvers(register: Register[LayoutResolverFactory]) -> None:
    register("auto", LazyFactory("kvtier.layout.resolvers", "build_auto"), configs.AutoLayoutConfig)
    register("flash_attn", _PER_LAYER, configs.FlashAttnLayoutConfig)
    register("block_first", _PER_LAYER, configs.BlockFirstLayoutConfig)
    register("mamba", _PER_LAYER, configs.MambaLayoutConfig)
