"""The tier benchmark on tiny settings: it runs, and every field it prints is documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, field_names, load_script
from tests.support.mooncake_server import mooncake_binaries
from tests.support.redis_server import redis_server_binary

PAGE = REPO_ROOT / "docs" / "benchmarks" / "tiers.md"


def test_every_field_the_tier_benchmark_prints_is_documented(tmp_path: Path) -> None:
    """The run also leaves nothing behind in its directories (``--dir`` and ``TMPDIR``)."""
    command = [
        sys.executable,
        str(REPO_ROOT / "benchmarks" / "tier_bench.py"),
        "--sizes",
        "65536",  # 16 records a MiB: moto answers each s3 request in tens of ms here
        "--total-mib",
        "1",
        "--redis-total-mib",
        "1",
        "--mooncake-total-mib",
        "1",
        "--s3-total-mib",
        "1",
        "--codec-total-mib",
        "1",
        "--link-mbps",  # the codec rows' redis and s3 tiers go through a relay
        "4000",
        "--repeats",
        "2",
        "--dir",
        str(tmp_path),
    ]
    # Where the drive can be capped (root, cgroup v1), the codec rows run under a cap.
    throttled = load_script(REPO_ROOT / "benchmarks" / "slow_disk.py").why_not(tmp_path) is None
    if throttled:
        command += ["--disk-mb-per-s", "2000"]
    if redis_server_binary() is None:
        command += ["--skip", "redis"]
    if mooncake_binaries() is None:
        command += ["--skip", "mooncake"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert not list(tmp_path.iterdir())
    report = json.loads(run.stdout)
    assert report["disk"][0]["records"] == 16
    assert report["settings"]["link_mbps"] == 4000
    assert report["settings"]["disk_mb_per_s"] == (2000 if throttled else None)
    assert report["s3"][0]["records"] == 16
    assert report["disk_o_direct"], "O_DIRECT arms ran, or say why they were skipped"
    if mooncake_binaries() is not None:
        assert report["mooncake"][0]["records"] == 16
    for row in report["disk"]:
        assert 0 < row["put_ratio"]["min"] <= row["put_ratio"]["median"] <= row["put_ratio"]["max"]
        limit = row["put_limit_ratio"]
        assert 0 < limit["min"] <= limit["median"] <= limit["max"]
        assert row["limit"]["put_gbps"] > 0 and row["get_limit_cpu_ratio"] > 0
    sealing = report["sealing"]
    assert set(sealing["hashes"][0]) == {
        "record_bytes",
        "xxh3",
        "gmac",
        "blake3",
        "hmac_sha256",
        "blake2b",
        "aes_256_gcm",
    }
    for tier in ("disk", "redis") if redis_server_binary() is not None else ("disk",):
        (row,) = sealing[tier]
        for scheme in ("mac", "aead"):
            assert row[scheme]["tier"]["put_gbps"] > 0 and row[scheme]["checksum"]["get_gbps"] > 0
            assert 0 < row[scheme]["get_ratio"]["min"] <= row[scheme]["get_ratio"]["max"]
            assert ("limit" in row[scheme]) is (tier == "disk"), "the limit arm is the disk's"
    tiers = ("disk", "redis", "s3") if redis_server_binary() is not None else ("disk", "s3")
    if not isinstance(report["disk_o_direct"], dict):  # where O_DIRECT works, the codec has rows
        tiers += ("disk_o_direct",)
    assert set(report["codec"]) == set(tiers)
    for tier in tiers:
        (row,) = report["codec"][tier]
        assert row["records"] == 16
        for codec in ("fp8", "int8"):
            assert row[codec]["tier"]["put_gbps"] > 0 and row[codec]["none"]["get_gbps"] > 0
    page = PAGE.read_text()
    missing = sorted(name for name in field_names(report) if f"`{name}`" not in page)
    assert not missing, f"docs/benchmarks/tiers.md does not describe {missing}"
