"""``torch``: the copy backend built on plain torch tensor operations, for CPU and CUDA.

On CPU, :meth:`TorchCopyBackend.submit` copies synchronously and returns a
handle that is already done: the copy is bound by memory bandwidth, and doing
it at once, on the caller's thread plus ``cpu_threads - 1`` helpers, is the
fastest correct choice (no hand-off, no queue). The rows move through
:class:`kvtier.copy.cpu_rows.RowCopier`: a batch of a few runs of consecutive
blocks and slots as one slice per run and region, any other batch by a runs,
gather, scatter or staged plan, a row per ``memcpy`` or a run per slice.

On CUDA, a batch runs on a side stream that first waits for the caller's
current stream: blocks are gathered into (or scattered from) a device staging
buffer with ``index_select`` / ``index_copy_``, and whole host records move
with ``non_blocking`` copies, one per run of consecutive slots. A CUDA event
recorded after the last copy tells completion. The host buffer should be
pinned; otherwise those copies are synchronous.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.copy.configs import TorchCopyConfig
from kvtier.copy.cpu_rows import RowCopier, run_starts, sort_ids
from kvtier.copy.planner import batch_arrays, batch_runs, check_host_matrix
from kvtier.layout.base import KVLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Side:
    """One region's rows on both sides: the engine view and its column slice of the host buffer."""

    device: torch.Tensor
    host: torch.Tensor


class TorchCopyBackend(CopyBackend):
    """Moves blocks with torch tensor operations; see the module docstring for the strategy."""

    def __init__(
        self, config: TorchCopyConfig, layout: KVLayout, host_buffer: torch.Tensor
    ) -> None:
        """Bind the backend to ``layout`` and a ``[num_slots, record_bytes]`` host buffer.

        Raises:
            ValueError: If the host buffer is not a contiguous CPU uint8 matrix of
                ``layout.record_bytes``-byte rows, or the regions are not all on one
                CPU or CUDA device.
        """
        check_host_matrix(host_buffer)
        if host_buffer.device.type != "cpu":
            raise ValueError(f"the host buffer must be in CPU memory, got {host_buffer.device}")
        if host_buffer.shape[1] != layout.record_bytes or not host_buffer.is_contiguous():
            raise ValueError(
                f"the host buffer must be a contiguous [num_slots, {layout.record_bytes}] tensor "
                f"(one layout record per row), got shape {tuple(host_buffer.shape)} with stride "
                f"{host_buffer.stride()}"
            )
        devices = {region.view.device for region in layout.regions}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ValueError(
                f"the torch backend copies from one CPU or CUDA device; the layout's regions "
                f"are on {sorted(map(str, devices))}"
            )
        self.config = config
        self.layout = layout
        self.host_buffer = host_buffer
        self.device = layout.device
        self.num_slots = int(host_buffer.shape[0])
        self._sides = tuple(
            _Side(region.view, host_buffer[:, offset : offset + region.bytes_per_block])
            for region, offset in zip(layout.regions, layout.record_offsets, strict=True)
        )
        self._next_id = 0
        self._pending: dict[int, tuple[torch.cuda.Event, list[torch.Tensor]]] = {}
        self._closed = False
        self._rows: RowCopier | None = None
        if self.device.type == "cpu":
            threads = config.cpu_threads or min(torch.get_num_threads(), 16)
            self._rows = RowCopier([(side.device, side.host) for side in self._sides], threads)
        else:
            self._stream = torch.cuda.Stream(device=self.device, priority=0)
            if not host_buffer.is_pinned():
                logger.warning(
                    "the host buffer is not pinned: copies to and from %s will not overlap "
                    "with compute",
                    self.device,
                )

    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Copy ``batch`` (at once on CPU; queued on a side stream on CUDA).

        Raises:
            CopyError: If the backend is closed, the batch names an id out of
                range or a destination twice, or the copy could not be issued.
        """
        if self._closed:
            raise CopyError("the torch copy backend is closed; build a new one")
        rows = self._rows
        runs = (
            batch_runs(batch, self.layout.num_blocks, self.num_slots, rows.max_runs(len(batch)))
            if rows is not None
            else None
        )
        if runs is None:
            blocks, slots = batch_arrays(batch, self.layout.num_blocks, self.num_slots)
        handle = CopyHandle(self._next_id, batch.direction, len(batch))
        self._next_id += 1
        if len(batch) == 0:
            return handle
        try:
            if rows is not None and runs is not None:
                rows.copy_runs(batch.direction, runs)
            elif rows is not None:
                rows.copy(batch.direction, blocks, slots)
            else:
                self._pending[handle.id] = self._submit_cuda(batch.direction, blocks, slots)
        except (RuntimeError, ValueError) as exc:
            raise CopyError(
                f"{batch.direction.value} of {len(batch)} blocks failed: {exc}"
            ) from exc
        return handle

    def done(self, handle: CopyHandle) -> bool:
        """Return whether ``handle`` finished.

        Raises:
            CopyError: If the copy failed on the device.
            ValueError: If this backend did not issue ``handle``.
        """
        pending = self._lookup(handle)
        if pending is None:
            return True
        try:
            finished = bool(pending[0].query())
        except RuntimeError as exc:
            del self._pending[handle.id]
            raise CopyError(f"{handle.direction.value} batch {handle.id} failed: {exc}") from exc
        if finished:
            del self._pending[handle.id]
        return finished

    def wait(self, handle: CopyHandle) -> None:
        """Block until ``handle`` finished.

        Raises:
            CopyError: If the copy failed on the device.
            ValueError: If this backend did not issue ``handle``.
        """
        pending = self._lookup(handle)
        if pending is None:
            return
        del self._pending[handle.id]
        try:
            pending[0].synchronize()
        except RuntimeError as exc:
            raise CopyError(f"{handle.direction.value} batch {handle.id} failed: {exc}") from exc

    def close(self) -> None:
        """Wait for every batch in flight; later submits fail. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._rows is not None:
            self._rows.close()
        pending, self._pending = self._pending, {}
        for handle_id, (event, _) in pending.items():
            try:
                event.synchronize()
            except RuntimeError:
                logger.exception("batch %d failed while the torch copy backend closed", handle_id)

    def _lookup(self, handle: CopyHandle) -> tuple[torch.cuda.Event, list[torch.Tensor]] | None:
        if not 0 <= handle.id < self._next_id:
            raise ValueError(f"copy handle {handle.id} was not issued by this backend")
        return self._pending.get(handle.id)

    def _submit_cuda(
        self, direction: Direction, blocks: np.ndarray, slots: np.ndarray
    ) -> tuple[torch.cuda.Event, list[torch.Tensor]]:
        """Queue the batch on the side stream; return its completion event and host tensors.

        Device tensors (indices, staging) are allocated on the side stream, so
        the caching allocator reuses their memory only for work queued after
        them on that stream: they may be dropped at once. The host-side index
        tensors are kept until the event completes.
        """
        by_slot = sort_ids(slots)
        blocks, slots = blocks[by_slot.order], by_slot.ids
        record_bytes = self.layout.record_bytes
        chunk_rows = max(1, self.config.cuda_staging_bytes // record_bytes)
        keep: list[torch.Tensor] = []
        with torch.cuda.device(self.device):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for start in range(0, blocks.shape[0], chunk_rows):
                    chunk_blocks = torch.from_numpy(blocks[start : start + chunk_rows])
                    keep.append(chunk_blocks)
                    self._copy_chunk_cuda(
                        direction,
                        chunk_blocks.to(self.device, non_blocking=True),
                        slots[start : start + chunk_rows],
                    )
                event = torch.cuda.Event()
                event.record(self._stream)
        return event, keep

    def _copy_chunk_cuda(
        self, direction: Direction, index: torch.Tensor, slots: np.ndarray
    ) -> None:
        """Copy one chunk on the current (side) stream; ``slots`` ascend, ``index`` matches."""
        staging = torch.empty(
            (slots.shape[0], self.layout.record_bytes), dtype=torch.uint8, device=self.device
        )
        starts = run_starts(slots)
        ends = np.append(starts[1:], slots.shape[0])
        runs = [
            (begin, end, int(slots[begin]))
            for begin, end in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
        columns = [
            (side.device, staging[:, offset : offset + side.device.shape[1]])
            for side, offset in zip(self._sides, self.layout.record_offsets, strict=True)
        ]
        if direction is Direction.STORE:
            for rows, column in columns:
                column.copy_(rows.index_select(0, index))
            for begin, end, slot in runs:
                self.host_buffer[slot : slot + end - begin].copy_(
                    staging[begin:end], non_blocking=True
                )
        else:
            for begin, end, slot in runs:
                staging[begin:end].copy_(
                    self.host_buffer[slot : slot + end - begin], non_blocking=True
                )
            for rows, column in columns:
                rows.index_copy_(0, index, column)


def build(config: TorchCopyConfig, layout: KVLayout, host_buffer: torch.Tensor) -> TorchCopyBackend:
    """Build the ``torch`` copy backend."""
    return TorchCopyBackend(config, layout, host_buffer)
