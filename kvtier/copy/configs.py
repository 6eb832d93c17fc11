"""Config models of the built-in copy backends, importable without torch or CUDA.

The backends themselves (:mod:`kvtier.copy.torch_backend`, :mod:`~kvtier.copy.dma`,
:mod:`~kvtier.copy.kernel`, :mod:`~kvtier.copy.auto`) are imported only when a
config selects one; validating a config needs these models alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier.config.units import ByteCount
from kvtier.models import PluginConfig


class StreamCopyConfig(PluginConfig):
    """Settings every streamed CUDA copy backend (``dma``, ``kernel``, ``auto``) shares."""

    stream_priority: int | None = Field(
        default=None,
        ge=-(2**31),
        le=2**31 - 1,
        description=(
            "CUDA priority of the copy streams; lower numbers run first. Default: the lowest "
            "priority the device offers, so copies yield to the engine's compute."
        ),
    )


class TorchCopyConfig(PluginConfig):
    """Copies with plain torch operations on CPU or CUDA."""

    type: Literal["torch"] = Field(default="torch", description="Use the torch copy backend.")
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description=(
            "Threads that copy one large batch on CPU, the caller's included; by default "
            "torch's intra-op thread count (at most 16). Runs of 256 KiB and more of "
            "consecutive blocks and slots are split by torch over its own intra-op threads "
            "instead. Unused on CUDA."
        ),
    )
    cuda_staging_bytes: ByteCount = Field(
        default=256 << 20,
        description=(
            "Largest device staging buffer a CUDA batch uses at a time, in bytes; larger "
            "batches are copied in chunks of this size. Unused on CPU."
        ),
    )


class DmaCopyConfig(StreamCopyConfig):
    """Config of the ``dma`` copy backend."""

    type: Literal["dma"] = Field(
        default="dma", description="Use the dma copy backend (batched CUDA DMA)."
    )
    batched: bool = Field(
        default=True,
        description=(
            "Use one cuMemcpyBatchAsync call per batch where the driver has it (CUDA 12.8+); "
            "false issues one cuMemcpyAsync per segment."
        ),
    )


class KernelCopyConfig(StreamCopyConfig):
    """Config of the ``kernel`` copy backend."""

    type: Literal["kernel"] = Field(
        default="kernel",
        description="Use the kernel copy backend (one CUDA gather/scatter kernel per batch).",
    )
    threads_per_block: int = Field(
        default=256,
        ge=32,
        le=1024,
        multiple_of=32,
        description="Threads per thread block of the copy kernel (a multiple of the warp size).",
    )
    chunk_bytes: int = Field(
        default=64 << 10,
        ge=16,
        le=1 << 30,
        multiple_of=16,
        description=(
            "Most bytes one thread block copies; longer segments are cut into several rows. "
            "A multiple of 16 so that cut rows stay 16-byte aligned."
        ),
    )


class AutoCopyConfig(StreamCopyConfig):
    """Config of the ``auto`` copy backend."""

    type: Literal["auto"] = Field(
        default="auto",
        description="Use the auto copy backend (kernel or dma per batch, by segment size).",
    )
    kernel_below_bytes: int = Field(
        default=128 << 10,
        ge=0,
        description=(
            "Batches whose mean merged segment is smaller than this many bytes use the copy "
            "kernel, the others batched DMA; 0 always uses DMA. Measure the crossover with "
            "benchmarks/gpu_check.sh."
        ),
    )
    kernel_threads_per_block: int = Field(
        default=256,
        ge=32,
        le=1024,
        multiple_of=32,
        description="Threads per thread block of the copy kernel (a multiple of the warp size).",
    )
    kernel_chunk_bytes: int = Field(
        default=64 << 10,
        ge=16,
        le=1 << 30,
        multiple_of=16,
        description="Most bytes one thread block of the copy kernel copies (a multiple of 16).",
    )
