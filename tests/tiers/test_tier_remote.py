"""RemoteTier on its own: start-up, back-off, causes and store counting over a dict client."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import pytest

from kvtier.index.base import BlockKey
from kvtier.testing.contracts_tier import block_hashes, make_spec, payloads
from kvtier.tiers.base import Cause, TierError, TierState
from kvtier.tiers.configs import RemoteTierConfig
from kvtier.tiers.remote import RemoteTier

RECORD = 64
FULL = 7
"""The error code the client returns for a key the store has no room for."""


class DictClient:
    """A store in a dict whose calls fail with ``failure`` while it is set."""

    def __init__(self) -> None:
        self.records: dict[BlockKey, bytes] = {}
        self.failure: BaseException | None = None
        self.calls = 0
        self.closed = False

    def call(self, run: Callable[[], list[int]]) -> list[int]:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        return run()

    def close(self) -> None:
        self.closed = True


class DictTierConfig(RemoteTierConfig):
    type: Literal["dict"] = "dict"


class DictTier(RemoteTier):
    """Puts answer a code per key (0 stored, ``FULL`` refused); gets return the records."""

    failures = (ConnectionError, TimeoutError, PermissionError)
    causes = {TimeoutError: Cause.TIMEOUT, ConnectionError: Cause.CONNECTION, FULL: Cause.NO_SPACE}

    def __init__(self, config: DictTierConfig, client: DictClient, problem: str | None) -> None:
        super().__init__(config, make_spec(record_bytes=RECORD), name="dict", where="the dict")
        self.refused: set[BlockKey] = set()
        self._open(lambda: self._connect(client, problem), "the dict")

    def _connect(self, client: DictClient, problem: str | None) -> str | None:
        if problem is None:
            self._client = client
        return problem

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        client: DictClient = self._client
        found = self._call_store(keys, lambda: client.call(lambda: [0] * len(keys)))
        if found is None:
            return [None] * len(keys)
        return [self._checked(key, client.records[key]) for key in keys]

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        client: DictClient = self._client

        def put() -> list[int]:
            for key, record in zip(keys, records, strict=True):
                if key not in self.refused:
                    client.records[key] = self._codec.encode(key, record)
            return [FULL if key in self.refused else 0 for key in keys]

        codes = self._call_store(keys, lambda: client.call(put))
        if codes is None:
            return [False] * len(keys)
        for code in codes:
            if code:
                self._count_error(self._cause_of(code))
        return self._count_stored([code == 0 for code in codes])

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [key in self._client.records for key in keys]

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [self._client.records.pop(key, None) is not None for key in keys]


@pytest.fixture
def client() -> DictClient:
    return DictClient()


@pytest.fixture
def tiers(client: DictClient) -> Iterator[Callable[..., DictTier]]:
    built: list[DictTier] = []

    def build(problem: str | None = None, **fields: object) -> DictTier:
        config = DictTierConfig.model_validate({"reconnect_backoff_s": 60.0, **fields})
        built.append(DictTier(config, client, problem))
        return built[-1]

    yield build
    for tier in built:
        tier.close()


def test_a_required_store_that_does_not_answer_stops_start_up(
    tiers: Callable[..., DictTier],
) -> None:
    with pytest.raises(TierError) as caught:
        tiers("the dict is gone; fill it")
    assert str(caught.value) == (
        "dict tier: the dict is gone; fill it; or set required: false to run without this tier"
    )


def test_an_optional_store_that_does_not_answer_disables_the_tier(
    tiers: Callable[..., DictTier], client: DictClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.remote"):
        tier = tiers("the dict is gone; fill it", required=False)
    assert "dict tier: the dict is gone; fill it; running with the tier disabled" in caplog.text
    keys = tier.keys.keys(block_hashes("disabled", 3))
    assert tier.put(keys, payloads(3, RECORD)).result().stored == (False,) * 3
    assert tier.get(keys).result().hits == 0
    assert tier.stats().errors == {"disabled": 6}
    assert client.calls == 0
    tier.close()
    assert not client.closed, "a tier that never connected closes nothing"


def test_a_store_that_stops_answering_is_left_alone_until_its_wait_is_over(
    tiers: Callable[..., DictTier], client: DictClient
) -> None:
    tier = tiers()
    keys = tier.keys.keys(block_hashes("outage", 2))
    client.failure = TimeoutError("no answer in 1 s")
    assert tier.put(keys, payloads(2, RECORD)).result().stored == (False, False)
    client.failure = None
    assert tier.get(keys).result().hits == 0, "within the wait, the store is not called"
    assert client.calls == 1
    assert tier.stats().errors == {"timeout": 2, "connection": 2}
    tier.close()
    assert client.closed


def test_the_state_is_backing_off_while_the_wait_lasts_and_up_once_it_is_over(
    tiers: Callable[..., DictTier], client: DictClient
) -> None:
    tier = tiers(reconnect_backoff_s=0.05)
    keys = tier.keys.keys(block_hashes("state", 2))
    assert tier.stats().state is TierState.UP
    client.failure = ConnectionError("refused")
    tier.put(keys, payloads(2, RECORD)).result()
    assert tier.stats().state is TierState.BACKING_OFF
    time.sleep(0.06)
    assert tier.stats().state is TierState.UP
    assert tiers("gone", required=False).stats().state is TierState.DISABLED


def test_a_failure_that_is_not_an_outage_opens_no_wait(
    tiers: Callable[..., DictTier], client: DictClient
) -> None:
    tier = tiers()
    keys = tier.keys.keys(block_hashes("refused", 2))
    client.failure = PermissionError("not yours")
    assert tier.put(keys, payloads(2, RECORD)).result().stored == (False, False)
    client.failure = None
    assert tier.put(keys, payloads(2, RECORD)).result().stored == (True, True)
    assert client.calls == 2
    assert tier.stats().errors == {"server": 2}, "a failure causes does not name is other_cause"


def test_stores_are_counted_and_codes_name_their_cause(
    tiers: Callable[..., DictTier], client: DictClient
) -> None:
    tier = tiers()
    keys = tier.keys.keys(block_hashes("stored", 3))
    tier.refused.add(keys[1])
    records = payloads(3, RECORD)
    assert tier.put(keys, records).result().stored == (True, False, True)
    assert [bytes(r) for r in tier.get([keys[0], keys[2]]).result().records] == [
        records[0],
        records[2],
    ]
    stats = tier.stats()
    assert (stats.stores, stats.bytes_written, stats.drops) == (2, 2 * RECORD, 1)
    assert stats.errors == {"no_space": 1}


@pytest.mark.parametrize("memory_s", [0.0, 0.3])
def test_a_record_of_another_writer_is_not_read_again_for_fault_memory_s(
    tiers: Callable[..., DictTier], client: DictClient, memory_s: float
) -> None:
    tier = tiers(fault_memory_s=memory_s)
    keys = tier.keys.keys(block_hashes("foreign", 2))
    client.records[keys[0]] = b"a value of some other format"
    tier.put(keys[1:], payloads(1, RECORD)).result()
    for _ in range(3):
        assert tier.get(keys).result().hits == 1
        assert tier.contains(keys).result().present == (memory_s == 0, True)
    assert tier.stats().errors == {"version": 3 if memory_s == 0 else 1}
    time.sleep(memory_s)
    assert tier.get(keys).result().hits == 1
    assert tier.stats().errors == {"version": 4 if memory_s == 0 else 2}
    assert keys[0] in client.records, "a record this tier did not seal is left to its writer"
