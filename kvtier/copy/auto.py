"""The ``auto`` copy backend: per batch, the ``kernel`` for small segments and ``dma`` otherwise.

The copy kernel wins when a batch is many small pieces (per-copy DMA setup
dominates); the copy engines win on large ones (the kernel competes with the
model for SMs and stalls on host latency). ``auto`` looks at each batch's
mean merged segment size and sends it to whichever side of
``kernel_below_bytes`` it falls; both share one worker thread and one stream
per direction, so batches stay in submission order. The default threshold
(128 KiB) lies between the block sizes at which each is meant to win (the
kernel at 16-32 KiB, DMA from 256 KiB); it is not a measurement. Replace it
with the crossover that ``benchmarks/gpu_check.sh`` reports for the machine
(``auto_kernel_below_bytes_measured`` in its ``targets.json``; see docs/gpu.md).

If the kernel cannot be used (host buffer not pinned and mapped, NVRTC
missing), ``auto`` says so once and uses ``dma`` for every batch.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from kvtier.copy.base import Direction
from kvtier.copy.configs import AutoCopyConfig, DmaCopyConfig, KernelCopyConfig
from kvtier.copy.dma import DmaExecutor
from kvtier.copy.kernel import KernelExecutor
from kvtier.copy.planner import Segments
from kvtier.copy.streamed import SegmentExecutor, StreamCopyBackend
from kvtier.cuda.bindings import CudaError
from kvtier.cuda.driver import CudaDriver
from kvtier.cuda.pinning import PinningError
from kvtier.layout.base import KVLayout

logger = logging.getLogger(__name__)


class AutoExecutor(SegmentExecutor):
    """Sends each batch to the kernel or to DMA by its mean segment size."""

    name = "auto"

    def __init__(self, config: AutoCopyConfig) -> None:
        self._threshold = config.kernel_below_bytes
        self._dma = DmaExecutor(DmaCopyConfig(stream_priority=config.stream_priority))
        self._kernel: KernelExecutor | None = KernelExecutor(
            KernelCopyConfig(
                stream_priority=config.stream_priority,
                threads_per_block=config.kernel_threads_per_block,
                chunk_bytes=config.kernel_chunk_bytes,
            )
        )
        self.choices: Counter[str] = Counter()
        """How many batches each executor ran, by name."""

    def setup(self, driver: CudaDriver, layout: KVLayout, host_buffer: torch.Tensor) -> None:
        self._dma.setup(driver, layout, host_buffer)
        if self._threshold == 0 or self._kernel is None:
            self._kernel = None
            return
        try:
            self._kernel.setup(driver, layout, host_buffer)
        except (PinningError, CudaError) as exc:
            logger.warning(
                "the auto copy backend uses dma only; the copy kernel is unusable: %s", exc
            )
            self._kernel = None

    def pick(self, segments: Segments) -> SegmentExecutor:
        """The executor for ``segments``: the kernel below the threshold, else DMA."""
        if self._kernel is not None and len(segments):
            if segments.total_bytes < self._threshold * len(segments):
                return self._kernel
        return self._dma

    def execute(
        self, driver: CudaDriver, segments: Segments, direction: Direction, stream: int
    ) -> None:
        executor = self.pick(segments)
        self.choices[executor.name] += 1
        executor.execute(driver, segments, direction, stream)

    def close(self, driver: CudaDriver) -> None:
        if self._kernel is not None:
            self._kernel.close(driver)
        self._dma.close(driver)


def build_auto_backend(
    config: AutoCopyConfig, layout: KVLayout, host_buffer: torch.Tensor
) -> StreamCopyBackend:
    """Factory of the ``auto`` copy backend.

    Raises:
        kvtier.cuda.CudaUnavailable: The layout is not on a CUDA
            device or CUDA cannot be used ("needs CUDA: ...").
    """
    return StreamCopyBackend.open(
        layout, host_buffer, AutoExecutor(config), stream_priority=config.stream_priority
    )
