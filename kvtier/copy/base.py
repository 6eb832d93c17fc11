"""The copy contract: move batches of blocks between engine regions and host slots.

Primitives, in the order they are called:

1. ``factory(config, layout, host_buffer)`` builds a backend bound to one
   :class:`~kvtier.layout.KVLayout` and one host buffer
   (``[num_slots, layout.record_bytes]`` uint8).
2. :meth:`CopyBackend.submit` queues a :class:`CopyBatch` and returns a
   :class:`CopyHandle` at once. The copy is ordered after all work already
   queued on the caller's current device stream (a store must not read blocks
   the model is still writing).
3. :meth:`CopyBackend.done` polls a handle; :meth:`CopyBackend.wait` blocks.
   Both raise :class:`CopyError` if the copy failed; after that the handle is
   spent. Only a completed load may be read by the engine.
4. :meth:`CopyBackend.close` waits for everything in flight and releases the
   backend's resources.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class Direction(enum.Enum):
    """Which way a batch moves."""

    STORE = "store"
    """Engine blocks to host slots."""
    LOAD = "load"
    """Host slots to engine blocks."""


class CopyError(RuntimeError):
    """A batch failed; none of its destination blocks may be trusted."""


@dataclass(frozen=True)
class CopyBatch:
    """Pairs of (engine block id, host slot) to copy in one direction."""

    direction: Direction
    device_blocks: Sequence[int]
    host_slots: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.device_blocks) != len(self.host_slots):
            raise ValueError(
                f"a copy batch pairs blocks with slots: got {len(self.device_blocks)} blocks "
                f"and {len(self.host_slots)} slots"
            )

    def __len__(self) -> int:
        return len(self.device_blocks)


@dataclass(frozen=True)
class CopyHandle:
    """Names one submitted batch; only the backend that issued it understands it."""

    id: int
    direction: Direction
    num_blocks: int


class CopyBackend(ABC):
    """Moves blocks between engine memory and the host buffer, asynchronously."""

    @abstractmethod
    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Queue ``batch`` behind the caller's current stream and return at once."""

    @abstractmethod
    def done(self, handle: CopyHandle) -> bool:
        """Return whether ``handle`` finished; raise :class:`CopyError` if it failed."""

    @abstractmethod
    def wait(self, handle: CopyHandle) -> None:
        """Block until ``handle`` finished; raise :class:`CopyError` if it failed."""

    @abstractmethod
    def close(self) -> None:
        """Wait for all in-flight batches and release resources. Idempotent."""
