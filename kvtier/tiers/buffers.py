"""Buffers that a tier's I/O threads read records into, reused from one read to the next.

A record read into a new multi-megabyte allocation pays a page fault per 4 KiB
page before the first byte lands, and glibc hands such blocks back to the
system as soon as the last one is freed. A tier whose reader copies each
record out and drops it (the host tier's promotions do) would fault every page
of every record in again. :class:`ReadBuffers` keeps the buffers instead.

A buffer is handed out again once the pool holds the only reference to it: the
reader dropped the record and every view of it (a ``memoryview`` or a numpy
array of a buffer holds a reference to it), so a record still in use is never
written over. Each I/O thread has buffers of its own, at most
``keep_bytes`` of them; a read that finds none free gets a new buffer, kept if
there is room.
"""

from __future__ import annotations

import sys
import threading
from collections import deque

import numpy as np

KEEP_BYTES = 32 << 20
"""Bytes of buffers each I/O thread keeps: a few reads of 2 MiB records in flight."""


def _free_refs() -> int:
    """``sys.getrefcount`` of a kept buffer that nobody else holds, asked as
    :meth:`ReadBuffers.take` asks it (the count differs between Python versions)."""
    pool = deque([(np.empty(1, np.uint8), 0)])
    return sys.getrefcount(pool[0][0])


_FREE_REFS = _free_refs()


class ReadBuffers:
    """Per-thread buffers of ``capacity`` bytes, each thread keeping at most ``keep_bytes``;
    each view handed out starts on a multiple of ``align`` bytes (``O_DIRECT`` needs pages)."""

    def __init__(self, capacity: int, keep_bytes: int = KEEP_BYTES, align: int = 1) -> None:
        if capacity < 1 or align < 1:
            raise ValueError(f"capacity and align must be at least 1, got {capacity}, {align}")
        self.capacity = capacity
        self.align = align
        self.keep = max(1, keep_bytes // capacity)
        """Buffers each thread keeps."""
        self.kept_bytes = 0
        """Bytes of the buffers every thread keeps (each is kept until the pool is dropped,
        so this only grows: to at most ``keep`` buffers a thread)."""
        self._kept_lock = threading.Lock()
        self._local = threading.local()

    def take(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes (contents undefined), in a buffer of this
        thread's that nobody holds, or a new one.

        The thread's buffers are handed out in turn, as readers drop records in
        about the order they got them: only the next one in turn is looked at, so a
        buffer somebody keeps costs one new buffer per turn and never a search. A
        ``size`` above :attr:`capacity` gets a buffer of its own, never kept.
        """
        if size > self.capacity:
            buffer, skip = self._new(size)
            return memoryview(buffer)[skip : skip + size]
        pool: deque[tuple[np.ndarray, int]] | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = deque()
        free = bool(pool) and sys.getrefcount(pool[0][0]) == _FREE_REFS
        pool.rotate(-1)
        if free:
            buffer, skip = pool[-1]
        else:
            buffer, skip = self._new(self.capacity)
            if len(pool) < self.keep:
                pool.append((buffer, skip))
                with self._kept_lock:
                    self.kept_bytes += buffer.nbytes
        return memoryview(buffer)[skip : skip + size]

    def _new(self, size: int) -> tuple[np.ndarray, int]:
        """A new buffer with room for ``size`` bytes from an aligned start, and that start;
        no zero-fill: the caller writes it."""
        if self.align == 1:
            return np.empty(size, np.uint8), 0
        buffer = np.empty(size + self.align - 1, np.uint8)
        return buffer, -buffer.ctypes.data % self.align
