"""The ``kernel`` copy backend: one gather/scatter kernel per batch, for many small blocks.

Per-copy DMA setup dominates when a batch is thousands of 16-32 KiB pieces.
This backend instead launches one kernel per batch that reads and writes the
pinned host buffer directly through its device mapping, with 16-byte accesses.
The kernel is CUDA C++ compiled at run time with NVRTC (cached per process)
and launched through the driver API; see :mod:`kvtier.cuda.driver` and
:mod:`kvtier.cuda.nvrtc`.

A batch's merged segments are cut into rows of at most ``chunk_bytes``; row
``i`` of the segment table (``src, dst, bytes``, three ``uint64``) is copied by
thread block ``i``. The table lives in mapped host memory from a small pool:
the kernel reads it in place, and a table is reused only after the launch
that read it finished.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.copy.base import Direction
from kvtier.copy.configs import KernelCopyConfig
from kvtier.copy.planner import Segments
from kvtier.copy.streamed import SegmentExecutor, StreamCopyBackend
from kvtier.cuda.driver import CudaDriver
from kvtier.cuda.pinning import mapped_offset
from kvtier.layout.base import KVLayout

logger = logging.getLogger(__name__)

KERNEL_NAME = "kvtier_copy_segments"

KERNEL_SOURCE = r"""
// kvtier gather/scatter copy: thread block i copies row i of a segment table
// (src address, dst address, bytes) in mapped host memory. Either side may be
// device memory or mapped pinned host memory; rows whose ends are 16-byte
// aligned move in 16-byte vectors, with four loads in flight per thread
// before their stores to keep the interconnect busy. Streaming (evict-first)
// cache hints: every byte is touched once, so it should not displace the
// model's working set in L2. Mapped host memory lies in the global window.
extern "C" __global__ void kvtier_copy_segments(
    const unsigned long long* __restrict__ table, unsigned int num_rows)
{
    const unsigned int row = blockIdx.x;
    if (row >= num_rows) {
        return;
    }
    const unsigned long long src_address = table[3 * row];
    const unsigned long long dst_address = table[3 * row + 1];
    const unsigned long long nbytes = table[3 * row + 2];
    const unsigned char* __restrict__ src = (const unsigned char*)src_address;
    unsigned char* __restrict__ dst = (unsigned char*)dst_address;
    const unsigned long long step = blockDim.x;
    unsigned long long tail = 0;
    if (((src_address | dst_address) & 15ull) == 0) {
        const uint4* __restrict__ src4 = (const uint4*)src;
        uint4* __restrict__ dst4 = (uint4*)dst;
        const unsigned long long vectors = nbytes >> 4;
        unsigned long long i = threadIdx.x;
        for (; i + 3 * step < vectors; i += 4 * step) {
            const uint4 a = __ldcs(src4 + i);
            const uint4 b = __ldcs(src4 + i + step);
            const uint4 c = __ldcs(src4 + i + 2 * step);
            const uint4 d = __ldcs(src4 + i + 3 * step);
            __stcs(dst4 + i, a);
            __stcs(dst4 + i + step, b);
            __stcs(dst4 + i + 2 * step, c);
            __stcs(dst4 + i + 3 * step, d);
        }
        for (; i < vectors; i += step) {
            __stcs(dst4 + i, __ldcs(src4 + i));
        }
        tail = vectors << 4;
    }
    for (unsigned long long i = tail + threadIdx.x; i < nbytes; i += step) {
        dst[i] = src[i];
    }
}
"""
"""CUDA C++ source of the copy kernel, compiled with NVRTC for the engine's device."""

TABLE_ROW_BYTES = 3 * 8
"""One segment table row: source address, destination address, bytes (``uint64`` each)."""

MIN_TABLE_BYTES = 64 << 10
"""Smallest mapped table allocation; larger ones are powers of two."""

MAX_GRID_X = (1 << 31) - 1
"""CUDA's limit on ``gridDim.x``: the most rows one launch can copy."""


def split_rows(segments: Segments, chunk_bytes: int) -> np.ndarray:
    """Cut segments into table rows of at most ``chunk_bytes``.

    Args:
        segments: Merged segments from the planner.
        chunk_bytes: Most bytes per row, a positive multiple of 16.

    Returns:
        A C-contiguous ``[rows, 3]`` ``uint64`` array of ``(src, dst, bytes)``.
    """
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    srcs, dsts, sizes = (
        np.asarray(array, dtype=np.uint64)
        for array in (segments.src, segments.dst, segments.nbytes)
    )
    chunk = np.uint64(chunk_bytes)
    pieces = np.maximum((sizes + chunk - np.uint64(1)) // chunk, np.uint64(1)).astype(np.int64)
    owner = np.repeat(np.arange(len(sizes)), pieces)
    first_row = np.cumsum(pieces) - pieces
    index = (np.arange(len(owner)) - first_row[owner]).astype(np.uint64)
    offsets = index * chunk
    rows = np.empty((len(owner), 3), dtype=np.uint64)
    rows[:, 0] = srcs[owner] + offsets
    rows[:, 1] = dsts[owner] + offsets
    rows[:, 2] = np.minimum(sizes[owner] - offsets, chunk)
    return rows


@dataclass
class _Table:
    address: int
    device_address: int
    nbytes: int
    fence: int | None = None


class MappedTablePool:
    """Mapped host buffers for segment tables, each reused once its last launch finished.

    Used from the copy backend's worker thread only.
    """

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._tables: list[_Table] = []

    def acquire(self, nbytes: int) -> _Table:
        """A table of at least ``nbytes`` that no queued launch still reads."""
        for table in sorted(self._tables, key=lambda t: t.nbytes):
            if table.nbytes >= nbytes and self._idle(table):
                return table
        size = max(MIN_TABLE_BYTES, 1 << (nbytes - 1).bit_length())
        address = self._driver.host_alloc_mapped(size)
        table = _Table(address, self._driver.host_device_pointer(address), size)
        self._tables.append(table)
        logger.debug("allocated a %d-byte mapped segment table", size)
        return table

    def release(self, table: _Table, stream: int) -> None:
        """Mark ``table`` in use until the work queued so far on ``stream`` finished."""
        if table.fence is None:
            table.fence = self._driver.event_create()
        self._driver.event_record(table.fence, stream)

    def _idle(self, table: _Table) -> bool:
        return table.fence is None or self._driver.event_query(table.fence)

    def close(self) -> None:
        """Wait for the launches that read the tables, then free them."""
        for table in self._tables:
            if table.fence is not None:
                self._driver.event_synchronize(table.fence)
                self._driver.event_destroy(table.fence)
            self._driver.host_free(table.address)
        self._tables.clear()


class KernelExecutor(SegmentExecutor):
    """Queues a batch as one launch of the copy kernel."""

    name = "kernel"

    def __init__(self, config: KernelCopyConfig) -> None:
        self._config = config
        self._kernel: int | None = None
        self._host_offset = 0
        self._pool: MappedTablePool | None = None

    def setup(self, driver: CudaDriver, layout: KVLayout, host_buffer: torch.Tensor) -> None:
        """Compile and load the kernel and find the host buffer's device mapping.

        Raises:
            kvtier.cuda.PinningError: The host buffer is not pinned and mapped.
            kvtier.cuda.CudaError: NVRTC or loading the kernel failed.
        """
        self._host_offset = mapped_offset(driver, host_buffer.data_ptr(), host_buffer.numel())
        self._kernel = driver.load_kernel(KERNEL_SOURCE, KERNEL_NAME)
        self._pool = MappedTablePool(driver)

    def execute(
        self, driver: CudaDriver, segments: Segments, direction: Direction, stream: int
    ) -> None:
        assert self._kernel is not None and self._pool is not None, "setup() runs first"
        rows = split_rows(segments, self._config.chunk_bytes)
        if len(rows) == 0:
            return
        if len(rows) > MAX_GRID_X:
            raise ValueError(f"a batch of {len(rows)} rows exceeds one launch ({MAX_GRID_X})")
        host_column = 1 if direction is Direction.STORE else 0
        rows[:, host_column] += np.uint64(self._host_offset % (1 << 64))  # wraps like pointers
        table = self._pool.acquire(rows.nbytes)
        ctypes.memmove(table.address, rows.ctypes.data, rows.nbytes)
        driver.launch_kernel(
            self._kernel,
            (len(rows), 1, 1),
            (self._config.threads_per_block, 1, 1),
            (ctypes.c_uint64(table.device_address), ctypes.c_uint32(len(rows))),
            stream,
        )
        self._pool.release(table, stream)

    def close(self, driver: CudaDriver) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def build_kernel_backend(
    config: KernelCopyConfig, layout: KVLayout, host_buffer: torch.Tensor
) -> StreamCopyBackend:
    """Factory of the ``kernel`` copy backend (see :meth:`StreamCopyBackend.open`)."""
    return StreamCopyBackend.open(
        layout, host_buffer, KernelExecutor(config), stream_priority=config.stream_priority
    )
