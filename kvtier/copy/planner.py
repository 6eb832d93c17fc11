"""Segment planner: a copy batch becomes merged ``(src address, dst address, bytes)`` segments.

Pure arithmetic on numpy arrays, for backends that issue raw memory copies
(one DMA descriptor or one kernel work item per segment). For pair ``i`` of a
batch and region ``r`` of the layout:

- the device address is ``region[r].address + block_i * region[r].block_stride_bytes``;
- the host address is ``host_address + slot_i * host_row_bytes + record_offset[r]``;
- the segment moves ``region[r].bytes_per_block`` bytes, device to host for a
  store and host to device for a load.

Segments that are adjacent in both source and destination (consecutive
blocks in consecutive slots of a single-region layout, say) are merged into
one. Typical use::

    planner = SegmentPlanner.for_tensors(layout, host_buffer)
    segments = planner.plan(batch)          # validates the batch first
    for src, dst, nbytes in segments:       # or hand the arrays to a device
        memcpy(dst, src, nbytes)

:func:`batch_arrays` is the batch validation every backend shares;
:func:`batch_runs` recognises the common batch, a few runs, without numpy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.copy.base import CopyBatch, CopyError, Direction
from kvtier.layout.base import KVLayout


def batch_arrays(
    batch: CopyBatch, num_blocks: int, num_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """Check ``batch`` against the layout and host buffer and return its ids as int64 arrays.

    Args:
        batch: The batch to check.
        num_blocks: Blocks in the layout (valid ids are ``0 .. num_blocks - 1``).
        num_slots: Slots in the host buffer.

    Returns:
        ``(device_blocks, host_slots)`` as one-dimensional int64 arrays.

    Raises:
        CopyError: If an id is out of range, or the batch writes one destination
            (a slot for a store, a block for a load) twice.
    """
    blocks = np.asarray(batch.device_blocks, dtype=np.int64).reshape(-1)
    slots = np.asarray(batch.host_slots, dtype=np.int64).reshape(-1)
    for ids, limit, what in ((blocks, num_blocks, "device block"), (slots, num_slots, "host slot")):
        if ids.size and (ids.min() < 0 or ids.max() >= limit):
            bad = int(ids[(ids < 0) | (ids >= limit)][0])
            raise CopyError(
                f"{batch.direction.value} batch names {what} {bad}, outside 0..{limit - 1}"
            )
    if batch.direction is Direction.STORE:
        destination, what, limit = slots, "host slot", num_slots
    else:
        destination, what, limit = blocks, "device block", num_blocks
    if destination.size > 1 and _has_repeats(destination, limit):
        ordered = np.sort(destination)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        raise CopyError(
            f"{batch.direction.value} batch writes {what} {int(repeated[0])} more than once"
        )
    return blocks, slots


MAX_RUNS = 8
"""Most runs :func:`batch_runs` finds before it leaves a batch to :func:`batch_arrays`."""

Run = tuple[int, int, int, int]
"""``(first_block, first_slot, count, step)``: blocks ``first_block + k`` with slots
``first_slot + step * k`` for ``k`` below ``count``; ``step`` is 1 or -1."""


def batch_runs(
    batch: CopyBatch, num_blocks: int, num_slots: int, max_runs: int = MAX_RUNS
) -> list[Run] | None:
    """The batch as at most ``max_runs`` valid runs in which blocks and slots each count
    by one, else ``None``.

    The common batch, a request's blocks to or from consecutive slots, is one
    run or a few, in either direction on either side (vLLM hands out freed
    blocks in reverse order). They are found in plain Python, in the order
    given, without numpy: sorting id arrays and searching them for runs costs
    some 200 us when the CPU's cache is cold, as it is after a forward pass. A
    batch that is not a few runs, names an id out of range or writes a
    destination twice is left to :func:`batch_arrays`, which says what is
    wrong with it.
    """
    blocks, slots = batch.device_blocks, batch.host_slots
    count = len(blocks)
    runs: list[Run] = []
    start = 0
    while start < count:
        if len(runs) == max_runs:
            return None
        first_block, first_slot = int(blocks[start]), int(slots[start])
        block_step = slot_step = 1
        end = start + 1
        if end < count:
            block_step, slot_step = int(blocks[end]) - first_block, int(slots[end]) - first_slot
            if abs(block_step) == 1 and abs(slot_step) == 1:
                end += 1
                while (
                    end < count
                    and blocks[end] - blocks[end - 1] == block_step
                    and slots[end] - slots[end - 1] == slot_step
                ):
                    end += 1
            else:
                block_step = slot_step = 1
        size = end - start
        if block_step == -1:  # the same pairs with the blocks counting up
            first_block -= size - 1
            first_slot += slot_step * (size - 1)
            slot_step = -slot_step
        runs.append((first_block, first_slot, size, slot_step))
        start = end
    if not _runs_valid(runs, batch.direction, num_blocks, num_slots):
        return None
    return runs


def _runs_valid(runs: list[Run], direction: Direction, num_blocks: int, num_slots: int) -> bool:
    """Whether every id is in range and no destination is written twice."""
    targets = []
    for first_block, first_slot, size, step in runs:
        low_slot = min(first_slot, first_slot + step * (size - 1))
        if first_block < 0 or first_block + size > num_blocks:
            return False
        if low_slot < 0 or low_slot + size > num_slots:
            return False
        targets.append((low_slot if direction is Direction.STORE else first_block, size))
    targets.sort()
    return all(
        start + size <= following
        for (start, size), (following, _) in zip(targets, targets[1:], strict=False)
    )


def check_host_matrix(host_buffer: torch.Tensor) -> None:
    """Check that ``host_buffer`` is a 2-D uint8 tensor, one host slot per row.

    Raises:
        ValueError: If it has another dtype or number of dimensions.
    """
    if host_buffer.dtype != torch.uint8 or host_buffer.dim() != 2:
        raise ValueError(
            f"the host buffer must be a [num_slots, record_bytes] uint8 tensor, got "
            f"{host_buffer.dtype} of shape {tuple(host_buffer.shape)}"
        )


def _has_repeats(ids: np.ndarray, limit: int) -> bool:
    """Whether ``ids`` (all in ``0 .. limit - 1``) holds a value twice; linear when it can be."""
    if limit <= 16 * ids.size:
        seen = np.zeros(limit, dtype=bool)
        seen[ids] = True
        return int(np.count_nonzero(seen)) != ids.size
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


@dataclass(frozen=True)
class RegionGeometry:
    """Where one layout region's blocks live and where they go in a host record."""

    address: int
    """Address of block 0's first byte."""
    block_stride_bytes: int
    """Bytes from one block's start to the next."""
    bytes_per_block: int
    """Contiguous bytes of one block in this region."""
    record_offset: int
    """Offset of this region's bytes inside a host record."""


@dataclass(frozen=True)
class Segments:
    """Merged copies: segment ``k`` moves ``nbytes[k]`` bytes from ``src[k]`` to ``dst[k]``.

    The three arrays are int64 and of equal length; segments never overlap in
    their destinations.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """Yield ``(src, dst, nbytes)`` as Python ints."""
        return zip(self.src.tolist(), self.dst.tolist(), self.nbytes.tolist(), strict=True)

    @property
    def total_bytes(self) -> int:
        """Bytes moved by all segments."""
        return int(self.nbytes.sum())


class SegmentPlanner:
    """Plans the segments of batches between one layout and one host buffer."""

    def __init__(
        self,
        regions: Sequence[RegionGeometry],
        host_address: int,
        host_row_bytes: int,
        num_blocks: int,
        num_slots: int,
    ) -> None:
        """Describe the memory a backend copies between.

        Args:
            regions: One geometry per layout region, in record order.
            host_address: Address of host slot 0's first byte.
            host_row_bytes: Bytes from one host slot's start to the next.
            num_blocks: Blocks in every region.
            num_slots: Slots in the host buffer.

        Raises:
            ValueError: If there are no regions, a size is not positive, or a
                region does not fit inside a host record.
        """
        if not regions:
            raise ValueError("a segment planner needs at least one region")
        if num_blocks <= 0 or num_slots <= 0 or host_row_bytes <= 0:
            raise ValueError(
                f"num_blocks ({num_blocks}), num_slots ({num_slots}) and host_row_bytes "
                f"({host_row_bytes}) must be positive"
            )
        for index, region in enumerate(regions):
            if region.bytes_per_block <= 0 or region.record_offset < 0:
                raise ValueError(f"region {index} has an empty or negative extent: {region}")
            if region.record_offset + region.bytes_per_block > host_row_bytes:
                raise ValueError(
                    f"region {index} ends at byte {region.record_offset + region.bytes_per_block} "
                    f"of a {host_row_bytes}-byte host row"
                )
        self.regions = tuple(regions)
        self.host_address = int(host_address)
        self.host_row_bytes = int(host_row_bytes)
        self.num_blocks = int(num_blocks)
        self.num_slots = int(num_slots)
        self._address = np.array([r.address for r in regions], dtype=np.int64)[:, None]
        self._stride = np.array([r.block_stride_bytes for r in regions], dtype=np.int64)[:, None]
        self._offset = np.array([r.record_offset for r in regions], dtype=np.int64)[:, None]
        self._bytes = np.array([r.bytes_per_block for r in regions], dtype=np.int64)[:, None]

    @classmethod
    def for_tensors(cls, layout: KVLayout, host_buffer: torch.Tensor) -> SegmentPlanner:
        """Plan between ``layout``'s region views and a ``[num_slots, record_bytes]`` buffer.

        Raises:
            ValueError: If the host buffer is not a 2-D uint8 tensor with contiguous
                rows of at least ``layout.record_bytes`` bytes.
        """
        check_host_matrix(host_buffer)
        if host_buffer.shape[1] < layout.record_bytes or host_buffer.stride(1) != 1:
            raise ValueError(
                f"host rows must hold {layout.record_bytes} contiguous bytes, got shape "
                f"{tuple(host_buffer.shape)} with stride {host_buffer.stride()}"
            )
        regions = [
            RegionGeometry(region.data_ptr, region.block_stride_bytes, region.bytes_per_block, off)
            for region, off in zip(layout.regions, layout.record_offsets, strict=True)
        ]
        return cls(
            regions,
            host_buffer.data_ptr(),
            host_buffer.stride(0),
            layout.num_blocks,
            int(host_buffer.shape[0]),
        )

    def plan(self, batch: CopyBatch) -> Segments:
        """Validate ``batch`` and return its merged segments.

        Raises:
            CopyError: If the batch names an id out of range or a destination twice.
        """
        blocks, slots = batch_arrays(batch, self.num_blocks, self.num_slots)
        return self.plan_arrays(batch.direction, blocks, slots)

    def plan_arrays(self, direction: Direction, blocks: np.ndarray, slots: np.ndarray) -> Segments:
        """Return the merged segments of already validated int64 id arrays."""
        device = (self._address + blocks[None, :] * self._stride).reshape(-1)
        host = (self.host_address + slots[None, :] * self.host_row_bytes + self._offset).reshape(-1)
        nbytes = np.broadcast_to(self._bytes, (len(self.regions), blocks.shape[0])).reshape(-1)
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        return merge_segments(src, dst, nbytes)


def merge_segments(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Segments:
    """Merge segments that continue each other in both source and destination.

    The segments are ordered by source address, and each maximal chain where
    one segment's source and destination both end where the next one's begin
    becomes a single segment.
    """
    if src.shape[0] == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Segments(empty, empty.copy(), empty.copy())
    order = np.lexsort((dst, src))
    src, dst, nbytes = src[order], dst[order], nbytes[order]
    continues = np.empty(src.shape[0], dtype=bool)
    continues[0] = False
    end_src, end_dst = src[:-1] + nbytes[:-1], dst[:-1] + nbytes[:-1]
    continues[1:] = (end_src == src[1:]) & (end_dst == dst[1:])
    starts = np.flatnonzero(~continues)
    return Segments(src[starts], dst[starts], np.add.reduceat(nbytes, starts))
