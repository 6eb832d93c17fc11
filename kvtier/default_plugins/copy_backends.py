"""Built-in copy backends, each imported (with torch and CUDA) only when a config picks it."""

from __future__ import annotations

from kvtier.api import CopyBackendFactory, LazyFactory, Register, hookimpl
from kvtier.copy import configs


@hookimpl
def register_copy_backends(register: Register[CopyBackendFactory]) -> None:
    register("torch", LazyFactory("kvtier.copy.torch_backend", "build"), configs.TorchCopyConfig)
    register("dma", LazyFactory("kvtier.copy.dma", "build_dma_backend"), configs.DmaCopyConfig)
    register(
        "kernel",
        LazyFactory("kvtier.copy.kernel", "build_kernel_backend"),
        configs.KernelCopyConfig,
    )
    register("auto", LazyFactory("kvtier.copy.auto", "build_auto_backend"), configs.AutoCopyConfig)
