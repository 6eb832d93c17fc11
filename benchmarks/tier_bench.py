"""Storage-tier bandwidth, 256 KiB to 2 MiB records, against the bare I/O in the same run.

Two comparisons, each arm run in turn ``--repeats`` times (alternating, so
both see the same machine), medians reported in GB/s:

- ``disk``: the disk tier's put and get of N records (header, checksum, index,
  I/O threads included) against plain sequential ``os.pwrite``/``os.pread`` of
  the same payload bytes to a preallocated file in the same directory. Both
  go through the page cache, so on a machine with memory to spare this
  measures the software path rather than the drive.
- ``redis``: the redis tier's put and get against a bare redis-py pipeline
  that SETs and GETs the same payloads in batches of the same size, on a
  ``redis-server`` the benchmark starts on 127.0.0.1 (or ``--redis-url``).
  Both arms write new keys in every run and delete them after it, untimed.

``ratio`` is tier / bare GB/s for each direction; 1.0 is as fast as the bare
I/O. ``cpu_ratio`` compares this process's CPU seconds per byte the same way
(bare / tier), which a busy machine disturbs less than wall-clock time.
Prints one JSON object. Usage::

    python benchmarks/tier_bench.py
    python benchmarks/tier_bench.py --sizes 262144,2097152 --total-mib 512 --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import redis

from kvtier.keys import KeyNamespace
from kvtier.testing.redis_server import RedisServer, redis_server_binary
from kvtier.tiers.base import StorageTier, TierSpec
from kvtier.tiers.disk import DiskTier, DiskTierConfig, build_disk_tier
from kvtier.tiers.redis import RedisTier, RedisTierConfig

TARGET_RATIO = 0.8
WAIT_S = 600.0


def timed(action: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of ``action``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - start, time.process_time() - start_cpu


def gbps(total_bytes: int, seconds: float) -> float:
    return round(total_bytes / seconds / 1e9, 3)


class TierArms:
    """Put every record under fresh keys (evicting the previous run's), and get them back."""

    def __init__(self, tier: StorageTier, records: list[bytes], batch: int) -> None:
        self.tier = tier
        self.records = records
        self.batches = [
            range(start, min(start + batch, len(records)))
            for start in range(0, len(records), batch)
        ]
        self.run = 0
        self.keys: list[bytes] = []
        self.got: list[memoryview | None] = []

    def put(self) -> None:
        self.run += 1
        keys = self.tier.keys.keys(
            [f"run-{self.run}/block-{i}".encode() for i in range(len(self.records))]
        )
        self.keys = keys
        futures = [
            self.tier.put([keys[i] for i in b], [self.records[i] for i in b]) for b in self.batches
        ]
        for future in futures:
            if not all(future.result(WAIT_S).stored):
                raise RuntimeError(f"{self.tier!r} dropped records; raise queue_depth")

    def get(self) -> None:
        futures: list[Future[Any]] = [
            self.tier.get([self.keys[i] for i in b], deadline_s=WAIT_S) for b in self.batches
        ]
        self.got = [record for future in futures for record in future.result(WAIT_S).records]

    def check(self) -> None:
        """Outside the timed runs: every record came back intact; then they are deleted."""
        if any(
            got is None or bytes(got) != record
            for got, record in zip(self.got, self.records, strict=True)
        ):
            raise RuntimeError(f"{self.tier!r} returned a wrong or missing record")
        self.got = []
        self.tier.delete(self.keys).result(WAIT_S)


def measure(
    arms: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], None]]],
    repeats: int,
    total: int,
) -> dict[str, Any]:
    """Alternate the arms ``repeats`` times; medians of each direction and their ratios.

    Each arm is (put, get, check); the check runs after each get, outside the timing.
    """
    seconds: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name in arms}
    cpu: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name in arms}
    for _ in range(repeats):
        for name, (put, get, check) in arms.items():
            for direction, action in (("put", put), ("get", get)):
                wall, used = timed(action)
                seconds[name][direction].append(wall)
                cpu[name][direction].append(used)
            check()
    result: dict[str, Any] = {
        name: {
            f"{direction}_gbps": gbps(total, statistics.median(times))
            for direction, times in directions.items()
        }
        | {
            f"{direction}_cpu_s_per_gb": round(statistics.median(times) / (total / 1e9), 4)
            for direction, times in cpu[name].items()
        }
        for name, directions in seconds.items()
    }
    tier, bare = list(arms)
    for direction in ("put", "get"):
        result[f"{direction}_ratio"] = round(
            statistics.median(seconds[bare][direction])
            / statistics.median(seconds[tier][direction]),
            3,
        )
        result[f"{direction}_cpu_ratio"] = round(
            statistics.median(cpu[bare][direction]) / statistics.median(cpu[tier][direction]), 3
        )
    return result


def payloads(count: int, record_bytes: int) -> list[bytes]:
    rng = np.random.default_rng(record_bytes)
    return [rng.integers(0, 256, record_bytes, dtype=np.uint8).tobytes() for _ in range(count)]


def spec(record_bytes: int) -> TierSpec:
    return TierSpec(record_bytes, KeyNamespace("bench", f"layout-{record_bytes}", 0, 1))


def bench_disk(args: argparse.Namespace, record_bytes: int, directory: Path) -> dict[str, Any]:
    count = max(args.total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    config = DiskTierConfig(
        path=directory / "tier",
        capacity_bytes=4096 + count * DiskTier.slot_bytes_for(record_bytes),
        io_threads=args.io_threads,
        queue_depth=count,
    )
    tier = build_disk_tier(config, spec(record_bytes))
    bare_file = directory / "bare.bin"
    fd = os.open(bare_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, count * record_bytes)

        def bare_put() -> None:
            for i, record in enumerate(records):
                os.pwrite(fd, record, i * record_bytes)

        read: list[bytes] = []

        def bare_get() -> None:
            read[:] = [os.pread(fd, record_bytes, i * record_bytes) for i in range(count)]

        def bare_check() -> None:
            if read != records:
                raise RuntimeError("plain pread returned other bytes")

        tier_arms = TierArms(tier, records, args.batch)
        arms = {
            "tier": (tier_arms.put, tier_arms.get, tier_arms.check),
            "pwrite_pread": (bare_put, bare_get, bare_check),
        }
        result = measure(arms, args.repeats, count * record_bytes)
    finally:
        tier.close()
        os.close(fd)
        bare_file.unlink()
        tier.file.unlink()
    return {"record_bytes": record_bytes, "records": count, **result}


def bench_redis(args: argparse.Namespace, record_bytes: int, url: str) -> dict[str, Any]:
    count = max(args.redis_total_mib * 2**20 // record_bytes, 1)
    records = payloads(count, record_bytes)
    config = RedisTierConfig(url=url, io_threads=args.io_threads, queue_depth=count)  # type: ignore[arg-type]
    tier = RedisTier(config, spec(record_bytes))
    client = redis.Redis.from_url(url)
    runs = iter(range(1, 1 << 30))
    names: list[bytes] = []
    batches = [
        range(start, min(start + args.batch, count)) for start in range(0, count, args.batch)
    ]

    def bare_put() -> None:
        run = next(runs)
        names[:] = [f"bare:run-{run}/block-{i}".encode() for i in range(count)]
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

    tier_arms = TierArms(tier, records, args.batch)
    arms = {
        "tier": (tier_arms.put, tier_arms.get, tier_arms.check),
        "pipeline": (bare_put, bare_get, bare_check),
    }
    try:
        result = measure(arms, args.repeats, count * record_bytes)
    finally:
        tier.close()
        client.flushdb()
        client.close()
    return {"record_bytes": record_bytes, "records": count, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="262144,1048576,2097152",
        help="record sizes in bytes, comma separated (default: 256 KiB, 1 MiB, 2 MiB)",
    )
    parser.add_argument("--total-mib", type=int, default=256, help="MiB per disk measurement")
    parser.add_argument("--redis-total-mib", type=int, default=64, help="MiB per redis measurement")
    parser.add_argument("--batch", type=int, default=8, help="records per request or pipeline")
    parser.add_argument("--io-threads", type=int, default=4, help="the tiers' I/O threads")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each arm; medians shown")
    parser.add_argument("--dir", type=Path, default=None, help="directory for the disk files")
    parser.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    parser.add_argument("--skip", choices=("disk", "redis"), action="append", default=[])
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]

    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {
            key: value for key, value in vars(args).items() if key not in ("skip", "redis_url")
        }
        | {"dir": str(args.dir) if args.dir else None},
        "statistic": (
            "median of repeats, arms alternated; ratio = tier GB/s / bare GB/s; "
            "cpu_ratio = bare CPU s / tier CPU s"
        ),
        "load_average": os.getloadavg(),
        "target_ratio": TARGET_RATIO,
    }
    if "disk" not in args.skip:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-bench-") as directory:
            report["disk"] = [bench_disk(args, size, Path(directory)) for size in sizes]
    if "redis" not in args.skip:
        server = None
        url = args.redis_url
        if url is None:
            if redis_server_binary() is None:
                print("redis-server is not installed; skipping the redis tier", file=sys.stderr)
            else:
                directory = Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-"))
                server = RedisServer(directory).start()
                url = server.url
        try:
            if url is not None:
                report["redis"] = [bench_redis(args, size, url) for size in sizes]
        finally:
            if server is not None:
                server.stop()
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
