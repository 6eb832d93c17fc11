"""The benchmarks' throttled drive: the process's I/O goes through a capped cgroup, then back."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, load_script

slow_disk = load_script(REPO_ROOT / "benchmarks" / "slow_disk.py")


def test_direct_writes_are_counted_in_the_capped_group_and_the_process_comes_back(
    tmp_path: Path,
) -> None:
    reason = slow_disk.why_not(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    home = slow_disk.current_group()
    data = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
    data.write(os.urandom(1 << 20))
    with slow_disk.throttled_disk(tmp_path, 200 * 10**6) as group:
        assert slow_disk.current_group() == group == home / group.name
        device = slow_disk.block_device(tmp_path)
        for throttle in slow_disk.THROTTLES:
            assert (group / throttle).read_text().split() == [device, str(200 * 10**6)]
        try:
            fd = os.open(tmp_path / "direct", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        except OSError as exc:
            pytest.skip(f"O_DIRECT refused here: {exc}")
        try:
            assert os.write(fd, data) == 1 << 20
        finally:
            os.close(fd)
        counted = {
            kind: int(value)
            for line in (group / "blkio.throttle.io_service_bytes").read_text().splitlines()
            if line.startswith(device)
            for _, kind, value in [line.split()]
        }
        assert counted.get("Write", 0) >= 1 << 20
    assert slow_disk.current_group() == home
    assert not group.exists()


def test_a_directory_off_any_block_device_is_refused_with_the_reason() -> None:
    if os.geteuid() != 0 or not (slow_disk.BLKIO / slow_disk.THROTTLES[0]).exists():
        pytest.skip("needs root and cgroup v1 blkio to reach the device check")
    assert "not on a block device" in (slow_disk.why_not(Path("/proc")) or "")
