"""Connects a block index's evictions to a sink, whether or not the index pushes them itself.

:func:`push_evictions` is what the offload manager calls: an index that
:class:`~kvtier.index.base.PushesEvictions` (every built-in one) is told the
sink directly; any other :class:`~kvtier.index.base.BlockIndex` (a plugin
written against the per-key contract, which only keeps events) is wrapped in
an :class:`EvictionPushAdapter`, which takes the index's events after each call
that may evict and hands the evicted keys to the sink.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.index.base import (
    BlockIndex,
    BlockKey,
    EventKind,
    EvictionSink,
    IndexEvent,
    IndexStats,
    PrioritizedEviction,
    Priority,
    PushesEvictions,
)


class EvictionPushAdapter(BlockIndex, PushesEvictions):
    """A per-key :class:`BlockIndex` whose evictions reach a sink after each call that evicts.

    Every call goes to the wrapped ``index``; after ``reserve``, ``commit``,
    ``discard`` and ``clear`` its events are taken, the evicted keys go to the
    sink and, with ``keep_events``, the events are kept for :meth:`take_events`.
    """

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.num_slots = index.num_slots
        self._sink: EvictionSink | None = None
        self._keep_events = True
        self._events: list[IndexEvent] = []

    def push_evictions(self, sink: EvictionSink, *, keep_events: bool) -> None:
        self._sink = sink
        self._keep_events = keep_events
        self._take()
        if not keep_events:
            self._events.clear()

    def _take(self) -> None:
        events = self.index.take_events()
        if not events:
            return
        if self._keep_events:
            self._events.extend(events)
        if self._sink is not None:
            evicted = [event.key for event in events if event.kind is EventKind.EVICTED]
            if evicted:
                self._sink(evicted)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self.index.lookup(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.index.touch(keys)

    def pin(self, keys: Sequence[BlockKey]) -> list[int]:
        return self.index.pin(keys)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        self.index.unpin(keys)

    def request_started(self, request_id: str) -> None:
        self.index.request_started(request_id)

    def request_finished(self, request_id: str) -> None:
        self.index.request_finished(request_id)

    def reserve(
        self, keys: Sequence[BlockKey], parent: BlockKey | None = None, *, lazy: bool = False
    ) -> list[int | None]:
        slots = self.index.reserve(keys, parent, lazy=lazy)
        self._take()
        return slots

    def commit(self, keys: Sequence[BlockKey]) -> None:
        self.index.commit(keys)
        self._take()

    def abort(self, keys: Sequence[BlockKey]) -> None:
        self.index.abort(keys)
        self._take()

    def discard(self, keys: Sequence[BlockKey]) -> None:
        self.index.discard(keys)
        self._take()

    def clear(self) -> bool:
        empty = self.index.clear()
        self._take()
        return empty

    def slot_of(self, key: BlockKey) -> int | None:
        return self.index.slot_of(key)

    def stats(self) -> IndexStats:
        return self.index.stats()

    def take_events(self) -> list[IndexEvent]:
        self._take()
        events, self._events = self._events, []
        return events


class PrioritizedPushAdapter(EvictionPushAdapter, PrioritizedEviction):
    """An :class:`EvictionPushAdapter` over an index that takes eviction priorities."""

    index: PrioritizedEviction  # type: ignore[assignment]

    def prioritize(self, keys: Sequence[BlockKey], priority: Priority) -> None:
        self.index.prioritize(keys, priority)


def push_evictions(index: BlockIndex, sink: EvictionSink, *, keep_events: bool) -> BlockIndex:
    """Have ``index``'s evictions reach ``sink`` as they happen; return the index to use.

    An index that :class:`~kvtier.index.base.PushesEvictions` is returned as it is;
    any other is wrapped in an :class:`EvictionPushAdapter`.
    """
    if isinstance(index, PushesEvictions):
        index.push_evictions(sink, keep_events=keep_events)
        return index
    adapter = (
        PrioritizedPushAdapter(index)
        if isinstance(index, PrioritizedEviction)
        else EvictionPushAdapter(index)
    )
    adapter.push_evictions(sink, keep_events=keep_events)
    return adapter
