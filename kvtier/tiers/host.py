"""The host tier: one ``[num_slots, record_bytes]`` uint8 buffer in CPU memory.

A slot holds one block's record: the block's bytes from every region of the
:class:`~kvtier.layout.KVLayout`, regions in order. The buffer is allocated as
plain memory; when the engine's KV cache lives on a CUDA device it is then
pinned in place (``cudaHostRegister``, in chunks) by
:mod:`kvtier.cuda.pinning`, so copies can run asynchronously without the
power-of-two rounding of a pinned allocator.

The tier's directory (which key sits in which slot) is a
:class:`~kvtier.index.BlockIndex` held by the scheduler-side
:class:`~kvtier.offload.OffloadManager`; the buffer lives in each worker. Both
sides size the tier with :func:`slots_for_bytes` so they agree on the slot count.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvtier.cuda.pinning import PinnedRegion, pin_host_buffer

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

logger = logging.getLogger(__name__)


def capacity_per_rank(config: KVTierConfig, world_size: int) -> int:
    """Host-tier bytes one rank may use: ``cpu_bytes_per_rank``, else ``cpu_bytes // world_size``.

    Raises:
        ValueError: If ``world_size`` is not positive.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if config.cpu_bytes_per_rank is not None:
        return int(config.cpu_bytes_per_rank)
    return int(config.cpu_bytes) // world_size


def slots_for_bytes(capacity_bytes: int, record_bytes: int) -> int:
    """How many records of ``record_bytes`` fit in ``capacity_bytes``.

    Raises:
        ValueError: If ``record_bytes`` is not positive or not even one record fits.
    """
    if record_bytes <= 0:
        raise ValueError(f"record_bytes must be positive, got {record_bytes}")
    num_slots = capacity_bytes // record_bytes
    if num_slots <= 0:
        raise ValueError(
            f"the host tier's {capacity_bytes} bytes per rank hold no block of {record_bytes} "
            "bytes; raise cpu_bytes (or cpu_bytes_per_rank)"
        )
    return num_slots


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
        self.buffer = torch.empty((num_slots, record_bytes), dtype=torch.uint8)
        self._pinned: PinnedRegion | None = pin_host_buffer(self.buffer) if pin else None
        logger.info(
            "host tier: %d slots of %d bytes (%.2f GiB, %s)",
            num_slots,
            record_bytes,
            num_slots * record_bytes / 2**30,
            "pinned" if self._pinned is not None else "pageable",
        )

    @classmethod
    def for_device(cls, capacity_bytes: int, record_bytes: int, device: torch.device) -> HostTier:
        """Size a tier from bytes and pin it when ``device`` is a CUDA device and CUDA works."""
        pin = device.type == "cuda" and torch.cuda.is_available()
        return cls(slots_for_bytes(capacity_bytes, record_bytes), record_bytes, pin=pin)

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
