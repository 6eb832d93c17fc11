"""Contract tests for :class:`~kvtier.index.BlockIndex` implementations.

A block-index author subclasses :class:`BlockIndexContract` in a pytest module
and provides the ``make_index`` fixture, a callable that builds an empty index
with a given number of slots::

    import pytest
    from kvtier.testing.contracts_index import BlockIndexContract
    from my_plugin import MyPolicy
    from kvtier.index import PolicyIndex

    class TestMyIndex(BlockIndexContract):
        @pytest.fixture
        def make_index(self):
            return lambda num_slots: PolicyIndex(num_slots, MyPolicy())

Every ``test_*`` method then runs against that index: slot states, pins,
eviction, events, errors, and a hypothesis state machine that drives random
reserves, commits, aborts, pins, unpins, touches and clears and checks the
invariants after every step (no slot leaks, a pinned or writing slot is never
evicted or reused, a key is never readable before its commit, capacity is
never exceeded). Indexes whose policy may decline to admit a key set
``admits_all = False``; the tests that need a particular key admitted then skip.

Both forms of the contract are tested: the index as built, which keeps its
events for ``take_events``, and the index the offload manager uses, whose
evictions reach a sink as they happen
(:func:`~kvtier.index.push.push_evictions`: directly for an index that
:class:`~kvtier.index.base.PushesEvictions`, through
:class:`~kvtier.index.push.EvictionPushAdapter` for any other), with or
without kept events.

An eviction-policy author subclasses :class:`EvictionPolicyContract` instead
and provides ``make_policy``, a callable that builds the policy for a tier of a
given number of slots: the whole block-index contract then runs on the policy
inside a :class:`~kvtier.index.PolicyIndex`, plus the rules a policy keeps on
its own (victims are evictable keys it was told about, notifications are
accepted in any request order)::

    class TestMyPolicy(EvictionPolicyContract):
        @pytest.fixture
        def make_policy(self):
            return lambda num_slots: MyPolicy()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvtier.index.base import BlockIndex, BlockKey, EventKind, IndexEvent
from kvtier.index.policy import EvictionPolicy, PolicyIndex
from kvtier.index.push import push_evictions

IndexFactory = Callable[[int], BlockIndex]
"""Builds an empty index with the given number of slots."""
PolicyFactory = Callable[[int], EvictionPolicy]
"""Builds an eviction policy for a tier of the given number of slots."""


def chain(prefix: str, length: int) -> list[BlockKey]:
    """``length`` distinct keys, named after ``prefix``, standing for one prefix chain."""
    return [f"{prefix}/{position}".encode() for position in range(length)]


def store(index: BlockIndex, keys: list[BlockKey]) -> list[int | None]:
    """Reserve ``keys`` as one chain and commit those that got a slot; return the slots."""
    slots = index.reserve(keys)
    index.commit([key for key, slot in zip(keys, slots, strict=True) if slot is not None])
    return slots


class BlockIndexContract:
    """Behaviour every :class:`~kvtier.index.BlockIndex` must have; subclass it in a test module."""

    admits_all: ClassVar[bool] = True
    """Whether the index admits every new key while it has a free or evictable slot."""

    stateful_examples: ClassVar[int] = 60
    """How many random programs the state-machine test runs."""

    # Subclasses provide the fixture ``make_index() -> IndexFactory``.

    def _need_admission(self) -> None:
        if not self.admits_all:
            pytest.skip("this index may decline to admit keys")

    # ---------------------------------------------------------------- basics

    def test_new_index_is_empty(self, make_index: IndexFactory) -> None:
        index = make_index(4)
        assert index.num_slots == 4
        stats = index.stats()
        assert (stats.num_slots, stats.free, stats.writing, stats.readable, stats.pinned) == (
            4,
            4,
            0,
            0,
            0,
        )
        assert index.lookup(chain("a", 3)) == 0
        assert index.take_events() == []

    def test_reserved_key_is_not_readable_until_commit(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(4)
        keys = chain("a", 2)
        slots = index.reserve(keys)
        assert all(slot is not None for slot in slots)
        assert len(set(slots)) == 2 and all(0 <= slot < 4 for slot in slots)  # type: ignore[operator]
        assert index.lookup(keys) == 0
        assert index.slot_of(keys[0]) is None
        assert index.stats().writing == 2
        with pytest.raises(KeyError):
            index.pin(keys[:1])
        index.commit(keys)
        assert index.lookup(keys) == 2
        assert [index.slot_of(key) for key in keys] == slots
        assert index.stats().readable == 2
        events = index.take_events()
        assert events == [IndexEvent(EventKind.STORED, key) for key in keys]
        assert index.take_events() == []

    def test_abort_frees_the_slot(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(1)
        key = chain("a", 1)
        assert index.reserve(key) != [None]
        index.abort(key)
        assert index.stats().free == 1
        assert index.lookup(key) == 0
        assert index.take_events() == []
        assert index.reserve(key) != [None]

    def test_reserve_skips_present_keys(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(4)
        keys = chain("a", 2)
        store(index, keys[:1])
        index.reserve(keys[1:])
        assert index.reserve(keys) == [None, None]
        assert index.stats().free == 2

    def test_lookup_counts_the_leading_readable_keys(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(8)
        keys = chain("a", 4)
        store(index, [keys[0], keys[1], keys[3]])
        assert index.lookup(keys) == 2
        assert index.lookup(keys[1:]) == 1
        assert index.lookup(keys[2:]) == 0
        assert index.lookup([]) == 0

    def test_lookup_changes_nothing(self, make_index: IndexFactory) -> None:
        self._need_admission()
        looked, untouched = make_index(4), make_index(4)
        for index in (looked, untouched):
            store(index, chain("a", 2))
            store(index, chain("b", 2))
        for _ in range(3):
            looked.lookup(chain("a", 2))
            looked.lookup(chain("a", 1) + chain("missing", 1))
        for index in (looked, untouched):
            index.take_events()
            store(index, chain("c", 2))
        assert looked.take_events() == untouched.take_events()
        assert looked.stats() == untouched.stats()

    def test_commit_or_abort_of_unreserved_key_raises(self, make_index: IndexFactory) -> None:
        index = make_index(2)
        with pytest.raises(KeyError):
            index.commit(chain("never", 1))
        with pytest.raises(KeyError):
            index.abort(chain("never", 1))

    def test_pin_is_all_or_nothing(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(4)
        keys = chain("a", 2)
        store(index, keys[:1])
        with pytest.raises(KeyError):
            index.pin(keys)
        assert index.stats().pinned == 0
        slots = index.pin(keys[:1])
        assert slots == [index.slot_of(keys[0])]
        assert index.stats().pinned == 1
        index.unpin(keys[:1])
        assert index.stats().pinned == 0

    def test_touch_ignores_unknown_keys(self, make_index: IndexFactory) -> None:
        index = make_index(2)
        index.touch(chain("unknown", 3))
        assert index.stats().free == 2

    def test_discard_drops_readable_keys_and_frees_pinned_slots_on_release(
        self, make_index: IndexFactory
    ) -> None:
        self._need_admission()
        index = make_index(3)
        keys = chain("a", 2)
        store(index, keys)
        index.take_events()
        index.pin(keys[1:])
        index.discard(keys + chain("never", 1))
        assert index.lookup(keys[:1]) == 0 and index.lookup(keys[1:]) == 0
        assert [event.kind for event in index.take_events()] == [EventKind.EVICTED] * 2
        stats = index.stats()
        assert (stats.free, stats.readable, stats.discarded, stats.pinned) == (2, 0, 1, 1)
        assert index.reserve(keys[1:]) == [None], "a discarded key is busy until unpinned"
        index.unpin(keys[1:])
        assert index.stats().free == 3 and index.stats().discarded == 0

    # -------------------------------------------------------------- eviction

    def test_full_index_evicts_a_readable_key(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(2)
        store(index, chain("a", 2))
        index.take_events()
        slots = index.reserve(chain("b", 1))
        if slots == [None]:
            return  # a policy may decline a newcomer when full; it then evicts nothing
        assert index.stats().readable == 1
        events = index.take_events()
        assert [event.kind for event in events] == [EventKind.EVICTED]
        assert events[0].key in chain("a", 2)
        assert index.slot_of(events[0].key) is None
        assert slots[0] not in {index.slot_of(key) for key in chain("a", 2)}

    def test_pinned_and_writing_slots_are_never_evicted(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(3)
        pinned = chain("pinned", 1)
        store(index, pinned)
        index.pin(pinned)
        pinned_slot = index.slot_of(pinned[0])
        writing = chain("writing", 1)
        (writing_slot,) = index.reserve(writing)
        store(index, chain("plain", 1))
        handed = [
            slot
            for attempt in range(4)
            for slot in index.reserve(chain(f"new{attempt}", 1))
            if slot is not None
        ]
        assert pinned_slot not in handed and writing_slot not in handed
        assert len(handed) <= 1
        assert index.slot_of(pinned[0]) == pinned_slot
        index.commit(writing)
        assert index.slot_of(writing[0]) == writing_slot

    def test_reserve_returns_none_when_nothing_can_be_evicted(
        self, make_index: IndexFactory
    ) -> None:
        self._need_admission()
        index = make_index(2)
        keys = chain("a", 2)
        store(index, keys[:1])
        index.pin(keys[:1])
        index.reserve(keys[1:])
        assert index.reserve(chain("b", 3)) == [None, None, None]
        assert index.stats().free == 0
        assert index.slot_of(keys[0]) is not None

    def test_unpinned_key_becomes_evictable(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(1)
        key = chain("a", 1)
        store(index, key)
        index.pin(key)
        index.pin(key)
        index.unpin(key)
        assert index.reserve(chain("b", 1)) == [None]
        index.unpin(key)
        newcomer = chain("c", 1)
        slots = index.reserve(newcomer)
        if slots != [None]:
            assert index.slot_of(key[0]) is None

    def test_clear_keeps_pinned_and_writing(self, make_index: IndexFactory) -> None:
        self._need_admission()
        index = make_index(4)
        store(index, chain("a", 2))
        pinned = chain("p", 1)
        store(index, pinned)
        index.pin(pinned)
        writing = chain("w", 1)
        index.reserve(writing)
        index.take_events()
        assert index.clear() is False
        assert index.stats().readable == 1
        evicted = {event.key for event in index.take_events() if event.kind is EventKind.EVICTED}
        assert evicted == set(chain("a", 2))
        index.unpin(pinned)
        index.abort(writing)
        assert index.clear() is True
        assert index.stats().free == 4

    # ------------------------------------------------------- pushed evictions

    def test_evictions_reach_the_sink_before_the_call_returns(
        self, make_index: IndexFactory
    ) -> None:
        self._need_admission()
        pushed: list[list[BlockKey]] = []
        index = push_evictions(make_index(3), _collect(pushed), keep_events=True)
        store(index, chain("a", 3))
        assert pushed == [] and len(index.take_events()) == 3
        slots = index.reserve(chain("b", 2))
        evicted = [event.key for event in index.take_events()]
        assert [key for batch in pushed for key in batch] == evicted
        assert len(evicted) == sum(slot is not None for slot in slots)
        pushed.clear()
        readable = [key for key in chain("a", 3) if index.slot_of(key) is not None]
        index.discard(readable[:1])
        assert pushed == [readable[:1]]
        pushed.clear()
        index.clear()
        assert sorted(key for batch in pushed for key in batch) == sorted(readable[1:])
        assert sorted(event.key for event in index.take_events()) == sorted(readable)

    def test_an_index_told_to_keep_no_events_keeps_none(self, make_index: IndexFactory) -> None:
        self._need_admission()
        pushed: list[list[BlockKey]] = []
        index = push_evictions(make_index(2), _collect(pushed), keep_events=False)
        store(index, chain("a", 2))
        store(index, chain("b", 2))
        assert index.take_events() == []
        assert sorted(key for batch in pushed for key in batch) == sorted(
            key for key in chain("a", 2) + chain("b", 2) if index.slot_of(key) is None
        )
        assert pushed, "a full index that stored a new chain evicted some key"

    # ---------------------------------------------------------- state machine

    def test_random_programs_keep_the_invariants(self, make_index: IndexFactory) -> None:
        self._run_machine(_index_machine(make_index, num_slots=6, pushed=False))

    def test_random_programs_push_what_they_evict(self, make_index: IndexFactory) -> None:
        self._run_machine(_index_machine(make_index, num_slots=6, pushed=True))

    def _run_machine(self, machine: type[RuleBasedStateMachine]) -> None:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.stateful_examples,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


def _collect(batches: list[list[BlockKey]]) -> Callable[[Sequence[BlockKey]], None]:
    """An eviction sink that appends a copy of each batch to ``batches``."""
    return lambda keys: batches.append(list(keys))


def _index_machine(
    make_index: IndexFactory, num_slots: int, *, pushed: bool
) -> type[RuleBasedStateMachine]:
    """A state machine that checks an index against a model of slot states.

    ``pushed``: the index's evictions also reach a sink, and every call's pushed keys
    must be the keys its events say it evicted, in order.
    """

    key_names = st.integers(min_value=0, max_value=14).map(lambda n: f"k{n}".encode())

    class IndexMachine(RuleBasedStateMachine):
        writing_keys = Bundle("writing_keys")

        def __init__(self) -> None:
            super().__init__()
            self.index = make_index(num_slots)
            self.pushed: list[list[BlockKey]] = []
            if pushed:
                self.index = push_evictions(self.index, _collect(self.pushed), keep_events=True)
            self.readable: dict[BlockKey, int] = {}
            self.writing: dict[BlockKey, int] = {}
            self.pins: dict[BlockKey, int] = {}
            self.discarded: dict[BlockKey, int] = {}

        def _absorb_events(self) -> set[BlockKey]:
            evicted = set()
            events = self.index.take_events()
            if pushed:
                told = [key for batch in self.pushed for key in batch]
                self.pushed.clear()
                assert told == [e.key for e in events if e.kind is EventKind.EVICTED]
            for event in events:
                if event.kind is EventKind.EVICTED:
                    assert event.key in self.readable, f"evicted {event.key!r}, not readable"
                    assert self.pins.get(event.key, 0) == 0, f"evicted pinned {event.key!r}"
                    del self.readable[event.key]
                    evicted.add(event.key)
                else:
                    assert event.key in self.readable, f"stored event for {event.key!r} early"
            return evicted

        @rule(keys=st.lists(key_names, min_size=1, max_size=4, unique=True))
        def reserve(self, keys: list[BlockKey]) -> None:
            before_present = set(self.readable) | set(self.writing) | set(self.discarded)
            slots = self.index.reserve(keys)
            assert len(slots) == len(keys)
            # a key evicted by this very call may be reserved again further down the chain
            before_present -= self._absorb_events()
            taken = (
                set(self.readable.values())
                | set(self.writing.values())
                | set(self.discarded.values())
            )
            for key, slot in zip(keys, slots, strict=True):
                if slot is None:
                    continue
                assert key not in before_present, f"{key!r} reserved twice"
                assert 0 <= slot < num_slots
                assert slot not in taken, f"slot {slot} handed out while in use"
                taken.add(slot)
                self.writing[key] = slot

        @rule(data=st.data())
        def commit(self, data: st.DataObject) -> None:
            if not self.writing:
                return
            key = data.draw(st.sampled_from(sorted(self.writing)))
            self.index.commit([key])
            self.readable[key] = self.writing.pop(key)
            events = self.index.take_events()
            assert IndexEvent(EventKind.STORED, key) in events

        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            if not self.writing:
                return
            key = data.draw(st.sampled_from(sorted(self.writing)))
            self.index.abort([key])
            del self.writing[key]

        @rule(data=st.data())
        def pin(self, data: st.DataObject) -> None:
            if not self.readable:
                return
            key = data.draw(st.sampled_from(sorted(self.readable)))
            assert self.index.pin([key]) == [self.readable[key]]
            self.pins[key] = self.pins.get(key, 0) + 1

        @rule(data=st.data())
        def unpin(self, data: st.DataObject) -> None:
            pinned = sorted(key for key, count in self.pins.items() if count)
            if not pinned:
                return
            key = data.draw(st.sampled_from(pinned))
            self.index.unpin([key])
            self.pins[key] -= 1
            if not self.pins[key]:
                self.discarded.pop(key, None)

        @rule(data=st.data())
        def discard(self, data: st.DataObject) -> None:
            if not self.readable:
                return
            key = data.draw(st.sampled_from(sorted(self.readable)))
            self.index.discard([key])
            assert self.index.take_events() == [IndexEvent(EventKind.EVICTED, key)]
            if pushed:
                assert self.pushed == [[key]]
                self.pushed.clear()
            slot = self.readable.pop(key)
            if self.pins.get(key, 0):
                self.discarded[key] = slot
            assert self.index.lookup([key]) == 0

        @rule(key=key_names)
        def pin_unreadable_raises(self, key: BlockKey) -> None:
            if key in self.readable:
                return
            with pytest.raises(KeyError):
                self.index.pin([key])

        @rule(keys=st.lists(key_names, max_size=4))
        def touch(self, keys: list[BlockKey]) -> None:
            self.index.touch(keys)

        @rule()
        def clear(self) -> None:
            empty = self.index.clear()
            self._absorb_events()
            assert all(self.pins.get(key, 0) for key in self.readable)
            assert empty == (not self.readable and not self.writing and not self.discarded)

        @invariant()
        def matches_model(self) -> None:
            stats = self.index.stats()
            assert stats.num_slots == num_slots
            assert stats.readable == len(self.readable)
            assert stats.writing == len(self.writing)
            assert stats.discarded == len(self.discarded)
            assert stats.free + stats.readable + stats.writing + stats.discarded == num_slots, (
                "slot leak"
            )
            assert stats.pinned == sum(1 for count in self.pins.values() if count)
            for key, slot in self.readable.items():
                assert self.index.slot_of(key) == slot
                assert self.index.lookup([key]) == 1
            for key in self.writing:
                assert self.index.slot_of(key) is None, f"{key!r} readable before commit"
                assert self.index.lookup([key]) == 0

    return IndexMachine


class EvictionPolicyContract(BlockIndexContract):
    """Behaviour every :class:`~kvtier.index.EvictionPolicy` must have; subclass it in a test.

    Subclasses provide the fixture ``make_policy() -> PolicyFactory``; every
    :class:`BlockIndexContract` test runs on the policy in a ``PolicyIndex``.
    """

    @pytest.fixture
    def make_index(self, make_policy: PolicyFactory) -> IndexFactory:
        return lambda num_slots: PolicyIndex(num_slots, make_policy(num_slots))

    def test_victim_is_an_inserted_evictable_key_or_none(self, make_policy: PolicyFactory) -> None:
        policy = make_policy(8)
        keys = chain("v", 4)
        parent = None
        for key in keys:
            policy.inserted(key, parent)
            parent = key
        assert policy.victim(lambda key: False) is None
        assert policy.victim(lambda key: key == keys[2]) == keys[2]
        policy.removed(keys[2])
        assert policy.victim(lambda key: key == keys[2]) is None
        assert policy.victim(lambda key: True) in keys

    def test_notifications_reach_the_policy_in_request_order(
        self, make_policy: PolicyFactory
    ) -> None:
        index = PolicyIndex(2, make_policy(2))
        index.request_started("r1")
        index.request_started("r2")
        first = chain("n", 3)
        slots = index.reserve(first, lazy=True)
        index.abort([key for key, slot in zip(first, slots, strict=True) if slot is not None])
        self._need_admission()
        index.request_finished("r1")
        stored = store(index, chain("m", 2))
        assert stored == [0, 1] or stored == [1, 0]
        assert index.reserve(chain("m", 2)) == [None, None]  # present: offered, not admitted
        index.request_finished("r2")
        assert index.stats().readable == 2 and index.stats().free == 0

    def test_batch_calls_answer_as_the_calls_per_key(self, make_policy: PolicyFactory) -> None:
        """``admit_all`` and ``inserted_all`` of a chain leave the policy as ``admit`` and
        ``inserted`` of each of its keys in order (the defaults do exactly that; a policy that
        does the work in one pass must keep it)."""
        runs = [_batch_or_per_key_run(make_policy(6), batched=flag) for flag in (True, False)]
        assert runs[0] == runs[1]


def _batch_or_per_key_run(policy: EvictionPolicy, *, batched: bool) -> list[object]:
    """Chains that come back and evict each other, offered and stored in one call each or key by
    key (a small tier: the caller evicts down to 6 keys); every answer and victim, in order."""
    held: list[BlockKey] = []
    seen: list[object] = []
    for round_ in range(40):
        name, length = f"c{round_ * 7 % 5}", 2 + round_ % 4
        parent = f"c{round_ % 3}/9".encode() if round_ % 4 == 3 else None
        keys = [key for key in chain(name, length) if key not in held]
        if len(keys) != length:
            continue  # partly stored: a chain offered must be new in full
        if batched:
            admitted = policy.admit_all(keys, parent)
        else:
            admitted, before = [], parent
            for key in keys:
                admitted.append(policy.admit(key, before))
                before = key
        seen.append(admitted)
        stored = keys[: admitted.index(False)] if False in admitted else keys
        parents = [parent, *stored[:-1]]
        if batched:
            policy.inserted_all(stored, parents)
        else:
            for key, before in zip(stored, parents, strict=True):
                policy.inserted(key, before)
        held.extend(stored)
        if round_ % 5 == 4:
            policy.accessed_all(held[-2:])
        while len(held) > 6:
            victim = policy.victim(lambda key: key in held)
            assert victim is not None, "a victim must be found among the held keys"
            policy.removed(victim)
            held.remove(victim)
            seen.append(victim)
    seen.append(policy.state())
    return seen
