"""A copy backend wrapper that delays completions and injects failures, for tests.

:class:`FlakyBackend` wraps any :class:`~kvtier.copy.CopyBackend`. It lets a
batch report ``done`` only after a number of polls (as a slow transfer would),
and fails the batches a predicate picks: the copy runs, then its destination
(device blocks for a load, host slots for a store) is overwritten with noise
and :class:`~kvtier.copy.CopyError` is raised when the batch is polled. Code
that trusts a failed transfer therefore reads wrong bytes, which a synthetic
engine's check catches.

It also hangs batches (they never finish until :meth:`FlakyBackend.release_hung`,
and a released store writes its host slots once more, late, so a slot reused
while it hung holds wrong bytes) and raises exceptions that are not
:class:`~kvtier.copy.CopyError`, as a buggy backend would. :class:`ManualClock`
is a clock for deadlines that moves only when a test (or a wait) moves it.
:func:`flaky_copy_registry` registers it as copy backend type ``flaky``, for
code that builds its backend from a config (an engine's connector).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field

import kvtier
from kvtier.config import PluginConfig
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.kinds import COPY_BACKEND
from kvtier.layout.base import KVLayout

if TYPE_CHECKING:
    from kvtier.plugins import Registry

NOISE_BYTE = 0xA5
"""What a failed batch leaves in its destination."""


class HungCopyError(AssertionError):
    """:meth:`FlakyBackend.wait` was called on a hung batch: a real backend would never return."""


class ManualClock:
    """Monotonic seconds that move only by :meth:`advance` or :meth:`sleep`.

    Pass the clock itself as a ``clock`` argument and :meth:`sleep` as a
    ``sleep`` argument, so that waiting advances time instead of taking it.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """Advance the clock by ``seconds`` at once."""
        self.advance(seconds)


@dataclass
class _Pending:
    inner: CopyHandle
    batch: CopyBatch
    polls_left: int
    failed: bool
    hung: bool = False
    poll_bug: bool = False


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
        hang: Callable[[CopyBatch], bool] | None = None,
        submit_bug: Callable[[CopyBatch], bool] | None = None,
        poll_bug: Callable[[CopyBatch], bool] | None = None,
    ) -> None:
        """Wrap ``inner``, bound to the same ``layout`` and ``host_buffer``.

        Args:
            inner: The backend that moves the bytes.
            layout: The engine layout ``inner`` was built for.
            host_buffer: The host buffer ``inner`` was built for.
            fail: Returns ``True`` for batches that must fail; none fail if ``None``.
            delay_polls: How many :meth:`done` polls return ``False`` before a batch finishes.
            hang: Returns ``True`` for batches that never finish until
                :meth:`release_hung`; :meth:`wait` on one raises :class:`HungCopyError`.
            submit_bug: Returns ``True`` for batches whose :meth:`submit` raises a
                ``RuntimeError`` (not a ``CopyError``) and copies nothing.
            poll_bug: Returns ``True`` for batches whose first :meth:`done` or
                :meth:`wait` raises a ``RuntimeError`` (not a ``CopyError``);
                later polls behave normally.
        """
        self.inner = inner
        self.layout = layout
        self.host_buffer = host_buffer
        self.fail = fail
        self.delay_polls = delay_polls
        self.hang = hang
        self.submit_bug = submit_bug
        self.poll_bug = poll_bug
        self.submitted = 0
        self.failed = 0
        self._pending: dict[int, _Pending] = {}

    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Submit through the wrapped backend; remember how this batch misbehaves."""
        if self.submit_bug is not None and self.submit_bug(batch):
            raise RuntimeError(f"injected backend bug submitting a {batch.direction.value} batch")
        failed = self.fail is not None and self.fail(batch)
        inner = self.inner.submit(batch)
        self.submitted += 1
        self._pending[inner.id] = _Pending(
            inner,
            batch,
            self.delay_polls,
            failed,
            hung=self.hang is not None and self.hang(batch),
            poll_bug=self.poll_bug is not None and self.poll_bug(batch),
        )
        return inner

    def done(self, handle: CopyHandle) -> bool:
        """``False`` until the delay ran out, the batch is not hung and the wrapped one finished."""
        pending = self._get(handle)
        self._raise_poll_bug(handle, pending)
        if pending.hung:
            return False
        if pending.polls_left > 0:
            pending.polls_left -= 1
            return False
        if not self.inner.done(pending.inner):
            return False
        self._settle(handle, pending)
        return True

    def wait(self, handle: CopyHandle) -> None:
        """Finish the batch now, delay or not.

        Raises:
            HungCopyError: If the batch is hung (a real backend would block forever).
        """
        pending = self._get(handle)
        self._raise_poll_bug(handle, pending)
        if pending.hung:
            raise HungCopyError(f"wait() on hung {handle.direction.value} batch {handle.id}")
        self.inner.wait(pending.inner)
        self._settle(handle, pending)

    @property
    def num_hung(self) -> int:
        """Batches hung now."""
        return sum(pending.hung for pending in self._pending.values())

    def release_hung(self) -> int:
        """Let every hung batch finish; a hung store writes its host slots again. Returns how many.

        The late write copies what the batch's device blocks hold now, as a
        copy that was stuck and resumes would: a slot given to another block
        while the store hung ends up with wrong bytes.
        """
        released = [pending for pending in self._pending.values() if pending.hung]
        for pending in released:
            pending.hung = False
            if pending.batch.direction is Direction.STORE:
                self.inner.wait(self.inner.submit(pending.batch))
        return len(released)

    def close(self) -> None:
        """Close the wrapped backend."""
        self.inner.close()

    def _get(self, handle: CopyHandle) -> _Pending:
        pending = self._pending.get(handle.id)
        if pending is None:
            raise CopyError(f"handle {handle.id} is unknown or already finished")
        return pending

    def _raise_poll_bug(self, handle: CopyHandle, pending: _Pending) -> None:
        if pending.poll_bug:
            pending.poll_bug = False
            raise RuntimeError(f"injected backend bug polling batch {handle.id}")

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


class FlakyCopyConfig(PluginConfig):
    """The ``torch`` copy backend wrapped in a :class:`FlakyBackend` (tests only)."""

    type: Literal["flaky"] = Field(
        default="flaky", description="Use the torch backend with injected delays and failures."
    )


class _FlakyCopyPlugin:
    def __init__(self, faults: dict[str, Any]) -> None:
        self.faults = faults

    @kvtier.hookimpl
    def register_copy_backends(self, register: Callable[..., None]) -> None:
        def build(
            config: FlakyCopyConfig, layout: KVLayout, host_buffer: torch.Tensor
        ) -> CopyBackend:
            from kvtier.plugins import default_registry

            torch_backend = default_registry().get(COPY_BACKEND, "torch")
            inner = torch_backend.factory(torch_backend.config_model(), layout, host_buffer)
            return FlakyBackend(inner, layout, host_buffer, **self.faults)

        register("flaky", build, FlakyCopyConfig)


def flaky_copy_registry(**faults: Any) -> Registry:
    """The built-in plugins plus copy backend ``flaky``: torch copies with these faults.

    Args:
        **faults: :class:`FlakyBackend` keyword arguments (``fail``, ``delay_polls``, ...).

    Returns:
        A registry to stand in for :func:`kvtier.plugins.default_registry` (tests patch
        ``kvtier.plugins._default_registry`` with it) while a config names ``{"type": "flaky"}``.
    """
    from kvtier.plugins import build_plugin_manager, collect

    manager = build_plugin_manager()
    manager.register(_FlakyCopyPlugin(faults), name="kvtier-testing-flaky-copy")
    return collect(manager)
