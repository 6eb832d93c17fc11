"""A copy backend that moves no bytes, for timing everything around the copies.

:class:`NoCopyBackend` finishes every batch the moment it is submitted and
touches neither the engine's blocks nor the host buffer, so a benchmark of
the worker half measures its Python bookkeeping alone (on a GPU, the copy
engine's time is the device's, not the worker's). :func:`no_copy_registry`
registers it as copy backend type ``none``, for code that builds its backend
from a config (an engine's connector).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import Field

import kvtier
from kvtier.config import PluginConfig
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle

if TYPE_CHECKING:
    import torch

    from kvtier.layout.base import KVLayout
    from kvtier.plugins import Registry


class NoCopyBackend(CopyBackend):
    """Every batch is done at once; nothing is copied."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._closed = False
        self.batches = 0
        """Batches submitted so far."""

    def submit(self, batch: CopyBatch) -> CopyHandle:
        if self._closed:
            raise CopyError("the no-copy backend is closed; build a new one")
        self.batches += 1
        return CopyHandle(next(self._ids), batch.direction, len(batch))

    def done(self, handle: CopyHandle) -> bool:
        return True

    def wait(self, handle: CopyHandle) -> None:
        pass

    def close(self) -> None:
        self._closed = True


class NoCopyConfig(PluginConfig):
    """Copies that move nothing (benchmarks of the worker's bookkeeping only)."""

    type: Literal["none"] = Field(
        default="none", description="Finish every copy at once without moving bytes."
    )


class _NoCopyPlugin:
    @kvtier.hookimpl
    def register_copy_backends(self, register: Callable[..., None]) -> None:
        def build(config: NoCopyConfig, layout: KVLayout, host_buffer: torch.Tensor) -> CopyBackend:
            return NoCopyBackend()

        register("none", build, NoCopyConfig)


def no_copy_registry() -> Registry:
    """The built-in plugins plus copy backend ``none``.

    Returns:
        A registry to stand in for :func:`kvtier.plugins.default_registry` (patch
        ``kvtier.plugins._default_registry`` with it) while a config names ``{"type": "none"}``.
    """
    from kvtier.plugins import build_plugin_manager, collect

    manager = build_plugin_manager()
    manager.register(_NoCopyPlugin(), name="kvtier-benchmarks-no-copy")
    return collect(manager)
