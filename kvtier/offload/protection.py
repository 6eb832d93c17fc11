"""Lazy-mode store protection: device blocks a lazy store reads stay out of the engine's reuse.

In lazy mode the manager stores blocks the engine has already freed (its
eviction frontier), so nothing else keeps the engine from handing such a block
to a new request while the store still reads it. :class:`LazyStoreGuard` says
which blocks to take a reference on when a plan is built and which to let go
when the manager reports their stores over (stored or failed). An engine
integration maps these to its own reference counts (vLLM: ``BlockPool.touch``
and ``BlockPool.free_blocks``). In eager mode it protects nothing: eager stores
read blocks of running requests, or of finished ones the manager holds.
"""

from __future__ import annotations

from kvtier.offload.ledger import Progress
from kvtier.offload.manager import OffloadManager
from kvtier.offload.messages import DeviceBlock, TransferPlan


class LazyStoreGuard:
    """Counts the references a manager's lazy stores need on the engine's device blocks."""

    def __init__(self, manager: OffloadManager) -> None:
        self.manager = manager
        self._references: dict[DeviceBlock, int] = {}

    def protect(self, plan: TransferPlan) -> list[DeviceBlock]:
        """The blocks ``plan``'s stores read: take one engine reference on each, now."""
        if self.manager.store_mode != "lazy":
            return []
        blocks = [
            DeviceBlock(transfer.group, block)
            for transfer in plan.stores
            for block in transfer.device_blocks
        ]
        for block in blocks:
            self._references[block] = self._references.get(block, 0) + 1
        return blocks

    def release(self, progress: Progress) -> list[DeviceBlock]:
        """The protected blocks whose stores ``progress`` reports over: drop one reference each."""
        if not self._references:
            return []  # nothing protected (eager mode, or no lazy store in flight)
        released = []
        for block in progress.stored_blocks:
            count = self._references.get(block)
            if count is None:
                continue
            if count == 1:
                del self._references[block]
            else:
                self._references[block] = count - 1
            released.append(block)
        return released

    @property
    def num_protected(self) -> int:
        """Device blocks protected now."""
        return len(self._references)
