"""The mooncake tier against a real Mooncake Store on loopback: the contract, settings, faults."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.config import load_config
from kvtier.keys import KeyNamespace
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
from kvtier.tiers.base import Cause, TierError, TierSpec
from kvtier.tiers.chain import TierChain
from kvtier.tiers.mooncake import MooncakeTier
from kvtier.tiers.mooncake_config import MooncakeTierConfig
from kvtier.tiers.record import RecordCodec, RecordKeys
from tests.support.mooncake_server import MooncakeStore, mooncake_binaries
from tests.support.redis_server import free_port

pytestmark = pytest.mark.skipif(
    mooncake_binaries() is None,
    reason="mooncake_master is not installed; `make install` installs kvtier[mooncake]",
)

RECORD = 12 * 1024 + 7
SECRET = "5e" * 32
OTHER = "01" * 32


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """A file holding the tier's key."""
    path = tmp_path / "tier.key"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    """One store for the tests that only read and write; each test starts it empty."""
    started = MooncakeStore(tmp_path_factory.mktemp("mooncake")).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def own_store(tmp_path: Path) -> Iterator[MooncakeStore]:
    """A store a test may take down; stopped at the end."""
    started = MooncakeStore(tmp_path / "mooncake").start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def tiers() -> Iterator[Callable[..., MooncakeTier]]:
    """Builds mooncake tiers from config fields; closes them all at the end."""
    built: list[MooncakeTier] = []

    def build(spec: TierSpec | None = None, **fields: object) -> MooncakeTier:
        config = MooncakeTierConfig.model_validate(fields)
        built.append(
            MooncakeTier(config, spec if spec is not None else make_spec(record_bytes=RECORD))
        )
        return built[-1]

    yield build
    for tier in built:
        tier.close()


class TestMooncakeContract(StorageTierContract):
    @pytest.fixture
    def make_tier(
        self, mooncake: MooncakeStore, tiers: Callable[..., MooncakeTier]
    ) -> Iterator[TierFactory]:
        mooncake.clear()
        yield lambda spec: tiers(spec, **mooncake.tier_settings())


class TestMooncakeSealedContract(StorageTierContract):
    @pytest.fixture
    def make_tier(
        self, mooncake: MooncakeStore, tiers: Callable[..., MooncakeTier], key_file: Path
    ) -> Iterator[TierFactory]:
        mooncake.clear()
        yield lambda spec: tiers(spec, **mooncake.tier_settings(), key_file=key_file, encrypt=True)


def test_the_registry_builds_the_mooncake_tier(mooncake: MooncakeStore) -> None:
    registration = default_registry().get(STORAGE_TIER, "mooncake")
    config = registration.config_model.model_validate(mooncake.tier_settings())
    tier = registration.factory(config, make_spec(record_bytes=RECORD))
    try:
        assert isinstance(tier, MooncakeTier) and tier.capacity_bytes is None
    finally:
        tier.close()


def test_kvtier_plugins_lists_the_tier() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "kvtier", "plugins"], capture_output=True, text=True, check=True
    )
    rows = [line.split()[:4] for line in listed.stdout.splitlines()]
    assert ["storage", "tier", "mooncake", "kvtier"] in rows


def test_a_config_builds_the_tier_and_its_counts_are_reported_under_its_name(
    mooncake: MooncakeStore,
) -> None:
    """The per-tier metrics read a chain's counts by tier name: ``mooncake`` here."""
    mooncake.clear()
    config = load_config({"tiers": [mooncake.tier_settings()]}, env={})
    chain = TierChain.from_config(
        config,
        record_bytes=RECORD,
        keys=KeyNamespace("model", "layout", 0, 1),
        registry=default_registry(),
    )
    try:
        [(name, tier)] = chain.tiers
        assert name == "mooncake" and isinstance(tier, MooncakeTier)
        hashes = block_hashes("chain", 2)
        chain.store(0, hashes, payloads(2, RECORD, seed=5), (0,))
        deadline = time.monotonic() + 10
        while tier.stats().stores < 2:
            assert time.monotonic() < deadline, "the chain's stores never reached the store"
            time.sleep(0.01)
        counts = chain.take_counts()
        assert counts["mooncake"]["stores"] == 2
        assert counts["mooncake"]["bytes_written"] == 2 * RECORD
    finally:
        chain.close()


def test_records_outlive_the_tier_that_wrote_them(
    mooncake: MooncakeStore, tiers: Callable[..., MooncakeTier]
) -> None:
    """A second engine finds the first one's blocks after the first stopped."""
    mooncake.clear()
    first = tiers(**mooncake.tier_settings())
    keys = first.keys.keys(block_hashes("outlive", 3))
    records = payloads(3, RECORD, seed=1)
    assert store(first, keys, records) == (True,) * 3
    first.close()
    second = tiers(**mooncake.tier_settings())
    assert fetch(second, keys) == records


def test_a_writer_without_the_key_cannot_plant_a_record(
    mooncake: MooncakeStore,
    tiers: Callable[..., MooncakeTier],
    key_file: Path,
) -> None:
    """Anyone who can write to the store forges records an unkeyed tier serves; with a key,
    forged, unkeyed and replayed records are misses, counted as auth failures."""
    mooncake.clear()
    evil = payloads(1, RECORD, seed=9)[0]
    unkeyed = tiers(**mooncake.tier_settings())
    keyed = tiers(**mooncake.tier_settings(), key_file=key_file)
    encrypted = tiers(**mooncake.tier_settings(), key_file=key_file, encrypt=True)
    attacker = RecordCodec(keyed.keys.layout_fingerprint, RECORD)
    wrong_key = RecordCodec(keyed.keys.layout_fingerprint, RECORD, keys=RecordKeys.parse(OTHER))
    client = mooncake.client()
    try:
        for tier, name in ((unkeyed, "unkeyed"), (keyed, "keyed"), (encrypted, "encrypted")):
            keys = tier.keys.keys(block_hashes(name, 4))
            records = payloads(4, RECORD)
            store(tier, keys, records)
            names = [f"kvtier:{key.hex()}" for key in keys]
            planted = [
                attacker.encode(keys[0], evil),  # forged with the public code
                client.get(names[2]),  # replayed under another key
                wrong_key.encode(keys[2], evil),
            ]
            assert client.upsert_batch(names[:3], planted) == 0
            got = fetch(tier, keys)
            if tier is unkeyed:
                assert got == [evil, None, None, records[3]], "checksums stop no forger"
                assert tier.stats().errors == {"key": 1, "auth": 1}
            else:
                assert got == [None, None, None, records[3]]
                assert tier.stats().errors == {"auth": 2, "key": 1}
    finally:
        client.close()


def test_a_damaged_record_is_deleted_so_a_put_can_replace_it(
    mooncake: MooncakeStore, tiers: Callable[..., MooncakeTier], key_file: Path
) -> None:
    """The store keeps the first object put under a name: a damaged record would miss for
    good unless the tier that finds it deletes it."""
    mooncake.clear()
    tier = tiers(**mooncake.tier_settings(), key_file=key_file)
    keys = tier.keys.keys(block_hashes("damaged", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    client = mooncake.client()
    try:
        name = f"kvtier:{keys[0].hex()}"
        damaged = bytearray(client.get(name))
        damaged[-1] ^= 1
        assert client.upsert_batch([name], [bytes(damaged)]) == 0
        assert fetch(tier, keys) == [None, records[1]]
        deadline = time.monotonic() + 5
        while client.is_exist(name) == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.is_exist(name) == 0, "the damaged record is deleted"
    finally:
        client.close()
    store(tier, keys[:1], records[:1])
    assert fetch(tier, keys) == records
    assert tier.stats().errors == {"auth": 1}


def _listening_hosts() -> set[tuple[str, int]]:
    """(local address in /proc's hex, port) of each TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    listening = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # LISTEN
                    host, port = local.split(":")
                    listening.add((host, int(port, 16)))
    return listening


def test_the_client_listens_on_every_interface_whatever_local_hostname_says(
    mooncake: MooncakeStore, tiers: Callable[..., MooncakeTier]
) -> None:
    """docs/tiers/mooncake.md says that the store client cannot be kept on loopback: with
    local_hostname 127.0.0.1 its transfer engine still binds every interface. Once a client
    release honours local_hostname this fails, and the page must change."""
    before = _listening_hosts()
    tiers(**mooncake.tier_settings(), local_hostname="127.0.0.1")
    opened = _listening_hosts() - before
    assert opened, "the client listens on no port"
    wildcard = {"00000000", "0" * 32}
    assert {host for host, _ in opened} <= wildcard, opened


def test_soft_pinned_records_are_pinned_in_the_store(
    mooncake: MooncakeStore, tiers: Callable[..., MooncakeTier]
) -> None:
    mooncake.clear()
    tier = tiers(**mooncake.tier_settings(), soft_pin_ttl_s=60)
    keys = tier.keys.keys(block_hashes("pinned", 2))
    assert store(tier, keys, payloads(2, RECORD, seed=3)) == (True, True)
    deadline = time.monotonic() + 10
    while mooncake.metric("master_soft_pin_key_count") < 2:
        assert time.monotonic() < deadline, "the master reports no soft-pinned keys"
        time.sleep(0.05)


def test_a_master_that_does_not_answer_fails_start_up_in_one_line(
    tiers: Callable[..., MooncakeTier],
) -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(TierError) as refused:
        tiers(
            master_address=f"127.0.0.1:{port}",
            metadata_server=f"http://127.0.0.1:{free_port()}/metadata",
        )
    assert time.monotonic() - started < 10
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"mooncake tier: cannot use the store of the master at 127.0.0.1:{port}:"
    )
    assert "required: false" in message


def test_an_optional_store_that_is_down_runs_disabled(tiers: Callable[..., MooncakeTier]) -> None:
    tier = tiers(
        master_address=f"127.0.0.1:{free_port()}",
        metadata_server=f"http://127.0.0.1:{free_port()}/metadata",
        required=False,
    )
    keys = tier.keys.keys(block_hashes("disabled", 2))
    assert store(tier, keys, payloads(2, RECORD)) == (False, False)
    assert fetch(tier, keys) == [None, None]
    stats = tier.stats()
    assert stats.drops == 2 and stats.misses == 2
    assert stats.errors == {Cause.DISABLED.value: 4}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"master_address": "master"}, "expected the master as host:port"),
        ({"master_address": "master:0"}, "the port is not a number from 1 to 65535"),
        ({"master_address": "master:port"}, "the port is not a number from 1 to 65535"),
        ({"metadata_server": "ftp://host/metadata"}, "expected http://host:port/metadata"),
        ({"metadata_server": "http://host:99999/metadata"}, "expected http://host:port/metadata"),
        ({"protocol": "udp"}, "'tcp' or 'rdma'"),
        ({"replicas": 0}, "greater than or equal to 1"),
        ({"soft_pin_ttl_s": 7200}, "less than or equal to 3600"),
    ],
)
def test_settings_are_checked(fields: dict[str, object], message: str) -> None:
    settings = {
        "type": "mooncake",
        "master_address": "master:50051",
        "metadata_server": "http://master:8080/metadata",
        **fields,
    }
    with pytest.raises(ValidationError, match=message):
        MooncakeTierConfig.model_validate(settings)


def test_the_metadata_server_may_be_none() -> None:
    config = MooncakeTierConfig.model_validate(
        {"master_address": "[::1]:50051", "metadata_server": "P2PHANDSHAKE"}
    )
    assert config.metadata_server == "P2PHANDSHAKE"


def test_a_master_killed_and_restarted_mid_run(
    own_store: MooncakeStore, tiers: Callable[..., MooncakeTier]
) -> None:
    """Loads become misses and stores drops, all counted; the tier recovers."""
    tier = tiers(
        **own_store.tier_settings(),
        reconnect_backoff_s=0.05,
        reconnect_max_backoff_s=0.2,
        get_deadline_s=0.5,
    )
    before = tier.keys.keys(block_hashes("before", 4))
    records = payloads(4, RECORD, seed=4)
    assert store(tier, before, records) == (True,) * 4
    assert fetch(tier, before) == records

    own_store.kill_master()
    during = tier.keys.keys(block_hashes("during", 4))
    assert store(tier, during, records) == (False,) * 4
    loaded = done(tier.get(before))
    assert loaded.records == (None,) * 4
    assert done(tier.contains(before)).present == (False,) * 4
    down = tier.stats()
    assert down.drops == 4 and down.misses == 4
    # A get the client holds up is answered at its deadline; the rest at once, counted.
    assert down.errors.get(Cause.CONNECTION.value, 0) + down.deadline_misses >= 12

    own_store.start_master()
    own_store.wait_until_mounted()
    after = tier.keys.keys(block_hashes("after", 4))
    deadline = time.monotonic() + 30
    while store(tier, after, records) != (True,) * 4:
        assert time.monotonic() < deadline, "the tier did not recover after the master restarted"
        time.sleep(0.2)
    assert fetch(tier, after) == records
    # The restarted master knows nothing written before it went away.
    assert fetch(tier, before) == [None] * 4
    recovered = tier.stats()
    assert recovered.stores >= 8


def test_a_store_that_lost_its_memory_is_restarted_when_cleared(
    own_store: MooncakeStore, tiers: Callable[..., MooncakeTier]
) -> None:
    """The tests share one store; one whose lender died would fail every later test with
    "insufficient space", so clearing it restarts it, with a warning that says why."""
    assert own_store.holder is not None
    own_store.holder.kill()
    own_store.holder.wait(timeout=10)
    with pytest.warns(RuntimeWarning, match="mooncake_client exited with -9"):
        own_store.clear()
    tier = tiers(**own_store.tier_settings())
    keys = tier.keys.keys(block_hashes("restarted", 2))
    records = payloads(2, RECORD, seed=6)
    assert store(tier, keys, records) == (True,) * 2
    assert fetch(tier, keys) == records
