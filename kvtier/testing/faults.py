"""A copy backend wrapper that delays completions and injects failures, for tests.

:class:`FlakyBackend` wraps any :class:`~kvtier.copy.CopyBackend`. It lets a
batch report ``done`` only after a number of polls (as a slow transfer would),
and fails the batches a predicate picks: the copy runs, then its destination
(device blocks for a load, host slots for a store) is overwritten with noise
and :class:`~kvtier.copy.CopyError` is raised when the batch is polled. Code
that trusts a failed transfer therefore reads wrong bytes, which a synthetic
engine's check catches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.layout.base import KVLayout

NOISE_BYTE = 0xA5
"""What a failed batch leaves in its destination."""


@dataclass
class _Pending:
    inner: CopyHandle
    batch: CopyBatch
    polls_left: int
    failed: bool


class FlakyBackend(CopyBackend):
    """Wraps a backend to delay completions and fail chosen batches."""

    def __init__(
        self,
        inner: CopyBackend,
        layout: KVLayout,
        host_buffer: torch.Tensor,
        *,
        fail: Callable[[CopyBatch], bool] | None = None,
        delay_polls: int = 0,
    ) -> None:
        """Wrap ``inner``, bound to the same ``layout`` and ``host_buffer``.

        Args:
            inner: The backend that moves the bytes.
            layout: The engine layout ``inner`` was built for.
            host_buffer: The host buffer ``inner`` was built for.
            fail: Returns ``True`` for batches that must fail; none fail if ``None``.
            delay_polls: How many :meth:`done` polls return ``False`` before a batch finishes.
        """
        self.inner = inner
        self.layout = layout
        self.host_buffer = host_buffer
        self.fail = fail
        self.delay_polls = delay_polls
        self.submitted = 0
        self.failed = 0
        self._pending: dict[int, _Pending] = {}

    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Submit through the wrapped backend; remember whether this batch fails."""
        failed = self.fail is not None and self.fail(batch)
        inner = self.inner.submit(batch)
        self.submitted += 1
        self._pending[inner.id] = _Pending(inner, batch, self.delay_polls, failed)
        return inner

    def done(self, handle: CopyHandle) -> bool:
        """``False`` until the delay ran out and the wrapped batch finished."""
        pending = self._get(handle)
        if pending.polls_left > 0:
            pending.polls_left -= 1
            return False
        if not self.inner.done(pending.inner):
            return False
        self._settle(handle, pending)
        return True

    def wait(self, handle: CopyHandle) -> None:
        """Finish the batch now, delay or not."""
        pending = self._get(handle)
        self.inner.wait(pending.inner)
        self._settle(handle, pending)

    def close(self) -> None:
        """Close the wrapped backend."""
        self.inner.close()

    def _get(self, handle: CopyHandle) -> _Pending:
        pending = self._pending.get(handle.id)
        if pending is None:
            raise CopyError(f"handle {handle.id} is unknown or already finished")
        return pending

    def _settle(self, handle: CopyHandle, pending: _Pending) -> None:
        del self._pending[handle.id]
        if not pending.failed:
            return
        self.failed += 1
        self.corrupt(pending.batch)
        raise CopyError(f"injected failure of {handle.direction.value} batch {handle.id}")

    def corrupt(self, batch: CopyBatch) -> None:
        """Overwrite ``batch``'s destination with :data:`NOISE_BYTE`."""
        if batch.direction is Direction.STORE:
            for slot in batch.host_slots:
                self.host_buffer[slot].fill_(NOISE_BYTE)
        else:
            for region in self.layout.regions:
                for block in batch.device_blocks:
                    region.view[block].fill_(NOISE_BYTE)
