"""Pinning the host tier's buffer: page-lock a plain allocation for fast, asynchronous GPU copies.

The buffer is allocated plainly (``torch.empty``) and registered with
``cuMemHostRegister`` (the driver call behind ``cudaHostRegister``), portable
and mapped into the device address space, in chunks: single registrations
above some tens of GiB fail on some drivers. ``pin_memory=True`` is avoided on
purpose: its allocator rounds sizes up to a power of two.

Pinning is an optimisation, never a requirement: when CUDA is unavailable or a
registration fails, :func:`pin_host_buffer` logs a warning, undoes what it
registered and returns ``None``; the buffer stays usable, unpinned.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from kvtier.cuda.bindings import CudaError, CudaUnavailable
from kvtier.cuda.driver import CudaDriver, open_driver

logger = logging.getLogger(__name__)

GiB = 1 << 30

DEFAULT_CHUNK_BYTES = 16 * GiB
"""Largest single registration: well below the sizes at which some drivers refuse one."""

CHUNK_ALIGN_BYTES = 2 << 20
"""Chunk sizes are multiples of this (a huge page), so no page belongs to two registrations."""


class PinningError(RuntimeError):
    """Host memory is not pinned and mapped the way a caller needs."""


@dataclass(frozen=True)
class Chunk:
    """One registration: ``nbytes`` of host memory starting at ``address``."""

    address: int
    nbytes: int


def plan_chunks(address: int, nbytes: int, chunk_bytes: int) -> list[Chunk]:
    """Split ``[address, address + nbytes)`` into registrations of at most ``chunk_bytes``.

    Chunk boundaries fall on multiples of ``chunk_bytes`` in the address space,
    so two registrations never share a page.

    Raises:
        ValueError: ``nbytes`` is not positive or ``chunk_bytes`` is not a
            positive multiple of :data:`CHUNK_ALIGN_BYTES`.
    """
    if nbytes <= 0:
        raise ValueError(f"cannot pin {nbytes} bytes; the buffer must not be empty")
    if chunk_bytes <= 0 or chunk_bytes % CHUNK_ALIGN_BYTES:
        raise ValueError(
            f"chunk_bytes must be a positive multiple of {CHUNK_ALIGN_BYTES} (2 MiB), "
            f"got {chunk_bytes}"
        )
    chunks, start, end = [], address, address + nbytes
    while start < end:
        stop = min(end, (start // chunk_bytes + 1) * chunk_bytes)
        chunks.append(Chunk(start, stop - start))
        start = stop
    return chunks


def mapped_offset(driver: CudaDriver, address: int, nbytes: int) -> int:
    """The constant ``device address - host address`` of mapped host memory.

    Args:
        driver: The driver of the device that will access the memory.
        address: Start of page-locked, mapped host memory.
        nbytes: Its length.

    Raises:
        PinningError: The memory is not page-locked and mapped, or its mapping
            is not one contiguous range (the device cannot address it as one
            buffer).
    """
    with driver.activated():
        try:
            first = driver.host_device_pointer(address) - address
            last_byte = address + nbytes - 1
            last = driver.host_device_pointer(last_byte) - last_byte
        except CudaError as exc:
            raise PinningError(
                f"host memory at {address:#x} ({nbytes} bytes) is not pinned and mapped for "
                f"device {driver.device_index}: {exc}; pin it with "
                "kvtier.cuda.pinning.pin_host_buffer"
            ) from exc
    if first != last:
        raise PinningError(
            f"host memory at {address:#x} ({nbytes} bytes) is not mapped as one contiguous "
            f"device range (offsets {first:#x} and {last:#x}); this system lacks unified addressing"
        )
    return first


class PinnedRegion:
    """A host buffer registered with CUDA; :meth:`close` unregisters it.

    Holds a reference to the buffer so that its memory cannot be freed while
    it is still registered.
    """

    def __init__(
        self, buffer: torch.Tensor, chunks: list[Chunk], driver: CudaDriver, owns_driver: bool
    ) -> None:
        self.buffer = buffer
        self.chunks = tuple(chunks)
        self._driver = driver
        self._owns_driver = owns_driver
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> int:
        return self.chunks[0].address

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    @property
    def closed(self) -> bool:
        return self._closed

    def device_pointer(self) -> int:
        """The device address at which the device reads and writes this host buffer.

        Raises:
            PinningError: The region is closed, or its chunks are not mapped
                contiguously.
        """
        if self._closed:
            raise PinningError("the pinned region is closed; its buffer is no longer mapped")
        return self.address + mapped_offset(self._driver, self.address, self.nbytes)

    def close(self) -> None:
        """Unregister every chunk. Idempotent; a failure is logged, not raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _unregister(self._driver, self.chunks)
            if self._owns_driver:
                self._driver.close()

    def __enter__(self) -> PinnedRegion:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _unregister(driver: CudaDriver, chunks: tuple[Chunk, ...] | list[Chunk]) -> None:
    with driver.activated():
        for chunk in chunks:
            try:
                driver.host_unregister(chunk.address)
            except CudaError as exc:
                logger.warning(
                    "could not unregister pinned host memory at %#x (%d bytes): %s",
                    chunk.address,
                    chunk.nbytes,
                    exc,
                )


def pin_host_buffer(
    buffer: torch.Tensor,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    driver: CudaDriver | None = None,
) -> PinnedRegion | None:
    """Page-lock ``buffer`` for the engine's current CUDA device, in chunks.

    Args:
        buffer: A contiguous CPU tensor (the host tier's buffer).
        chunk_bytes: Largest single registration, a multiple of 2 MiB.
        driver: The CUDA driver to register with; by default one is bound to
            the current CUDA device and closed with the region.

    Returns:
        The registered region, or ``None`` (after a logged warning) when CUDA
        is unavailable or a registration failed; then nothing stays registered
        and the buffer is usable unpinned.

    Raises:
        ValueError: ``buffer`` is not a contiguous, non-empty CPU tensor, or
            ``chunk_bytes`` is invalid.
    """
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(
            f"only a contiguous CPU tensor can be pinned; got a tensor on {buffer.device} "
            f"(contiguous: {buffer.is_contiguous()})"
        )
    nbytes = buffer.numel() * buffer.element_size()
    chunks = plan_chunks(buffer.data_ptr(), nbytes, chunk_bytes)
    owns_driver = driver is None
    if driver is None:
        try:
            driver = open_driver()
        except CudaUnavailable as exc:
            logger.warning("host buffer of %d bytes stays unpinned: %s", nbytes, exc)
            return None
    registered: list[Chunk] = []
    try:
        with driver.activated():
            for chunk in chunks:
                driver.host_register(chunk.address, chunk.nbytes)
                registered.append(chunk)
    except CudaError as exc:
        failed = chunks[len(registered)]
        logger.warning(
            "host buffer of %d bytes stays unpinned: registering chunk %d of %d (%d bytes at "
            "offset %d) failed: %s; raise the locked-memory limit (ulimit -l) or lower cpu_bytes "
            "for faster copies",
            nbytes,
            len(registered) + 1,
            len(chunks),
            failed.nbytes,
            failed.address - chunks[0].address,
            exc,
        )
        _unregister(driver, registered)
        if owns_driver:
            driver.close()
        return None
    logger.info(
        "pinned host buffer of %d bytes in %d chunk(s) for CUDA device %d",
        nbytes,
        len(chunks),
        driver.device_index,
    )
    return PinnedRegion(buffer, chunks, driver, owns_driver)
