"""The disk tier: the contract, warm restart, and every fault a disk can have."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import resource
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.codecs.configs import Int8CodecConfig
from kvtier.codecs.quantised import QuantisedCodec
from kvtier.index.base import BlockKey
from kvtier.kinds import BLOCK_INDEX, STORAGE_TIER
from kvtier.plugins import PluginError, default_registry
from kvtier.testing.contracts_codec import CASES, case_from_layout
from kvtier.testing.contracts_layout import flash_attn_case
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
from kvtier.tiers import disk as disk_module
from kvtier.tiers.base import TierError, TierSpec
from kvtier.tiers.buffers import KEEP_BYTES
from kvtier.tiers.disk import (
    HEADER_AREA_BYTES,
    SUPERBLOCK_BYTES,
    WRITE_GROUP,
    DiskTier,
    DiskTierConfig,
    aligned_buffer,
    build_disk_tier,
)
from kvtier.tiers.record import HEADER_FIXED_BYTES, RecordCodec
from tests.conftest import mount_tmpfs, unmount

RECORD = 8192 + 100
SLOT = DiskTier.slot_bytes_for(RECORD)


def capacity_for(slots: int) -> int:
    return SUPERBLOCK_BYTES + slots * SLOT


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator[Callable[..., DiskTier]]:
    """Builds disk tiers under ``tmp_path/tier``; closes them all at the end."""
    built: list[DiskTier] = []

    def build(spec: TierSpec | None = None, **options: object) -> DiskTier:
        settings: dict[str, object] = {"path": tmp_path / "tier", "capacity_bytes": capacity_for(8)}
        settings.update(options)
        tier = build_disk_tier(
            DiskTierConfig(**settings),  # type: ignore[arg-type]
            spec if spec is not None else make_spec(record_bytes=RECORD),
        )
        built.append(tier)
        return tier

    yield build
    for tier in built:
        tier.close()


class TestDiskContract(StorageTierContract):
    concurrent_namespaces = False

    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Iterator[TierFactory]:
        built: list[DiskTier] = []

        def build(spec: TierSpec) -> DiskTier:
            config = DiskTierConfig(path=tmp_path, capacity_bytes=capacity_for(24), io_threads=2)
            built.append(build_disk_tier(config, spec))
            return built[-1]

        yield build
        for tier in built:
            tier.close()


SECRET = "5e" * 32
OLD_SECRET = "01" * 32


def write_keys(path: Path, *secrets: str) -> Path:
    path.write_text("\n".join(secrets) + "\n")
    return path


class TestDiskKeyedContract(StorageTierContract):
    concurrent_namespaces = False

    @pytest.fixture(params=[False, True], ids=["mac", "aead"])
    def make_tier(self, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TierFactory]:
        built: list[DiskTier] = []
        key_file = write_keys(tmp_path / "tier.key", SECRET)

        def build(spec: TierSpec) -> DiskTier:
            config = DiskTierConfig(
                path=tmp_path / "tier",
                capacity_bytes=capacity_for(24),
                key_file=key_file,
                encrypt=request.param,
            )
            built.append(build_disk_tier(config, spec))
            return built[-1]

        yield build
        for tier in built:
            tier.close()


def o_direct_refused(path: Path) -> str | None:
    """Why the filesystem of ``path`` cannot do aligned ``O_DIRECT`` I/O, or ``None``."""
    probe = path / "o_direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        return f"the filesystem of {path} refuses O_DIRECT: {exc.strerror}"
    try:
        os.pwrite(fd, aligned_buffer(4096), 0)
    except OSError as exc:
        return f"the filesystem of {path} refuses O_DIRECT writes: {exc.strerror}"
    finally:
        os.close(fd)
        probe.unlink()
    return None


class TestDiskContractODirect(StorageTierContract):
    concurrent_namespaces = False

    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Iterator[TierFactory]:
        refused = o_direct_refused(tmp_path)
        if refused is not None:
            pytest.skip(refused)
        built: list[DiskTier] = []

        def build(spec: TierSpec) -> DiskTier:
            config = DiskTierConfig(
                path=tmp_path, capacity_bytes=capacity_for(24), io_threads=2, o_direct=True
            )
            built.append(build_disk_tier(config, spec))
            return built[-1]

        yield build
        for tier in built:
            tier.close()


def test_the_registry_builds_the_disk_tier(tmp_path: Path) -> None:
    registration = default_registry().get(STORAGE_TIER, "disk")
    config = registration.config_model.model_validate(
        {"type": "disk", "path": str(tmp_path), "capacity_bytes": "1MiB", "eviction": "s3fifo"}
    )
    tier = registration.factory(config, make_spec(rank=1, world_size=2, record_bytes=RECORD))
    try:
        assert tier.file == tmp_path / "rank1-of2.kvtier"
        assert tier.num_slots == (2**20 // 2 - SUPERBLOCK_BYTES) // SLOT
        assert tier.capacity_bytes == tier.num_slots * RECORD
        assert os.path.getsize(tier.file) == SUPERBLOCK_BYTES + tier.num_slots * SLOT
    finally:
        tier.close()


def test_an_unknown_eviction_policy_lists_the_installed_ones(tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path, capacity_bytes="1MiB", eviction="nonesuch")
    with pytest.raises(PluginError, match="no block index named 'nonesuch'; installed: .*lru"):
        build_disk_tier(config, make_spec(record_bytes=RECORD))


def test_a_capacity_below_one_record_is_a_start_up_error(tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path, capacity_bytes=SLOT, eviction="lru")
    with pytest.raises(TierError, match=f"set it to at least {2 * capacity_for(1)}"):
        build_disk_tier(config, make_spec(world_size=2, record_bytes=RECORD))


def test_one_file_serves_one_process(open_tier: Callable[..., DiskTier]) -> None:
    open_tier()
    with pytest.raises(TierError, match="in use by another kvtier process"):
        open_tier()


def test_a_second_process_on_the_directory_is_refused_until_the_first_is_killed(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    """The lock is the kernel's: a SIGKILLed holder leaves no stale lock behind, and the next
    engine finds what it wrote."""
    keys = make_spec(record_bytes=RECORD).keys.keys(block_hashes("held", 2))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "tier"), str(capacity_for(8)), str(RECORD)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        message = refusal(open_tier)
        # The holder is named, so that an engine left running by a killed one can be found.
        name = Path(sys.executable).name[:15]  # the kernel's name of the process
        assert message.endswith(
            f"is in use by another kvtier process (pid {holder.pid}, {name}); give each "
            "engine its own path, or stop that process if its engine is gone"
        )
    finally:
        holder.kill()
        holder.wait()
    tier = open_tier()
    assert fetch(tier, keys) == payloads(2, RECORD)


HOLDER = """
import sys, time
from kvtier.testing.contracts_tier import block_hashes, make_spec, payloads, store
from kvtier.tiers.disk import DiskTierConfig, build_disk_tier
path, capacity, record = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = DiskTierConfig(path=path, capacity_bytes=capacity)
tier = build_disk_tier(config, make_spec(record_bytes=record))
store(tier, tier.keys.keys(block_hashes("held", 2)), payloads(2, record))
print("ready", flush=True)
time.sleep(600)
"""
"""A process that holds a disk tier open under ``path`` after storing two records."""


def test_files_of_an_engine_of_another_world_size_are_removed_at_start(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    """A restart with another tensor-parallel size finds no records (the keys name the
    rank), so the old files only took room: the directory keeps to ``capacity_bytes``."""
    open_tier().close()
    directory = tmp_path / "tier"
    assert [p.name for p in directory.iterdir()] == ["rank0-of1.kvtier"]
    for rank in (0, 1):
        open_tier(
            make_spec(rank=rank, world_size=2, record_bytes=RECORD), capacity_bytes=capacity_for(16)
        )
    assert sorted(p.name for p in directory.iterdir()) == ["rank0-of2.kvtier", "rank1-of2.kvtier"]


def test_an_engine_of_another_world_size_on_the_directory_is_refused(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    open_tier()
    message = refusal(open_tier, spec=make_spec(world_size=2, record_bytes=RECORD))
    assert message == (
        f"disk tier: {tmp_path / 'tier'} is in use by an engine of 1 rank(s) (rank0-of1.kvtier "
        "is locked), and this one has 2; give each engine its own path"
    )
    # The refused engine leaves no file of its own behind.
    assert [p.name for p in (tmp_path / "tier").iterdir()] == ["rank0-of1.kvtier"]


# ------------------------------------------------------------------ files kvtier did not make

OTHER_UID = 65534
"""A user other than this one (``nobody``), for files and links only root can give away."""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user needs root"
)


def refusal(open_tier: Callable[..., DiskTier], **options: object) -> str:
    """The one-line message of the ``TierError`` opening a tier with ``options`` raises."""
    with pytest.raises(TierError) as raised:
        open_tier(**options)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_link_in_place_of_the_file_is_refused_and_its_target_left_alone(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "tier").mkdir(mode=0o700)
    (tmp_path / "tier" / "rank0-of1.kvtier").symlink_to(victim)
    message = refusal(open_tier)
    file = tmp_path / "tier" / "rank0-of1.kvtier"
    assert f"{file} is a symbolic link, not a regular file" in message
    assert "point path at a directory only this user can write" in message
    assert victim.read_bytes() == b"precious"


def test_a_fifo_in_place_of_the_file_is_refused_at_once(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    (tmp_path / "tier").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "tier" / "rank0-of1.kvtier")
    messages: list[str] = []
    opener = threading.Thread(target=lambda: messages.append(refusal(open_tier)), daemon=True)
    opener.start()
    opener.join(timeout=30)
    assert not opener.is_alive(), "opening the tier blocked on the FIFO"
    assert messages and "is a FIFO (named pipe), not a regular file" in messages[0]


def test_a_file_with_another_name_is_refused(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    (tmp_path / "tier").mkdir(mode=0o700)
    other = tmp_path / "other-name"
    other.write_bytes(b"precious")
    os.link(other, tmp_path / "tier" / "rank0-of1.kvtier")
    assert "has 2 names (hard links)" in refusal(open_tier)
    assert other.read_bytes() == b"precious"


def test_a_directory_others_can_write_is_refused_unless_sticky(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o770):
        shared.chmod(mode)
        message = refusal(open_tier, path=shared)
        assert f"directory {shared} can be written by other users and is not sticky" in message
    shared.chmod(0o1777)
    open_tier(path=shared).close()
    assert (shared / "rank0-of1.kvtier").stat().st_uid == os.geteuid()


@needs_root
def test_a_directory_of_another_user_is_refused_unless_sticky(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    assert f"owner uid {OTHER_UID}" in refusal(open_tier, path=theirs)


@needs_root
def test_a_file_of_another_user_in_a_sticky_shared_directory_is_refused(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "rank0-of1.kvtier"
    planted.write_bytes(b"theirs")
    os.chown(planted, OTHER_UID, OTHER_UID)
    message = refusal(open_tier, path=shared)
    assert f"{planted} is owned by uid {OTHER_UID}, not by this user" in message
    assert planted.read_bytes() == b"theirs"


@needs_root
def test_a_path_that_is_another_users_link_is_refused(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    assert f"path {link} is a symbolic link owned by uid {OTHER_UID}" in refusal(
        open_tier, path=link
    )
    assert not list(target.iterdir())
    os.lchown(link, os.geteuid(), os.getegid())
    open_tier(path=link).close()


def test_the_read_buffers_kept_are_counted_and_bounded(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier(io_threads=2)
    keys = tier.keys.keys(block_hashes("buffers", 8))
    store(tier, keys, payloads(8, RECORD))
    assert tier.stats().read_buffer_bytes == 0
    held = [done(tier.get(keys)).records for _ in range(4)]  # held: each read a new buffer
    kept = tier.stats().read_buffer_bytes
    assert kept >= 8 * RECORD
    assert kept <= 2 * KEEP_BYTES + 2 * tier.slot_bytes
    del held
    for _ in range(4):
        fetch(tier, keys)  # dropped each time: read into the buffers kept
    assert tier.stats().read_buffer_bytes == kept


# ------------------------------------------------------------------ warm restart


def test_warm_restart_serves_the_records_found(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("warm", 5))
    records = payloads(5, RECORD)
    store(tier, keys, records)
    assert done(tier.delete(keys[4:])).deleted == (True,)
    tier.close()
    again = open_tier()
    assert again.stats().records == 4
    assert fetch(again, keys) == [*records[:4], None]
    assert again.stats().errors == {}


def test_warm_restart_keeps_the_write_order_for_eviction(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier(capacity_bytes=capacity_for(4))
    keys = tier.keys.keys(block_hashes("order", 5))
    records = payloads(5, RECORD)
    for key, record in zip(keys[:4], records[:4], strict=True):
        store(tier, [key], [record])
    fetch(tier, keys[:1])  # a hit does not survive a restart; the write order does
    tier.close()
    again = open_tier(capacity_bytes=capacity_for(4))
    store(again, keys[4:], records[4:])
    assert fetch(again, keys) == [None, *records[1:]]
    assert again.stats().evictions == 1


def test_a_larger_capacity_keeps_the_records_and_adds_slots(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier(capacity_bytes=capacity_for(2))
    keys = tier.keys.keys(block_hashes("grow", 4))
    records = payloads(4, RECORD)
    store(tier, keys[:2], records[:2])
    tier.close()
    bigger = open_tier(capacity_bytes=capacity_for(4))
    store(bigger, keys[2:], records[2:])
    assert fetch(bigger, keys) == records
    assert bigger.stats().evictions == 0


@pytest.mark.parametrize("preallocate", [True, False])
def test_a_smaller_capacity_shrinks_the_file_and_keeps_the_records_that_still_fit(
    open_tier: Callable[..., DiskTier], preallocate: bool
) -> None:
    """Records in the slots past the smaller file's end are dropped, and do not come back
    when the capacity grows again."""
    tier = open_tier(capacity_bytes=capacity_for(8), preallocate=preallocate)
    keys = tier.keys.keys(block_hashes("shrink", 8))
    records = payloads(8, RECORD)
    store(tier, keys, records)
    tier.close()
    smaller = open_tier(capacity_bytes=capacity_for(4), preallocate=preallocate)
    assert smaller.file.stat().st_size <= capacity_for(4)
    found = fetch(smaller, keys)
    kept = [key for key, record in zip(keys, found, strict=True) if record is not None]
    assert len(kept) == smaller.stats().records == 4
    assert [r for r in found if r is not None] == [
        record for record, got in zip(records, found, strict=True) if got is not None
    ]
    more = tier.keys.keys(block_hashes("shrink-more", 3))
    store(smaller, more, payloads(3, RECORD, seed=1))
    assert smaller.stats().records == 4 and smaller.file.stat().st_size <= capacity_for(4)
    smaller.close()
    larger = open_tier(capacity_bytes=capacity_for(8), preallocate=preallocate)
    assert larger.stats().records == 4


def test_capacity_holds_across_restarts_of_every_size(open_tier: Callable[..., DiskTier]) -> None:
    """Restarts at random capacities, each storing more than fits: the tier never counts
    more records than its slots, nor its file more bytes than its capacity."""
    rng = random.Random(3)
    for restart in range(8):
        slots = rng.choice((2, 3, 5, 8))
        tier = open_tier(capacity_bytes=capacity_for(slots), preallocate=rng.random() < 0.5)
        keys = tier.keys.keys(block_hashes(f"restart-{restart}", 6))
        for key, record in zip(keys, payloads(6, RECORD, seed=restart), strict=True):
            store(tier, [key], [record])
        assert tier.stats().records == slots
        assert tier.file.stat().st_size <= capacity_for(slots)
        assert fetch(tier, keys[-1:]) == payloads(6, RECORD, seed=restart)[-1:]
        tier.close()


def test_another_record_size_starts_the_file_empty(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("size", 2))
    store(tier, keys, payloads(2, RECORD))
    tier.close()
    other = open_tier(make_spec(record_bytes=RECORD + 4096))
    assert other.stats().records == 0 and other.stats().errors == {}
    assert fetch(other, keys) == [None, None]


def test_records_of_another_layout_or_namespace_are_counted_and_never_served(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier()
    hashes = block_hashes("foreign", 3)
    store(tier, tier.keys.keys(hashes), payloads(3, RECORD))
    tier.close()
    other_layout = open_tier(make_spec(fingerprint="layout-b", record_bytes=RECORD))
    assert other_layout.stats().errors == {"fingerprint": 3}
    assert other_layout.stats().records == 0
    assert fetch(other_layout, other_layout.keys.keys(hashes)) == [None] * 3
    other_layout.close()
    other_tenant = open_tier(namespace="tenant-b")
    assert other_tenant.stats().errors == {"key": 3}
    assert fetch(other_tenant, other_tenant.keys.keys(hashes)) == [None] * 3


# ------------------------------------------------------------------- corruption


def slot_offset(tier: DiskTier, key: BlockKey) -> int:
    slot = tier._index.slot_of(key)
    assert slot is not None
    return SUPERBLOCK_BYTES + tier._file_slots[slot] * tier.slot_bytes


def overwrite(tier: DiskTier, offset: int, data: bytes) -> None:
    with open(tier.file, "r+b") as file:
        file.seek(offset)
        file.write(data)


def test_a_corrupted_payload_is_a_counted_miss_and_leaves_the_index(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("flip", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    overwrite(tier, slot_offset(tier, keys[0]) + HEADER_AREA_BYTES + 1234, b"\xff\x00")
    assert fetch(tier, keys) == [None, records[1]]
    assert tier.stats().errors == {"checksum": 1}
    assert done(tier.contains(keys)).present == (False, True)
    store(tier, keys[:1], records[:1])
    assert fetch(tier, keys[:1]) == records[:1]


def test_a_corrupted_header_is_a_miss_live_and_after_a_restart(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("header", 3))
    records = payloads(3, RECORD)
    store(tier, keys, records)
    overwrite(tier, slot_offset(tier, keys[0]) + 20, b"\x01")  # inside the fingerprint digest
    overwrite(tier, slot_offset(tier, keys[1]), b"JUNK")  # the magic
    assert fetch(tier, keys) == [None, None, records[2]]
    assert tier.stats().errors == {"checksum": 1, "version": 1}
    tier.close()
    store_again = open_tier()
    assert fetch(store_again, keys) == [None, None, records[2]]


def test_a_torn_record_is_a_miss(open_tier: Callable[..., DiskTier]) -> None:
    """A crash part-way through rewriting a slot leaves its old header over a mixed payload;
    a header written over half a payload (a write torn in another order) is no better."""
    tier = open_tier()
    key_old, key_new, key_kept = tier.keys.keys(block_hashes("torn", 3))
    old, new, kept = payloads(3, RECORD)
    store(tier, [key_old, key_kept], [old, kept])
    old_at, kept_at = slot_offset(tier, key_old), slot_offset(tier, key_kept)
    header, _ = tier._codec.header(key_new, new, sequence=99)
    tier.close()
    with open(tier.file, "r+b") as file:
        file.seek(old_at + HEADER_AREA_BYTES)
        file.write(new[: RECORD // 2])
        file.seek(kept_at)
        file.write(header.ljust(HEADER_AREA_BYTES, b"\0") + new[: RECORD // 2])
    again = open_tier()
    assert again.stats().records == 2, "both headers are intact, so both records are indexed"
    assert fetch(again, [key_old, key_new, key_kept]) == [None, None, None]
    assert again.stats().errors == {"checksum": 2}


def test_a_truncated_file_is_a_miss(open_tier: Callable[..., DiskTier]) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("short", 1))
    store(tier, keys, payloads(1, RECORD))
    os.truncate(tier.file, slot_offset(tier, keys[0]) + HEADER_AREA_BYTES + 10)
    assert fetch(tier, keys) == [None]
    assert tier.stats().errors == {"length": 1}


def test_a_file_truncated_inside_a_run_of_slots_is_a_miss_from_there(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("short run", 3))
    records = payloads(3, RECORD)
    store(tier, keys, records)
    offsets = [slot_offset(tier, key) for key in keys]
    assert offsets == [offsets[0] + i * tier.slot_bytes for i in range(3)], "one run of slots"
    os.truncate(tier.file, offsets[1] + HEADER_AREA_BYTES + 10)
    assert fetch(tier, keys) == [records[0], None, None]
    assert tier.stats().errors == {"length": 2}


@pytest.mark.parametrize("o_direct", [False, True])
def test_records_in_consecutive_slots_are_read_in_one_call(
    o_direct: bool,
    tmp_path: Path,
    open_tier: Callable[..., DiskTier],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One ``preadv`` a run: the I/O thread waits for the interpreter once a run, not once a
    record (a busy engine thread made a record-at-a-time read of 96 records 4 to 5 times
    slower than alone)."""
    if o_direct and o_direct_refused(tmp_path) is not None:
        pytest.skip(str(o_direct_refused(tmp_path)))
    tier = open_tier(o_direct=o_direct)
    keys = tier.keys.keys(block_hashes("run", 6))
    records = payloads(6, RECORD)
    store(tier, keys, records)
    # records 0-3 are one run and 5 is alone (4 was deleted), whatever the order asked in
    assert done(tier.delete(keys[4:5])).deleted == (True,)
    asked = [keys[2], keys[0], keys[1], keys[5], keys[4], keys[3]]
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    expected = [records[2], records[0], records[1], records[5], None, records[3]]
    assert fetch(tier, asked) == expected
    assert sorted(calls) == [1, 4]


@pytest.mark.parametrize("o_direct", [False, True])
def test_a_get_returns_new_writable_buffers(
    o_direct: bool, tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    if o_direct and o_direct_refused(tmp_path) is not None:
        pytest.skip(str(o_direct_refused(tmp_path)))
    tier = open_tier(o_direct=o_direct)
    keys = tier.keys.keys(block_hashes("writable", 1))
    records = payloads(1, RECORD)
    store(tier, keys, records)
    first, second = (done(tier.get(keys)).records[0] for _ in range(2))
    assert first is not None and second is not None
    assert not first.readonly and len(first) == RECORD
    first[:4] = b"\0\0\0\0"
    assert bytes(second) == records[0], "each get has its own buffer"
    assert fetch(tier, keys) == records


def test_short_writes_are_continued(
    monkeypatch: pytest.MonkeyPatch, open_tier: Callable[..., DiskTier]
) -> None:
    """A write the kernel takes only in part (a signal, a filesystem's limit) is finished."""
    tier = open_tier()
    real_pwritev = os.pwritev
    calls = []

    def short_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        first = memoryview(buffers[0])
        return real_pwritev(fd, [first[: max(1, min(len(first), 3000))]], offset)

    keys = tier.keys.keys(block_hashes("short-writes", 2))
    records = payloads(2, RECORD)
    monkeypatch.setattr(os, "pwritev", short_pwritev)
    assert store(tier, keys, records) == (True, True)
    monkeypatch.undo()
    assert len(calls) > 2 * (HEADER_AREA_BYTES + RECORD) // 3000
    assert fetch(tier, keys) == records


def test_records_in_consecutive_slots_go_out_in_one_write(
    monkeypatch: pytest.MonkeyPatch, open_tier: Callable[..., DiskTier]
) -> None:
    tier = open_tier(capacity_bytes=capacity_for(2 * WRITE_GROUP + 4))
    real_pwritev = os.pwritev
    writes: list[int] = []

    def counted_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        writes.append(len(buffers))
        return real_pwritev(fd, buffers, offset)

    count = WRITE_GROUP + 2
    keys = tier.keys.keys(block_hashes("grouped", count))
    records = payloads(count, RECORD)
    monkeypatch.setattr(os, "pwritev", counted_pwritev)
    assert all(store(tier, keys, records))
    monkeypatch.undo()
    # a header, a payload and its padding per record; no padding after a group's last one
    assert writes == [3 * WRITE_GROUP - 1, 3 * 2 - 1]
    assert fetch(tier, keys) == records
    tier.close()
    assert fetch(open_tier(capacity_bytes=capacity_for(2 * WRITE_GROUP + 4)), keys) == records


def test_a_header_area_holds_nothing_after_its_header(
    open_tier: Callable[..., DiskTier],
) -> None:
    """Header areas are built in a reused buffer: a short key's must not keep a long key's tail."""
    tier = open_tier(io_threads=1)
    long_key, short_key = (tier.keys.keys([name])[0] for name in (b"long" * 50, b"short"))
    records = payloads(2, RECORD)
    store(tier, [long_key], records[:1])
    store(tier, [short_key], records[1:])
    with open(tier.file, "rb") as file:
        file.seek(slot_offset(tier, short_key))
        area = file.read(HEADER_AREA_BYTES)
    assert area[HEADER_FIXED_BYTES : HEADER_FIXED_BYTES + len(short_key)] == short_key
    assert not any(area[HEADER_FIXED_BYTES + len(short_key) :])
    assert fetch(tier, [long_key, short_key]) == records


# ------------------------------------------------------------------------- O_DIRECT


def test_o_direct_bypasses_the_page_cache_in_the_same_file_format(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    refused = o_direct_refused(tmp_path)
    if refused is not None:
        pytest.skip(refused)
    tier = open_tier(o_direct=True)
    assert fcntl.fcntl(tier._fd, fcntl.F_GETFL) & os.O_DIRECT
    keys = tier.keys.keys(block_hashes("direct", 4))
    records = payloads(4, RECORD)
    assert store(tier, keys, records) == (True,) * 4
    assert fetch(tier, keys) == records
    overwrite(tier, slot_offset(tier, keys[0]) + HEADER_AREA_BYTES + RECORD - 1, b"\x5a")
    assert fetch(tier, keys[:1]) == [None]
    assert tier.stats().errors == {"checksum": 1}
    tier.close()
    buffered = open_tier()
    assert fetch(buffered, keys) == [None, *records[1:]], "a warm restart reads the same file"
    store(buffered, keys[:1], records[:1])
    buffered.close()
    assert fetch(open_tier(o_direct=True), keys) == records


@pytest.mark.parametrize("refusing", ["open", "preadv"])
def test_a_filesystem_that_refuses_o_direct_is_a_start_up_error(
    refusing: str, monkeypatch: pytest.MonkeyPatch, open_tier: Callable[..., DiskTier]
) -> None:
    """Some filesystems refuse ``O_DIRECT`` when the file is opened, others at the first
    read; both answer ``EINVAL``, as tmpfs did before Linux 6.6."""
    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()

    def fake_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_DIRECT and refusing == "open":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        fd = real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
        return fd

    def fake_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    with pytest.raises(TierError, match="refuses O_DIRECT .*set o_direct: false"):
        open_tier(o_direct=True)
    open_tier().close()


# ------------------------------------------------------------------ full or read-only disks


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A directory where at most about 256 KiB can be written: a small tmpfs where this
    process may mount one, else a file-size limit (``RLIMIT_FSIZE``) on this process."""
    limit = 256 * 1024
    target = tmp_path / "small"
    if mount_tmpfs(target, limit):
        try:
            yield target, limit
        finally:
            unmount(target)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield target, limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_disk_too_small_is_a_start_up_error(
    small_disk: tuple[Path, int], open_tier: Callable[..., DiskTier]
) -> None:
    path, limit = small_disk
    with pytest.raises(TierError, match="no room for .* lower capacity_bytes"):
        open_tier(path=path, capacity_bytes=4 * limit)
    file = path / "rank0-of1.kvtier"
    # Refused before the file is made where the free space shows it (a small tmpfs), or
    # when reserving it fails (a file-size limit): either way no space is kept.
    assert not file.exists() or os.path.getsize(file) == 0, "the space is given back"


@pytest.fixture
def index_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The slot counts of the block indexes the disk tier builds from now on."""
    builds: list[int] = []
    real = default_registry().get(BLOCK_INDEX, "lru")

    def factory(config: object, num_slots: int) -> object:
        builds.append(num_slots)
        # Never build a huge index: a regression fails here instead of filling the memory.
        assert num_slots <= 1 << 20, f"an index of {num_slots} slots was built"
        return real.factory(config, num_slots)

    spy = SimpleNamespace(factory=factory, config_model=real.config_model)
    registry = SimpleNamespace(get=lambda kind, name: spy)
    monkeypatch.setattr(disk_module, "default_registry", lambda: registry)
    return builds


def test_a_capacity_beyond_the_free_space_fails_before_the_index_is_built(
    tmp_path: Path, index_builds: list[int], open_tier: Callable[..., DiskTier]
) -> None:
    status = os.statvfs(tmp_path)
    free = status.f_bavail * status.f_frsize
    with pytest.raises(TierError) as raised:
        open_tier(path=tmp_path / "tier", capacity_bytes=free + (1 << 40))
    message = str(raised.value)
    assert "\n" not in message
    assert "no room for " in message and f"in {tmp_path / 'tier' / 'rank0-of1.kvtier'}" in message
    assert "free on its filesystem" in message and message.endswith("lower capacity_bytes")
    assert index_builds == [], "the index was built before the space was checked"
    assert not (tmp_path / "tier").exists()
    open_tier().close()
    assert index_builds == [8]


def test_an_index_larger_than_the_memory_fails_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch, index_builds: list[int], open_tier: Callable[..., DiskTier]
) -> None:
    monkeypatch.setattr(disk_module, "available_memory_bytes", lambda: 1 << 20)
    slots = (1 << 20) // disk_module.INDEX_BYTES_PER_SLOT + 1
    with pytest.raises(
        TierError,
        match=f"makes {slots} slots of {RECORD}-byte records, whose "
        "index needs about 0.0 GiB of memory, more than the 0.0 GiB available; "
        "lower capacity_bytes",
    ):
        open_tier(capacity_bytes=capacity_for(slots), preallocate=False)
    assert index_builds == []
    open_tier(capacity_bytes=capacity_for(slots - 1), preallocate=False).close()
    assert index_builds == [slots - 1]


def test_a_disk_that_fills_up_mid_run_drops_and_counts_stores(
    small_disk: tuple[Path, int], open_tier: Callable[..., DiskTier]
) -> None:
    path, limit = small_disk
    tier = open_tier(path=path, capacity_bytes=4 * limit, preallocate=False)
    count = 4 * limit // SLOT
    keys = tier.keys.keys(block_hashes("fill", count))
    records = payloads(count, RECORD)
    stored = [store(tier, [key], [record])[0] for key, record in zip(keys, records, strict=True)]
    assert any(stored) and not all(stored)
    stats = tier.stats()
    assert stats.errors == {"no_space": stored.count(False)}
    assert stats.drops == stored.count(False)
    got = fetch(tier, keys)
    assert got == [record if ok else None for record, ok in zip(records, stored, strict=True)]


def test_a_disk_that_fills_up_within_a_write_stores_the_records_that_fit(
    small_disk: tuple[Path, int], open_tier: Callable[..., DiskTier]
) -> None:
    path, limit = small_disk
    tier = open_tier(path=path, capacity_bytes=4 * limit, preallocate=False)
    count = tier.num_slots  # one put: every record has a slot
    keys = tier.keys.keys(block_hashes("fill-grouped", count))
    records = payloads(count, RECORD)
    stored = store(tier, keys, records)
    # every record that fits, not only the writes of several records that went through whole
    assert stored.count(True) == (limit - SUPERBLOCK_BYTES) // SLOT
    stats = tier.stats()
    assert stats.errors == {"no_space": stored.count(False)}
    assert fetch(tier, keys) == [
        record if ok else None for record, ok in zip(records, stored, strict=True)
    ]


def test_a_read_only_path_is_a_start_up_error(
    tmp_path: Path, open_tier: Callable[..., DiskTier]
) -> None:
    target = tmp_path / "read-only"
    if not mount_tmpfs(target, 1 << 20, read_only=True):
        if os.geteuid() == 0:
            pytest.skip("cannot mount a read-only tmpfs here, and root writes anywhere else")
        target.chmod(0o500)
    try:
        with pytest.raises(TierError, match="cannot open .*point path at a writable directory"):
            open_tier(path=target)
        with pytest.raises(TierError, match="cannot create the directory"):
            open_tier(path=target / "below")
    finally:
        unmount(target)


# ------------------------------------------------------------------- keyed records


def test_a_record_forged_in_the_file_is_an_auth_miss(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    key_file = write_keys(tmp_path / "tier.key", SECRET)
    tier = open_tier(key_file=key_file)
    keys = tier.keys.keys(block_hashes("forge", 2))
    records = payloads(2, RECORD)
    store(tier, keys, records)
    evil = payloads(1, RECORD, seed=7)[0]
    forged = RecordCodec(tier.keys.layout_fingerprint, RECORD).encode(keys[0], evil)
    overwrite(tier, slot_offset(tier, keys[0]), forged[: HEADER_FIXED_BYTES + len(keys[0])])
    overwrite(tier, slot_offset(tier, keys[0]) + HEADER_AREA_BYTES, evil)
    assert fetch(tier, keys) == [None, records[1]]
    assert tier.stats().errors == {"auth": 1}
    assert done(tier.contains(keys)).present == (False, True), "it left the index"


def test_an_encrypted_file_holds_no_payload_in_the_clear(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    key_file = write_keys(tmp_path / "tier.key", SECRET)
    refused = o_direct_refused(tmp_path)
    tier = open_tier(key_file=key_file, encrypt=True, o_direct=refused is None)
    keys = tier.keys.keys(block_hashes("clear", 3))
    records = payloads(3, RECORD)
    store(tier, keys, records)
    assert fetch(tier, keys) == records
    tier.close()
    contents = tier.file.read_bytes()
    assert all(record[:256] not in contents for record in records)
    assert fetch(open_tier(key_file=key_file, encrypt=True), keys) == records


def test_a_warm_restart_keeps_records_of_every_key_it_holds(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    old = write_keys(tmp_path / "old.key", OLD_SECRET)
    tier = open_tier(key_file=old)
    keys = tier.keys.keys(block_hashes("restart", 3))
    records = payloads(3, RECORD)
    store(tier, keys, records)
    tier.close()
    rotated = open_tier(key_file=write_keys(tmp_path / "rotated.key", SECRET, OLD_SECRET))
    assert rotated.stats().records == 3 and rotated.stats().errors == {}
    assert fetch(rotated, keys) == records
    rotated.close()
    other = open_tier(key_file=write_keys(tmp_path / "new.key", SECRET))
    assert other.stats().records == 0 and other.stats().errors == {"auth": 3}
    assert fetch(other, keys) == [None] * 3
    other.close()
    unkeyed = open_tier()
    assert unkeyed.stats().records == 0 and unkeyed.stats().errors == {"auth": 3}


def test_a_key_that_cannot_be_read_is_a_start_up_error(
    open_tier: Callable[..., DiskTier], tmp_path: Path
) -> None:
    with pytest.raises(TierError, match=r"^disk tier: cannot read key_file .*absent.key"):
        open_tier(key_file=tmp_path / "absent.key")
    with pytest.raises(TierError, match=r"^disk tier: key_file .*: a key is 32 to 64 bytes"):
        open_tier(key_file=write_keys(tmp_path / "short.key", "ab" * 16))


def test_a_watched_tier_names_the_records_it_evicted_found_corrupt_or_deleted(
    open_tier: Callable[..., DiskTier],
) -> None:
    tier = open_tier()
    keys = tier.keys.keys(block_hashes("gone", 11))
    records = payloads(11, RECORD)
    store(tier, keys[:8], records[:8])
    assert tier.take_removed() == [], "removals are kept only once watched"
    tier.watch_removals()
    store(tier, keys[8:10], records[8:10])
    assert tier.take_removed() == keys[:2], "the tier holds 8 records: the two oldest went"
    overwrite(tier, slot_offset(tier, keys[2]) + HEADER_AREA_BYTES + 10, b"\xff\x00")
    assert fetch(tier, keys[2:4]) == [None, records[3]]
    done(tier.delete(keys[4:5] + keys[10:]))
    assert tier.take_removed() == [keys[2], keys[4]], "a key never stored is not removed"
    assert tier.take_removed() == []


@pytest.mark.parametrize("o_direct", [False, True], ids=["page_cache", "o_direct"])
def test_a_codec_shrinks_records_and_a_tier_without_it_never_serves_them(
    open_tier: Callable[..., DiskTier], tmp_path: Path, o_direct: bool
) -> None:
    refused = o_direct_refused(tmp_path) if o_direct else None
    if refused is not None:
        pytest.skip(refused)
    case = CASES["flash_attn_nhd_bf16"]()
    spec = TierSpec(case.spec.record_bytes, make_spec().keys, case.spec.regions)
    int8 = QuantisedCodec(Int8CodecConfig(), case.spec)
    expected = [
        bytes(int8.decode(memoryview(bytes(int8.encode(memoryview(record))))))
        for record in case.records
    ]
    tier = open_tier(spec, codec="int8", o_direct=o_direct)
    keys = tier.keys.keys(block_hashes("codec", len(case.records)))
    store(tier, keys, list(case.records))
    assert [bytes(record) for record in fetch(tier, keys)] == expected
    tier.close()
    again = open_tier(spec, codec="int8", o_direct=o_direct)
    assert [bytes(record) for record in fetch(again, keys)] == expected
    again.close()
    plain = open_tier(spec, o_direct=o_direct)
    assert fetch(plain, keys) == [None] * len(keys)
    assert plain.stats().errors == {"codec": len(keys)}


@pytest.mark.parametrize("o_direct", [False, True], ids=["page_cache", "o_direct"])
def test_a_codec_record_moves_only_the_pages_it_needs(
    open_tier: Callable[..., DiskTier],
    tmp_path: Path,
    o_direct: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Half the bytes with int8, with and without O_DIRECT: the slot stays full size, the
    writes and reads do not."""
    refused = o_direct_refused(tmp_path) if o_direct else None
    if refused is not None:
        pytest.skip(refused)
    layout = flash_attn_case(
        num_blocks=2, block_tokens=64, num_heads=2, head_dim=64, num_layers=2, dtype=torch.bfloat16
    )
    case = case_from_layout(layout)
    spec = TierSpec(case.spec.record_bytes, make_spec().keys, case.spec.regions)
    capacity = SUPERBLOCK_BYTES + 4 * DiskTier.slot_bytes_for(case.spec.record_bytes)
    tier = open_tier(spec, codec="int8", o_direct=o_direct, capacity_bytes=capacity)
    moved: list[int] = []
    for name in ("pwritev", "preadv"):
        real = getattr(os, name)

        def counting(fd: int, buffers: list[Any], offset: int, real: Any = real) -> int:
            done_bytes: int = real(fd, buffers, offset)
            moved.append(done_bytes)
            return done_bytes

        monkeypatch.setattr(os, name, counting)
    keys = tier.keys.keys(block_hashes("pages", 1))
    store(tier, keys, [case.records[0]])
    written = sum(moved)
    moved.clear()
    assert fetch(tier, keys)[0] is not None
    read = sum(moved)
    full = HEADER_AREA_BYTES + case.spec.record_bytes
    for moved_bytes in (written, read):
        assert moved_bytes < 0.6 * full, (written, read, full)
