"""Behaviour of the arc, s3fifo and prefix_arc eviction policies beyond the index contract."""

from __future__ import annotations

import random
from typing import Literal

import pytest
from pydantic import ValidationError

from kvtier.index.arc import ARCPolicy, ARCShadow
from kvtier.index.base import BlockKey, EventKind, IndexEvent
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import EvictionPolicy, PolicyIndex
from kvtier.index.prefix_arc import PrefixARCConfig, PrefixARCPolicy
from kvtier.index.s3fifo import S3FIFOConfig, S3FIFOPolicy
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry


def store(index: PolicyIndex, keys: list[BlockKey], parent: BlockKey | None = None) -> None:
    slots = index.reserve(keys, parent)
    index.commit([key for key, slot in zip(keys, slots, strict=True) if slot is not None])


def hit(index: PolicyIndex, keys: list[BlockKey]) -> None:
    index.pin(keys)
    index.unpin(keys)


def evicted(index: PolicyIndex) -> list[BlockKey]:
    return [event.key for event in index.take_events() if event.kind is EventKind.EVICTED]


def new_keys(prefix: str, count: int) -> list[BlockKey]:
    return [f"{prefix}{n}".encode() for n in range(count)]


@pytest.mark.parametrize("name", ["arc", "s3fifo", "prefix_arc"])
def test_registered_with_a_default_config(name: str) -> None:
    registry = default_registry()
    config = registry.get(BLOCK_INDEX, name).config_model()
    index = registry.build(BLOCK_INDEX, config, 8)
    assert isinstance(index, PolicyIndex)
    assert index.num_slots == 8


def test_config_bounds_are_checked() -> None:
    with pytest.raises(ValidationError):
        S3FIFOConfig(small_fraction=1.0)
    with pytest.raises(ValidationError):
        PrefixARCConfig(history_factor=-1)


def scan_survivor(policy: EvictionPolicy) -> bool:
    """Store one key, hit it twice, then store one-time keys; is the hit key still there?"""
    index = PolicyIndex(4, policy)
    store(index, [b"hot"])
    hit(index, [b"hot"])
    hit(index, [b"hot"])
    for key in new_keys("scan", 10):
        store(index, [key])
    return index.slot_of(b"hot") is not None


@pytest.mark.parametrize(
    "policy",
    [ARCPolicy(4), S3FIFOPolicy(4), PrefixARCPolicy(4, eviction="arc")],
    ids=["arc", "s3fifo", "prefix"],
)
def test_reused_key_survives_a_scan(policy: EvictionPolicy) -> None:
    assert scan_survivor(policy)


def test_lru_does_not_survive_the_same_scan() -> None:
    assert not scan_survivor(LRUPolicy())


def test_prefix_arc_evicts_a_chain_from_its_tail() -> None:
    index = PolicyIndex(3, PrefixARCPolicy(3))
    store(index, [b"a", b"b", b"c"])
    store(index, [b"x"])
    assert evicted(index) == [b"c"]
    assert index.lookup([b"a", b"b"]) == 2


def test_prefix_arc_evicts_orphans_first() -> None:
    index = PolicyIndex(4, PrefixARCPolicy(4))
    store(index, [b"a", b"b"])
    store(index, [b"x"])
    store(index, [b"y"])
    index.pin([b"b"])
    store(index, [b"z"])
    assert evicted(index) == [b"a"]
    index.unpin([b"b"])
    # ``b`` is unreachable without ``a``: it goes before the older root ``x``.
    store(index, [b"w"])
    assert evicted(index) == [b"b"]
    assert index.slot_of(b"x") is not None


def test_prefix_arc_remembers_reuse_beyond_the_ghost_lists() -> None:
    def survives(history_factor: float) -> bool:
        index = PolicyIndex(4, PrefixARCPolicy(4, history_factor, eviction="arc"))
        store(index, [b"doc"])
        for key in new_keys("first", 12):
            store(index, [key])
        store(index, [b"doc"])
        for key in new_keys("second", 6):
            store(index, [key])
        return index.slot_of(b"doc") is not None

    assert survives(history_factor=4.0)
    assert not survives(history_factor=0.0)


def test_s3fifo_one_hit_keys_leave_through_the_small_queue() -> None:
    index = PolicyIndex(10, S3FIFOPolicy(10, small_fraction=0.2))
    store(index, [b"kept"])
    hit(index, [b"kept"])
    hit(index, [b"kept"])
    for key in new_keys("once", 30):
        store(index, [key])
    assert index.slot_of(b"kept") is not None
    assert index.lookup([b"once0"]) == 0


def test_arc_moves_its_target_towards_the_list_that_missed() -> None:
    policy = ARCPolicy(4)
    index = PolicyIndex(4, policy)
    for key in new_keys("k", 5):
        store(index, [key])
    assert policy.target_t1 == 0.0
    store(index, [b"k0"])  # remembered by the recency ghost list
    assert policy.target_t1 > 0.0


@pytest.mark.parametrize(
    "policy", [ARCPolicy(3), S3FIFOPolicy(3), PrefixARCPolicy(3)], ids=["arc", "s3fifo", "prefix"]
)
def test_no_victim_while_everything_is_pinned(policy: EvictionPolicy) -> None:
    index = PolicyIndex(3, policy)
    store(index, [b"a", b"b", b"c"])
    index.pin([b"a", b"b", b"c"])
    assert index.reserve([b"d"]) == [None]
    index.unpin([b"a", b"b", b"c"])
    assert index.reserve([b"d"]) != [None]


def test_prefix_arc_learns_which_stored_blocks_are_rarely_reused() -> None:
    def first_victim_after_training(low_value_ratio: float) -> list[BlockKey]:
        index = PolicyIndex(8, PrefixARCPolicy(8, 4.0, low_value_ratio, eviction="arc"))
        for round_ in range(30):
            head, middle, tail = (f"{part}{round_}".encode() for part in "abc")
            store(index, [head, middle, tail])
            # Heads and tails are used again (elsewhere), the middle blocks never are.
            index.touch([head, tail])
        store(index, [b"x", b"y", b"z"])
        index.take_events()
        store(index, [b"w"])
        return evicted(index)

    assert first_victim_after_training(0.5) == [b"y"]
    assert first_victim_after_training(0.0) == [b"z"]


def test_prefix_arc_reuse_from_the_long_history_shrinks_the_recency_target() -> None:
    policy = PrefixARCPolicy(4, eviction="arc")
    index = PolicyIndex(4, policy)
    store(index, [b"hot"])
    hit(index, [b"hot"])
    for key in new_keys("k", 10):
        store(index, [key])
    store(index, [b"k6"])  # remembered by the recency ghost list: the target grows
    grown = policy.target_t1
    assert grown > 0.0
    store(index, [b"k0"])  # only the long history remembers it: the target shrinks
    assert policy.target_t1 < grown


def test_prefix_arc_a_parent_held_elsewhere_does_not_make_an_orphan() -> None:
    # Lazy stores arrive leaf first, while the parent still sits in the engine's device cache.
    index = PolicyIndex(3, PrefixARCPolicy(3))
    store(index, [b"old"])
    store(index, [b"leaf"], parent=b"parent")
    store(index, [b"parent"], parent=b"root")
    store(index, [b"new"])
    assert evicted(index) == [b"old"]


def serve(index: PolicyIndex, keys: list[BlockKey]) -> None:
    """Serve one request as the offload manager does: load the readable prefix, store the rest."""
    hits = index.lookup(keys)
    if hits:
        hit(index, keys[:hits])
    if hits < len(keys):
        store(index, keys[hits:], keys[hits - 1] if hits else None)


def one_shot_scan_with_hot_keys(policy: PrefixARCPolicy, rounds: int = 20) -> PolicyIndex:
    """Each round reuses four hot keys and stores eight blocks never used again, in 8 slots."""
    index = PolicyIndex(8, policy)
    for round_ in range(rounds):
        for hot in new_keys("hot", 4):
            serve(index, [hot])
        serve(index, new_keys(f"scan{round_}-", 8))
    return index


def test_prefix_arc_learns_to_store_only_blocks_seen_before() -> None:
    policy = PrefixARCPolicy(8)
    index = one_shot_scan_with_hot_keys(policy)
    assert policy.second_sight
    assert all(index.slot_of(hot) is not None for hot in new_keys("hot", 4))
    # A new chain is declined, its second block because its parent was; seen again, it is stored.
    assert index.reserve([b"new0", b"new1"]) == [None, None]
    assert None not in index.reserve([b"new0", b"new1"])


def test_prefix_arc_admission_all_stores_first_sight_blocks() -> None:
    policy = PrefixARCPolicy(8, admission="all")
    index = one_shot_scan_with_hot_keys(policy)
    assert not policy.second_sight
    assert None not in index.reserve([b"new0", b"new1"])


def test_prefix_arc_keeps_storing_first_sight_blocks_that_come_back_soon() -> None:
    policy = PrefixARCPolicy(8)
    index = PolicyIndex(8, policy)
    for round_ in range(40):
        # Each chain is used again by the next request and never after: storing pays.
        chain = new_keys(f"c{round_}-", 3)
        serve(index, chain)
        serve(index, chain)
    assert not policy.second_sight
    assert None not in index.reserve([b"new0", b"new1"])


def test_arc_shadow_hits_what_the_arc_index_hits() -> None:
    shadow = ARCShadow(8)
    index = PolicyIndex(8, ARCPolicy(8))
    # Hot keys, a loop slightly larger than the cache and one-time keys, interleaved.
    uses = [
        f"{kind}{n % size}".encode() for n in range(400) for kind, size in ((b"h", 3), (b"l", 9))
    ]
    uses += [f"once{n}".encode() for n in range(20)] + uses[:100]
    for key in uses:
        hit_in_index = index.lookup([key]) == 1
        if hit_in_index:
            hit(index, [key])
        else:
            store(index, [key])
        assert shadow.reference(key) == hit_in_index


def test_arc_shadow_remembers_reuse_beyond_the_ghost_lists() -> None:
    def survives(history_size: int) -> bool:
        shadow = ARCShadow(4, history_size)
        shadow.reference(b"doc")
        for key in new_keys("first", 12):
            shadow.reference(key)
        shadow.reference(b"doc")
        for key in new_keys("second", 6):
            shadow.reference(key)
        return shadow.reference(b"doc")

    assert survives(history_size=16)
    assert not survives(history_size=0)


def test_prefix_arc_recency_rule_evicts_the_least_recent_block_of_both_lists() -> None:
    def first_victim(eviction: Literal["arc", "recency"]) -> list[BlockKey]:
        index = PolicyIndex(2, PrefixARCPolicy(2, eviction=eviction))
        store(index, [b"old"])
        hit(index, [b"old"])  # in the frequency list, last used before ``new`` was stored
        store(index, [b"new"])
        store(index, [b"next"])
        return evicted(index)

    assert first_victim("recency") == [b"old"]
    assert first_victim("arc") == [b"new"]


def reuse_soon_and_after_long_gaps(index: PolicyIndex, steps: int = 200) -> None:
    """Each key is used three times: when new, two steps later and twenty steps later."""
    for step in range(steps):
        for back in (0, 2, 20):
            if step >= back:
                serve(index, [f"w{step - back}".encode()])


def test_prefix_arc_follows_the_rule_whose_shadow_hits_more() -> None:
    policy = PrefixARCPolicy(8)
    assert policy.recency
    # Hot keys between one-shot scans: ARC keeps them in its frequency list, LRU does not.
    index = one_shot_scan_with_hot_keys(policy)
    assert not policy.recency
    # Keys reused soon, then once after a long gap: ARC's target pushes the soon-reused keys
    # out of its recency list, LRU keeps them.
    reuse_soon_and_after_long_gaps(index)
    assert policy.recency


def test_prefix_arc_eviction_rule_can_be_fixed() -> None:
    # Each workload turns the adaptive rule away from the fixed one (see the test above).
    arc = PrefixARCPolicy(8, eviction="arc")
    reuse_soon_and_after_long_gaps(PolicyIndex(8, arc))
    assert not arc.recency
    recency = PrefixARCPolicy(8, eviction="recency")
    one_shot_scan_with_hot_keys(recency)
    assert recency.recency


def test_a_chain_gets_its_slots_counting_up_whatever_order_they_were_freed_in() -> None:
    index = PolicyIndex(4, LRUPolicy())
    old = new_keys("old", 4)
    store(index, old)
    assert [index.slot_of(key) for key in old] == [0, 1, 2, 3]
    hit(index, old[::-1])  # least recent is now old[3]: evictions free slots 3, 2, 1
    chain = new_keys("chain", 3)
    slots = index.reserve([chain[0], old[0], chain[1], chain[2]])
    assert evicted(index) == [old[3], old[2], old[1]]
    assert slots == [1, None, 2, 3]
    index.commit(chain)
    assert [index.slot_of(key) for key in chain] == [1, 2, 3]


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "prefix_arc"])
def test_priority_bends_every_policys_choice(name: str) -> None:
    registry = default_registry()
    index = registry.build(BLOCK_INDEX, registry.get(BLOCK_INDEX, name).config_model(), 4)
    assert isinstance(index, PolicyIndex)
    store(index, [b"high"])
    index.prioritize([b"high"], "high")
    store(index, [b"a", b"b"])
    store(index, [b"low"])
    hit(index, [b"low"])
    index.prioritize([b"low", b"absent"], "low")
    store(index, [b"c"])
    assert evicted(index) == [b"low"]
    for key in new_keys("n", 6):
        store(index, [key])
    assert index.lookup([b"high"]) == 1, "the high key outlives every normal one"
    index.prioritize([b"high"], "normal")
    for key in new_keys("m", 8):
        store(index, [key])
    assert index.lookup([b"high"]) == 0


def test_a_priority_leaves_with_its_key() -> None:
    index = PolicyIndex(2, LRUPolicy())
    (slot,) = index.reserve([b"w"])
    assert slot is not None
    index.prioritize([b"w"], "low")
    index.abort([b"w"])
    store(index, [b"a", b"b"])
    index.prioritize([b"a"], "high")
    index.discard([b"a"])
    store(index, [b"w", b"c"])
    assert evicted(index)[-1] == b"b", "neither the aborted nor the discarded key is ranked"


def batched_and_per_key(
    name: str, seed: int, *, decode: bool = False
) -> tuple[list[object], list[object]]:
    """One random trace through two indexes of policy ``name``: one commits each batch of
    several requests' chains at once, the other key by key. Everything observable, per index.

    ``decode``: most chains are one key each, as in a decode step where many requests fill
    a block; some of them stored before (a repeat), some starting a prompt."""
    registry = default_registry()
    config = registry.get(BLOCK_INDEX, name).config_model()
    rng = random.Random(seed)
    num_slots = rng.choice([8, 32, 96])
    indexes = [registry.build(BLOCK_INDEX, config, num_slots) for _ in range(2)]
    seen: list[list[object]] = [[], []]
    prompts = [new_keys(f"{seed}.{p}.", rng.randint(1, 24)) for p in range(40)]
    for _ in range(150):
        chains = []
        for _ in range(rng.randint(1, 24 if decode else 6)):
            prompt = rng.choice(prompts)
            start = rng.randrange(len(prompt))
            if decode and rng.random() < 0.9:
                stop = start + 1
            else:
                stop = rng.randint(start + 1, len(prompt))
            chains.append((prompt[start:stop], prompt[start - 1] if start else None))
        lazy = rng.random() < 0.3
        looked = rng.choice(prompts)
        for index, observed in zip(indexes, seen, strict=True):
            batch = []
            for keys, parent in chains:
                slots = index.reserve(keys, parent, lazy=lazy)
                observed.append(slots)
                batch.extend(key for key, slot in zip(keys, slots, strict=True) if slot is not None)
            if index is indexes[0]:
                index.commit(batch)
            else:
                for key in batch:
                    index.commit([key])
            hits = index.lookup(looked)
            if hits:
                hit(index, looked[:hits])
            observed.extend([hits, index.take_events(), index.stats()])
    for index, observed in zip(indexes, seen, strict=True):
        observed.append(index.policy.state())
    return seen[0], seen[1]


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "prefix_arc"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("decode", [False, True])
def test_a_commit_of_a_batch_is_the_commits_of_its_keys_in_order(
    name: str, seed: int, decode: bool
) -> None:
    batched, per_key = batched_and_per_key(name, seed, decode=decode)
    assert any(  # the trace evicts, so the policy's ranking decides something
        event.kind is EventKind.EVICTED
        for entry in batched
        if isinstance(entry, list)
        for event in entry
        if isinstance(event, IndexEvent)
    )
    assert batched == per_key
