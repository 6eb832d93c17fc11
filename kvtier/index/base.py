"""The block-index contract: one tier's directory of ``BlockKey -> slot``.

Primitives, in the order a store and a load call them:

- store: :meth:`BlockIndex.reserve` (slots for new keys, evicting unpinned
  readable ones), the copy, then :meth:`BlockIndex.commit` (readable from now
  on) or :meth:`BlockIndex.abort` (the slot is free again).
- load: :meth:`BlockIndex.lookup` (how many leading keys are readable, no side
  effects), :meth:`BlockIndex.pin` (slots to read; pinned slots are never
  evicted or reused), the copy, :meth:`BlockIndex.unpin`.

A slot is in exactly one state: free, writing (reserved, never readable, never
evicted) or readable (possibly pinned). Events describe what became readable
and what was evicted, for engines that publish cache events.

An index that :class:`PushesEvictions` hands the keys that leave it to a sink
as they leave (the offload manager's mover demotes them at once), and keeps
events only when asked to; :func:`kvtier.index.push.push_evictions` gives any
other index the same form by taking its events after every call that may
evict.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

BlockKey = bytes

Priority = Literal["low", "normal", "high"]
"""A block's eviction priority: ``low`` blocks go first, ``high`` ones last."""


class EventKind(enum.Enum):
    STORED = "stored"
    EVICTED = "evicted"


class IndexEvent(NamedTuple):
    """A key became readable (``STORED``) or left the tier (``EVICTED``).

    A named tuple, made when :meth:`BlockIndex.take_events` is called: an index
    keeps its events as batches of keys until then.
    """

    kind: EventKind
    key: BlockKey


@dataclass(frozen=True)
class IndexStats:
    """Slot counts by state.

    ``discarded`` slots belong to discarded keys that are still pinned; they
    are freed by the last unpin. ``pinned`` counts slots with at least one pin.
    """

    num_slots: int
    free: int
    writing: int
    readable: int
    pinned: int
    discarded: int = 0


class BlockIndex(ABC):
    """Directory of one tier: keys to slots, slot states, pins and an eviction policy."""

    num_slots: int

    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Return how many leading ``keys`` are readable. Changes nothing."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Tell the policy ``keys`` were used elsewhere (e.g. hit in a faster tier).

        Keys this tier does not hold are ignored.
        """

    @abstractmethod
    def pin(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin readable ``keys`` for reading, count a hit on each, and return their slots.

        Raises ``KeyError`` naming the first key that is not readable; nothing is pinned then.
        """

    @abstractmethod
    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Release one pin on each of ``keys``."""

    def request_started(self, request_id: str) -> None:  # noqa: B027 (a notification; the default ignores it)
        """The engine scheduled request ``request_id``; an index without per-request state
        ignores it (the base implementation does)."""

    def request_finished(self, request_id: str) -> None:  # noqa: B027 (a notification; the default ignores it)
        """The engine finished request ``request_id``; ignored by the base implementation."""

    @abstractmethod
    def reserve(
        self, keys: Sequence[BlockKey], parent: BlockKey | None = None, *, lazy: bool = False
    ) -> list[int | None]:
        """Reserve write slots for a chain of keys; ``keys[0]``'s prefix parent is ``parent``.

        ``lazy`` says the engine offers blocks it is about to evict (lazy store
        mode) rather than newly computed ones. Returns one entry per key: the
        reserved slot, or ``None`` when the key is already present (readable or
        being written), the policy declined to admit it, or no slot could be
        freed (every remaining key then gets ``None``).
        """

    @abstractmethod
    def commit(self, keys: Sequence[BlockKey]) -> None:
        """Make reserved ``keys`` readable (their stores completed)."""

    @abstractmethod
    def abort(self, keys: Sequence[BlockKey]) -> None:
        """Free the slots reserved for ``keys`` (their stores failed or were cancelled)."""

    @abstractmethod
    def discard(self, keys: Sequence[BlockKey]) -> None:
        """Drop readable ``keys`` whose bytes cannot be trusted (e.g. a load of them failed).

        They stop being readable at once and are reported as evicted; a slot that
        is still pinned is freed when its last pin is released. Keys that are not
        readable are ignored.
        """

    @abstractmethod
    def clear(self) -> bool:
        """Evict every unpinned readable key; return whether the tier is now empty."""

    @abstractmethod
    def slot_of(self, key: BlockKey) -> int | None:
        """The slot of a readable key, else ``None``."""

    @abstractmethod
    def stats(self) -> IndexStats:
        """Current slot counts."""

    @abstractmethod
    def take_events(self) -> list[IndexEvent]:
        """Return and forget the events since the last call."""


EvictionSink = Callable[[Sequence[BlockKey]], None]
"""Told the keys that left a tier (evicted for room, discarded or cleared), in the order they
left, one batch per call; it must not keep the sequence it is given past the call."""


class PushesEvictions(ABC):
    """A block index that tells a sink of the keys leaving it, as they leave."""

    @abstractmethod
    def push_evictions(self, sink: EvictionSink, *, keep_events: bool) -> None:
        """From now on, call ``sink`` with the keys each call evicts, before the call returns.

        ``keep_events``: whether :meth:`BlockIndex.take_events` still returns events
        (an index that is not asked keeps them, as every index does); without it
        the index records none, and its calls build no event.
        """


class PrioritizedEviction(ABC):
    """A block index that evicts by a priority given per key before its ranking.

    The offload manager gives a request's blocks the eviction priority the
    request asked for; an index without this capability ranks them like any.
    """

    @abstractmethod
    def prioritize(self, keys: Sequence[BlockKey], priority: Priority) -> None:
        """Give ``keys`` (readable or being written) ``priority`` until they leave the tier.

        A ``low`` key is evicted before every ``normal`` and ``high`` one, oldest
        priority first; a ``high`` key only when no other key can be. Keys the
        index does not hold are ignored.
        """
