"""The built-in layout resolvers: ``flash_attn``, ``block_first``, ``mamba`` and ``auto``.

Every resolver reads shapes and strides only (see :mod:`kvtier.layout.spans`)
and returns a :class:`~kvtier.layout.KVLayout` whose ``kind`` names it:

- ``flash_attn``: each layer is one ``(2, num_blocks, ...)`` tensor, K and V
  along dimension 0 (vLLM's FlashAttention ``(2, nb, bs, H, D)``, in either
  the NHD or the HND stride order, or with K/V packed inside each block).
- ``block_first``: each layer is one ``(num_blocks, ...)`` tensor: FlashInfer
  ``(nb, 2, bs, H, D)``, MLA ``(nb, bs, 576)``, vLLM's CPU backend
  ``(nb, H, bs, 2*D)``, cross-layer ``(nb, L, 2, bs, H, D)``, or a raw page
  view such as vLLM's ``[nb, 1, 1, page]`` Mamba allocation.
- ``mamba``: each layer is a list of state tensors (conv, ssm, ...), each
  ``(num_blocks, ...)`` and strided by the (padded) page that holds one
  block's states; states packed next to each other become one region.
- ``auto``: picks one of the above per layer from the value's type and shape,
  choosing the block count every layer agrees on, and fails naming the tensor
  it could not fit.

Storage shared by several layers, or layers packed side by side within each
block, is counted once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import torch

from kvtier.layout.base import KVCaches, KVLayout, LayoutError, LayoutResolver
from kvtier.layout.configs import (
    AutoLayoutConfig,
    BlockFirstLayoutConfig,
    FlashAttnLayoutConfig,
    MambaLayoutConfig,
)
from kvtier.layout.spans import Span, describe, spans_to_layout, tensor_spans

logger = logging.getLogger(__name__)


def _tensor(name: str, value: object, kind: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise LayoutError(
            f"{kind}: layer {name} is a {type(value).__name__}, not a tensor; "
            "use the 'mamba' or 'auto' layout for lists of state tensors"
        )
    return value


def _flash_attn_spans(name: str, value: object) -> list[Span]:
    tensor = _tensor(name, value, "flash_attn")
    if tensor.dim() < 3 or tensor.shape[0] != 2:
        raise LayoutError(
            f"flash_attn: layer {name} is not a (2, num_blocks, ...) K/V tensor "
            f"({describe(tensor)})"
        )
    # (2, nb, block_size, kv_heads, head_dim): K/V and heads get scales of their own.
    return tensor_spans(name, tensor, block_dim=1, scale_dims={0, 3} if tensor.dim() == 5 else {0})


_BLOCK_FIRST_SCALES: dict[int, tuple[set[int], bool]] = {
    3: (set(), False),  # MLA (nb, block_size, latent): one scale per block
    4: ({1}, True),  # vLLM's CPU cache (nb, kv_heads, block_size, 2 * head_dim)
    5: ({1, 3}, False),  # FlashInfer (nb, 2, block_size, kv_heads, head_dim)
    6: ({1, 2, 4}, False),  # cross-layer (nb, layers, 2, block_size, kv_heads, head_dim)
}
"""What the dimensions of a ``(num_blocks, ...)`` attention tensor index, by its rank."""


def _block_first_spans(name: str, value: object) -> list[Span]:
    tensor = _tensor(name, value, "block_first")
    if tensor.dim() < 2:
        raise LayoutError(
            f"block_first: layer {name} is not a (num_blocks, ...) tensor with per-block "
            f"contents ({describe(tensor)})"
        )
    scale_dims, kv_in_last_dim = _BLOCK_FIRST_SCALES.get(tensor.dim(), (None, False))
    return tensor_spans(
        name, tensor, block_dim=0, scale_dims=scale_dims, kv_in_last_dim=kv_in_last_dim
    )


def _mamba_spans(name: str, value: object) -> list[Span]:
    if isinstance(value, torch.Tensor):
        return tensor_spans(name, _tensor(name, value, "mamba"), block_dim=0)
    states = _states(name, value, "mamba")
    spans: list[Span] = []
    for index, state in enumerate(states):
        spans.extend(tensor_spans(f"{name}.{index}", state, block_dim=0))
    return spans


def _states(name: str, value: object, kind: str) -> Sequence[torch.Tensor]:
    if not isinstance(value, (list, tuple)) or not value:
        raise LayoutError(
            f"{kind}: layer {name} must be a non-empty list of state tensors, got "
            f"{type(value).__name__}"
        )
    for index, state in enumerate(value):
        if not isinstance(state, torch.Tensor) or state.dim() < 1:
            raise LayoutError(
                f"{kind}: state {index} of layer {name} is not a (num_blocks, ...) tensor "
                f"({type(state).__name__})"
            )
    return value


_READERS = {
    "flash_attn": _flash_attn_spans,
    "block_first": _block_first_spans,
    "mamba": _mamba_spans,
}


class PerLayerResolver(LayoutResolver):
    """Resolves every layer the same way: ``flash_attn``, ``block_first`` or ``mamba``."""

    def __init__(self, kind: str) -> None:
        """Bind the resolver to one of the built-in per-layer layouts.

        Args:
            kind: ``"flash_attn"``, ``"block_first"`` or ``"mamba"``.

        Raises:
            ValueError: If ``kind`` is not one of those.
        """
        if kind not in _READERS:
            raise ValueError(f"unknown per-layer layout {kind!r}; choose from {sorted(_READERS)}")
        self.kind = kind

    def resolve(self, kv_caches: KVCaches) -> KVLayout:
        """Resolve ``kv_caches`` layer by layer.

        Raises:
            LayoutError: Naming the first layer whose tensor does not fit.
        """
        if not kv_caches:
            raise LayoutError(f"{self.kind}: no KV-cache tensors to resolve")
        read = _READERS[self.kind]
        spans: list[Span] = []
        for name, value in kv_caches.items():
            spans.extend(read(name, value))
        layout = spans_to_layout(spans, self.kind)
        logger.debug(
            "%s layout: %d layers -> %d regions, %d bytes per block",
            self.kind,
            len(kv_caches),
            len(layout.regions),
            layout.record_bytes,
        )
        return layout


def _readings(name: str, value: object) -> list[tuple[str, int]]:
    """The ``(kind, num_blocks)`` readings a layer's value admits, preferred first."""
    if isinstance(value, (list, tuple)):
        states = _states(name, value, "auto")
        return [("mamba", int(states[0].shape[0]))]
    if not isinstance(value, torch.Tensor):
        raise LayoutError(
            f"auto: layer {name} is a {type(value).__name__}; expected a tensor or a list of "
            "state tensors"
        )
    if value.dim() < 2:
        raise LayoutError(
            f"auto: cannot tell which dimension of layer {name} indexes blocks "
            f"({describe(value)}); a KV-cache tensor has at least two dimensions"
        )
    readings = [("block_first", int(value.shape[0]))]
    if value.dim() >= 3 and value.shape[0] == 2:
        readings.insert(0, ("flash_attn", int(value.shape[1])))
    return readings


class AutoResolver(LayoutResolver):
    """Chooses ``flash_attn``, ``block_first`` or ``mamba`` for each layer.

    The block count is the one every layer admits (a ``(2, n, ...)`` tensor
    admits ``n`` as ``flash_attn`` and 2 as ``block_first``); the layout's
    ``kind`` is the chosen resolver, or several joined by ``+`` for hybrid
    models.
    """

    def resolve(self, kv_caches: KVCaches) -> KVLayout:
        """Resolve ``kv_caches``, inferring each layer's layout.

        Raises:
            LayoutError: Naming the tensor, with its shape and strides, that no
                built-in layout fits or whose block count differs from the others.
        """
        if not kv_caches:
            raise LayoutError("auto: no KV-cache tensors to resolve")
        readings = {name: _readings(name, value) for name, value in kv_caches.items()}
        support = Counter(nb for options in readings.values() for nb in {nb for _, nb in options})
        common = [nb for nb, count in support.items() if count == len(readings)]
        if not common:
            majority = support.most_common(1)[0][0]
            name = next(
                layer
                for layer, options in readings.items()
                if all(nb != majority for _, nb in options)
            )
            value = kv_caches[name]
            shape = describe(value) if isinstance(value, torch.Tensor) else f"{len(value)} states"
            raise LayoutError(
                f"auto: cannot resolve layer {name} ({shape}): read as "
                f"{' or '.join(f'{kind} it has {nb} blocks' for kind, nb in readings[name])}, "
                f"but most layers have {majority}; set the layout type explicitly or pass one "
                "KV-cache group at a time"
            )
        num_blocks = max(common)
        spans: list[Span] = []
        kinds: set[str] = set()
        for name, value in kv_caches.items():
            kind = next(kind for kind, nb in readings[name] if nb == num_blocks)
            kinds.add(kind)
            spans.extend(_READERS[kind](name, value))
        layout = spans_to_layout(spans, "+".join(sorted(kinds)))
        logger.debug(
            "auto layout %s: %d layers -> %d regions, %d bytes per block",
            layout.kind,
            len(kv_caches),
            len(layout.regions),
            layout.record_bytes,
        )
        return layout


def build_per_layer(
    config: FlashAttnLayoutConfig | BlockFirstLayoutConfig | MambaLayoutConfig,
) -> PerLayerResolver:
    """Build the ``flash_attn``, ``block_first`` or ``mamba`` resolver named by ``config.type``."""
    return PerLayerResolver(config.type)


def build_auto(config: AutoLayoutConfig) -> AutoResolver:
    """Build the ``auto`` resolver."""
    return AutoResolver()
