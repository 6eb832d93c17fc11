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

Engines whose workers run in other processes (vLLM's tensor parallel workers
are spawned) cannot be handed a Python predicate. For them,
:data:`RANK_FAULTS_PLUGIN` registers copy backend type ``rank-faults``, driven
and observed through files in one folder: a file ``fail-loads-rank<r>`` makes
rank ``r``'s loads fail from then on, and every rank keeps its counts in
``rank<r>.json``. :func:`install_rank_faults` makes the plugin an entry point
that spawned processes find.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


class RankFaultsConfig(PluginConfig):
    """The ``torch`` copy backend with per-rank load failures and counts, through files (tests)."""

    type: Literal["rank-faults"] = Field(
        default="rank-faults",
        description="Use the torch backend with load failures chosen per rank by files.",
    )
    directory: str = Field(
        description=(
            "Folder shared by every rank: a file fail-loads-rank<r> in it makes rank r's loads "
            "fail; rank r writes its counts to rank<r>.json there."
        )
    )


class RankFaultsBackend(FlakyBackend):
    """A :class:`FlakyBackend` whose load failures and counts live in files, one set per rank."""

    def __init__(
        self, inner: CopyBackend, layout: KVLayout, host_buffer: torch.Tensor, directory: Path
    ) -> None:
        self.directory = directory
        self.rank = (
            torch.distributed.get_rank()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 0
        )
        self.counts = {
            "host_slots": host_buffer.shape[0],
            "host_bytes": host_buffer.numel() * host_buffer.element_size(),
            "stored_blocks": 0,
            "loaded_blocks": 0,
            "failed_load_blocks": 0,
        }
        super().__init__(inner, layout, host_buffer, fail=self._fails)
        self._write_counts()

    def _fails(self, batch: CopyBatch) -> bool:
        return (
            batch.direction is Direction.LOAD
            and (self.directory / f"fail-loads-rank{self.rank}").exists()
        )

    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Submit, then count the batch's blocks in this rank's file."""
        handle = super().submit(batch)
        if batch.direction is Direction.STORE:
            self.counts["stored_blocks"] += len(batch)
        elif self._pending[handle.id].failed:
            self.counts["failed_load_blocks"] += len(batch)
        else:
            self.counts["loaded_blocks"] += len(batch)
        self._write_counts()
        return handle

    def _write_counts(self) -> None:
        path = self.directory / f"rank{self.rank}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.counts))
        partial.replace(path)


def read_rank_counts(directory: str | Path) -> dict[int, dict[str, int]]:
    """The counts every ``rank-faults`` backend wrote to ``directory``, by rank."""
    return {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in Path(directory).glob("rank*.json")
    }


class _RankFaultsPlugin:
    @kvtier.hookimpl
    def register_copy_backends(self, register: Callable[..., None]) -> None:
        def build(
            config: RankFaultsConfig, layout: KVLayout, host_buffer: torch.Tensor
        ) -> CopyBackend:
            from kvtier.plugins import default_registry

            torch_backend = default_registry().get(COPY_BACKEND, "torch")
            inner = torch_backend.factory(torch_backend.config_model(), layout, host_buffer)
            return RankFaultsBackend(inner, layout, host_buffer, Path(config.directory))

        register("rank-faults", build, RankFaultsConfig)


RANK_FAULTS_PLUGIN = _RankFaultsPlugin()
"""The plugin registering copy backend type ``rank-faults``."""

RANK_FAULTS_DISTRIBUTION = "kvtier-testing-rank-faults"
"""The distribution name :func:`install_rank_faults` gives the plugin's entry point."""


def install_rank_faults(directory: str | Path) -> Path:
    """Write a minimal ``.dist-info`` into ``directory`` naming :data:`RANK_FAULTS_PLUGIN`.

    With ``directory`` on ``sys.path`` (spawned processes inherit the parent's),
    every process that builds its plugin registry afterwards finds the
    ``rank-faults`` copy backend; a process that already built one must drop it
    (tests reset ``kvtier.plugins._default_registry``).

    Returns:
        The ``.dist-info`` folder written.
    """
    info = Path(directory) / f"{RANK_FAULTS_DISTRIBUTION.replace('-', '_')}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {RANK_FAULTS_DISTRIBUTION}\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[kvtier]\nrank-faults = {__name__}:RANK_FAULTS_PLUGIN\n"
    )
    return info
