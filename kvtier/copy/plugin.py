"""Built-in copy backends."""

from __future__ import annotations

import kvtier
from kvtier.copy import auto, dma, kernel, torch_backend
from kvtier.hookspecs import Register


@kvtier.hookimpl
def register_copy_backends(register: Register) -> None:
    register("torch", torch_backend.build, torch_backend.TorchCopyConfig)
    register("dma", dma.build_dma_backend, dma.DmaCopyConfig)
    register("kernel", kernel.build_kernel_backend, kernel.KernelCopyConfig)
    register("auto", auto.build_auto_backend, auto.AutoCopyConfig)
