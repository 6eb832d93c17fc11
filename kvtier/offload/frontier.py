"""Owns what lazy mode remembers of the engine's eviction frontier, to offer each block once.

In lazy mode the engine offers the cached blocks nearest eviction through an
:class:`EvictionFrontier`; the manager stores those the tier does not hold.
Reading the frontier every step would cost as much as the frontier is long, so
:class:`FrontierMemory` skips it while its :meth:`~EvictionFrontier.signature`
stays the same and the tier took every block offered last time (the same
blocks are there, all held), and skips blocks whose contents the tier already
held when they were last offered. A key that leaves the tier drops only the
blocks it named from that memory, so a step in which the tier evicts costs
the blocks it evicted, not the frontier's length.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol

from kvtier.index.base import BlockKey
from kvtier.offload.ledger import BatchLedger
from kvtier.offload.messages import LazyCandidate
from kvtier.offload.setup import ManagerSetup


class EvictionFrontier(Protocol):
    """An engine's cached device blocks nearest reuse, for lazy stores (one per engine)."""

    def signature(self) -> Hashable:
        """A value that changes whenever the blocks at the frontier may have changed.

        (vLLM: the free queue's length and first block; a block reaches the
        front only after more allocations than one step makes.)
        """
        ...

    def blocks(self) -> Iterable[tuple[int, Hashable]]:
        """The cached blocks at the frontier, nearest eviction first: ``(device block id,
        the engine's name for its contents)``; the name changes when the contents do."""
        ...

    def candidate(self, block_id: int, contents: Hashable) -> LazyCandidate:
        """The candidate for a block :meth:`blocks` named."""
        ...


class FrontierMemory:
    """Which frontier blocks the tier held when last offered, and the frontier last read."""

    def __init__(self, setup: ManagerSetup, ledger: BatchLedger) -> None:
        self.setup = setup
        self.ledger = ledger
        # device block id -> the contents the tier already held when it was last offered, and
        # the key they are held under; and per such key, the device blocks it was held for
        self._held: dict[int, Hashable] = {}
        self._held_keys: dict[int, BlockKey] = {}
        self._blocks_of: dict[BlockKey, set[int]] = {}
        # the frontier's signature at the last read, or None when that read offered a block
        # the tier did not take
        self._seen: Hashable | None = None

    def offer(self, frontier: EvictionFrontier) -> list[tuple[Hashable, LazyCandidate]]:
        """The frontier's blocks worth offering now, with the contents each was named by."""
        departed = self.ledger.take_departed()
        if departed:
            self._forget(departed)
        signature = frontier.signature()
        if signature == self._seen:
            return []
        self._seen = signature
        held = self._held
        return [
            (contents, frontier.candidate(block_id, contents))
            for block_id, contents in frontier.blocks()
            if held.get(block_id) != contents
        ]

    def unchanged(self, frontier: EvictionFrontier) -> bool:
        """Whether :meth:`offer` would read nothing now, as far as the frontier tells (its
        signature is the one last read, and the tier took every block that read offered);
        keys that left the tier since are the caller's to rule out."""
        return frontier.signature() == self._seen

    def taken(self, offered: Iterable[tuple[Hashable, LazyCandidate]]) -> None:
        """After planning: remember the offered blocks the tier holds or writes now."""
        namespace, present = self.setup.namespace, self.ledger.present
        for contents, candidate in offered:
            key = namespace.key(candidate.block_hash, candidate.group)
            if present(key):
                block_id = candidate.block_id
                self._held[block_id] = contents
                self._held_keys[block_id] = key
                self._blocks_of.setdefault(key, set()).add(block_id)
            else:
                self._seen = None  # offer it again next time

    def _forget(self, departed: Iterable[BlockKey]) -> None:
        """The tier no longer holds these keys: offer their blocks again at the next read."""
        for key in departed:
            for block_id in self._blocks_of.pop(key, ()):
                if self._held_keys.get(block_id) == key:
                    del self._held[block_id], self._held_keys[block_id]
                    self._seen = None
