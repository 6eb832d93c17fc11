"""A drive of a given bandwidth under a directory, for the benchmarks: cgroup v1 block throttling.

A disk tier on a fast NVMe drive, or in the page cache, reads and writes
faster than a record codec encodes on one core, so nothing shows what a codec
buys on a drive that is the limit (a cloud volume, a shared SATA disk).
:func:`throttled_disk` moves this process, every thread of it, into a cgroup
of its own whose ``blkio`` controller caps reads and writes on the block
device holding a directory at ``bytes_per_s`` each, and moves it back after
(to the cgroup it came from).
The cap applies to I/O that reaches the device: ``O_DIRECT`` reads and
writes, and reads the page cache misses. Buffered writes are flushed by the
kernel's own threads, outside the cgroup, and are not capped. It needs root
and cgroup v1's ``blkio`` hierarchy; :func:`why_not` says what is missing.
Use::

    with throttled_disk(Path("/srv/kv"), 200 * 10**6):
        ...  # O_DIRECT I/O under /srv/kv moves at most 200 MB/s each way
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")
THROTTLES = ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device")


def block_device(path: Path) -> str:
    """``major:minor`` of the whole block device holding ``path`` (a partition's disk)."""
    number = os.stat(path).st_dev
    device = f"{os.major(number)}:{os.minor(number)}"
    sysfs = Path("/sys/dev/block") / device
    if (sysfs / "partition").exists():
        return (sysfs.resolve().parent / "dev").read_text().strip()
    return device


def current_group() -> Path:
    """The blkio cgroup this process is in, as a directory of the hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return BLKIO / path.lstrip("/")
    raise RuntimeError("this process is in no blkio cgroup")


def why_not(path: Path) -> str | None:
    """Why :func:`throttled_disk` cannot cap ``path``'s device here, or ``None`` if it can."""
    if os.geteuid() != 0:
        return "block throttling needs root"
    if not (BLKIO / THROTTLES[0]).exists():
        return f"no cgroup v1 blkio throttling at {BLKIO}"
    if not (Path("/sys/dev/block") / block_device(path)).exists():
        return f"{path} is not on a block device (tmpfs, overlay or network filesystem)"
    return None


@contextlib.contextmanager
def throttled_disk(path: Path, bytes_per_s: int) -> Iterator[Path]:
    """This process's I/O on ``path``'s block device capped at ``bytes_per_s`` each way;
    yields the cgroup's directory (its ``blkio.throttle.io_service_bytes`` counts the I/O).

    Raises:
        RuntimeError: The cap cannot be set here (see :func:`why_not`).
    """
    reason = why_not(path)
    if reason is not None:
        raise RuntimeError(f"cannot throttle the disk under {path}: {reason}")
    home = current_group()
    group = home / f"kvtier-bench-{os.getpid()}"
    group.mkdir()
    try:
        device = block_device(path)
        for throttle in THROTTLES:
            (group / throttle).write_text(f"{device} {bytes_per_s}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield group
        finally:
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        group.rmdir()
