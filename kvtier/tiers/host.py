"""The host tier: one ``[num_slots, record_bytes]`` uint8 buffer in CPU memory.

A slot holds one block's record: the block's bytes from every region of the
:class:`~kvtier.layout.KVLayout`, regions in order. The buffer is private
anonymous memory whose pages are all faulted in when the tier is built (see
:func:`populated_buffer`); when the engine's KV cache lives on a CUDA device it
is then pinned in place (``cudaHostRegister``, in chunks) by
:mod:`kvtier.cuda.pinning`, so copies can run asynchronously without the
power-of-two rounding of a pinned allocator.

The tier's directory (which key sits in which slot) is a
:class:`~kvtier.index.BlockIndex` held by the scheduler-side
:class:`~kvtier.offload.OffloadManager`; the buffer lives in each worker. Both
sides size the tier with :meth:`KVTierConfig.host_slots
<kvtier.config.KVTierConfig.host_slots>` so they agree on the slot count.
"""

from __future__ import annotations

import errno
import logging
import mmap
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.cuda.pinning import PinnedRegion, pin_host_buffer

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""Linux 5.14 and later: fault in every page of a range, writable, from the kernel."""


def populated_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed, page-aligned private memory with every page already faulted in.

    The first write to a page costs a page fault (on a virtual machine often a
    second one in the hypervisor): left to the first stores, faulting in the
    tier made their copies several times slower than copies into slots
    written before. Faulting every page in here moves that cost to start-up,
    and a tier the machine cannot back with memory fails there, not mid-run.
    Kernels older than 5.14 get one byte written per page instead.

    Raises:
        MemoryError: The kernel could not provide the pages.
    """
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise MemoryError(
                f"the host tier's {nbytes} bytes could not be backed by memory; lower cpu_bytes"
            ) from None
        np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
    return torch.frombuffer(region, dtype=torch.uint8)


class HostTier:
    """The host buffer of one rank, optionally pinned for asynchronous device copies."""

    def __init__(self, num_slots: int, record_bytes: int, *, pin: bool = False) -> None:
        """Allocate ``num_slots`` records of ``record_bytes``.

        Args:
            num_slots: Number of block records.
            record_bytes: Bytes of one record (``KVLayout.record_bytes``).
            pin: Page-lock the buffer for the current CUDA device; when that
                fails the pinning module logs a warning and the buffer stays pageable.

        Raises:
            ValueError: If either size is not positive.
        """
        if num_slots <= 0 or record_bytes <= 0:
            raise ValueError(
                f"a host tier needs positive sizes, got {num_slots} slots of {record_bytes} bytes"
            )
        self.num_slots = num_slots
        self.record_bytes = record_bytes
        started = time.perf_counter()
        self.buffer = populated_buffer(num_slots * record_bytes).view(num_slots, record_bytes)
        populated_s = time.perf_counter() - started
        self._pinned: PinnedRegion | None = pin_host_buffer(self.buffer) if pin else None
        # The engine integration's start-up line already gives the size; this adds pinning.
        logger.debug(
            "host tier: %d slots of %d bytes (%.2f GiB, %s), faulted in in %.2f s",
            num_slots,
            record_bytes,
            num_slots * record_bytes / 2**30,
            "pinned" if self._pinned is not None else "pageable",
            populated_s,
        )

    @classmethod
    def from_config(
        cls, config: KVTierConfig, record_bytes: int, device: torch.device, *, world_size: int = 1
    ) -> HostTier:
        """Allocate one rank's tier as ``config`` sizes it; pin it for a working CUDA ``device``.

        Args:
            config: The validated config (``cpu_bytes``, ``cpu_bytes_per_rank``).
            record_bytes: Bytes of one block record (``KVLayout.record_bytes``).
            device: Where the engine's KV cache lives.
            world_size: Ranks the host tier is split over.

        Raises:
            kvtier.config.ConfigError: This rank's share does not fit in the memory
                available, or holds no record; checked before anything is allocated.
        """
        config.check_host_memory(world_size)
        num_slots = config.host_slots(record_bytes, world_size)
        pin = device.type == "cuda" and torch.cuda.is_available()
        return cls(num_slots, record_bytes, pin=pin)

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked."""
        return self._pinned is not None

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return self.num_slots * self.record_bytes

    def close(self) -> None:
        """Unpin the buffer. Idempotent; the buffer stays usable as pageable memory."""
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
