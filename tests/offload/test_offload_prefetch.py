"""Prefetch at arrival: reads from the lower tiers start while a request waits, bounded,
cancellable and counted; the policies decide what a lookup answers meanwhile."""

from __future__ import annotations

import time

import pytest

from kvtier.config.model import PrefetchConfig
from kvtier.index.base import EventKind
from kvtier.index.lru import LRUPolicy
from kvtier.index.policy import PolicyIndex
from kvtier.keys import KeyNamespace, hash_token_blocks
from kvtier.offload import OffloadManager, TransferPlan, WorkerReport
from kvtier.offload.costguard import MIN_SAMPLES
from kvtier.offload.moves import READ_TRIES
from kvtier.offload.session import OffloadSession
from kvtier.tiers import TierSpec
from kvtier.tiers.chain import TierChain
from tests.offload.conftest import (
    BLOCK_TOKENS,
    PROMPT_BLOCKS,
    evict_to_the_tier,
    prompt,
    torch_backend,
)
from tests.support.engine import EngineSpec, OffloadedEngine, SyntheticEngine
from tests.support.tiers import MemoryTier

TOKENS = len(prompt(1))
FULL_HIT = PROMPT_BLOCKS * BLOCK_TOKENS


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager_with(
    policy: str = "wait_complete", *, slots: int = 16, share: float = 0.5, **options: object
) -> tuple[OffloadManager, Clock]:
    clock = Clock()
    settings: dict[str, object] = {"policy": policy, "max_host_share": share}
    if policy == "timeout":
        settings["timeout_s"] = 2.0
    manager = OffloadManager(
        PolicyIndex(slots, LRUPolicy()),
        block_tokens=BLOCK_TOKENS,
        record_bytes=64,
        write_policies=("write_back",),
        clock=clock,
        record_observations=True,
        prefetch=PrefetchConfig.model_validate(settings),
        **options,  # type: ignore[arg-type]
    )
    return manager, clock


def found_all(plan: TransferPlan) -> WorkerReport:
    """The report of a worker that found every block of the plan's promotions."""
    return WorkerReport(promoted={p.batch_id: (1, len(p.block_hashes)) for p in plan.promotions})


def read_all(manager: OffloadManager, probe_plan: TransferPlan | None = None) -> None:
    """The workers find every block the promotions of the next plans ask for: its probes
    (``probe_plan`` if built already), then the reads the probes' answers planned."""
    probes = manager.build_plan() if probe_plan is None else probe_plan
    assert probes.promotions and not any(p.host_slots for p in probes.promotions)
    manager.process(found_all(probes))
    reads = manager.build_plan()
    assert reads.promotions and all(p.host_slots for p in reads.promotions)
    manager.process(found_all(reads))


def test_an_arriving_request_is_read_ahead_and_its_first_lookup_is_a_host_hit() -> None:
    manager, clock = manager_with()
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    assert manager.stats().prefetches_started == 1
    clock.now = 0.25
    read_all(manager)
    clock.now = 3.0  # it waited in the queue meanwhile
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT
    stats = manager.stats()
    assert (stats.prefetches_completed, stats.prefetched_blocks) == (1, PROMPT_BLOCKS)
    assert manager.take_observations().prefetch_covered_seconds == [0.25]
    # the blocks stay pinned for it until the engine allocated it, then its load pins them
    assert manager.index.stats().pinned == PROMPT_BLOCKS
    manager.allocated("r", hashes, [list(range(PROMPT_BLOCKS + 1))], 0, FULL_HIT)
    assert manager.moves.prefetches.reserved == 0
    assert manager.stats().prefetched_used_blocks == PROMPT_BLOCKS


def test_the_first_lookup_is_served_in_the_step_that_schedules_the_request() -> None:
    manager, _ = manager_with()
    session = OffloadSession(manager, same_step_bytes=1 << 20)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    session.arrived("r", hashes, TOKENS)
    read_all(manager)
    hit, asynchronous = session.lookup("r", hashes, 0, TOKENS)
    assert (hit, asynchronous) == (FULL_HIT, False)


@pytest.mark.parametrize(
    ("policy", "answers"),
    [
        ("wait_complete", [None, None]),
        ("timeout", [None, 0]),
        ("best_effort", [0, 0]),
    ],
)
def test_what_a_lookup_answers_while_the_prefetch_is_read(
    policy: str, answers: list[int | None]
) -> None:
    manager, clock = manager_with(policy)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    plan = manager.build_plan()
    clock.now = 1.0
    first = manager.lookup("r", hashes, 0, TOKENS)
    clock.now = 2.5  # past timeout_s
    second = manager.lookup("r", hashes, 0, TOKENS)
    assert [first, second] == answers
    expired = answers[-1] is not None
    assert manager.stats().prefetches_expired == expired
    (probe,) = plan.promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, PROMPT_BLOCKS)}))
    if expired:
        # a probe answered after the lookup stopped waiting reads nothing: the request
        # computes those blocks and stores them itself
        assert manager.build_plan().promotions == ()
        assert manager.lookup("r", hashes, 0, TOKENS) == 0
        assert manager.moves.prefetches.reserved == 0
        return
    manager.process(found_all(manager.build_plan()))
    assert manager.index.stats().pinned == PROMPT_BLOCKS  # kept for it until allocated
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT


def test_prefetches_take_at_most_their_share_and_the_lookup_reads_the_rest() -> None:
    manager, _ = manager_with(slots=8, share=0.25)  # 2 slots for waiting requests
    first, second = (hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (1, 2))
    manager.arrived("a", first, 0, TOKENS)
    manager.arrived("b", second, 0, TOKENS)  # no room left
    assert manager.stats().prefetches_started == 1
    (probe,) = manager.build_plan().promotions
    assert probe.block_hashes == tuple(first[:2])
    read_all(manager, probe_plan=TransferPlan(promotions=(probe,)))
    # the first lookup promotes what the prefetch had no room for
    assert manager.lookup("a", first, 0, TOKENS) is None
    (rest,) = manager.build_plan().promotions
    assert rest.block_hashes == tuple(first[2:PROMPT_BLOCKS])
    read_all(manager, probe_plan=TransferPlan(promotions=(rest,)))
    assert manager.lookup("a", first, 0, TOKENS) == FULL_HIT
    # a request that got no prefetch promotes at its first lookup, as without prefetch
    assert manager.lookup("b", second, 0, TOKENS) is None


def test_a_lookup_during_the_prefetch_promotes_the_rest_beside_its_reads() -> None:
    manager, _ = manager_with(slots=8, share=0.25)  # the prefetch reads 2 of 5 blocks
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    (probe,) = manager.build_plan().promotions
    # scheduled before the probe's answer: the rest waits for it (the tiers may hold less)
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    assert manager.build_plan().promotions == ()
    manager.process(found_all(TransferPlan(promotions=(probe,))))
    (read,) = manager.build_plan().promotions
    # the prefetch's reads run: the next lookup probes the rest beside them
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    (rest,) = manager.build_plan().promotions
    assert rest.block_hashes == tuple(hashes[2:PROMPT_BLOCKS])
    manager.process(found_all(TransferPlan(promotions=(rest,))))
    (rest_read,) = manager.build_plan().promotions
    assert manager.lookup("r", hashes, 0, TOKENS) is None  # the reads are in flight
    manager.process(found_all(TransferPlan(promotions=(read, rest_read))))
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT
    assert manager.index.stats().pinned == PROMPT_BLOCKS  # kept for it until allocated
    assert manager.build_plan().promotions == ()  # nothing asked twice
    manager.allocated("r", hashes, [list(range(PROMPT_BLOCKS + 1))], 0, FULL_HIT)
    assert manager.moves.prefetches.reserved == 0
    assert manager.stats().prefetched_blocks == 2


def test_a_read_found_short_after_the_rest_was_asked_ends_the_search() -> None:
    manager, _ = manager_with(slots=8, share=0.25)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    (probe,) = manager.build_plan().promotions
    manager.process(found_all(TransferPlan(promotions=(probe,))))
    (read,) = manager.build_plan().promotions
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    (rest,) = manager.build_plan().promotions
    # the tier lost the second block meanwhile, and holds none of the rest
    manager.process(WorkerReport(promoted={read.batch_id: (1, 1), rest.batch_id: (1, 0)}))
    assert manager.lookup("r", hashes, 0, TOKENS) == BLOCK_TOKENS
    assert manager.build_plan().promotions == ()


def test_room_freed_in_the_share_goes_on_with_waiting_requests_in_arrival_order() -> None:
    manager, _ = manager_with(slots=8, share=0.25)  # 2 slots for waiting requests
    first, second, third = (hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (1, 2, 3))
    manager.arrived("a", first, 0, TOKENS)
    manager.arrived("b", second, 0, TOKENS)  # no room left
    manager.arrived("c", third, 0, TOKENS)
    assert [p.block_hashes for p in manager.build_plan().promotions] == [tuple(first[:2])]
    assert manager.build_plan().promotions == ()  # no room came free
    manager.finished("a")  # aborted: its room goes to the request that waited longest
    (probe,) = manager.build_plan().promotions
    assert probe.block_hashes == tuple(second[:2])
    # a lookup takes its request out of the queue: it promotes the rest itself
    assert manager.lookup("c", third, 0, TOKENS) is None
    manager.finished("b")
    (rest,) = manager.build_plan().promotions
    assert rest.block_hashes == tuple(third[:PROMPT_BLOCKS])
    assert manager.stats().prefetches_started == 2


def test_a_prefetch_the_share_cut_goes_on_from_where_it_stopped() -> None:
    manager, _ = manager_with(slots=8, share=0.5)  # 4 slots for waiting requests
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    other = hash_token_blocks(prompt(2), BLOCK_TOKENS)
    manager.arrived("x", other, 0, 3 * BLOCK_TOKENS + 1)  # wants 3 blocks
    manager.arrived("r", hashes, 0, TOKENS)  # gets the last slot
    probes = manager.build_plan().promotions
    assert [p.block_hashes for p in probes] == [tuple(other[:3]), tuple(hashes[:1])]
    manager.finished("x")
    (more,) = manager.build_plan().promotions
    assert more.block_hashes == tuple(hashes[1:4])  # the share's 3 slots, one block short
    manager.process(found_all(TransferPlan(promotions=(probes[1], more))))
    reads = manager.build_plan().promotions
    assert sorted(len(read.host_slots) for read in reads) == [1, 3]
    manager.process(found_all(TransferPlan(promotions=reads)))
    stats = manager.stats()
    assert (stats.prefetches_started, stats.prefetches_completed) == (2, 1)  # x's was cancelled
    assert stats.prefetched_blocks == 4
    # the lookup promotes the block the share had no room for
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    (rest,) = manager.build_plan().promotions
    assert rest.block_hashes == tuple(hashes[4:PROMPT_BLOCKS])
    read_all(manager, probe_plan=TransferPlan(promotions=(rest,)))
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT


def test_reads_of_two_probes_of_one_request_both_wait_for_free_slots() -> None:
    manager, _ = manager_with(slots=8, share=0.75)  # 6 slots for waiting requests
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("x", hash_token_blocks(prompt(2), BLOCK_TOKENS), 0, TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)  # one slot left: one block
    (_, first) = manager.build_plan().promotions
    # every host slot is taken by blocks being written
    other = manager.namespace.keys([*hash_token_blocks(prompt(3), BLOCK_TOKENS)[:5],
                                    *hash_token_blocks(prompt(4), BLOCK_TOKENS)[:3]])  # fmt: skip
    assert None not in manager.index.reserve(other)
    manager.process(found_all(TransferPlan(promotions=(first,))))
    manager.finished("x")
    (second,) = manager.build_plan().promotions  # the rest, while the first waits for a slot
    assert second.block_hashes == tuple(hashes[1:PROMPT_BLOCKS])
    manager.process(found_all(TransferPlan(promotions=(second,))))
    assert manager.moves.unread
    manager.index.abort(other)
    reads = manager.build_plan().promotions
    assert sorted(len(read.host_slots) for read in reads) == [1, 4]
    manager.process(found_all(TransferPlan(promotions=reads)))
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT
    assert not manager.moves.unread


def guarded_manager(read_s: float) -> OffloadManager:
    """A manager whose cost guard measured 100 us a token of prefill, and ``read_s`` a read
    of 4 records from its one lower tier."""
    manager, _ = manager_with(cost_guard=True, tier_names=("tier",), share=1.0)
    for i in range(MIN_SAMPLES):
        tokens = 100 if i % 2 else 1
        manager.step_timed(tokens, 0.005 + 1e-4 * tokens)
    manager.process(WorkerReport(read_times={"tier": ((4, read_s),) * MIN_SAMPLES}))
    return manager


@pytest.mark.parametrize(("read_s", "waits"), [(0.3, False), (1e-4, True)])
def test_a_prefetch_behind_queued_requests_is_judged_at_its_lookup(
    read_s: float, waits: bool
) -> None:
    manager = guarded_manager(read_s)
    manager.arrived("ahead", hash_token_blocks(prompt(2), BLOCK_TOKENS), 0, TOKENS)
    manager.build_plan()
    before = manager.stats().tiers.get("tier", {}).get("guard_skipped_records", 0)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    # it waits behind "ahead": read while it queues, whatever the guard predicts
    (probe,) = manager.build_plan().promotions
    assert probe.skip_tiers == frozenset()
    manager.process(found_all(TransferPlan(promotions=(probe,))))
    (read,) = manager.build_plan().promotions
    # its reads still run when it is scheduled: worth waiting for only if the tier is fast
    first = manager.lookup("r", hashes, 0, TOKENS)
    assert first == (None if waits else 0)
    assert manager.lookup("r", hashes, 0, TOKENS) == first  # asked once, answered alike
    stats = manager.stats()
    assert stats.prefetches_expired == (not waits)
    skipped = stats.tiers.get("tier", {}).get("guard_skipped_records", 0) - before
    assert skipped == (0 if waits else PROMPT_BLOCKS)
    manager.process(found_all(TransferPlan(promotions=(read,))))
    # the blocks read are host blocks for whoever asks next
    assert manager.index.lookup(manager.namespace.keys(hashes)) == PROMPT_BLOCKS


def test_a_request_no_one_waits_before_is_judged_at_arrival() -> None:
    manager = guarded_manager(0.3)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)  # likely scheduled at once: the read would delay it
    assert manager.build_plan().promotions == ()
    assert manager.stats().tiers["tier"]["guard_skipped_records"] == PROMPT_BLOCKS
    assert manager.lookup("r", hashes, 0, TOKENS) == 0


def test_a_prefetch_that_found_fewer_blocks_ends_the_search() -> None:
    manager, _ = manager_with(slots=8, share=0.25)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    (probe,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, 1)}))
    (read,) = manager.build_plan().promotions  # of the one block the tiers hold
    assert len(read.host_slots) == 1
    manager.process(found_all(TransferPlan(promotions=(read,))))
    assert manager.lookup("r", hashes, 0, TOKENS) == BLOCK_TOKENS
    assert manager.moves.prefetches.reserved == 1


def test_an_aborted_request_cancels_its_prefetch_and_keeps_no_slot() -> None:
    manager, _ = manager_with(share=1.0)
    first, second = (hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (1, 2))
    manager.arrived("planned", first, 0, TOKENS)
    manager.arrived("unplanned", second, 0, TOKENS)
    plan = manager.build_plan()
    manager.arrived("never-planned", hash_token_blocks(prompt(3), BLOCK_TOKENS), 0, TOKENS)
    assert manager.finished("never-planned") is False
    assert manager.finished("planned") is False
    # reads no plan carried are dropped with their slots
    assert manager.build_plan().promotions == ()
    assert manager.moves.prefetches.reserved == PROMPT_BLOCKS  # the request still waiting
    manager.finished("unplanned")
    assert manager.moves.prefetches.reserved == 0
    # probes already planned are answered, and read nothing for requests that left
    manager.process(found_all(plan))
    assert manager.build_plan().promotions == ()
    index = manager.index.stats()
    assert (index.pinned, index.writing, index.readable) == (0, 0, 0)
    assert manager.stats().prefetches_cancelled == 3
    assert manager.settled


def test_prefetched_blocks_evicted_before_use_are_counted_as_wasted() -> None:
    manager, _ = manager_with(slots=8, share=1.0)
    first, second = (hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (1, 2))
    manager.arrived("a", first, 0, TOKENS)
    read_all(manager)
    manager.finished("a")  # aborted: its blocks are ordinary, unpinned ones
    manager.arrived("b", second, 0, TOKENS)  # evicts a's to make room
    read_all(manager)
    stats = manager.stats()
    assert stats.prefetched_blocks == 2 * PROMPT_BLOCKS
    assert stats.prefetched_unused_blocks == 2 * PROMPT_BLOCKS - 8  # a's, to make room
    assert stats.prefetched_used_blocks == 0


def test_pinned_blocks_and_blocks_being_written_are_never_evicted_for_a_prefetch() -> None:
    manager, _ = manager_with(slots=8, share=1.0)
    first, second = (hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in (1, 2))
    manager.arrived("a", first, 0, TOKENS)
    read_all(manager)  # a's blocks are pinned for it while it waits
    manager.arrived("b", second, 0, TOKENS)
    (promotion,) = manager.build_plan().promotions
    assert len(promotion.block_hashes) == 8 - PROMPT_BLOCKS
    assert manager.index.lookup(manager.namespace.keys(first)) == PROMPT_BLOCKS


def test_prefetched_blocks_are_announced_as_stores() -> None:
    manager, _ = manager_with(record_events=True)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    read_all(manager)
    events = manager.take_events()
    assert [event.kind for event in events] == [EventKind.STORED] * PROMPT_BLOCKS
    assert [event.key for event in events] == manager.namespace.keys(hashes[:PROMPT_BLOCKS])


def test_off_reads_nothing_before_the_lookup() -> None:
    manager, _ = manager_with("off")
    manager.arrived("r", hash_token_blocks(prompt(1), BLOCK_TOKENS), 0, TOKENS)
    assert manager.build_plan().promotions == ()
    assert manager.stats().prefetches_started == 0


def test_a_request_that_loads_nothing_is_not_read_ahead() -> None:
    from kvtier.offload.control import request_control

    manager, _ = manager_with()
    session = OffloadSession(manager)
    control = request_control({"kvtier": {"load": False}})
    session.arrived("r", hash_token_blocks(prompt(1), BLOCK_TOKENS), TOKENS, control)
    assert manager.build_plan().promotions == ()


def test_a_queued_request_is_promoted_before_it_is_admitted_byte_for_byte() -> None:
    """The synthetic engine over a slow memory tier: a request waiting behind others has
    its blocks read while it waits, and loads them as host hits when admitted."""
    spec = EngineSpec(num_blocks=12, block_tokens=BLOCK_TOKENS)
    record_bytes = SyntheticEngine(spec).layout.record_bytes
    store: dict[bytes, bytes] = {}

    def engine() -> tuple[OffloadedEngine, MemoryTier]:
        tier = MemoryTier(TierSpec(record_bytes, KeyNamespace("m", "layout", 0, 1)), store=store)
        chain = TierChain([("memory", tier)])
        return OffloadedEngine(
            spec,
            PolicyIndex(4 * PROMPT_BLOCKS, LRUPolicy()),
            torch_backend,
            chains=[chain],
            prefetch=PrefetchConfig(policy="wait_complete", max_host_share=1.0),
        ), tier

    first, _ = engine()
    for seed in (1, 2, 3):
        first.submit(prompt(seed))
        first.drain()
    first.close()  # writes its host tier back into the shared store
    second, tier = engine()
    for seed in (1, 2, 3, 1):  # two fit the device at a time: the others queue
        second.submit(prompt(seed), decode_steps=3)
    # the last one, a repeat of the first, probes too; its read finds the blocks taken
    assert second.manager.stats().prefetches_started == 4
    deadline = time.monotonic() + 10
    while not second.idle:
        assert time.monotonic() < deadline, "the engine did not drain"
        second.step()
        # no request was admitted before its blocks were read
        assert second.manager.stats().prefetches_completed >= min(3, second.stats.requests)
        time.sleep(0.001)
    stats = second.manager.stats()
    assert stats.prefetches_expired == 0
    assert stats.prefetched_blocks == 3 * PROMPT_BLOCKS
    assert stats.prefetched_used_blocks == 3 * PROMPT_BLOCKS
    # the fourth, a repeat of the first, loads the same blocks again from the host tier
    assert second.stats.tier_hit_blocks == 4 * PROMPT_BLOCKS
    assert second.stats.verified_blocks == 4 * PROMPT_BLOCKS and second.mismatches == []
    assert [op for op, _ in tier.batches].count("read") == 3, "no read at a lookup"
    second.close()


def test_blocks_the_engine_holds_at_arrival_are_not_read() -> None:
    manager, _ = manager_with()
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 2 * BLOCK_TOKENS, TOKENS)
    (promotion,) = manager.build_plan().promotions
    assert promotion.block_hashes == tuple(hashes[2:PROMPT_BLOCKS])


def test_a_lookup_reads_again_what_left_the_engine_while_it_waited() -> None:
    manager, _ = manager_with()
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 2 * BLOCK_TOKENS, TOKENS)
    read_all(manager)
    # the engine evicted the first two blocks meanwhile: the lookup promotes them
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    (probe,) = manager.build_plan().promotions
    assert probe.block_hashes[:2] == tuple(hashes[:2])
    manager.process(found_all(TransferPlan(promotions=(probe,))))
    (rest,) = manager.build_plan().promotions  # up to the blocks the host tier holds
    assert rest.block_hashes == tuple(hashes[:2])
    manager.process(found_all(TransferPlan(promotions=(rest,))))
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT


def test_each_lookup_reads_again_what_the_engine_lost_since_the_last() -> None:
    manager, _ = manager_with()
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 2 * BLOCK_TOKENS, TOKENS)
    read_all(manager)
    for first in (1, 0):  # the engine evicts one more block before each lookup
        assert manager.lookup("r", hashes, first * BLOCK_TOKENS, TOKENS) is None
        read_all(manager)
        assert manager.lookup("r", hashes, first * BLOCK_TOKENS, TOKENS) == (
            FULL_HIT - first * BLOCK_TOKENS
        )


def test_a_prefetch_that_found_nothing_still_lets_the_lookup_read_blocks_before_it() -> None:
    manager, _ = manager_with()
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 2 * BLOCK_TOKENS, TOKENS)  # the engine holds two blocks
    (probe,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, 0)}))  # none of the rest
    # the engine evicted its two blocks meanwhile: the tiers were never asked about them
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    (again,) = manager.build_plan().promotions
    assert again.block_hashes[:2] == tuple(hashes[:2])
    manager.process(WorkerReport(promoted={again.batch_id: (1, 2)}))
    read_all_reads = manager.build_plan().promotions
    assert [len(p.host_slots) for p in read_all_reads] == [2]
    manager.process(found_all(TransferPlan(promotions=read_all_reads)))
    assert manager.lookup("r", hashes, 0, TOKENS) == 2 * BLOCK_TOKENS
    # where the probe found nothing, nothing is asked again
    assert manager.lookup("r", hashes, 2 * BLOCK_TOKENS, TOKENS) == 0


def test_a_prefix_written_down_after_the_prefetch_found_nothing_is_read_at_the_lookup() -> None:
    """Another request computed the prefix while this one waited: the prefetch's probe
    found nothing, then the blocks were stored and evicted down the chain. The lookup reads
    them from there (at once: this engine wrote them) instead of computing them."""
    manager, _ = manager_with(slots=8, share=1.0)
    hashes = hash_token_blocks(prompt(1), BLOCK_TOKENS)
    manager.arrived("r", hashes, 0, TOKENS)
    (probe,) = manager.build_plan().promotions
    manager.process(WorkerReport(promoted={probe.batch_id: (1, 0)}))
    evict_to_the_tier(manager, hashes[:PROMPT_BLOCKS])
    assert manager.lookup("r", hashes, 0, TOKENS) is None
    (read,) = manager.build_plan().promotions
    assert read.block_hashes == tuple(hashes[:PROMPT_BLOCKS])
    assert len(read.host_slots) == PROMPT_BLOCKS, "read at once, not probed first"
    manager.process(found_all(TransferPlan(promotions=(read,))))
    assert manager.lookup("r", hashes, 0, TOKENS) == FULL_HIT


@pytest.mark.parametrize("seed", range(1000))
def test_random_arrivals_lookups_and_answers_keep_the_share_and_end_every_wait(seed: int) -> None:
    """Requests arrive, are looked up, allocated or aborted in a random order while the
    workers answer with all, some or none of the blocks: the share holds at every step,
    every lookup gets its answer once the workers answered, and nothing stays reserved,
    pinned or queued once every request ended."""
    import random

    rng = random.Random(seed)
    manager, clock = manager_with(
        rng.choice(["wait_complete", "timeout"]), slots=rng.choice([6, 10, 16]),
        share=rng.choice([0.25, 0.5, 1.0]),
    )  # fmt: skip
    prefetches = manager.moves.prefetches
    prompts = {seed: hash_token_blocks(prompt(seed), BLOCK_TOKENS) for seed in range(6)}
    waiting: dict[str, list[bytes]] = {}

    def answer(found: object) -> None:
        plan = manager.build_plan()
        manager.process(
            WorkerReport(
                promoted={
                    p.batch_id: (1, found(len(p.block_hashes)))  # type: ignore[operator]
                    for p in plan.promotions
                }
            )
        )

    def check() -> None:
        assert prefetches.reserved == sum(p.slots for p in prefetches.waiting.values())
        assert 0 <= prefetches.reserved + prefetches.kept <= prefetches.share

    for step in range(80):
        action = rng.random()
        if action < 0.3:
            request_id = f"r{step}"
            waiting[request_id] = prompts[rng.randrange(len(prompts))]
            computed = rng.choice([0, 0, BLOCK_TOKENS])
            manager.arrived(request_id, waiting[request_id], computed, TOKENS)
        elif action < 0.55 and waiting:
            request_id = rng.choice(sorted(waiting))
            hit = manager.lookup(request_id, waiting[request_id], 0, TOKENS)
            if hit is not None and rng.random() < 0.5:
                manager.allocated(
                    request_id, waiting.pop(request_id), [list(range(PROMPT_BLOCKS + 1))], 0, 0
                )
                manager.finished(request_id)
        elif action < 0.65 and waiting:
            request_id = rng.choice(sorted(waiting))
            del waiting[request_id]
            manager.finished(request_id)
        else:
            answer(rng.choice([lambda n: n, lambda n: rng.randint(0, n), lambda n: 0]))
        clock.now += rng.choice([0.0, 0.05, 0.5])
        check()
    for request_id in sorted(waiting):  # every wait ends once the workers answer
        # (a read finding every host slot pinned gives up after READ_TRIES plans; a request's
        # prefetch, the prefetch's continuations and its rest each probe and read)
        for _ in range(4 * (READ_TRIES + 2)):
            if manager.lookup(request_id, waiting[request_id], 0, TOKENS) is not None:
                break
            answer(lambda n: n)
        else:
            pytest.fail(f"the lookup of {request_id} still waits")
        check()
    for request_id in waiting:
        manager.finished(request_id)
    answer(lambda n: n)
    assert (prefetches.reserved, prefetches.kept, prefetches.waiting, prefetches.cut) == (
        0, 0, {}, {},
    )  # fmt: skip
    assert manager.index.stats().pinned == 0
