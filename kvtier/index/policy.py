"""A :class:`BlockIndex` built from slot bookkeeping plus a pluggable :class:`EvictionPolicy`.

The index owns slot states and pins; the policy only ranks keys. A policy sees
every readable key (``inserted``), every hit (``accessed``), every removal
(``removed``), and is asked for a victim among the keys the index says are
evictable (readable and unpinned). A policy may also refuse to admit a key.

The calls a policy receives, in order, for one request (see the sequence
diagram in the eviction-policies page of the docs):

1. :meth:`~EvictionPolicy.request_started` when the engine schedules it.
2. :meth:`~EvictionPolicy.accessed_all` for the chain it hits (a pin for a
   load, or a touch for blocks the engine itself still holds), root first.
3. Per store (a ``reserve`` of a chain), for each key in chain order:
   :meth:`~EvictionPolicy.offered` (every key, already stored ones included,
   with whether the store is eager or lazy); for a key not stored yet
   :meth:`~EvictionPolicy.admit`; and if it is admitted and no slot is free,
   :meth:`~EvictionPolicy.victim` then :meth:`~EvictionPolicy.removed` for the
   key evicted to make room, before the next key of the chain is offered. A
   reserve of new keys that all fit in free slots, by a policy that ignores
   offers, asks :meth:`~EvictionPolicy.admit_all` for the chain at once.
4. When the copy ends: :meth:`~EvictionPolicy.inserted_all` for the keys a
   commit made readable, in order (the base implementation calls
   :meth:`~EvictionPolicy.inserted` per key), or :meth:`~EvictionPolicy.aborted`
   (never readable).
5. :meth:`~EvictionPolicy.request_finished` when the engine is done with it.

``removed`` also follows a discard (a load of the key failed) and a clear.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

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


class EvictionPolicy(ABC):
    """Ranks a tier's readable keys for eviction.

    Subclasses implement the abstract methods; the others are notifications
    whose base implementation ignores them (and ``admit`` admits everything),
    so a policy overrides only the events it ranks by.
    """

    def request_started(self, request_id: str) -> None:  # noqa: B027 (a notification; the default ignores it)
        """The engine scheduled request ``request_id``; its hits and stores follow."""

    def request_finished(self, request_id: str) -> None:  # noqa: B027 (a notification; the default ignores it)
        """The engine finished request ``request_id``; stores of its blocks may still complete."""

    def offered(  # noqa: B027 (a notification; the default ignores it)
        self, key: BlockKey, parent: BlockKey | None, *, present: bool, lazy: bool
    ) -> None:
        """A store offers ``key`` (prefix parent ``parent``), before :meth:`admit` is asked.

        Args:
            key: The block offered.
            parent: Its prefix parent, ``None`` for a chain's root.
            present: ``key`` is already readable or being written: no slot is
                reserved and :meth:`admit` is not asked.
            lazy: The engine offers a block it is about to evict (lazy store mode),
                which it may have hit itself; ``False`` for a newly computed block.
        """

    def admit(self, key: BlockKey, parent: BlockKey | None) -> bool:
        """Return whether ``key`` (whose prefix parent is ``parent``) is worth a slot."""
        return True

    def admit_all(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> list[bool]:
        """Return whether each of a chain of keys is worth a slot, in order.

        ``keys[0]``'s prefix parent is ``parent``, each next key's the one before it. Asked
        only while a free slot is left for every key, so no victim is chosen between two of
        them, and only of a policy that ignores :meth:`offered`. Calls :meth:`admit` per
        key; a policy may do the same work in one pass.
        """
        admitted = []
        for key in keys:
            admitted.append(self.admit(key, parent))
            parent = key
        return admitted

    def aborted(self, key: BlockKey) -> None:  # noqa: B027 (a notification; the default ignores it)
        """The store of admitted ``key`` failed or was cancelled; it never became readable."""

    @abstractmethod
    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        """``key`` became readable."""

    def inserted_all(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        """Each of ``keys`` (prefix parent ``parents[i]``) became readable, in this order.

        Calls :meth:`inserted` per key; a policy may do the same work in one pass.
        """
        for key, parent in zip(keys, parents, strict=True):
            self.inserted(key, parent)

    @abstractmethod
    def accessed(self, key: BlockKey) -> None:
        """``key`` was hit."""

    def accessed_all(self, keys: Sequence[BlockKey]) -> None:
        """Each of ``keys`` was hit, in this order (one pin or touch: a chain, root first).

        Calls :meth:`accessed` per key; a policy may do the same work in one pass.
        """
        for key in keys:
            self.accessed(key)

    @abstractmethod
    def removed(self, key: BlockKey) -> None:
        """``key`` left the tier."""

    @abstractmethod
    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        """Choose a key to evict among those for which ``evictable`` is true, or ``None``."""

    def state(self) -> dict[str, float]:
        """The policy's own counters now (list sizes, adaptive targets), by name.

        ``kvtier simulate --trace-state`` records them over a replay. The base
        implementation has none; keep it cheap, it is called every few requests.
        """
        return {}


class PolicyIndex(BlockIndex, PrioritizedEviction, PushesEvictions):
    """Slot table with free, writing and readable states, pins, and a policy for victims.

    Each call takes its keys as one batch and allocates no object per key: a
    key being written maps to its slot, and its prefix parent waits in a list
    indexed by slot; events are kept as batches of keys (one per commit, one per
    call that evicts) and made into :class:`IndexEvent` s only by
    :meth:`take_events`, or not kept at all once :meth:`push_evictions` says so.

    Keys given a priority (:meth:`prioritize`) bend the policy's choice: a
    ``low`` key is evicted before the policy is asked, a ``high`` one only when
    the policy finds no other victim.

    The slots one :meth:`reserve` grants count up along its keys, whichever
    order they were freed in, so a chain stored together lies in as few runs
    of consecutive slots as the free slots allow.
    """

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots <= 0:
            raise ValueError(f"a block index needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.policy = policy
        self._free = list(range(num_slots - 1, -1, -1))
        self._readable: dict[BlockKey, int] = {}
        self._writing: dict[BlockKey, int] = {}
        # The prefix parent of the key being written into each slot.
        self._parents: list[BlockKey | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self._pinned = 0
        self._discarded: dict[BlockKey, int] = {}
        # Events as batches of keys of one kind, in order.
        self._events: list[tuple[EventKind, Sequence[BlockKey]]] = []
        self._keep_events = True
        self._sink: EvictionSink | None = None
        # Keys evicted by the call running now, handed to the sink and the events at its end.
        self._evicted: list[BlockKey] = []
        self._low: dict[BlockKey, None] = {}
        """Keys of priority ``low``, in the order they got it."""
        self._high: set[BlockKey] = set()
        self._policy_hears_offers = type(policy).offered is not EvictionPolicy.offered

    def _evictable(self, key: BlockKey) -> bool:
        slot = self._readable.get(key)
        return slot is not None and self._pins[slot] == 0

    def _unrank(self, key: BlockKey) -> None:
        if self._low or self._high:
            self._low.pop(key, None)
            self._high.discard(key)

    def _evict(self, key: BlockKey) -> int:
        slot = self._readable.pop(key)
        self._unrank(key)
        self.policy.removed(key)
        self._evicted.append(key)
        return slot

    def _evicted_now(self) -> None:
        """Hand the keys this call evicted to the sink and the events."""
        evicted, self._evicted = self._evicted, []
        if self._keep_events:
            self._events.append((EventKind.EVICTED, evicted))
        if self._sink is not None:
            self._sink(evicted)

    def push_evictions(self, sink: EvictionSink, *, keep_events: bool) -> None:
        self._sink = sink
        self._keep_events = keep_events
        if not keep_events:
            self._events.clear()

    def _evict_for_slot(self) -> int | None:
        """The slot of a key evicted for a store, or ``None`` if no key may be evicted.

        Runs once per block stored into a full tier: without priorities the policy
        is asked at once and the victim is evicted here (``_victim`` and ``_evict``,
        inline).
        """
        ranked = self._low or self._high
        victim = self._victim() if ranked else self.policy.victim(self._evictable)
        if victim is None:
            return None
        readable = self._readable
        slot = readable.get(victim)
        if slot is None or self._pins[slot]:
            raise RuntimeError(f"{type(self.policy).__name__} chose a key that is not evictable")
        del readable[victim]
        if ranked:
            self._low.pop(victim, None)
            self._high.discard(victim)
        self.policy.removed(victim)
        self._evicted.append(victim)
        return slot

    def _victim(self) -> BlockKey | None:
        evictable, high = self._evictable, self._high
        for key in self._low:
            if evictable(key):
                return key
        if not high:
            return self.policy.victim(evictable)
        victim = self.policy.victim(lambda key: key not in high and evictable(key))
        return victim if victim is not None else self.policy.victim(evictable)

    def prioritize(self, keys: Sequence[BlockKey], priority: Priority) -> None:
        for key in keys:
            if key not in self._readable and key not in self._writing:
                continue
            self._low.pop(key, None)
            self._high.discard(key)
            if priority == "low":
                self._low[key] = None
            elif priority == "high":
                self._high.add(key)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        readable = self._readable
        hits = 0
        for key in keys:
            if key not in readable:
                break
            hits += 1
        return hits

    def touch(self, keys: Sequence[BlockKey]) -> None:
        readable = self._readable
        self.policy.accessed_all([key for key in keys if key in readable])

    def pin(self, keys: Sequence[BlockKey]) -> list[int]:
        readable, pins = self._readable, self._pins
        try:
            slots = [readable[key] for key in keys]
        except KeyError as exc:
            raise KeyError(f"block {exc.args[0].hex()} is not readable in this tier") from None
        pinned = 0
        for slot in slots:
            if not pins[slot]:
                pinned += 1
            pins[slot] += 1
        self._pinned += pinned
        self.policy.accessed_all(keys)
        return slots

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        readable, discarded, pins = self._readable, self._discarded, self._pins
        for key in keys:
            slot = readable.get(key)
            if slot is None:
                slot = discarded.get(key)
            if slot is None or not pins[slot]:
                raise ValueError(f"block {key.hex()} is not pinned")
            left = pins[slot] - 1
            pins[slot] = left
            if not left:
                self._pinned -= 1
                if key in discarded:
                    del discarded[key]
                    self._free.append(slot)

    def discard(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key not in self._readable:
                continue
            slot = self._evict(key)
            if self._pins[slot] == 0:
                self._free.append(slot)
            else:
                self._discarded[key] = slot
        if self._evicted:
            self._evicted_now()

    def request_started(self, request_id: str) -> None:
        self.policy.request_started(request_id)

    def request_finished(self, request_id: str) -> None:
        self.policy.request_finished(request_id)

    def reserve(
        self, keys: Sequence[BlockKey], parent: BlockKey | None = None, *, lazy: bool = False
    ) -> list[int | None]:
        readable, writing, discarded = self._readable, self._writing, self._discarded
        free, parents = self._free, self._parents
        if len(keys) == 1 and free and not self._policy_hears_offers:
            # A decode step's block (one a request in every ``block_tokens``): its own path.
            key = keys[0]
            if key not in readable and key not in writing and key not in discarded:
                if not self.policy.admit_all(keys, parent)[0]:
                    return [None]
                slot = writing[key] = free.pop()
                parents[slot] = parent
                return [slot]
        if (
            len(free) >= len(keys)
            and not self._policy_hears_offers
            and readable.keys().isdisjoint(keys)
            and writing.keys().isdisjoint(keys)
            and (not discarded or discarded.keys().isdisjoint(keys))
            and len(dict.fromkeys(keys)) == len(keys)
        ):
            return self._reserve_free(keys, parent)
        policy = self.policy
        # Most policies ignore offers: skip the call per key for them.
        offered = policy.offered if self._policy_hears_offers else None
        admit = policy.admit
        slots: list[int | None] = []
        append = slots.append
        granted = 0
        for key in keys:
            present = key in readable or key in writing or key in discarded
            if offered is not None:
                offered(key, parent, present=present, lazy=lazy)
            if present or not admit(key, parent):
                append(None)
            else:
                slot = free.pop() if free else self._evict_for_slot()
                if slot is None:
                    slots.extend([None] * (len(keys) - len(slots)))
                    break
                writing[key] = slot
                parents[slot] = parent
                append(slot)
                granted += 1
            parent = key
        if granted > 1:
            # Slots freed by evictions come back in the victims' order (a prefix-aware
            # policy frees a chain last block first); any free slot will do for any key,
            # so the chain gets them counting up, and a copy of it is a few long runs.
            positions = [position for position, slot in enumerate(slots) if slot is not None]
            granted_slots = [slots[position] for position in positions]
            ascending = sorted(granted_slots)  # type: ignore[type-var]
            if ascending != granted_slots:
                moved = [parents[slot] for slot in granted_slots]  # type: ignore[index]
                for position, slot, parent in zip(positions, ascending, moved, strict=True):
                    slots[position] = slot
                    writing[keys[position]] = slot  # type: ignore[assignment]
                    parents[slot] = parent  # type: ignore[index]
        if self._evicted:
            self._evicted_now()
        return slots

    def _reserve_free(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> list[int | None]:
        """:meth:`reserve` of distinct keys the tier lacks, with a free slot for each: the policy
        is asked about the chain in one call, and the slots are granted counting up."""
        admitted = self.policy.admit_all(keys, parent)
        count = sum(admitted)
        if not count:
            return [None] * len(keys)
        free = self._free
        granted = free[-count:]
        del free[-count:]
        granted.sort()
        parents, writing = self._parents, self._writing
        if count == len(keys):
            writing.update(zip(keys, granted, strict=True))
            parents[granted[0]] = parent
            for slot, key_parent in zip(granted[1:], keys, strict=False):
                parents[slot] = key_parent
            return granted  # type: ignore[return-value]
        slots: list[int | None] = []
        next_slot = iter(granted).__next__
        for key, admit in zip(keys, admitted, strict=True):
            if admit:
                slot = writing[key] = next_slot()
                parents[slot] = parent
                slots.append(slot)
            else:
                slots.append(None)
            parent = key
        return slots

    def commit(self, keys: Sequence[BlockKey]) -> None:
        writing = self._writing
        for key in keys:
            if key not in writing:
                raise KeyError(f"block {key.hex()} has no reserved slot to commit")
        slots = list(map(writing.pop, keys))
        self._readable.update(zip(keys, slots, strict=True))
        parents = self._parents
        self.policy.inserted_all(keys, [parents[slot] for slot in slots])
        if self._keep_events:
            self._events.append((EventKind.STORED, tuple(keys)))

    def abort(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key not in self._writing:
                raise KeyError(f"block {key.hex()} has no reserved slot to abort")
        for key in keys:
            slot = self._writing.pop(key)
            self._unrank(key)
            self._free.append(slot)
            self.policy.aborted(key)

    def clear(self) -> bool:
        for key in [key for key in self._readable if self._evictable(key)]:
            self._free.append(self._evict(key))
        if self._evicted:
            self._evicted_now()
        return not self._readable and not self._writing and not self._discarded

    def slot_of(self, key: BlockKey) -> int | None:
        return self._readable.get(key)

    def stats(self) -> IndexStats:
        return IndexStats(
            num_slots=self.num_slots,
            free=len(self._free),
            writing=len(self._writing),
            readable=len(self._readable),
            pinned=self._pinned,
            discarded=len(self._discarded),
        )

    def take_events(self) -> list[IndexEvent]:
        batches, self._events = self._events, []
        return [IndexEvent(kind, key) for kind, keys in batches for key in keys]
