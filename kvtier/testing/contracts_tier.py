"""Contract tests for :class:`~kvtier.tiers.base.StorageTier` implementations.

A storage-tier author subclasses :class:`StorageTierContract` in a pytest
module and provides the ``make_tier`` fixture: a callable that builds a tier
for a :class:`~kvtier.tiers.base.TierSpec`. Every tier it builds in one test
must use the same store (the same directory, the same server), start with
that store empty, and be closed by the fixture at the end (closing twice is
fine)::

    import pytest
    from kvtier.testing.contracts_tier import StorageTierContract
    from my_plugin import MyTier, MyTierConfig

    class TestMyTier(StorageTierContract):
        @pytest.fixture
        def make_tier(self, tmp_path):
            built = []

            def build(spec):
                built.append(MyTier(MyTierConfig(path=tmp_path), spec))
                return built[-1]

            yield build
            for tier in built:
                tier.close()

Every ``test_*`` method then runs against that tier: round trips of records
in any contiguous buffer, misses, presence and deletion, counters, refusal of
misuse, concurrent requests, closing, capacity (for tiers that declare one),
and isolation: a tier built for another tenant namespace or another layout
fingerprint on the same store never returns the first one's records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest

from kvtier.index.base import BlockKey
from kvtier.keys import KeyNamespace
from kvtier.tiers.base import StorageTier, TierSpec

TierFactory = Callable[[TierSpec], StorageTier]
"""Builds a tier on the test's store for a spec."""

RECORD_BYTES = 3 * 4096 + 123
"""Record size of the contract's specs: several pages and a ragged end."""

WAIT_S = 30.0
"""Longest wait for one future."""

T = TypeVar("T")


def make_spec(
    *,
    namespace: str = "",
    fingerprint: str = "layout-a",
    model: str = "contract-model",
    rank: int = 0,
    world_size: int = 1,
    record_bytes: int = RECORD_BYTES,
) -> TierSpec:
    """A spec for the contract's tiers."""
    keys = KeyNamespace(model, fingerprint, rank, world_size, namespace)
    return TierSpec(record_bytes, keys)


def block_hashes(name: str, count: int) -> list[bytes]:
    """``count`` distinct 32-byte block hashes named after ``name``."""
    return [f"{name}/{position}".encode().ljust(32, b".") for position in range(count)]


def payloads(count: int, record_bytes: int = RECORD_BYTES, seed: int = 0) -> list[bytes]:
    """``count`` distinct random records."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, record_bytes, dtype=np.uint8).tobytes() for _ in range(count)]


def done(future: Future[T]) -> T:
    """The result of ``future``, waiting at most :data:`WAIT_S`."""
    return future.result(timeout=WAIT_S)


def store(tier: StorageTier, keys: list[BlockKey], records: list[Any]) -> tuple[bool, ...]:
    """Put ``records`` under ``keys`` and wait."""
    return done(tier.put(keys, records)).stored


def fetch(tier: StorageTier, keys: list[BlockKey]) -> list[bytes | None]:
    """Get ``keys`` with no deadline and return the payloads as bytes."""
    result = done(tier.get(keys, deadline_s=WAIT_S))
    assert result.keys == tuple(keys)
    return [None if record is None else bytes(record) for record in result.records]


class StorageTierContract:
    """Behaviour every :class:`~kvtier.tiers.base.StorageTier` must have; subclass it."""

    concurrent_namespaces: ClassVar[bool] = True
    """Whether tiers of two namespaces may be open on the store at once (a shared server);
    ``False`` (one file per rank) makes the isolation tests close one before building the next."""

    # Subclasses provide the fixture ``make_tier() -> TierFactory``.

    # ------------------------------------------------------------ round trips

    def test_put_then_get_returns_the_same_bytes(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("a", 4))
        records = payloads(4)
        assert store(tier, keys, records) == (True,) * 4
        assert fetch(tier, keys) == records
        assert fetch(tier, keys[::-1]) == records[::-1]

    def test_a_read_submitted_after_a_put_finds_its_record(self, make_tier: TierFactory) -> None:
        # The offload path probes and reads blocks it demoted a moment before: it does not
        # wait for the put first.
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("read-after-put", 4))
        records = payloads(4, seed=2)
        put = tier.put(keys, records)
        contains, get = tier.contains(keys), tier.get(keys)
        stored = done(put).stored
        assert any(stored), "a put of 4 records into an empty tier stored none"
        present, got = done(contains).present, done(get).records
        for was_stored, held, record, expected in zip(stored, present, got, records, strict=True):
            if was_stored:
                assert held
                assert record is not None and bytes(record) == expected

    def test_records_may_be_any_contiguous_buffer(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("buffers", 4))
        records = payloads(4, seed=1)
        host_rows = np.frombuffer(b"".join(records), dtype=np.uint8).reshape(4, RECORD_BYTES)
        given = [
            bytearray(records[0]),
            memoryview(records[1]),
            host_rows[2],
            host_rows[3:4],
        ]
        assert store(tier, keys, given) == (True,) * 4
        assert fetch(tier, keys) == records

    def test_a_record_held_stays_intact_while_later_gets_run(self, make_tier: TierFactory) -> None:
        """A tier may read into buffers it reuses, but never into one a caller still holds."""
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("held", 6))
        records = payloads(6, seed=12)
        store(tier, keys, records)
        held = done(tier.get(keys[:3], deadline_s=WAIT_S)).records
        for _ in range(3):
            assert fetch(tier, keys[3:]) == records[3:]
        assert [None if record is None else bytes(record) for record in held] == records[:3]

    def test_absent_keys_miss_in_place(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("mixed", 3))
        records = payloads(1, seed=2)
        store(tier, [keys[1]], records)
        assert fetch(tier, keys) == [None, records[0], None]
        assert done(tier.contains(keys)).present == (False, True, False)

    def test_a_second_put_of_a_key_keeps_it_readable(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("twice", 1))
        records = payloads(1, seed=3)
        assert store(tier, keys, records) == (True,)
        assert store(tier, keys, records) == (True,)
        assert fetch(tier, keys) == records

    def test_delete_removes_only_the_named_keys(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("delete", 3))
        records = payloads(3, seed=4)
        store(tier, keys, records)
        assert done(tier.delete(keys[:2])).deleted == (True, True)
        assert done(tier.delete(keys[:1])).deleted == (False,)
        assert fetch(tier, keys) == [None, None, records[2]]
        assert done(tier.contains(keys)).present == (False, False, True)
        store(tier, keys[:1], records[:1])
        assert fetch(tier, keys[:1]) == records[:1]

    def test_empty_batches_complete(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        assert done(tier.put([], [])).stored == ()
        assert done(tier.get([])).records == ()
        assert done(tier.contains([])).present == ()
        assert done(tier.delete([])).deleted == ()

    # --------------------------------------------------------------- counters

    def test_stats_count_hits_misses_stores_and_bytes(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("stats", 3))
        before = tier.stats()
        store(tier, keys[:2], payloads(2, seed=5))
        fetch(tier, keys)
        after = tier.stats()
        assert after.stores - before.stores == 2
        assert after.bytes_written - before.bytes_written == 2 * RECORD_BYTES
        assert after.hits - before.hits == 2
        assert after.misses - before.misses == 1
        assert after.bytes_read - before.bytes_read == 2 * RECORD_BYTES
        assert after.drops == before.drops and after.queue_drops == before.queue_drops
        assert after.errors == before.errors

    def test_every_key_handed_to_a_put_is_counted_once(self, make_tier: TierFactory) -> None:
        """Stored, dropped or already held: a key put again lands in one counter too."""
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("handed", 3))
        records = payloads(3, seed=11)
        before = tier.stats()
        store(tier, keys[:2], records[:2])
        store(tier, keys, records)
        after = tier.stats()
        counted = sum(getattr(after, f) - getattr(before, f) for f in ("stores", "drops", "held"))
        assert counted == 5, after

    # ----------------------------------------------------------------- misuse

    def test_misuse_raises_at_the_call(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        key = tier.keys.keys(block_hashes("misuse", 1))
        with pytest.raises(ValueError, match="bytes"):
            tier.put(key, [bytes(RECORD_BYTES - 1)])
        with pytest.raises(ValueError):
            tier.put(key, [])
        strided = np.zeros(2 * RECORD_BYTES, dtype=np.uint8)[::2]
        with pytest.raises(ValueError, match="contiguous"):
            tier.put(key, [strided])
        foreign = KeyNamespace("another-model", "layout-a", 0, 1).key(b"x" * 32)
        for call in (
            lambda: tier.put([foreign], [bytes(RECORD_BYTES)]),
            lambda: tier.get([foreign]),
            lambda: tier.contains([foreign]),
            lambda: tier.delete([foreign]),
        ):
            with pytest.raises(ValueError, match="namespace"):
                call()

    def test_close_is_idempotent_and_later_calls_raise(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("close", 2))
        pending = tier.put(keys, payloads(2, seed=6))
        tier.close()
        assert pending.done(), "close finishes queued requests"
        tier.close()
        with pytest.raises(RuntimeError, match="closed"):
            tier.get(keys)
        with pytest.raises(RuntimeError, match="closed"):
            tier.put(keys, payloads(2, seed=6))

    # ------------------------------------------------------------ concurrency

    def test_concurrent_callers_read_back_what_they_stored(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        errors: list[str] = []
        hits: list[int] = []

        def caller(number: int) -> None:
            keys = tier.keys.keys(block_hashes(f"caller{number}", 4))
            records = payloads(4, seed=100 + number)
            for _ in range(3):
                store(tier, keys, records)
                for key, record, got in zip(keys, records, fetch(tier, keys), strict=True):
                    if got is not None and got != record:
                        errors.append(f"caller {number} read a wrong payload for {key.hex()}")
                    hits.append(got is not None)

        threads = [threading.Thread(target=caller, args=(number,)) for number in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert errors == []
        assert len(hits) == 4 * 3 * 4 and any(hits)

    def test_a_burst_of_puts_never_blocks_and_every_one_is_accounted_for(
        self, make_tier: TierFactory
    ) -> None:
        tier = make_tier(make_spec())
        keys = tier.keys.keys(block_hashes("burst", 200))
        record = payloads(1, seed=10)[0]
        before = tier.stats()
        futures = []
        slowest = 0.0
        for key in keys:
            started = time.monotonic()
            futures.append(tier.put([key], [record]))
            slowest = max(slowest, time.monotonic() - started)
        stored = sum(done(future).stored[0] for future in futures)
        after = tier.stats()
        assert slowest < 1.0, f"a put blocked its caller for {slowest:.2f} s"
        assert stored + after.drops - before.drops == len(keys)
        assert after.queue_drops - before.queue_drops <= after.drops - before.drops

    # --------------------------------------------------------------- capacity

    def test_a_full_tier_evicts_and_stays_within_capacity(self, make_tier: TierFactory) -> None:
        tier = make_tier(make_spec())
        if tier.capacity_bytes is None:
            pytest.skip("the store decides this tier's capacity (a shared server)")
        capacity = tier.capacity_bytes // RECORD_BYTES
        assert capacity >= 1
        keys = tier.keys.keys(block_hashes("full", capacity + 3))
        records = payloads(len(keys), seed=7)
        for key, record in zip(keys, records, strict=True):
            store(tier, [key], [record])
        stats = tier.stats()
        assert stats.records is not None and stats.records <= capacity
        assert stats.evictions >= 3
        got = fetch(tier, keys)
        assert got[-1] == records[-1], "the newest record was stored"
        assert sum(record is not None for record in got) <= capacity
        assert all(g is None or g == r for g, r in zip(got, records, strict=True))

    # -------------------------------------------------------------- isolation

    def _isolated(
        self, make_tier: TierFactory, first: TierSpec, second: TierSpec, name: str
    ) -> None:
        hashes = block_hashes(name, 3)
        theirs, ours = payloads(3, seed=8), payloads(3, seed=9)
        tier = make_tier(first)
        store(tier, tier.keys.keys(hashes), theirs)
        if not self.concurrent_namespaces:
            tier.close()
        other = make_tier(second)
        assert fetch(other, other.keys.keys(hashes)) == [None] * 3
        assert done(other.contains(other.keys.keys(hashes))).present == (False,) * 3
        store(other, other.keys.keys(hashes), ours)
        assert fetch(other, other.keys.keys(hashes)) == ours
        if not self.concurrent_namespaces:
            other.close()
            tier = make_tier(first)
        for got, record in zip(fetch(tier, tier.keys.keys(hashes)), theirs, strict=True):
            assert got is None or got == record, "a record of another tenant or layout was returned"

    def test_another_namespace_never_sees_the_records(self, make_tier: TierFactory) -> None:
        self._isolated(
            make_tier, make_spec(namespace="tenant-a"), make_spec(namespace="tenant-b"), "ns"
        )

    def test_another_layout_never_sees_the_records(self, make_tier: TierFactory) -> None:
        self._isolated(
            make_tier, make_spec(fingerprint="layout-a"), make_spec(fingerprint="layout-b"), "fp"
        )
