"""The queueing rules every QueuedTier follows: bounded queues, deadlines, counters, closing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import pytest

from kvtier.index.base import BlockKey
from kvtier.keys import KeyNamespace
from kvtier.testing.contracts_tier import (
    StorageTierContract,
    TierFactory,
    block_hashes,
    done,
    fetch,
    make_spec,
    payloads,
    store,
)
from kvtier.tiers.base import Cause, GetResult, PutResult, TierSpec, TierState
from tests.support.tiers import MemoryTier

RECORD = 256


@pytest.fixture
def tiers() -> Iterator[list[MemoryTier]]:
    built: list[MemoryTier] = []
    yield built
    for tier in built:
        tier.close()


def memory_tier(tiers: list[MemoryTier], **options: object) -> MemoryTier:
    tier = MemoryTier(make_spec(record_bytes=RECORD), **options)  # type: ignore[arg-type]
    tiers.append(tier)
    return tier


def wait_for(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


class TestMemoryTierContract(StorageTierContract):
    """The test double itself keeps the contract, so tests built on it mean something."""

    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        shared: dict[BlockKey, bytes] = {}
        built: list[MemoryTier] = []

        def build(spec: TierSpec) -> MemoryTier:
            built.append(MemoryTier(spec, store=shared, io_threads=2, queue_depth=64))
            return built[-1]

        yield build
        for tier in built:
            tier.close()


class TestJoinedPutsContract(StorageTierContract):
    """The contract holds with queued puts joined into one batch."""

    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        shared: dict[BlockKey, bytes] = {}
        built: list[MemoryTier] = []

        def build(spec: TierSpec) -> MemoryTier:
            tier = MemoryTier(
                spec, store=shared, io_threads=2, queue_depth=64, put_batch_bytes=1 << 20
            )
            built.append(tier)
            return tier

        yield build
        for tier in built:
            tier.close()


def test_spec_needs_rank_and_world_size() -> None:
    with pytest.raises(ValueError, match="rank= and world_size="):
        TierSpec(64, KeyNamespace("m", "fp"))
    with pytest.raises(ValueError, match="outside a world"):
        TierSpec(64, KeyNamespace("m", "fp", rank=2, world_size=2))
    with pytest.raises(ValueError, match="record_bytes"):
        TierSpec(0, KeyNamespace("m", "fp", rank=0, world_size=1))


def test_config_namespace_replaces_the_specs() -> None:
    spec = make_spec(namespace="from-engine", record_bytes=RECORD)
    with MemoryTier(spec) as plain, MemoryTier(spec, namespace="tenant") as tenant:
        assert plain.keys.namespace == "from-engine"
        assert tenant.keys.namespace == "tenant"
        assert plain.keys.key(b"h") != tenant.keys.key(b"h")
        assert (tenant.keys.rank, tenant.keys.world_size) == (0, 1)


def test_a_full_queue_drops_puts_at_once(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=2)
    tier.gate.clear()
    keys = tier.keys.keys(block_hashes("q", 4))
    records = payloads(4, RECORD)
    running = tier.put(keys[:1], records[:1])
    wait_for(lambda: not tier._writes)  # the I/O thread holds the first put at the gate
    queued = [
        tier.put([key], [record]) for key, record in zip(keys[1:3], records[1:3], strict=True)
    ]
    dropped = tier.put(keys[3:], records[3:])
    assert dropped.done() and dropped.result().stored == (False,)
    assert not running.done() and not any(future.done() for future in queued)
    stats = tier.stats()
    assert (stats.queue_drops, stats.drops) == (1, 1)
    tier.gate.set()
    assert [done(future).stored for future in [running, *queued]] == [(True,)] * 3
    assert fetch(tier, keys) == [*records[:3], None]


def test_a_full_queue_answers_gets_as_misses_without_blocking(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=1)
    keys = tier.keys.keys(block_hashes("g", 3))
    store(tier, keys, payloads(3, RECORD))
    tier.gate.clear()
    first = tier.get(keys[:1])
    wait_for(lambda: not tier._reads)
    second = tier.get(keys[1:2])
    started = time.monotonic()
    refused = tier.get(keys[2:])
    assert time.monotonic() - started < 0.5
    assert refused.done() and refused.result().records == (None,)
    assert tier.stats().queue_drops == 1 and tier.stats().misses == 1
    tier.gate.set()
    assert done(first).hits == 1 and done(second).hits == 1


def test_a_get_past_its_deadline_is_a_miss_and_its_late_result_is_dropped(
    tiers: list[MemoryTier],
) -> None:
    tier = memory_tier(tiers)
    keys = tier.keys.keys(block_hashes("late", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    tier.gate.clear()
    started = time.monotonic()
    late = tier.get(keys, deadline_s=0.05)
    result = done(late)
    assert time.monotonic() - started < 2.0
    assert result.records == (None, None)
    assert tier.stats().deadline_misses == 2 and tier.stats().misses == 2
    tier.gate.set()
    assert fetch(tier, keys) == records  # the late read ran, and this one is on time
    assert late.result() is result
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.deadline_misses) == (2, 2, 2)


def test_the_configured_deadline_applies_when_a_get_names_none(
    tiers: list[MemoryTier],
) -> None:
    tier = memory_tier(tiers, get_deadline_s=0.05)
    keys = tier.keys.keys(block_hashes("default-deadline", 1))
    tier.gate.clear()
    assert done(tier.get(keys)).records == (None,)
    assert done(tier.contains(keys)).present == (False,)
    assert tier.stats().deadline_misses == 2


@pytest.mark.parametrize("far", [1e10, float("inf")])
def test_a_deadline_past_what_a_wait_can_take_keeps_later_deadlines(
    far: float, tiers: list[MemoryTier]
) -> None:
    tier = memory_tier(tiers, queue_depth=8)
    keys = tier.keys.keys(block_hashes("far", 1))
    tier.gate.clear()
    distant = tier.get(keys, deadline_s=far)
    time.sleep(0.05)  # the deadline thread now waits for the distant deadline
    started = time.monotonic()
    assert done(tier.get(keys, deadline_s=0.05)).records == (None,)
    assert time.monotonic() - started < 1.0
    assert not distant.done()


def test_a_callback_may_submit_from_a_deadline(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8)
    keys = tier.keys.keys(block_hashes("callback", 1))
    tier.gate.clear()
    chained: list[object] = []
    first = tier.get(keys, deadline_s=0.02)
    first.add_done_callback(lambda _: chained.append(tier.get(keys, deadline_s=0.02)))
    done(first)
    wait_for(lambda: bool(chained))
    assert done(chained[0]).records == (None,)  # type: ignore[arg-type]


def test_reads_go_before_writes(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8)
    keys = tier.keys.keys(block_hashes("order", 3))
    records = payloads(3, RECORD)
    tier.gate.clear()
    first = tier.put(keys[:1], records[:1])
    wait_for(lambda: not tier._writes)
    put = tier.put(keys[1:2], records[1:2])
    get = tier.get(keys[2:], deadline_s=10)
    tier.gate.set()
    done(first), done(put), done(get)
    assert [op for op, _ in tier.batches] == ["write", "read", "write"]


def test_reads_find_the_records_of_puts_not_written_yet(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8)
    keys = tier.keys.keys(block_hashes("pending", 4))
    records = payloads(4, RECORD)
    first, queued = held_puts(tier, keys, records, [2])  # the first being written
    deleted = tier.delete(keys[2:3])  # a read no longer finds what the put holds for it
    get = tier.get(keys, deadline_s=10)
    contains = tier.contains(keys, deadline_s=10)
    tier.gate.set()
    done(first), done(queued), done(deleted)
    # the reads ran before the queued put was written (reads go first)
    assert [op for op, _ in tier.batches] == ["write", "read", "exists", "write", "remove"]
    assert [None if r is None else bytes(r) for r in done(get).records] == [
        records[0],
        records[1],
        None,
        None,
    ]
    assert done(contains).present == (True, True, False, False)
    assert fetch(tier, keys) == [records[0], records[1], None, None]


def test_a_failing_batch_is_counted_and_the_thread_survives(
    tiers: list[MemoryTier], caplog: pytest.LogCaptureFixture
) -> None:
    def fail(op: str, keys: Sequence[BlockKey]) -> None:
        if op == "write" and len(keys) == 2:
            raise ZeroDivisionError("a bug in the tier")

    tier = memory_tier(tiers, fail=fail)
    keys = tier.keys.keys(block_hashes("bug", 3))
    records = payloads(3, RECORD)
    assert done(tier.put(keys[:2], records[:2])).stored == (False, False)
    assert "put of 2 key(s) failed" in caplog.text and "ZeroDivisionError" in caplog.text
    assert tier.stats().errors == {Cause.INTERNAL.value: 2}
    assert tier.stats().drops == 2
    assert store(tier, keys[2:], records[2:]) == (True,)


def test_a_disabled_tier_answers_at_once_and_counts(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers)
    tier._disable(Cause.DISABLED)
    tier.gate.clear()
    keys = tier.keys.keys(block_hashes("off", 2))
    put = tier.put(keys, payloads(2, RECORD))
    get = tier.get(keys)
    assert put.done() and put.result().stored == (False, False)
    assert get.done() and get.result().records == (None, None)
    stats = tier.stats()
    assert stats.errors == {"disabled": 4} and stats.drops == 2 and stats.misses == 2


def test_close_finishes_queued_puts(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8)
    keys = tier.keys.keys(block_hashes("drain", 3))
    tier.gate.clear()
    futures = [
        tier.put([key], [record]) for key, record in zip(keys, payloads(3, RECORD), strict=True)
    ]
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(10)
    assert all(future.result(0).stored == (True,) for future in futures)
    assert set(tier.store) == set(keys)


def test_a_corrupted_record_is_a_counted_miss(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers)
    keys = tier.keys.keys(block_hashes("bad", 2))
    store(tier, keys, payloads(2, RECORD))
    damaged = bytearray(tier.store[keys[0]])
    damaged[-1] ^= 0xFF
    tier.store[keys[0]] = bytes(damaged)
    tier.store[keys[1]] = tier.store[keys[1]][:-1]
    result = done(tier.get(keys))
    assert isinstance(result, GetResult) and result.records == (None, None)
    assert tier.stats().errors == {"checksum": 1, "length": 1}


def held_puts(
    tier: MemoryTier, keys: Sequence[BlockKey], records: Sequence[bytes], sizes: Sequence[int]
) -> list[Future[PutResult]]:
    """Hold the I/O thread at the gate on a first put of one record, then queue puts of
    ``sizes`` records each from the rest of ``keys``; the gate stays closed."""
    tier.gate.clear()
    futures = [tier.put(keys[:1], records[:1])]
    wait_for(lambda: not tier._writes)
    start = 1
    for size in sizes:
        futures.append(tier.put(keys[start : start + size], records[start : start + size]))
        start += size
    return futures


def test_queued_puts_are_written_in_one_batch_up_to_the_limit(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8, put_batch_bytes=5 * RECORD)
    keys = tier.keys.keys(block_hashes("join", 9))
    records = payloads(9, RECORD)
    futures = held_puts(tier, keys, records, [2, 2, 2, 2])
    tier.gate.set()
    assert [done(future).stored for future in futures] == [(True,), *[(True, True)] * 4]
    assert [future.result().keys for future in futures[1:]] == [
        tuple(keys[start : start + 2]) for start in (1, 3, 5, 7)
    ]
    # The first put alone (it was taken before the others came), then two of two records
    # (a third would pass five records), then the last.
    assert [batch for _, batch in tier.batches] == [
        tuple(keys[:1]),
        tuple(keys[1:5]),
        tuple(keys[5:9]),
    ]
    assert fetch(tier, keys) == records
    assert tier.stats().stores == 9


def test_queued_counts_requests_until_their_answers_are_counted(tiers: list[MemoryTier]) -> None:
    """Queued or running, joined or alone, answered at their deadline or by the store: once
    the gauge reads 0, every key handed to a put is a store or a drop."""
    tier = memory_tier(tiers, queue_depth=8, put_batch_bytes=3 * RECORD, get_deadline_s=0.01)
    keys = tier.keys.keys(block_hashes("queued", 5))
    records = payloads(5, RECORD)
    futures = held_puts(tier, keys, records, [2, 2])
    late = tier.get(keys[:1])
    assert done(late).hits == 0, "answered at its deadline while it waits"
    assert tier.stats().queued == 4
    tier.gate.set()
    for future in futures:
        done(future)
    wait_for(lambda: tier.stats().queued == 0)
    stats = tier.stats()
    assert stats.stores + stats.drops == 5
    assert stats.state is TierState.UP


def test_a_disabled_tier_says_so(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers)
    tier._disable(Cause.DISABLED)
    assert tier.stats().state is TierState.DISABLED


def test_a_put_is_never_split_nor_joined_past_the_limit(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8, put_batch_bytes=2 * RECORD)
    keys = tier.keys.keys(block_hashes("whole", 6))
    records = payloads(6, RECORD)
    futures = held_puts(tier, keys, records, [3, 1, 1])
    tier.gate.set()
    assert all(all(done(future).stored) for future in futures)
    assert [len(batch) for _, batch in tier.batches] == [1, 3, 2]


def test_a_put_repeating_a_key_of_the_batch_waits_for_the_next(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8, put_batch_bytes=8 * RECORD)
    keys = tier.keys.keys(block_hashes("again", 4))
    records = payloads(4, RECORD)
    tier.gate.clear()
    first = tier.put(keys[:1], records[:1])
    wait_for(lambda: not tier._writes)
    joined = [tier.put(keys[1:3], records[1:3]), tier.put(keys[3:], records[3:])]
    repeated = tier.put(keys[2:3], records[2:3])
    tier.gate.set()
    assert [done(future).stored for future in [first, *joined, repeated]] == [
        (True,),
        (True, True),
        (True,),
        (True,),
    ]
    assert [batch for _, batch in tier.batches][1:] == [tuple(keys[1:4]), tuple(keys[2:3])]


def test_a_delete_between_puts_keeps_its_place(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, queue_depth=8, put_batch_bytes=8 * RECORD)
    keys = tier.keys.keys(block_hashes("between", 3))
    records = payloads(3, RECORD)
    tier.gate.clear()
    first = tier.put(keys[:1], records[:1])
    wait_for(lambda: not tier._writes)
    put = tier.put(keys[1:2], records[1:2])
    delete = tier.delete(keys[1:2])
    last = tier.put(keys[2:], records[2:])
    tier.gate.set()
    done(first), done(put), done(last)
    assert done(delete).deleted == (True,)
    assert [op for op, _ in tier.batches] == ["write", "write", "remove", "write"]
    assert fetch(tier, keys) == [records[0], None, records[2]]


def test_a_failing_joined_batch_drops_every_put_in_it(
    tiers: list[MemoryTier], caplog: pytest.LogCaptureFixture
) -> None:
    def fail(op: str, keys: Sequence[BlockKey]) -> None:
        if op == "write" and len(keys) == 4:
            raise ZeroDivisionError("a bug in the tier")

    tier = memory_tier(tiers, queue_depth=8, put_batch_bytes=8 * RECORD, fail=fail)
    keys = tier.keys.keys(block_hashes("joined-bug", 6))
    records = payloads(6, RECORD)
    futures = held_puts(tier, keys[:5], records[:5], [2, 2])
    tier.gate.set()
    assert [done(future).stored for future in futures] == [(True,), (False, False), (False, False)]
    assert "put of 4 key(s) failed" in caplog.text
    stats = tier.stats()
    assert (stats.errors, stats.drops) == ({Cause.INTERNAL.value: 4}, 4)
    assert store(tier, keys[5:], records[5:]) == (True,)


def test_the_calls_of_a_batch_run_at_once_on_the_io_threads(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, io_threads=2)
    together = threading.Barrier(3, timeout=5)
    runners: set[str] = set()

    def call(item: int) -> int:
        runners.add(threading.current_thread().name)
        together.wait()  # broken unless the caller and both I/O threads run one each
        return item * 10

    outcomes = tier._all_at_once(call, [1, 2, 3])
    assert [outcome.result() for outcome in outcomes] == [10, 20, 30]
    assert runners == {threading.current_thread().name, "kvtier-memory-io-0", "kvtier-memory-io-1"}


def test_a_batch_whose_io_threads_are_busy_runs_its_calls_itself(tiers: list[MemoryTier]) -> None:
    tier = memory_tier(tiers, io_threads=1)
    tier.gate.clear()
    held = tier.get(tier.keys.keys(block_hashes("held", 1)))
    wait_for(lambda: tier.batches == [] and not tier._reads)  # the I/O thread waits at the gate

    def call(item: int) -> int:
        return 10 // item

    start = time.monotonic()
    first, second = tier._all_at_once(call, [5, 0])
    assert time.monotonic() - start < 5, "the calls waited for the held I/O thread"
    assert first.result() == 2
    assert isinstance(second.exception(), ZeroDivisionError)
    tier.gate.set()
    assert done(held).hits == 0
