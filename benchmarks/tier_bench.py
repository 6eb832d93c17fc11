"""Storage-tier bandwidth, 256 KiB to 2 MiB records, against the bare I/O in the same run.

The comparisons, each pair of arms run in turn ``--repeats`` times
(alternating, so both see the same machine), medians reported in GB/s:

- ``disk``: the disk tier's put and get of N records (header, checksum, index,
  I/O threads included) against plain sequential ``os.pwrite``/``os.pread`` of
  the same payload bytes to a preallocated file in the same directory. Both
  go through the page cache, so on a machine with memory to spare this
  measures the software path rather than the drive. A third arm, ``limit``,
  is the most one core can do for a tier: the same bare writes and reads,
  each record sealed right before its write and checked right after its read
  with the tier's own record code, on one thread.
- ``disk_o_direct``: the same with ``o_direct: true``, against plain
  sequential ``O_DIRECT`` writes and reads through page-aligned buffers;
  skipped, with the reason, where the filesystem of ``--dir`` refuses O_DIRECT.
- ``redis``: the redis tier's put and get against a bare redis-py pipeline
  that SETs and GETs the same payloads in batches of the same size, on a
  ``redis-server`` the benchmark starts on 127.0.0.1 (or ``--redis-url``).
  Both arms write new keys in every run and delete them after it, untimed.
- ``mooncake``: the mooncake tier's put and get against the bare store client
  (``batch_put_from`` and ``batch_get_into`` of the same payloads, each read
  into a new buffer like the tier's) in batches of the same size, from as many
  threads as the tier has I/O threads, on a ``mooncake_master`` and a
  memory-holding ``mooncake_client`` the benchmark starts on 127.0.0.1.
- ``s3``: the s3 tier's put and get against bare boto3 ``put_object`` and
  ``get_object`` of the same payloads, one object per record, from as many
  threads as the tier has I/O threads, each taking a batch of the same size;
  on moto's S3 server, which the benchmark starts in a child process (or
  ``--s3-endpoint`` with ``--s3-bucket``, credentials from the AWS chain).
  The tier runs with ``chunk_blocks: 1`` so that both arms write the same
  objects.
- ``sealing``: what a key costs. For ``disk`` and ``redis``, the tier sealing
  records with a MAC (``mac``: a key) and with AES-256-GCM (``aead``:
  ``encrypt: true``), each against the same tier sealing them with checksums
  only (no key), the two arms alternating as above (the disk rows also against
  the ``limit`` arm with that scheme's seal); and ``hashes``, the
  single-thread speed of each MAC considered (GMAC, keyed BLAKE3, HMAC-SHA256,
  keyed BLAKE2b), of AES-256-GCM and of the XXH3 checksum over one record.

- ``codec``: what a record codec buys. On records cut from the KV cache of a
  model run (``kvtier bench codec``'s: kvtier's random-weight Llama through
  ``transformers``), the disk tier (page cache, and with ``o_direct`` where the
  filesystem allows it), the redis tier and the s3
  tier (blocks grouped into objects by its default ``chunk_blocks``, on moto's
  server or ``--s3-endpoint``) with
  each built-in codec against the same tier without one, in record bytes per
  second (the bytes the engine hands over), the two arms alternating as above.
  With ``--link-mbps N`` the redis and s3 tiers of these rows reach their
  servers through a link of N megabits a second each way
  (``benchmarks/link.py``), where a codec's smaller records should pay.
  With ``--disk-mb-per-s N`` (root, cgroup v1) they run with the block device
  under ``--dir`` capped at N MB/s each way (``benchmarks/slow_disk.py``):
  the ``disk_o_direct`` row's reads and writes reach the device and feel the
  cap; the page-cache ``disk`` row's do not.
  A codec that cannot be built here (``lossless`` without blosc2) is listed
  with the reason.

``ratio`` is tier / bare GB/s for each direction, per repeat (the tier's run
against the bare run next to it), as its median, min and max; 1.0 is as fast
as the bare I/O; ``limit_ratio`` is the same against the ``limit`` arm.
``cpu_ratio`` (and ``limit_cpu_ratio``) compares this process's CPU seconds per
byte the same way (bare / tier), which a busy machine disturbs less than
wall-clock time.
Prints one JSON object. Usage::

    python benchmarks/tier_bench.py
    python benchmarks/tier_bench.py --sizes 262144,2097152 --total-mib 512 --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import hmac
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support

import blake3
import boto3
import botocore.config
import numpy as np
import redis
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from link import ShapedLink
from slow_disk import throttled_disk, why_not
from stats import spread

from kvtier.cli.bench_codec import model_kv
from kvtier.codecs.base import CodecSpec
from kvtier.config import SectionConfig
from kvtier.keys import KeyNamespace
from kvtier.kinds import RECORD_CODEC
from kvtier.plugins import default_registry
from kvtier.tiers.base import StorageTier, TierSpec
from kvtier.tiers.disk import DiskTier, DiskTierConfig, aligned_buffer, build_disk_tier
from kvtier.tiers.mooncake_config import MooncakeTierConfig
from kvtier.tiers.record import RecordCodec, tier_codec
from kvtier.tiers.redis import RedisTier, RedisTierConfig
from kvtier.tiers.s3 import S3Tier, S3TierConfig
from tests.support.mooncake_server import MooncakeStore, mooncake_binaries
from tests.support.redis_server import RedisServer, redis_server_binary
from tests.support.s3_server import MotoS3Server, aws_test_environment

TARGET_RATIO = 0.8
SEALING_TARGET_RATIO = 0.9
"""What a tier sealing with a MAC aims at, against the same tier with checksums only."""
SCHEMES = {"mac": {}, "aead": {"encrypt": True}}
"""The keyed arms of ``sealing``: config fields besides the key."""
WAIT_S = 600.0


def timed(action: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of ``action``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - start, time.process_time() - start_cpu


def gbps(total_bytes: int, seconds: float) -> float:
    return round(total_bytes / seconds / 1e9, 3)


def same_bytes(got: object, expected: bytes) -> bool:
    """Whether ``got`` is a buffer holding ``expected`` (not a miss or a fault); compared as
    arrays, since comparing a memoryview with bytes goes item by item (about 1 ns a byte)."""
    return isinstance(got, (bytes, memoryview)) and np.array_equal(
        np.frombuffer(got, np.uint8), np.frombuffer(expected, np.uint8)
    )


class Arm(NamedTuple):
    """One way to move the records: put them all, get them all, then check (untimed)."""

    put: Callable[[], None]
    get: Callable[[], None]
    check: Callable[[], None]


def finished(futures: list[Future[Any]]) -> list[Future[Any]]:
    """``futures`` once all are done, waited for together: the caller wakes once, not once
    per request (on two cores, waking per request slowed the tiers' puts by up to a fifth).
    The tier chain never blocks on a put at all; it leaves a callback."""
    if wait(futures, WAIT_S).not_done:
        raise RuntimeError(f"the tier did not answer within {WAIT_S} s")
    return futures


class TierArm:
    """Put every record under fresh keys, get them back, check them and delete them."""

    def __init__(
        self,
        tier: StorageTier,
        records: list[bytes],
        batch: int,
        expected: list[bytes] | None = None,
    ) -> None:
        self.tier = tier
        self.records = records
        self.expected = records if expected is None else expected
        """What a get must return: the records, or what a lossy codec makes of them."""
        self.batches = [
            range(start, min(start + batch, len(records)))
            for start in range(0, len(records), batch)
        ]
        self.runs = itertools.count(1)
        self.keys: list[bytes] = []
        self.got: list[memoryview | None] = []
        self.next_keys()

    def next_keys(self) -> None:
        """Keys for the next put, made outside the timed runs like the bare arms' names."""
        run = next(self.runs)
        names = [f"run-{run}/block-{i}".encode() for i in range(len(self.records))]
        self.keys = self.tier.keys.keys(names)

    def put(self) -> None:
        keys = self.keys
        futures = [
            self.tier.put([keys[i] for i in b], [self.records[i] for i in b]) for b in self.batches
        ]
        for future in finished(futures):
            if not all(future.result().stored):
                raise RuntimeError(f"{self.tier!r} dropped records; raise queue_depth")

    def get(self) -> None:
        futures: list[Future[Any]] = [
            self.tier.get([self.keys[i] for i in b], deadline_s=WAIT_S) for b in self.batches
        ]
        self.got = [record for future in finished(futures) for record in future.result().records]

    def check(self) -> None:
        """Every record came back intact; then they are deleted."""
        if not all(
            same_bytes(got, record) for got, record in zip(self.got, self.expected, strict=True)
        ):
            raise RuntimeError(f"{self.tier!r} returned a wrong or missing record")
        self.got = []
        self.tier.delete(self.keys).result(WAIT_S)
        self.next_keys()

    def arm(self) -> Arm:
        return Arm(self.put, self.get, self.check)


def measure(
    tier: Arm,
    bare: tuple[str, Arm],
    repeats: int,
    total: int,
    limit: tuple[str, Arm] | None = None,
) -> dict[str, Any]:
    """Run the arms in turn ``repeats`` times; medians, and each run's ratio to its peers.

    Runs alternate in ABBA order (tier, bare, limit, then limit, bare, tier)
    so a drift in the machine's load weighs on every arm alike. The ratio of
    a repeat compares the tier's run with the bare (``put_ratio``) and the
    limit (``put_limit_ratio``) run of the same repeat. Each arm first runs
    once untimed, so that no repeat pays for pages touched for the first time
    (a new file's, a new server's).
    """
    bare_name = bare[0]
    arms = dict([("tier", tier), bare] + ([limit] if limit is not None else []))
    for arm in arms.values():
        arm.put()
        arm.get()
        arm.check()
    seconds: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name in arms}
    cpu: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name in arms}
    for repeat in range(repeats):
        order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
        for name in order:
            for direction, action in (("put", arms[name].put), ("get", arms[name].get)):
                wall, used = timed(action)
                seconds[name][direction].append(wall)
                cpu[name][direction].append(used)
            arms[name].check()
    result: dict[str, Any] = {
        name: {
            f"{direction}_gbps": gbps(total, statistics.median(seconds[name][direction]))
            for direction in ("put", "get")
        }
        | {
            f"{direction}_cpu_s_per_gb": round(
                statistics.median(cpu[name][direction]) / (total / 1e9), 4
            )
            for direction in ("put", "get")
        }
        for name in arms
    }

    def ratios(peer: str) -> dict[str, list[float]]:
        return {
            direction: [
                peer_s / tier_s
                for peer_s, tier_s in zip(
                    seconds[peer][direction], seconds["tier"][direction], strict=True
                )
            ]
            for direction in ("put", "get")
        }

    for direction, values in ratios(bare_name).items():
        result[f"{direction}_ratio"] = spread(values)
        result[f"{direction}_cpu_ratio"] = round(
            statistics.median(cpu[bare_name][direction])
            / statistics.median(cpu["tier"][direction]),
            3,
        )
    if limit is not None:
        for direction, values in ratios(limit[0]).items():
            result[f"{direction}_limit_ratio"] = spread(values)
            result[f"{direction}_limit_cpu_ratio"] = round(
                statistics.median(cpu[limit[0]][direction])
                / statistics.median(cpu["tier"][direction]),
                3,
            )
    return result


def payloads(count: int, record_bytes: int) -> list[bytes]:
    rng = np.random.default_rng(record_bytes)
    return [rng.integers(0, 256, record_bytes, dtype=np.uint8).tobytes() for _ in range(count)]


def io_threads(args: argparse.Namespace) -> dict[str, int]:
    """The tier config's ``io_threads`` when ``--io-threads`` was given; else the tier's default."""
    return {} if args.io_threads is None else {"io_threads": args.io_threads}


def spec(record_bytes: int) -> TierSpec:
    return TierSpec(record_bytes, KeyNamespace("bench", f"layout-{record_bytes}", 0, 1))


def bare_file_arm(path: Path, records: list[bytes], *, o_direct: bool) -> tuple[Arm, int]:
    """Sequential ``os.pwrite``/``os.pread`` of the records to a preallocated file, and its fd.

    With ``o_direct`` the file is opened with ``O_DIRECT``; each record is copied
    into one page-aligned buffer to be written, and read into a new page-aligned
    buffer, as the tier does.
    """
    record_bytes = len(records[0])
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if o_direct else 0)
    fd = os.open(path, flags, 0o600)
    os.posix_fallocate(fd, 0, len(records) * record_bytes)
    read: list[Any] = []

    def put() -> None:
        for i, record in enumerate(records):
            os.pwrite(fd, record, i * record_bytes)

    def put_aligned() -> None:
        staging = aligned_buffer(record_bytes)
        for i, record in enumerate(records):
            staging[:] = record
            os.pwrite(fd, staging, i * record_bytes)

    def get() -> None:
        read[:] = [os.pread(fd, record_bytes, i * record_bytes) for i in range(len(records))]

    def get_aligned() -> None:
        read.clear()
        for i in range(len(records)):
            buffer = aligned_buffer(record_bytes)
            os.preadv(fd, [buffer], i * record_bytes)
            read.append(buffer)

    def check() -> None:
        if not all(same_bytes(got, record) for got, record in zip(read, records, strict=True)):
            raise RuntimeError(f"plain pread of {path} returned other bytes")
        read.clear()

    if o_direct:
        return Arm(put_aligned, get_aligned, check), fd
    return Arm(put, get, check), fd


@contextlib.contextmanager
def limit_file_arm(path: Path, records: list[bytes], codec: RecordCodec) -> Iterator[Arm]:
    """The most a disk tier sealing with ``codec`` can move on one thread: the bare arm's
    sequential ``os.pwrite``/``os.pread`` of each record's body to a preallocated file, with
    the record sealed by ``codec`` right before its write and checked right after its read.

    Headers are kept in memory, not written: the limit is the bare write of the same
    bytes plus the seal's pass over them (XXH3, the MAC, or encryption).
    """
    record_bytes = len(records[0])
    names = [f"limit/block-{i}".encode() for i in range(len(records))]
    keys = spec(record_bytes).keys.keys(names)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    headers: list[bytes] = []
    read: list[Any] = []

    def put() -> None:
        headers.clear()
        for i, key in enumerate(keys):
            header, body = codec.header(key, records[i])
            headers.append(header)
            os.pwrite(fd, body, i * record_bytes)

    def get() -> None:
        read[:] = [
            codec.unseal(key, codec.parse(header), os.pread(fd, record_bytes, i * record_bytes))
            for i, (key, header) in enumerate(zip(keys, headers, strict=True))
        ]

    def check() -> None:
        if not all(same_bytes(got, record) for got, record in zip(read, records, strict=True)):
            raise RuntimeError(f"the limit arm read other bytes back from {path}")
        read.clear()

    try:
        os.posix_fallocate(fd, 0, len(records) * record_bytes)
        yield Arm(put, get, check)
    finally:
        os.close(fd)
        path.unlink()


def bench_disk(
    args: argparse.Namespace, record_bytes: int, directory: Path, *, o_direct: bool
) -> dict[str, Any]:
    count = max(args.total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    config = DiskTierConfig(
        path=directory / "tier",
        capacity_bytes=4096 + count * DiskTier.slot_bytes_for(record_bytes),
        queue_depth=count,
        o_direct=o_direct,
        **io_threads(args),
    )
    tier = build_disk_tier(config, spec(record_bytes))
    bare_file = directory / "bare.bin"
    fd = -1
    try:
        bare, fd = bare_file_arm(bare_file, records, o_direct=o_direct)
        tier_arm = TierArm(tier, records, args.batch).arm()
        total = count * record_bytes
        if o_direct:
            result = measure(tier_arm, ("pwrite_pread", bare), args.repeats, total)
        else:
            codec = RecordCodec(spec(record_bytes).keys.layout_fingerprint, record_bytes)
            with limit_file_arm(directory / "limit.bin", records, codec) as limit:
                result = measure(
                    tier_arm, ("pwrite_pread", bare), args.repeats, total, ("limit", limit)
                )
    finally:
        tier.close()
        if fd >= 0:
            os.close(fd)
        bare_file.unlink(missing_ok=True)
        tier.file.unlink()
    return {"record_bytes": record_bytes, "records": count, **result}


def o_direct_refused(directory: Path) -> str | None:
    """Why ``directory``'s filesystem cannot take the O_DIRECT arms, or ``None``."""
    probe = directory / "o_direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, aligned_buffer(4096), 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"the filesystem of {directory} refuses O_DIRECT: {exc.strerror}"
    finally:
        probe.unlink(missing_ok=True)
    return None


def bench_redis(args: argparse.Namespace, record_bytes: int, url: str) -> dict[str, Any]:
    count = max(args.redis_total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    config = RedisTierConfig(url=url, queue_depth=count, **io_threads(args))  # type: ignore[arg-type]
    tier = RedisTier(config, spec(record_bytes))
    client = redis.Redis.from_url(url)
    runs = itertools.count(1)
    names: list[bytes] = []
    batches = [
        range(start, min(start + args.batch, count)) for start in range(0, count, args.batch)
    ]

    def next_names() -> None:
        run = next(runs)
        names[:] = [f"bare:run-{run}/block-{i}".encode() for i in range(count)]

    def bare_put() -> None:
        for b in batches:
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.set(names[i], records[i])
            pipe.execute()

    read: list[bytes] = []

    def bare_get() -> None:
        read.clear()
        for b in batches:
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.get(names[i])
            read.extend(pipe.execute())

    def bare_check() -> None:
        if read != records:
            raise RuntimeError("the bare pipeline returned other bytes")
        read.clear()
        client.delete(*names)
        next_names()

    next_names()
    tier_arm = TierArm(tier, records, args.batch).arm()
    try:
        result = measure(
            tier_arm,
            ("pipeline", Arm(bare_put, bare_get, bare_check)),
            args.repeats,
            count * record_bytes,
        )
    finally:
        tier.close()
        client.flushdb()
        client.close()
    return {"record_bytes": record_bytes, "records": count, **result}


def write_key(directory: Path) -> Path:
    """A new random key in ``directory``, readable by this user only."""
    path = directory / "bench.key"
    path.touch(0o600)
    path.write_text(os.urandom(32).hex() + "\n")
    return path


def sealing_rows(
    args: argparse.Namespace,
    record_bytes: int,
    total_mib: int,
    build: Callable[[str, dict[str, Any], int], StorageTier],
    limit: Callable[[str, dict[str, Any], list[bytes]], contextlib.AbstractContextManager[Arm]]
    | None = None,
) -> dict[str, Any]:
    """The tier ``build(name, fields, count)`` makes, with each scheme against checksums and,
    given ``limit``, against the arm ``limit(name, fields, records)`` makes."""
    count = max(total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    tiers = {"checksum": build("checksum", {}, count)}
    measured: dict[str, Any] = {}
    try:
        for name, fields in SCHEMES.items():
            tiers[name] = build(name, fields, count)
        arms = {name: TierArm(tier, records, args.batch).arm() for name, tier in tiers.items()}
        for name, fields in SCHEMES.items():
            peers = arms[name], ("checksum", arms["checksum"]), args.repeats, count * record_bytes
            if limit is None:
                measured[name] = measure(*peers)
                continue
            with limit(name, fields, records) as limit_arm:
                measured[name] = measure(*peers, ("limit", limit_arm))
    finally:
        for tier in tiers.values():
            tier.close()
    return {"record_bytes": record_bytes, "records": count, **measured}


def bench_sealing(
    args: argparse.Namespace, sizes: list[int], directory: Path, url: str | None
) -> dict[str, Any]:
    """Every scheme against checksums, on the disk tier and (given ``url``) the redis tier."""
    key_file = write_key(directory)

    def keyed(name: str, fields: dict[str, Any]) -> dict[str, Any]:
        return {} if name == "checksum" else {"key_file": key_file, **fields}

    def disk_row(size: int) -> dict[str, Any]:
        def config(name: str, fields: dict[str, Any], count: int) -> DiskTierConfig:
            return DiskTierConfig(
                path=directory / f"sealing-{name}",
                capacity_bytes=4096 + count * DiskTier.slot_bytes_for(size),
                queue_depth=count,
                **keyed(name, fields),
                **io_threads(args),
            )

        def build(name: str, fields: dict[str, Any], count: int) -> StorageTier:
            return build_disk_tier(config(name, fields, count), spec(size))

        def limit(
            name: str, fields: dict[str, Any], records: list[bytes]
        ) -> contextlib.AbstractContextManager[Arm]:
            fingerprint = spec(size).keys.layout_fingerprint
            codec = tier_codec(
                config(name, fields, len(records)), fingerprint, size, tier="disk", shared=False
            )
            return limit_file_arm(directory / f"limit-{name}.bin", records, codec)

        return sealing_rows(args, size, args.total_mib, build, limit)

    def redis_row(url: str, size: int) -> dict[str, Any]:
        def build(name: str, fields: dict[str, Any], count: int) -> StorageTier:
            config = RedisTierConfig(
                url=url,  # type: ignore[arg-type]
                namespace=f"sealing-{name}",
                queue_depth=count,
                **keyed(name, fields),
                **io_threads(args),
            )
            return RedisTier(config, spec(size))

        return sealing_rows(args, size, args.redis_total_mib, build)

    report: dict[str, Any] = {
        "target_ratio": SEALING_TARGET_RATIO,
        "hashes": [hash_speeds(size, args.total_mib) for size in sizes],
        "disk": [disk_row(size) for size in sizes],
    }
    if url is not None:
        report["redis"] = [redis_row(url, size) for size in sizes]
    return report


CODECS = ("lossless", "fp8", "int8")
"""The codecs of the ``codec`` rows, each against the same tier without one."""


def codec_records(record_bytes: int, count: int) -> tuple[CodecSpec, list[bytes]]:
    """``count`` records of about ``record_bytes`` cut from a model run's KV (repeated)."""
    probe = model_kv(argparse.Namespace(model=None, tokens=64, block_tokens=1, seed=0))
    per_token = probe.spec.record_bytes
    block_tokens = max(record_bytes // per_token, 1)
    blocks = max(min(count, 2048 // block_tokens), 1)
    kv = model_kv(
        argparse.Namespace(
            model=None, tokens=blocks * block_tokens, block_tokens=block_tokens, seed=0
        )
    )
    return kv.spec, [kv.records[i % len(kv.records)] for i in range(count)]


class CodecStores(NamedTuple):
    """Where the ``codec`` rows put their records: a directory, and the servers running."""

    directory: Path
    redis_url: str | None
    s3: S3TierConfig | None


@contextlib.contextmanager
def shaped(stores: CodecStores, megabits_per_s: float) -> Iterator[CodecStores]:
    """``stores`` with their servers reached through links of ``megabits_per_s`` each way."""

    def through(address: str, stack: contextlib.ExitStack) -> str:
        parts = urllib.parse.urlsplit(address)
        assert parts.hostname is not None and parts.port is not None
        link = stack.enter_context(ShapedLink((parts.hostname, parts.port), megabits_per_s))
        return parts._replace(netloc=f"127.0.0.1:{link.port}").geturl()

    with contextlib.ExitStack() as stack:
        yield stores._replace(
            redis_url=None if stores.redis_url is None else through(stores.redis_url, stack),
            s3=None
            if stores.s3 is None or stores.s3.endpoint_url is None
            else stores.s3.model_copy(
                update={"endpoint_url": through(stores.s3.endpoint_url, stack)}
            ),
        )


def codec_disk_tier(
    args: argparse.Namespace,
    stores: CodecStores,
    count: int,
    tier_spec: TierSpec,
    name: str | None,
    *,
    o_direct: bool = False,
) -> StorageTier:
    """A disk tier for ``count`` records, with the codec ``name`` (``None``: none)."""
    config = DiskTierConfig(
        path=stores.directory / f"codec-{name}",
        capacity_bytes=4096 + count * DiskTier.slot_bytes_for(tier_spec.record_bytes),
        queue_depth=count,
        codec=name,  # type: ignore[arg-type]
        o_direct=o_direct,
        **io_threads(args),
    )
    return build_disk_tier(config, tier_spec)


def codec_redis_tier(
    args: argparse.Namespace,
    stores: CodecStores,
    count: int,
    tier_spec: TierSpec,
    name: str | None,
) -> StorageTier:
    """A redis tier with the codec ``name`` (``None``: none)."""
    config = RedisTierConfig(
        url=stores.redis_url,  # type: ignore[arg-type]
        namespace=f"codec-{name}",
        queue_depth=count,
        codec=name,  # type: ignore[arg-type]
        **io_threads(args),
    )
    return RedisTier(config, tier_spec)


def codec_s3_tier(
    args: argparse.Namespace,
    stores: CodecStores,
    count: int,
    tier_spec: TierSpec,
    name: str | None,
) -> StorageTier:
    """An s3 tier with the codec ``name`` (``None``: none), as users run it: blocks grouped
    into objects by the default ``chunk_blocks``, not one object per record as in the ``s3``
    rows."""
    assert stores.s3 is not None
    fields = stores.s3.model_dump(exclude_unset=True)
    del fields["chunk_blocks"]
    fields.update(queue_depth=count, prefix=f"{stores.s3.prefix}codec-{name}/", codec=name)
    return S3Tier(S3TierConfig(**fields), tier_spec)


def bench_codecs(args: argparse.Namespace, sizes: list[int], stores: CodecStores) -> dict[str, Any]:
    """Each codec against no codec, on the disk tier and on the redis and s3 tiers whose
    servers run."""
    # The model run makes torch write a compile cache; keep it with the run's other files.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(stores.directory / "torchinductor"))
    registry = default_registry()
    builders: dict[str, Callable[..., StorageTier]] = {"disk": codec_disk_tier}
    if o_direct_refused(stores.directory) is None:
        builders["disk_o_direct"] = functools.partial(codec_disk_tier, o_direct=True)
    if stores.redis_url is not None:
        builders["redis"] = codec_redis_tier
    if stores.s3 is not None:
        builders["s3"] = codec_s3_tier
    report: dict[str, Any] = {name: [] for name in builders}
    for size in sizes:
        count = max(args.codec_total_mib * 2**20 // size, 1)
        codec_spec, records = codec_records(size, count)
        record_bytes = codec_spec.record_bytes
        tier_spec = TierSpec(record_bytes, spec(record_bytes).keys, codec_spec.regions)
        expected: dict[str, list[bytes] | str] = {}
        for name in CODECS:
            try:
                codec = registry.build(RECORD_CODEC, SectionConfig(type=name), codec_spec)
            except ImportError as exc:
                expected[name] = f"skipped: {exc}"
                continue
            expected[name] = [
                bytes(codec.decode(memoryview(form))) if len(form) < len(record) else record
                for record in records
                for form in [bytes(codec.encode(memoryview(record)))]
            ]
        for tier_name, make in builders.items():
            build = functools.partial(make, args, stores, count, tier_spec)
            row: dict[str, Any] = {"record_bytes": record_bytes, "records": count}
            plain = build(None)
            try:
                plain_arm = TierArm(plain, records, args.batch).arm()
                for name, wanted in expected.items():
                    if isinstance(wanted, str):
                        row[name] = wanted
                        continue
                    coded = build(name)
                    try:
                        arm = TierArm(coded, records, args.batch, wanted).arm()
                        total = count * record_bytes
                        row[name] = measure(arm, ("none", plain_arm), args.repeats, total)
                    finally:
                        coded.close()
            finally:
                plain.close()
            report[tier_name].append(row)
    return report


def hash_speeds(record_bytes: int, total_mib: int, runs: int = 5) -> dict[str, Any]:
    """GB/s of each way to seal records on this thread, ``total_mib`` at a time (best of
    ``runs``)."""
    record = payloads(1, record_bytes)[0]
    key = os.urandom(32)
    aead = AESGCM(key)
    nonce = os.urandom(12)
    header = os.urandom(128)

    ways: dict[str, Callable[[], object]] = {
        "xxh3": lambda: xxhash.xxh3_64_intdigest(record),
        # as the records' MAC makes it: a header encrypted, the payload associated
        "gmac": lambda: aead.encrypt(nonce, header, record)[-16:],
        "blake3": lambda: blake3.blake3(record, key=key).digest(16),
        "hmac_sha256": lambda: hmac.digest(key, record, "sha256"),
        "blake2b": lambda: hashlib.blake2b(record, key=key, digest_size=16).digest(),
        "aes_256_gcm": lambda: aead.encrypt(nonce, record, None),
    }
    repeat = max(1, total_mib * 2**20 // record_bytes)
    speeds: dict[str, Any] = {"record_bytes": record_bytes}
    for name, way in ways.items():
        best = min(timed(lambda way=way: [way() for _ in range(repeat)])[0] for _ in range(runs))
        speeds[name] = gbps(repeat * record_bytes, best)
    return speeds


def bench_mooncake(
    args: argparse.Namespace, record_bytes: int, store: MooncakeStore
) -> dict[str, Any]:
    from kvtier.tiers.mooncake import MooncakeTier

    count = max(args.mooncake_total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    config = MooncakeTierConfig.model_validate(
        {**store.tier_settings(), "queue_depth": count, **io_threads(args)}
    )
    tier = MooncakeTier(config, spec(record_bytes))
    client = store.client()
    pool = ThreadPoolExecutor(config.io_threads)
    addresses = [np.frombuffer(record, dtype=np.uint8).ctypes.data for record in records]
    runs = itertools.count(1)
    names: list[str] = []
    batches = [
        range(start, min(start + args.batch, count)) for start in range(0, count, args.batch)
    ]

    def next_names() -> None:
        run = next(runs)
        names[:] = [f"bare:run-{run}/block-{i}" for i in range(count)]

    def put_batch(b: range) -> None:
        codes = client.batch_put_from(
            [names[i] for i in b], [addresses[i] for i in b], [record_bytes] * len(b)
        )
        if any(code != 0 for code in codes):
            raise RuntimeError(f"the bare client's put failed: {codes}")

    def bare_put() -> None:
        list(pool.map(put_batch, batches))

    def get_batch(b: range) -> list[bytearray]:
        buffers = [bytearray(record_bytes) for _ in b]
        codes = client.batch_get_into(
            [names[i] for i in b],
            [np.frombuffer(buffer, dtype=np.uint8).ctypes.data for buffer in buffers],
            [record_bytes] * len(b),
        )
        if any(code != record_bytes for code in codes):
            raise RuntimeError(f"the bare client's get failed: {codes}")
        return buffers

    read: list[bytearray] = []

    def bare_get() -> None:
        read[:] = [buffer for buffers in pool.map(get_batch, batches) for buffer in buffers]

    def bare_check() -> None:
        if read != records:
            raise RuntimeError("the bare client returned other bytes")
        read.clear()
        client.batch_remove(names, force=True)
        next_names()

    next_names()
    tier_arm = TierArm(tier, records, args.batch).arm()
    try:
        result = measure(
            tier_arm,
            ("client", Arm(bare_put, bare_get, bare_check)),
            args.repeats,
            count * record_bytes,
        )
    finally:
        tier.close()
        pool.shutdown()
        client.close()
    return {"record_bytes": record_bytes, "records": count, **result}


def bench_s3(args: argparse.Namespace, record_bytes: int, config: S3TierConfig) -> dict[str, Any]:
    count = max(args.s3_total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    tier = S3Tier(config.model_copy(update={"queue_depth": count}), spec(record_bytes))
    client = boto3.session.Session(profile_name=config.profile).client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region or ("us-east-1" if config.endpoint_url else None),
        config=botocore.config.Config(
            max_pool_connections=config.io_threads,
            s3={"addressing_style": config.addressing_style},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    threads = ThreadPoolExecutor(config.io_threads)
    runs = itertools.count(1)
    names: list[str] = []
    batches = [
        range(start, min(start + args.batch, count)) for start in range(0, count, args.batch)
    ]

    def next_names() -> None:
        run = next(runs)
        names[:] = [f"{config.prefix}bare/run-{run}/block-{i}" for i in range(count)]

    def put_batch(batch: range) -> None:
        for i in batch:
            client.put_object(Bucket=config.bucket, Key=names[i], Body=records[i])

    def get_batch(batch: range) -> list[bytes]:
        return [client.get_object(Bucket=config.bucket, Key=names[i])["Body"].read() for i in batch]

    read: list[bytes] = []

    def bare_put() -> None:
        list(threads.map(put_batch, batches))

    def bare_get() -> None:
        read[:] = [record for got in threads.map(get_batch, batches) for record in got]

    def bare_check() -> None:
        if read != records:
            raise RuntimeError("the bare boto3 client returned other bytes")
        read.clear()
        for start in range(0, count, 1000):
            objects = [{"Key": name} for name in names[start : start + 1000]]
            client.delete_objects(Bucket=config.bucket, Delete={"Objects": objects})
        next_names()

    next_names()
    tier_arm = TierArm(tier, records, args.batch).arm()
    try:
        result = measure(
            tier_arm,
            ("boto3", Arm(bare_put, bare_get, bare_check)),
            args.repeats,
            count * record_bytes,
        )
    finally:
        tier.close()
        threads.shutdown()
        client.close()
    return {"record_bytes": record_bytes, "records": count, **result}


def s3_config(args: argparse.Namespace, server: MotoS3Server | None) -> S3TierConfig:
    """The tier's config: on the server started here, or on ``--s3-endpoint``."""
    fields: dict[str, Any] = {"chunk_blocks": 1, "prefix": "kvtier-bench/", **io_threads(args)}
    if server is not None:
        return S3TierConfig(
            bucket=server.create_bucket("kvtier-bench"),
            endpoint_url=server.url,
            addressing_style="path",
            # moto is slow to answer on a busy machine.
            timeout_s=60.0,
            **fields,
        )
    return S3TierConfig(
        bucket=args.s3_bucket,
        endpoint_url=args.s3_endpoint,
        addressing_style=args.s3_addressing_style,
        **fields,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="262144,1048576,2097152",
        help="record sizes in bytes, comma separated (default: 256 KiB, 1 MiB, 2 MiB)",
    )
    parser.add_argument("--total-mib", type=int, default=256, help="MiB per disk measurement")
    parser.add_argument(
        "--redis-total-mib", type=int, default=256, help="MiB per redis measurement"
    )
    parser.add_argument(
        "--mooncake-total-mib", type=int, default=256, help="MiB per mooncake measurement"
    )
    parser.add_argument("--s3-total-mib", type=int, default=64, help="MiB per s3 measurement")
    parser.add_argument("--codec-total-mib", type=int, default=64, help="MiB per codec measurement")
    parser.add_argument(
        "--link-mbps",
        type=float,
        default=None,
        help="the codec rows reach Redis and S3 through a link of this many Mbit/s each way",
    )
    parser.add_argument(
        "--disk-mb-per-s",
        type=int,
        default=None,
        help="the codec rows run with the drive under --dir capped at this many MB/s each way "
        "(root, cgroup v1 blkio)",
    )
    parser.add_argument("--batch", type=int, default=8, help="records per request or pipeline")
    parser.add_argument(
        "--io-threads", type=int, default=None, help="the tiers' I/O threads (default: each tier's)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each arm; medians shown")
    parser.add_argument("--dir", type=Path, default=None, help="directory for the disk files")
    parser.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    parser.add_argument(
        "--s3-endpoint", default=None, help="use this S3 server instead of starting moto's"
    )
    parser.add_argument("--s3-bucket", default=None, help="bucket on --s3-endpoint")
    parser.add_argument(
        "--s3-addressing-style",
        choices=("path", "virtual"),
        default="path",
        help="for --s3-endpoint",
    )
    parser.add_argument(
        "--skip",
        choices=("disk", "o_direct", "redis", "sealing", "mooncake", "s3", "codec"),
        action="append",
        default=[],
    )
    args = parser.parse_args()
    if args.s3_endpoint is not None and args.s3_bucket is None:
        parser.error("--s3-endpoint needs --s3-bucket")
    if args.disk_mb_per_s is not None:
        refused = why_not(args.dir or Path(tempfile.gettempdir()))
        if refused is not None:
            parser.error(f"--disk-mb-per-s: {refused}")
    sizes = [int(size) for size in args.sizes.split(",")]

    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {
            key: value
            for key, value in vars(args).items()
            if key not in ("skip", "redis_url", "s3_endpoint", "s3_bucket", "s3_addressing_style")
        }
        | {"dir": str(args.dir) if args.dir else None},
        "statistic": (
            "GB/s and CPU s/GB: medians of the repeats; ratio: tier GB/s / bare GB/s of each "
            "repeat (ABBA order), median, min and max; cpu_ratio: bare CPU s / tier CPU s"
        ),
        "load_average": {"start": os.getloadavg()},
        "target_ratio": TARGET_RATIO,
    }
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if url is None and not {"redis", "sealing", "codec"} <= set(args.skip):
            if redis_server_binary() is None:
                print("redis-server is not installed; skipping the redis tier", file=sys.stderr)
            else:
                name = stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-")
                )
                server = RedisServer(Path(name)).start()
                stack.callback(server.stop)
                url = server.url
        directory = Path(
            stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-bench-"))
        )
        if "disk" not in args.skip:
            report["disk"] = [bench_disk(args, size, directory, o_direct=False) for size in sizes]
        if "o_direct" not in args.skip:
            refused = o_direct_refused(directory)
            report["disk_o_direct"] = (
                {"skipped": refused}
                if refused is not None
                else [bench_disk(args, size, directory, o_direct=True) for size in sizes]
            )
        if "redis" not in args.skip and url is not None:
            report["redis"] = [bench_redis(args, size, url) for size in sizes]
        if "sealing" not in args.skip:
            report["sealing"] = bench_sealing(args, sizes, directory, url)
        s3 = None
        if not {"s3", "codec"} <= set(args.skip):
            s3_server = None
            if args.s3_endpoint is None:
                os.environ.update(aws_test_environment())
                s3_server = MotoS3Server().start()
                stack.callback(s3_server.stop)
            s3 = s3_config(args, s3_server)
        if "codec" not in args.skip:
            stores = CodecStores(directory, url, s3)
            if args.link_mbps is not None:
                stores = stack.enter_context(shaped(stores, args.link_mbps))
            with contextlib.ExitStack() as throttle:
                if args.disk_mb_per_s is not None:
                    throttle.enter_context(throttled_disk(directory, args.disk_mb_per_s * 10**6))
                report["codec"] = bench_codecs(args, sizes, stores)
        if "mooncake" not in args.skip:
            if mooncake_binaries() is None:
                print(
                    "mooncake_master is not installed; skipping the mooncake tier", file=sys.stderr
                )
            else:
                with tempfile.TemporaryDirectory(prefix="kvtier-bench-mooncake-") as name:
                    # Room for both arms' records with the eviction watermark far away.
                    segment = max(4 * args.mooncake_total_mib << 20, 64 << 20)
                    store = MooncakeStore(Path(name), segment_bytes=segment).start()
                    try:
                        report["mooncake"] = [bench_mooncake(args, size, store) for size in sizes]
                    finally:
                        store.stop()
        if "s3" not in args.skip:
            assert s3 is not None
            report["s3"] = [bench_s3(args, size, s3) for size in sizes]
    report["load_average"]["end"] = os.getloadavg()
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
