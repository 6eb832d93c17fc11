"""The s3 tier against moto's S3 server on loopback: the contract, chunked objects, and faults."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.config import ConfigError, load_config
from kvtier.kinds import STORAGE_TIER
from kvtier.plugins import default_registry
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
from kvtier.tiers.base import TierError, TierSpec, TierState
from kvtier.tiers.record import RecordCodec
from kvtier.tiers.s3 import S3Tier, S3TierConfig, chunk_ends, pack_table, runs, table_bytes
from tests.support.s3_server import MotoS3Server, ThrottlingProxy, aws_test_environment

RECORD = 12 * 1024 + 7
SECRET = "5e" * 32
_buckets = itertools.count()


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials from the environment, as the AWS chain finds them; nothing else."""
    for name in ("AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_test_environment().items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def server() -> Iterator[MotoS3Server]:
    started = MotoS3Server().start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def bucket(server: MotoS3Server) -> str:
    """A new, empty bucket."""
    return server.create_bucket(f"kvtier-test-{next(_buckets)}-{time.monotonic_ns()}")


@pytest.fixture
def tiers(server: MotoS3Server, bucket: str) -> Iterator[Callable[..., S3Tier]]:
    """Builds s3 tiers on the test's bucket from config fields; closes them all at the end."""
    built: list[S3Tier] = []

    def build(spec: TierSpec | None = None, **fields: object) -> S3Tier:
        settings = {
            "bucket": bucket,
            "endpoint_url": server.url,
            "addressing_style": "path",
            # moto answers slowly when the machine is busy.
            "timeout_s": 10.0,
            "get_deadline_s": 10.0,
            **fields,
        }
        config = S3TierConfig.model_validate(settings)
        built.append(S3Tier(config, spec if spec is not None else make_spec(record_bytes=RECORD)))
        return built[-1]

    yield build
    for tier in built:
        tier.close()


@pytest.fixture
def own_server(bucket: str) -> Iterator[MotoS3Server]:
    """A server of the test's own, which it may stop and start, holding ``bucket``."""
    own = MotoS3Server().start()
    try:
        own.create_bucket(bucket)
        yield own
    finally:
        own.stop()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """A file holding the tier's key."""
    path = tmp_path / "tier.key"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


class TestS3Contract(StorageTierContract):
    @pytest.fixture
    def make_tier(self, tiers: Callable[..., S3Tier]) -> TierFactory:
        return lambda spec: tiers(spec, chunk_blocks=2)


class TestS3EncryptedContract(StorageTierContract):
    @pytest.fixture
    def make_tier(self, tiers: Callable[..., S3Tier], key_file: Path) -> TierFactory:
        return lambda spec: tiers(spec, chunk_blocks=2, key_file=key_file, encrypt=True)


def object_names(server: MotoS3Server, bucket: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def test_the_registry_builds_the_s3_tier(server: MotoS3Server, bucket: str) -> None:
    registration = default_registry().get(STORAGE_TIER, "s3")
    config = registration.config_model.model_validate(
        {"type": "s3", "bucket": bucket, "endpoint_url": server.url, "addressing_style": "path"}
    )
    tier = registration.factory(config, make_spec(record_bytes=RECORD))
    try:
        assert isinstance(tier, S3Tier) and tier.capacity_bytes is None
    finally:
        tier.close()


def test_config_show_prints_no_credential(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "kvtier.yaml"
    file.write_text("tiers:\n  - {type: s3, bucket: kv-fleet, endpoint_url: 'http://minio:9000'}\n")
    secret = aws_test_environment()["AWS_SECRET_ACCESS_KEY"]
    for argv in (["config", "show", str(file)], ["config", "show", "--json", str(file)]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "kv-fleet" in out and "chunk_blocks" in out
        assert secret not in out and "aws_access_key" not in out.lower()


def test_two_entries_on_one_bucket_and_prefix_are_refused() -> None:
    one = {"type": "s3", "bucket": "kv-fleet"}
    tiers = [one, {**one, "prefix": "other/"}]
    assert len(load_config({"tiers": tiers}, env={}, registry=default_registry()).tiers) == 2
    with pytest.raises(ConfigError, match=r"same store \(s3 s3://kv-fleet/kvtier/ at AWS S3\)"):
        load_config(
            {"tiers": [one, {**one, "chunk_blocks": 4}]}, env={}, registry=default_registry()
        )


def test_credentials_never_go_in_the_config() -> None:
    with pytest.raises(ValueError, match="credentials do not belong in the URL"):
        S3TierConfig(bucket="kvtier", endpoint_url="http://key:secret@127.0.0.1:9000")
    with pytest.raises(ValueError, match="aws_secret_access_key"):
        S3TierConfig.model_validate({"bucket": "kvtier", "aws_secret_access_key": "x"})


# ------------------------------------------------------------------ objects


def test_a_prefix_is_a_few_objects_of_consecutive_blocks(
    server: MotoS3Server, bucket: str, tiers: Callable[..., S3Tier]
) -> None:
    tier = tiers(chunk_blocks=4, prefix="fleet/")
    keys = tier.keys.keys(block_hashes("prefix", 64))
    records = payloads(64, RECORD)
    assert store(tier, keys, records) == (True,) * 64
    names = object_names(server, bucket)
    cut = runs(keys, 4)
    assert names == sorted(f"fleet/{keys[run[-1]].hex()}" for run in cut)
    assert 8 <= len(names) <= 32, "about one object per chunk_blocks blocks"
    assert fetch(tier, keys) == records


def test_a_lookup_costs_a_request_per_chunk_not_per_block(
    server: MotoS3Server, bucket: str, tiers: Callable[..., S3Tier]
) -> None:
    proxy = ThrottlingProxy(server.port)
    try:
        tier = tiers(chunk_blocks=8, endpoint_url=proxy.url)
        keys = tier.keys.keys(block_hashes("lookup", 96))
        records = payloads(96, RECORD)
        store(tier, keys, records)
        chunks = len(runs(keys, 8))
        before = len(proxy.requests)
        # Found from a block in the middle of a chunk, as the chain asks after a host hit.
        assert fetch(tier, keys[5:]) == records[5:]
        found_cost = len(proxy.requests) - before
        before = len(proxy.requests)
        cold = tier.keys.keys(block_hashes("cold", 96))
        assert fetch(tier, cold) == [None] * 96
        cold_cost = len(proxy.requests) - before
        before = len(proxy.requests)
        # A shorter prefix of a stored one is found up to its last chunk end: the blocks
        # after it are in an object named after a key it does not have.
        last_end = max(i for i, ends in enumerate(chunk_ends(keys[:40], 8)) if ends)
        present = done(tier.contains(keys[:40])).present
        assert present == (True,) * (last_end + 1) + (False,) * (39 - last_end)
        contains_cost = len(proxy.requests) - before
    finally:
        proxy.stop()
    assert found_cost <= chunks + 1
    assert cold_cost <= len(runs(cold, 8)) + 1 + 8
    assert contains_cost <= len(runs(keys[:40], 8)) + 1 + 8
    assert set(proxy.requests[-contains_cost:]) == {"GET"}


def test_a_delete_rewrites_its_objects_at_once_and_one_failing_stops_none_of_the_others(
    server: MotoS3Server, bucket: str, tiers: Callable[..., S3Tier]
) -> None:
    proxy = ThrottlingProxy(server.port)
    try:
        tier = tiers(chunk_blocks=1, endpoint_url=proxy.url, get_deadline_s=0.5)
        keys = tier.keys.keys(block_hashes("delete", 4))
        store(tier, keys, payloads(4, RECORD))
        proxy.refuse("DELETE", f"/kvtier/{keys[0].hex()}")
        assert done(tier.delete(keys)).deleted == (False, True, True, True)
    finally:
        proxy.stop()
    assert object_names(server, bucket) == [f"kvtier/{keys[0].hex()}"]
    assert tier.stats().errors == {"server": 1}


def test_a_delete_while_the_tier_backs_off_asks_nothing_and_is_no_answer(
    own_server: MotoS3Server, tiers: Callable[..., S3Tier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = tiers(endpoint_url=own_server.url, timeout_s=0.5, reconnect_backoff_s=60)
    keys = tier.keys.keys(block_hashes("wait", 2))
    store(tier, keys[:1], payloads(1, RECORD))
    own_server.stop()
    assert done(tier.put(keys[1:], payloads(1, RECORD))).stored == (False,)
    assert tier.stats().state is TierState.BACKING_OFF
    with caplog.at_level(logging.INFO, logger="kvtier"):
        assert done(tier.delete(keys)).deleted == (False, False)
    assert tier.stats().state is TierState.BACKING_OFF
    assert "answers again" not in caplog.text, "a delete sent nowhere is no answer"


def test_a_longer_prefix_finds_a_shorter_one_stored_before(tiers: Callable[..., S3Tier]) -> None:
    tier = tiers(chunk_blocks=4)
    keys = tier.keys.keys(block_hashes("grow", 24))
    records = payloads(24, RECORD)
    store(tier, keys[:15], records[:15])
    assert fetch(tier, keys) == records[:15] + [None] * 9


def test_engines_sharing_a_bucket_find_each_others_prefixes(
    tiers: Callable[..., S3Tier],
) -> None:
    first, second = tiers(chunk_blocks=4), tiers(chunk_blocks=4)
    keys = first.keys.keys(block_hashes("shared", 20))
    records = payloads(20, RECORD)
    store(first, keys, records)
    assert fetch(second, keys[3:]) == records[3:]


def test_a_damaged_object_is_a_counted_miss(
    server: MotoS3Server, bucket: str, tiers: Callable[..., S3Tier]
) -> None:
    tier = tiers(chunk_blocks=1)
    keys = tier.keys.keys(block_hashes("damaged", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    client = server.client()
    name = f"kvtier/{keys[0].hex()}"
    body = bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=name, Body=bytes(body))
    client.put_object(
        Bucket=bucket, Key=f"kvtier/{keys[1].hex()}", Body=b"this is not a table of records"
    )
    assert fetch(tier, keys) == [None, None]
    assert tier.stats().errors == {"checksum": 1, "version": 1}


def test_a_writer_without_the_key_cannot_plant_a_record(
    server: MotoS3Server, bucket: str, tiers: Callable[..., S3Tier], key_file: Path
) -> None:
    """An object in the tier's own format, its record encoded by the public code without
    the key, is a miss counted as an auth failure."""
    tier = tiers(chunk_blocks=1, key_file=key_file)
    keys = tier.keys.keys(block_hashes("forged", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    evil = payloads(1, RECORD, seed=9)[0]
    forged = RecordCodec(tier.keys.layout_fingerprint, RECORD).encode(keys[0], evil)
    body = bytearray(table_bytes(keys[:1]))
    body += forged
    pack_table(body, keys[:1], [len(forged)])
    server.client().put_object(Bucket=bucket, Key=f"kvtier/{keys[0].hex()}", Body=bytes(body))
    assert fetch(tier, keys) == [None, records[1]]
    assert tier.stats().errors == {"auth": 1}


# ----------------------------------------------------------------- start-up


def test_a_missing_bucket_is_a_clear_error(server: MotoS3Server) -> None:
    config = S3TierConfig(bucket="kvtier-no-such-bucket", endpoint_url=server.url)
    with pytest.raises(TierError, match="bucket 'kvtier-no-such-bucket' does not exist"):
        S3Tier(config, make_spec(record_bytes=RECORD))


def test_an_unknown_profile_is_a_clear_error(server: MotoS3Server, bucket: str) -> None:
    config = S3TierConfig(bucket=bucket, endpoint_url=server.url, profile="no-such-profile")
    with pytest.raises(TierError, match="profile 'no-such-profile' is not in the AWS config"):
        S3Tier(config, make_spec(record_bytes=RECORD))


def test_missing_credentials_are_a_clear_error(
    server: MotoS3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    config = S3TierConfig(bucket=bucket, endpoint_url=server.url)
    with pytest.raises(TierError, match="no AWS credentials .* AWS_PROFILE"):
        S3Tier(config, make_spec(record_bytes=RECORD))


def test_an_optional_server_down_at_start_up_disables_the_tier(
    tiers: Callable[..., S3Tier], caplog: pytest.LogCaptureFixture
) -> None:
    down = MotoS3Server()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.remote"):
        tier = tiers(endpoint_url=down.url, required=False, timeout_s=0.2)
    assert "running with the tier disabled" in caplog.text
    keys = tier.keys.keys(block_hashes("off", 2))
    assert done(tier.put(keys, payloads(2, RECORD))).stored == (False, False)
    assert fetch(tier, keys) == [None, None]
    stats = tier.stats()
    assert stats.errors == {"disabled": 4} and (stats.drops, stats.misses) == (2, 2)


# ------------------------------------------------------------------- faults


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_throttling_is_retried_within_the_deadlines(
    server: MotoS3Server, tiers: Callable[..., S3Tier]
) -> None:
    proxy = ThrottlingProxy(server.port)
    try:
        # deadlines long enough that a loaded machine still tries each request before them
        deadline_s = 4.0
        tier = tiers(
            endpoint_url=proxy.url,
            chunk_blocks=1,
            get_deadline_s=deadline_s,
            put_deadline_s=deadline_s,
        )
        keys = tier.keys.keys(block_hashes("slow", 4))
        records = payloads(4, RECORD)
        proxy.throttle(3)
        assert store(tier, keys[:2], records[:2]) == (True, True)
        proxy.throttle(3)
        assert fetch(tier, keys[:2]) == records[:2]
        assert proxy.throttled == 6 and tier.stats().errors == {}
        proxy.throttle(10**6)
        started = time.monotonic()
        assert store(tier, keys[2:], records[2:]) == (False, False)
        assert done(tier.get(keys[:2])).records == (None, None)
        assert time.monotonic() - started < 2 * deadline_s + 1.0, "retries stop at the deadlines"
        # the deadline thread may answer the get before its I/O thread's last try counts it
        wait_until(lambda: tier.stats().errors.get("server") == 4)
        stats = tier.stats()
        assert stats.errors == {"server": 4} and (stats.drops, stats.misses) == (2, 2)
        proxy.throttle(0)
        assert fetch(tier, keys[:2]) == records[:2]
    finally:
        proxy.stop()


def test_a_server_gone_gives_misses_and_drops_then_recovers(
    own_server: MotoS3Server, bucket: str, tiers: Callable[..., S3Tier]
) -> None:
    tier = tiers(endpoint_url=own_server.url, timeout_s=0.5, reconnect_backoff_s=0.05)
    keys = tier.keys.keys(block_hashes("gone", 3))
    records = payloads(3, RECORD)
    store(tier, keys[:1], records[:1])
    own_server.stop()
    assert fetch(tier, keys[:1]) == [None]
    assert done(tier.put(keys[1:2], records[1:2])).stored == (False,)
    stats = tier.stats()
    assert stats.errors.get("connection", 0) >= 2 and stats.drops == 1 and stats.misses == 1
    own_server.start()  # the same port, empty: a replaced server keeps nothing here
    own_server.create_bucket(bucket)
    wait_until(lambda: done(tier.put(keys[2:], records[2:])).stored == (True,))
    assert fetch(tier, keys) == [None, None, records[2]]
