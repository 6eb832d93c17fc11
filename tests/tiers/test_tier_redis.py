"""The redis tier against real redis-server processes: the contract, a cluster, and faults."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.exceptions

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
from kvtier.tiers.base import TierError, TierSpec
from kvtier.tiers.record import RecordCodec, RecordKeys
from kvtier.tiers.redis import RedisTier, RedisTierConfig, redacted_url
from tests.support.redis_server import RedisServer, free_port, redis_server_binary, start_cluster

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None,
    reason="redis-server is not installed; `make test` installs it (apt-get install redis-server)",
)

RECORD = 12 * 1024 + 7
PASSWORD = "s3cr3t-pass-word"
SECRET = "5e" * 32
OLD_SECRET = "01" * 32


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """A file holding the tier's key."""
    path = tmp_path / "tier.key"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the tests that only read and write; each test starts it empty."""
    started = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """A three-node Redis Cluster on 127.0.0.1."""
    nodes = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Starts servers that a test may kill, pause or configure; stops them all at the end."""
    started: list[RedisServer] = []

    def start(*args: str, port: int | None = None, ping: bool = True) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(started)}", port=port, args=args)
        started.append(server)
        return server.start(ping=ping)

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def tiers() -> Iterator[Callable[..., RedisTier]]:
    """Builds redis tiers from config fields; closes them all at the end."""
    built: list[RedisTier] = []

    def build(spec: TierSpec | None = None, **fields: object) -> RedisTier:
        config = RedisTierConfig.model_validate(fields)
        built.append(
            RedisTier(config, spec if spec is not None else make_spec(record_bytes=RECORD))
        )
        return built[-1]

    yield build
    for tier in built:
        tier.close()


class TestRedisContract(StorageTierContract):
    @pytest.fixture
    def make_tier(
        self, server: RedisServer, tiers: Callable[..., RedisTier]
    ) -> Iterator[TierFactory]:
        server.client().flushall()
        yield lambda spec: tiers(spec, url=server.url, io_threads=2)


class TestRedisClusterContract(StorageTierContract):
    @pytest.fixture
    def make_tier(
        self, cluster: list[RedisServer], tiers: Callable[..., RedisTier]
    ) -> Iterator[TierFactory]:
        for node in cluster:
            node.client().flushall()
        yield lambda spec: tiers(spec, url=cluster[1].url, cluster=True, io_threads=2)


class TestRedisKeyedContract(StorageTierContract):
    @pytest.fixture
    def make_tier(
        self, server: RedisServer, tiers: Callable[..., RedisTier], key_file: Path
    ) -> Iterator[TierFactory]:
        server.client().flushall()
        yield lambda spec: tiers(spec, url=server.url, key_file=key_file)


class TestRedisEncryptedClusterContract(StorageTierContract):
    @pytest.fixture
    def make_tier(
        self, cluster: list[RedisServer], tiers: Callable[..., RedisTier], key_file: Path
    ) -> Iterator[TierFactory]:
        for node in cluster:
            node.client().flushall()
        yield lambda spec: tiers(
            spec, url=cluster[1].url, cluster=True, key_file=key_file, encrypt=True
        )


def test_the_registry_builds_the_redis_tier(server: RedisServer) -> None:
    registration = default_registry().get(STORAGE_TIER, "redis")
    config = registration.config_model.model_validate({"type": "redis", "url": server.url})
    tier = registration.factory(config, make_spec(record_bytes=RECORD))
    try:
        assert isinstance(tier, RedisTier) and tier.capacity_bytes is None
    finally:
        tier.close()


def test_cluster_keys_spread_over_every_node(
    cluster: list[RedisServer], tiers: Callable[..., RedisTier]
) -> None:
    for node in cluster:
        node.client().flushall()
    tier = tiers(url=cluster[0].url, cluster=True)
    keys = tier.keys.keys(block_hashes("spread", 30))
    records = payloads(30, RECORD)
    assert store(tier, keys, records) == (True,) * 30
    assert all(node.client().dbsize() > 0 for node in cluster)
    assert sum(node.client().dbsize() for node in cluster) == 30
    assert fetch(tier, keys) == records


def test_a_url_must_be_redis() -> None:
    with pytest.raises(ValueError, match=r"redis:// or rediss://"):
        RedisTierConfig(url="http://127.0.0.1:6379")  # type: ignore[arg-type]


# ---------------------------------------------------------------- start-up


def test_a_server_down_at_start_up_is_a_clear_error(tiers: Callable[..., RedisTier]) -> None:
    port = free_port()
    with pytest.raises(TierError) as caught:
        tiers(url=f"redis://user:{PASSWORD}@127.0.0.1:{port}/0", timeout_s=0.2)
    message = str(caught.value)
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in message
    assert "required: false" in message and PASSWORD not in message


def test_an_optional_server_down_at_start_up_disables_the_tier(
    tiers: Callable[..., RedisTier], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.remote"):
        tier = tiers(url=f"redis://127.0.0.1:{port}/0", required=False, timeout_s=0.2)
    assert "running with the tier disabled" in caplog.text
    keys = tier.keys.keys(block_hashes("off", 2))
    assert done(tier.put(keys, payloads(2, RECORD))).stored == (False, False)
    assert fetch(tier, keys) == [None, None]
    stats = tier.stats()
    assert stats.errors == {"disabled": 4} and (stats.drops, stats.misses) == (2, 2)


# ------------------------------------------------------------------ faults


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_server_killed_mid_run_gives_misses_and_drops_then_recovers(
    own_server: Callable[..., RedisServer], tiers: Callable[..., RedisTier]
) -> None:
    server = own_server()
    tier = tiers(url=server.url, timeout_s=0.5, reconnect_backoff_s=0.05)
    keys = tier.keys.keys(block_hashes("kill", 3))
    records = payloads(3, RECORD)
    store(tier, keys[:1], records[:1])
    server.kill()
    assert fetch(tier, keys[:1]) == [None]
    assert done(tier.put(keys[1:2], records[1:2])).stored == (False,)
    stats = tier.stats()
    assert stats.errors.get("connection", 0) >= 2 and stats.drops == 1 and stats.misses == 1
    server.start()  # the same port, empty: a restarted server keeps nothing here
    wait_until(lambda: done(tier.put(keys[2:], records[2:])).stored == (True,))
    assert fetch(tier, keys) == [None, None, records[2]]


def test_a_long_outage_keeps_counting_connection_errors_at_the_longest_wait(
    own_server: Callable[..., RedisServer], tiers: Callable[..., RedisTier]
) -> None:
    # Two thousand failures in a row: the doubling wait must stop at its ceiling
    # rather than grow past what a float holds (which would turn every later
    # batch into an internal error and a logged traceback).
    server = own_server()
    tier = tiers(
        url=server.url, timeout_s=0.5, reconnect_backoff_s=1e-6, reconnect_max_backoff_s=1e-6
    )
    keys = tier.keys.keys(block_hashes("outage", 1))
    server.kill()
    for _ in range(2000):
        assert fetch(tier, keys) == [None]
    errors = tier.stats().errors
    assert errors.get("connection", 0) == 2000 and "internal" not in errors
    server.start()
    wait_until(lambda: done(tier.put(keys, payloads(1, RECORD))).stored == (True,))


def test_a_stalled_server_turns_gets_into_deadline_misses_and_drops_puts(
    own_server: Callable[..., RedisServer], tiers: Callable[..., RedisTier]
) -> None:
    server = own_server()
    tier = tiers(
        url=server.url,
        timeout_s=0.3,
        get_deadline_s=0.05,
        io_threads=1,
        queue_depth=1,
        reconnect_backoff_s=0.05,
    )
    keys = tier.keys.keys(block_hashes("stall", 4))
    records = payloads(4, RECORD)
    store(tier, keys[:1], records[:1])
    server.pause()
    try:
        started = time.monotonic()
        assert done(tier.get(keys[:1])).records == (None,)
        assert time.monotonic() - started < 0.25, "the deadline answers before the timeout"
        puts = [
            tier.put([key], [record]) for key, record in zip(keys[1:], records[1:], strict=True)
        ]
        assert puts[-1].done() and puts[-1].result().stored == (False,)
        stats = tier.stats()
        assert stats.deadline_misses == 1 and stats.queue_drops >= 1
    finally:
        server.resume()
    for future in puts:
        done(future)
    wait_until(lambda: fetch(tier, keys[:1]) == records[:1])


def test_a_full_server_drops_puts_and_an_evicting_one_loses_keys(
    own_server: Callable[..., RedisServer], tiers: Callable[..., RedisTier]
) -> None:
    server = own_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    tier = tiers(url=server.url)
    keys = tier.keys.keys(block_hashes("full", 400))
    records = payloads(400, RECORD)
    stored = done(tier.put(keys, records)).stored
    assert any(stored) and not all(stored)
    assert tier.stats().errors == {"no_space": stored.count(False)}
    got = fetch(tier, keys)
    assert got == [record if ok else None for record, ok in zip(records, stored, strict=True)]
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    more = tier.keys.keys(block_hashes("more", 200))
    assert all(done(tier.put(more, payloads(200, RECORD, seed=1))).stored)
    got = fetch(tier, keys)
    assert any(record is None for record in got)
    assert all(g is None or g == r for g, r in zip(got, records, strict=True))


def test_no_bad_record_is_ever_returned(
    server: RedisServer, tiers: Callable[..., RedisTier]
) -> None:
    server.client().flushall()
    tier = tiers(url=server.url)
    keys = tier.keys.keys(block_hashes("bad", 6))
    records = payloads(6, RECORD)
    store(tier, keys, records)
    client = server.client()
    names = [b"kvtier:" + key.hex().encode() for key in keys]
    flipped = bytearray(client.get(names[0]))
    flipped[-1] ^= 1
    client.set(names[0], bytes(flipped))
    client.set(names[1], client.get(names[1])[:-5])
    client.set(names[2], client.get(names[3]))  # another key's record
    other_layout = RecordCodec("layout-b", RECORD)
    client.set(names[3], other_layout.encode(keys[3], records[3]))
    client.set(names[4], b"\x80\x04\x95 not a record, and never unpickled")
    assert fetch(tier, keys) == [None, None, None, None, None, records[5]]
    assert tier.stats().errors == {
        "checksum": 1,
        "length": 1,
        "key": 1,
        "fingerprint": 1,
        "version": 1,
    }


# ---------------------------------------------------------------- reading replies


@pytest.mark.parametrize("record_bytes", [1, 64 * 1024 - 3, 3 * 1024 * 1024 + 5])
def test_gets_read_records_of_any_size_between_misses(
    server: RedisServer, tiers: Callable[..., RedisTier], record_bytes: int
) -> None:
    # Records shorter than, near and far past the reader's 64 KiB line buffer,
    # each batch with misses between them so every reply kind follows every other.
    server.client().flushall()
    tier = tiers(make_spec(record_bytes=record_bytes), url=server.url)
    keys = tier.keys.keys(block_hashes(f"sizes-{record_bytes}", 6))
    records = payloads(3, record_bytes)
    store(tier, keys[1::2], records)
    assert fetch(tier, keys) == [None, records[0], None, records[1], None, records[2]]
    assert fetch(tier, keys[::-1]) == [records[2], None, records[1], None, records[0], None]


def test_an_error_reply_is_one_miss_and_the_batch_reads_on(
    server: RedisServer, tiers: Callable[..., RedisTier]
) -> None:
    server.client().flushall()
    tier = tiers(url=server.url)
    keys = tier.keys.keys(block_hashes("wrongtype", 3))
    records = payloads(3, RECORD)
    store(tier, keys, records)
    name = b"kvtier:" + keys[1].hex().encode()
    client = server.client()
    client.delete(name)
    client.rpush(name, b"a list, where a string belongs")  # GET answers WRONGTYPE
    assert fetch(tier, keys) == [records[0], None, records[2]]
    assert fetch(tier, keys) == [records[0], None, records[2]]  # the connection stayed in step
    assert tier.stats().errors == {"server": 2}


def test_a_url_asking_for_resp3_reads_through_the_client(
    server: RedisServer, tiers: Callable[..., RedisTier]
) -> None:
    server.client().flushall()
    tier = tiers(url=server.url + "?protocol=3")
    keys = tier.keys.keys(block_hashes("resp3", 3))
    records = payloads(2, RECORD)
    store(tier, keys[:2], records)
    assert fetch(tier, keys) == [*records, None]
    assert tier.stats().errors == {}


# ---------------------------------------------------------------- secrets and TLS


def test_a_password_in_the_url_works_and_is_never_shown(
    own_server: Callable[..., RedisServer],
    tiers: Callable[..., RedisTier],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = own_server("--requirepass", PASSWORD, ping=False)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        tier = tiers(url=url)
        keys = tier.keys.keys(block_hashes("secret", 1))
        store(tier, keys, payloads(1, RECORD))
        assert fetch(tier, keys) == payloads(1, RECORD)
        with pytest.raises(TierError) as caught:
            tiers(url=f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0")
    config = RedisTierConfig(url=url)  # type: ignore[arg-type]
    shown = [
        repr(config),
        str(config),
        config.model_dump_json(),
        str(config.model_dump()),
        repr(tier),
        str(caught.value),
        caplog.text,
    ]
    assert all(PASSWORD not in text for text in shown)
    assert redacted_url(url) == f"redis://127.0.0.1:{server.port}/0"


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_with_the_servers_ca_works_and_without_it_fails_at_start_up(
    own_server: Callable[..., RedisServer],
    tiers: Callable[..., RedisTier],
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    port = free_port()
    tls = ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
    files = [
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(cert),
    ]
    own_server(*tls, *files, port=port, ping=False)  # the later --port 0 closes the plain port
    url = f"rediss://127.0.0.1:{port}/0"
    tier = tiers(url=url, tls_ca_path=cert)
    keys = tier.keys.keys(block_hashes("tls", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    assert fetch(tier, keys) == records
    with pytest.raises(TierError, match="certificate"):
        tiers(url=url)
    with pytest.raises(TierError, match="cannot reach"):
        tiers(url=f"redis://127.0.0.1:{port}/0", timeout_s=0.5)


def test_a_put_retried_on_a_fresh_connection_sends_its_records_again(
    server: RedisServer, tiers: Callable[..., RedisTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first send fails after its first chunk went out, as on a connection
    # the server closed; the client's one retry must send the whole batch again.
    send = redis.connection.AbstractConnection.send_packed_command
    failed: list[bool] = []

    def fail_once(connection: Any, command: Any, check_health: bool = True) -> None:
        if failed:
            return send(connection, command, check_health)
        failed.append(True)
        send(connection, [next(iter(command))], check_health)
        connection.disconnect()
        raise redis.exceptions.ConnectionError("closed by the test")

    tier = tiers(url=server.url, io_threads=1)
    keys = tier.keys.keys(block_hashes("retry", 2))
    records = payloads(2, RECORD)
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", fail_once)
    assert done(tier.put(keys, records)).stored == (True, True)
    assert failed
    assert fetch(tier, keys) == records
    assert tier.stats().errors == {}


# ---------------------------------------------------------------- keyed records


def test_a_writer_without_the_key_cannot_plant_a_record(
    server: RedisServer,
    tiers: Callable[..., RedisTier],
    key_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Anyone who can write to the server forges records an unkeyed tier serves; with a key,
    forged, unkeyed and replayed records are misses, counted as auth failures."""
    server.client().flushall()
    evil = payloads(1, RECORD, seed=9)[0]
    unkeyed = tiers(url=server.url)
    monkeypatch.setenv("TEST_TIER_KEY", SECRET)
    keyed = tiers(url=server.url, key_env="TEST_TIER_KEY")
    encrypted = tiers(url=server.url, key_file=key_file, encrypt=True)
    client = server.client()
    attacker = RecordCodec(keyed.keys.layout_fingerprint, RECORD)
    for tier, name in ((unkeyed, "unkeyed"), (keyed, "keyed"), (encrypted, "encrypted")):
        keys = tier.keys.keys(block_hashes(name, 4))
        records = payloads(4, RECORD)
        store(tier, keys, records)
        names = [b"kvtier:" + key.hex().encode() for key in keys]
        client.set(names[0], attacker.encode(keys[0], evil))  # forged with the public code
        client.set(names[1], client.get(names[2]))  # replayed under another key
        wrong_key = RecordCodec(
            tier.keys.layout_fingerprint, RECORD, keys=RecordKeys.parse(OLD_SECRET)
        )
        client.set(names[2], wrong_key.encode(keys[2], evil))
        got = fetch(tier, keys)
        if tier is unkeyed:
            assert got == [evil, None, None, records[3]], "checksums stop no forger"
            assert tier.stats().errors == {"key": 1, "auth": 1}
        else:
            assert got == [None, None, None, records[3]]
            assert tier.stats().errors == {"auth": 2, "key": 1}


def test_a_tenants_records_are_misses_for_another_salt_and_stay_in_the_store(
    server: RedisServer, tiers: Callable[..., RedisTier], key_file: Path
) -> None:
    """Engines holding the tier's key but another salt, or none, miss a tenant's records;
    the records are not taken for damaged ones and deleted."""
    server.client().flushall()
    hashes, records = block_hashes("tenant", 2), payloads(2, RECORD)
    owner = tiers(url=server.url, key_file=key_file, encrypt=True)
    store(owner, owner.keys.keys(hashes, 0, b"salt-of-a"), records)
    for salt in (b"salt-of-b", None):
        other = tiers(url=server.url, key_file=key_file, encrypt=True)
        assert fetch(other, other.keys.keys(hashes, 0, salt)) == [None, None]
        assert other.stats().errors == {"tenant": 2}
    assert fetch(owner, owner.keys.keys(hashes, 0, b"salt-of-a")) == records
    # one engine serving both tenants: another's miss is not remembered against the owner
    assert fetch(owner, owner.keys.keys(hashes, 0, b"salt-of-b")) == [None, None]
    assert fetch(owner, owner.keys.keys(hashes, 0, b"salt-of-a")) == records
    client = server.client()
    stored = b"".join(client.get(name) for name in client.keys())
    assert b"salt-of-a" not in stored and records[0] not in stored


def test_rotating_keys_keeps_the_records_of_the_old_one(
    server: RedisServer, tiers: Callable[..., RedisTier], tmp_path: Path
) -> None:
    server.client().flushall()
    old, rotated, new = tmp_path / "old", tmp_path / "rotated", tmp_path / "new"
    old.write_text(OLD_SECRET)
    rotated.write_text(f"{SECRET}\n{OLD_SECRET}\n")
    new.write_text(SECRET)
    before = tiers(url=server.url, key_file=old)
    keys = before.keys.keys(block_hashes("rotate", 2))
    records = payloads(2, RECORD)
    store(before, keys[:1], records[:1])
    during = tiers(url=server.url, key_file=rotated)
    store(during, keys[1:], records[1:])
    assert fetch(during, keys) == records
    assert fetch(before, keys) == [records[0], None]
    after = tiers(url=server.url, key_file=new)
    assert fetch(after, keys) == [None, records[1]]
    assert after.stats().errors == {"auth": 1}


def test_a_record_that_fails_its_checks_is_read_once(
    server: RedisServer, tiers: Callable[..., RedisTier], key_file: Path
) -> None:
    """A damaged record sealed with the tier's key is deleted; one sealed with a key the tier
    lacks (another engine's, mid-rotation) stays, but is not read again until a put."""
    server.client().flushall()
    tier = tiers(url=server.url, key_file=key_file)
    keys = tier.keys.keys(block_hashes("faulty", 3))
    records = payloads(3, RECORD)
    store(tier, keys, records)
    client = server.client()
    names = [b"kvtier:" + key.hex().encode() for key in keys]
    damaged = bytearray(client.get(names[0]))
    damaged[-1] ^= 1
    client.set(names[0], bytes(damaged))
    other = RecordCodec(tier.keys.layout_fingerprint, RECORD, keys=RecordKeys.parse(OLD_SECRET))
    client.set(names[1], other.encode(keys[1], records[1]))
    for _ in range(3):
        assert fetch(tier, keys) == [None, None, records[2]]
    assert tier.stats().errors == {"auth": 2}, "each faulty record is read once"
    deadline = time.monotonic() + 5
    while client.exists(names[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not client.exists(names[0]), "the damaged record is deleted"
    assert client.exists(names[1]), "another key's record is left to its writer"
    store(tier, keys[1:2], records[1:2])
    assert fetch(tier, keys) == [None, records[1], records[2]]


def test_an_unkeyed_shared_tier_warns_once_and_require_key_refuses_to_start(
    server: RedisServer,
    tiers: Callable[..., RedisTier],
    key_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        tier = tiers(url=server.url)
        store(tier, tier.keys.keys(block_hashes("warn", 2)), payloads(2, RECORD))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checksums only" in warnings[0] and "key_file" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        tiers(url=server.url, key_file=key_file)
    assert not caplog.records
    with pytest.raises(
        ValueError,
        match="require_key is true but this redis tier has no key; set key_file or key_env",
    ):
        RedisTierConfig.model_validate({"url": server.url, "require_key": True})
    with pytest.raises(ValueError, match="encrypt is true but this redis tier has no key"):
        RedisTierConfig.model_validate({"url": server.url, "encrypt": True})
    with pytest.raises(TierError, match=r"^redis tier: environment variable UNSET_TIER_KEY "):
        tiers(url=server.url, key_env="UNSET_TIER_KEY", require_key=True)


def test_a_url_query_credential_is_never_shown(
    own_server: Callable[..., RedisServer],
    tiers: Callable[..., RedisTier],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = own_server(ping=False)
    server.client().acl_setuser(
        "tenant", enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], commands=["+@all"]
    )
    good = f"redis://127.0.0.1:{server.port}/0?username=tenant&password={PASSWORD}"
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        tier = tiers(url=good)
        keys = tier.keys.keys(block_hashes("query", 1))
        store(tier, keys, payloads(1, RECORD))
        assert fetch(tier, keys) == payloads(1, RECORD)
        with pytest.raises(TierError) as caught:
            tiers(url=good.replace(PASSWORD, "wrong-" + PASSWORD))
        dead = tiers(url=good.replace(str(server.port), str(free_port())), required=False)
    shown = [repr(tier), repr(dead), str(caught.value), caplog.text]
    assert all(PASSWORD not in text and "tenant" not in text for text in shown)
    assert redacted_url(good) == (f"redis://127.0.0.1:{server.port}/0?username=****&password=****")
    assert redacted_url(f"redis://u:p@[::1]:6379/0?db=1&Password={PASSWORD}#x") == (
        "redis://[::1]:6379/0?db=1&Password=****"
    )


def test_a_value_far_longer_than_a_record_is_not_read_whole(
    server: RedisServer, tiers: Callable[..., RedisTier]
) -> None:
    server.client().flushall()
    tier = tiers(url=server.url)
    keys = tier.keys.keys(block_hashes("huge", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    client = server.client()
    name = b"kvtier:" + keys[0].hex().encode()
    client.set(name, client.get(name) + bytes(64 << 20))  # a record, then 64 MiB more

    def sent_bytes() -> int:
        return int(client.info("stats")["total_net_output_bytes"])

    before = sent_bytes()
    assert fetch(tier, keys) == [None, records[1]]
    assert sent_bytes() - before < 1 << 20, "the server sent the tier no more than a record"
    assert tier.stats().errors == {"length": 1}


def test_a_stalled_server_costs_a_batch_one_timeout(
    own_server: Callable[..., RedisServer], tiers: Callable[..., RedisTier]
) -> None:
    server = own_server()
    tier = tiers(url=server.url, timeout_s=0.4, get_deadline_s=None, io_threads=1)
    keys = tier.keys.keys(block_hashes("one-timeout", 1))
    store(tier, keys, payloads(1, RECORD))
    server.pause()
    try:
        started = time.monotonic()
        assert done(tier.get(keys)).records == (None,)
        elapsed = time.monotonic() - started
    finally:
        server.resume()
    assert 0.4 <= elapsed < 0.7, f"a get took {elapsed:.2f} s of a 0.4 s timeout"
    assert tier.stats().errors == {"timeout": 1}
