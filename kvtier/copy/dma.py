"""The ``dma`` copy backend: one ``cuMemcpyBatchAsync`` per batch on the copy engines.

Each batch's merged segments go to the driver in a single batched call
(CUDA 12.8 or newer; the 12.8 and 13 ABIs are both handled in
:mod:`kvtier.cuda.driver`), queued from the backend's worker thread on a
low-priority stream per direction. Sources are read in stream order, after the
compute the batch waits for. On older drivers each segment is one
``cuMemcpyAsync``. Best for blocks of a few hundred KiB and up, where the copy
engines reach the interconnect's bandwidth.
"""

from __future__ import annotations

import logging

import torch

from kvtier.copy.base import Direction
from kvtier.copy.configs import DmaCopyConfig
from kvtier.copy.planner import Segments
from kvtier.copy.streamed import (
    SegmentExecutor,
    StreamCopyBackend,
    as_address_arrays,
)
from kvtier.cuda.driver import CudaDriver
from kvtier.layout.base import KVLayout

logger = logging.getLogger(__name__)


class DmaExecutor(SegmentExecutor):
    """Queues a batch as one batched DMA call, or one copy per segment."""

    name = "dma"

    def __init__(self, config: DmaCopyConfig) -> None:
        self._batched = config.batched

    def setup(self, driver: CudaDriver, layout: KVLayout, host_buffer: torch.Tensor) -> None:
        if self._batched and not driver.has_memcpy_batch:
            logger.warning(
                "CUDA driver %d has no cuMemcpyBatchAsync (needs 12.8 or newer); the dma backend "
                "issues one copy per segment, which is slower for many small blocks",
                driver.driver_version(),
            )

    def execute(
        self, driver: CudaDriver, segments: Segments, direction: Direction, stream: int
    ) -> None:
        if len(segments) == 0:
            return
        if self._batched and driver.has_memcpy_batch:
            dsts, srcs, sizes = as_address_arrays(segments)
            driver.memcpy_batch(dsts, srcs, sizes, stream)
            return
        for src, dst, nbytes in segments:
            driver.memcpy_async(dst, src, nbytes, stream)


def build_dma_backend(
    config: DmaCopyConfig, layout: KVLayout, host_buffer: torch.Tensor
) -> StreamCopyBackend:
    """Factory of the ``dma`` copy backend.

    Raises:
        kvtier.cuda.CudaUnavailable: The layout is not on a CUDA
            device or CUDA cannot be used ("needs CUDA: ...").
    """
    return StreamCopyBackend.open(
        layout, host_buffer, DmaExecutor(config), stream_priority=config.stream_priority
    )
