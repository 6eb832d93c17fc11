"""Warm-restart time of the disk tier with many records on disk (100,000 by default).

Fills one disk tier's file with ``--records`` records of ``--record-bytes`` (4 KiB by default:
8 KiB slots, so 100,000 records make a file of about 800 MB), closes it, then opens the tier
again ``--repeats`` times and times each start (the tier's constructor: the file opened and
sized, every header area read, the records indexed) in two states of the page cache:

- ``warm``: the file's pages as the previous start left them (a restart right after a stop);
- ``cold``: the file's pages dropped from the page cache first (``posix_fadvise``
  ``DONTNEED``), so every header area is read from the drive (a restart after a reboot).

Each start must find every record. Prints one JSON object, medians and maxima in seconds, and
the time per record. Usage::

    python benchmarks/disk_restart.py
    python benchmarks/disk_restart.py --records 100000 --dir /var/cache/kvtier-bench
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
from pathlib import Path
from typing import Any

from kvtier.keys import KeyNamespace
from kvtier.tiers.base import TierSpec
from kvtier.tiers.disk import SUPERBLOCK_BYTES, DiskTier, DiskTierConfig, build_disk_tier

BATCH = 512
"""Records per put while filling the file."""


def drop_from_page_cache(file: Path) -> None:
    """Ask the kernel to drop ``file``'s clean pages from the page cache."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def restart_times(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    spec = TierSpec(args.record_bytes, KeyNamespace("bench", "restart", 0, 1))
    slot_bytes = DiskTier.slot_bytes_for(args.record_bytes)
    config = DiskTierConfig(
        path=directory, capacity_bytes=SUPERBLOCK_BYTES + args.records * slot_bytes
    )
    tier = build_disk_tier(config, spec)
    payload = memoryview(os.urandom(args.record_bytes))
    filled = time.perf_counter()
    for first in range(0, args.records, BATCH):
        count = min(BATCH, args.records - first)
        keys = tier.keys.keys([i.to_bytes(32, "little") for i in range(first, first + count)])
        result = tier.put(keys, [payload] * count).result()
        assert all(result.stored), "the fill dropped records: lower the record count"
    filled = time.perf_counter() - filled
    tier.close()
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    for _ in range(args.repeats):
        for state, seconds in times.items():
            if state == "cold":
                drop_from_page_cache(tier.file)
            started = time.perf_counter()
            again = build_disk_tier(config, spec)
            seconds.append(time.perf_counter() - started)
            found = again.stats().records
            again.close()
            if found != args.records:
                raise RuntimeError(f"a restart found {found} of {args.records} records")
    return {
        "records": args.records,
        "record_bytes": args.record_bytes,
        "file_bytes": tier.file.stat().st_size,
        "fill_s": round(filled, 2),
        "restart_s": {
            state: {
                "median": round(statistics.median(seconds), 3),
                "max": round(max(seconds), 3),
                "per_record_us": round(statistics.median(seconds) / args.records * 1e6, 2),
            }
            for state, seconds in times.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000, help="records on disk")
    parser.add_argument("--record-bytes", type=int, default=4096, help="bytes per record")
    parser.add_argument("--repeats", type=int, default=5, help="starts timed in each state")
    parser.add_argument(
        "--dir", help="directory for the tier's file (default: a new temporary one)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-restart-") as directory:
        result = restart_times(args, Path(directory))
    result |= {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
