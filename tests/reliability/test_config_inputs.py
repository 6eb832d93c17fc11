"""Hostile config input through the real ``kvtier config`` command line, in a subprocess.

Every input is refused with one line per problem after the count, exit status 2,
no traceback, within a time limit and a memory limit (so that a regression fails
fast instead of exhausting the machine).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.config.conftest import FLOAT_FILES, NOT_POSITIVE_SIZES

TIMEOUT_S = 60
MEMORY_LIMIT_BYTES = 2 << 30
MAX_LINE_CHARS = 400


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def kvtier(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvtier ARGV`` with only the built-in plugins and only ``env``'s KVTIER_*."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith("KVTIER_")}
    environ.update({"KVTIER_LOAD_PLUGINS": "", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *argv],
        env=environ,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=TIMEOUT_S,
        preexec_fn=_limit_memory,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *starts: str) -> None:
    """Exit status 2, nothing on stdout, a count, then one line per problem beginning as given."""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (result.returncode, result.stdout) == (2, ""), result.stderr[-2000:]
    header, *lines = result.stderr.splitlines()
    plural = "s" if len(starts) != 1 else ""
    assert header == f"invalid kvtier configuration: {len(starts)} problem{plural}"
    assert len(lines) == len(starts), lines
    for line, start in zip(lines, starts, strict=True):
        assert line.startswith(start), line
        assert len(line) <= MAX_LINE_CHARS, line


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def billion_laughs() -> str:
    """Nine levels of nine aliases under an unknown key: a few hundred bytes, 9**9 strings."""
    lines = ["bogus:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level, previous in zip("bcdefghi", "abcdefgh", strict=True):
        lines.append(f"  {level}: &{level} [{','.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + "\n"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_small_valid_file_passes(tmp_path: Path) -> None:
    file = write(tmp_path / "kvtier.yaml", "cpu_bytes: 1MiB\n")
    result = kvtier("config", "validate", str(file))
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"{file}: valid kvtier configuration\n",
        "",
    )


FILES: dict[str, tuple[str, str | bytes, str]] = {
    "billion laughs": (
        "kvtier.yaml",
        billion_laughs(),
        "(file): cannot parse YAML: found alias *a; kvtier does not accept YAML aliases",
    ),
    "deep YAML": ("kvtier.yaml", f"bogus: {nested(5000)}\n", "(file): nested more than 32 levels"),
    "deep TOML": ("kvtier.toml", f"bogus = {nested(5000)}\n", "(file): nested more than 32 levels"),
    "YAML integer of 5000 digits": (
        "kvtier.yaml",
        f"cpu_bytes: 1{'0' * 5000}\n",
        "(file): cannot parse YAML: Exceeds the limit (4300 digits)",
    ),
}


@pytest.mark.parametrize("case", FILES)
def test_file_content_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    name, content, expected = FILES[case]
    file = write(tmp_path / name, content)
    assert_refused(kvtier("config", "validate", str(file)), f"file {file}: {expected}")


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def make_huge_sparse_file(path: Path) -> None:
    with path.open("wb") as file:
        file.truncate(4 << 30)


def write_not_utf8(path: Path) -> None:
    write(path, b"cpu_bytes: \xff\xfe\n")


NOT_CONFIG_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "FIFO": (make_fifo, "a FIFO (named pipe), not a regular file; name a YAML, TOML or JSON file"),
    "link to /dev/zero": (link_to_dev_zero, "a character device, not a regular file"),
    "directory": (Path.mkdir, "a directory, not a regular file"),
    "4 GiB file": (make_huge_sparse_file, "larger than the 1048576 bytes a config file may have"),
    "not UTF-8": (write_not_utf8, "not UTF-8 text: byte 0xff at offset 11"),
}


@pytest.mark.parametrize("case", NOT_CONFIG_FILES)
def test_what_is_not_a_config_file_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    make, expected = NOT_CONFIG_FILES[case]
    file = tmp_path / "kvtier.yaml"
    make(file)
    assert_refused(
        kvtier("config", "validate", str(file)), f"argument config_file: config_file: {expected}"
    )


def test_show_refuses_a_fifo_named_by_kvtier_config(tmp_path: Path) -> None:
    fifo = tmp_path / "kvtier.toml"
    make_fifo(fifo)
    assert_refused(
        kvtier("config", "show", env={"KVTIER_CONFIG": str(fifo)}),
        "env KVTIER_CONFIG: config_file: a FIFO (named pipe), not a regular file",
    )


NOT_FINITE = "Input should be a finite number"
TOO_LARGE = "Input should be less than or equal to 1024"


@pytest.mark.parametrize(("name", "content"), FLOAT_FILES.values(), ids=list(FLOAT_FILES))
def test_float_fields_in_files_must_be_finite_and_bounded(
    name: str, content: str, tmp_path: Path
) -> None:
    file = write(tmp_path / name, content)
    assert_refused(
        kvtier("config", "validate", str(file)),
        f"file {file}: index.history_factor: {NOT_FINITE}",
        f"file {file}: index.low_value_ratio: {NOT_FINITE}",
        f"file {file}: index.first_sight_memory_factor: {TOO_LARGE}",
    )


def test_float_fields_in_env_must_be_finite_and_bounded(tmp_path: Path) -> None:
    file = write(tmp_path / "kvtier.yaml", "cpu_bytes: 1MiB\n")
    env = {
        "KVTIER_INDEX__HISTORY_FACTOR": "inf",
        "KVTIER_INDEX__LOW_VALUE_RATIO": "-inf",
        "KVTIER_INDEX__FIRST_SIGHT_MEMORY_FACTOR": "1e308",
    }
    assert_refused(
        kvtier("config", "validate", str(file), env=env),
        f"env KVTIER_INDEX__HISTORY_FACTOR: index.history_factor: {NOT_FINITE}",
        f"env KVTIER_INDEX__LOW_VALUE_RATIO: index.low_value_ratio: {NOT_FINITE}",
        f"env KVTIER_INDEX__FIRST_SIGHT_MEMORY_FACTOR: index.first_sight_memory_factor: "
        f"{TOO_LARGE}",
    )


def test_sizes_must_be_positive(tmp_path: Path) -> None:
    file = write(tmp_path / "kvtier.yaml", NOT_POSITIVE_SIZES)
    assert_refused(
        kvtier("config", "validate", str(file)),
        f"file {file}: cpu_bytes: Input should be greater than 0 (got -1)",
        f"file {file}: cpu_bytes_per_rank: Input should be greater than 0 (got 0)",
        f"file {file}: copy.cuda_staging_bytes: Input should be greater than 0 (got '0GiB')",
    )


def test_a_host_tier_larger_than_memory_is_refused(tmp_path: Path) -> None:
    file = write(tmp_path / "kvtier.yaml", "cpu_bytes: 1000TiB\n")
    assert_refused(
        kvtier("config", "validate", str(file)),
        f"file {file}: cpu_bytes: the host tier needs 1099511627776000 bytes (1024000.0 GiB), "
        "more than the ",
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"KVTIER_COPY": '{"type": "nope"}'},
            "env KVTIER_COPY: copy.type: unknown copy backend type; installed: ",
        ),
        ({"KVTIER_INDEX": nested(5000)}, "env KVTIER_INDEX: index: nested more than 32 levels"),
    ],
    ids=["unknown type", "5000 levels"],
)
def test_json_env_values_are_refused_in_one_line(
    env: dict[str, str], expected: str, tmp_path: Path
) -> None:
    file = write(tmp_path / "kvtier.yaml", "cpu_bytes: 1MiB\n")
    assert_refused(kvtier("config", "validate", str(file), env=env), expected)


def disk(path: str, **settings: object) -> dict[str, object]:
    return {"type": "disk", "path": path, "capacity_bytes": "1GiB", **settings}


def redis(url: str = "redis://cache:6379/0", **settings: object) -> dict[str, object]:
    return {"type": "redis", "url": url, **settings}


URL_PORT = "url: the port is not a number from 1 to 65535"
AT_MOST_AN_HOUR = "Input should be less than or equal to 3600 (got 10000000000.0)"
NUL = "a path cannot hold a NUL byte (got '/var/cache/a\\x00b')"
SAME_STORE = "list each store once: remove one entry, or point it at another store"

TIER_SETTINGS: dict[str, tuple[list[dict[str, object]], str]] = {
    "port out of range": (
        [redis("redis://:hunter2@cache:99999/0")],
        f"tiers[0].{URL_PORT} ('99999'); write the URL as redis://host:6379/0 (got '*****",
    ),
    "port not a number": (
        [redis("redis://cache:port/0")],
        f"tiers[0].{URL_PORT} ('port')",
    ),
    "port 0": ([redis("redis://cache:0/0")], "tiers[0].url: port 0 is not a server's port"),
    "database not a number": (
        [redis("redis://cache:6379/zero")],
        "tiers[0].url: the path names database 'zero', not a number from 0 to 2147483647",
    ),
    "timeout in the URL": (
        [redis("redis://cache:6379/0?socket_timeout=1e10")],
        "tiers[0].url: the URL option 'socket_timeout' overrides the tier's own setting; set "
        "timeout_s instead",
    ),
    "unknown URL option": (
        [redis("redis://cache:6379/0?sockettimeout=1")],
        "tiers[0].url: unknown URL option 'sockettimeout'; the URL may carry client_name, db,",
    ),
    "redis timeout_s 1e10": ([redis(timeout_s=1e10)], f"tiers[0].timeout_s: {AT_MOST_AN_HOUR}"),
    "redis get_deadline_s 1e10": (
        [redis(get_deadline_s=1e10)],
        f"tiers[0].get_deadline_s: {AT_MOST_AN_HOUR}",
    ),
    "disk get_deadline_s 1e10": (
        [disk("/var/cache/kvtier", get_deadline_s=1e10)],
        f"tiers[0].get_deadline_s: {AT_MOST_AN_HOUR}",
    ),
    "redis back-off 1e10": (
        [redis(reconnect_max_backoff_s=1e10)],
        f"tiers[0].reconnect_max_backoff_s: {AT_MOST_AN_HOUR}",
    ),
    "queue_depth 1e18": (
        [disk("/var/cache/kvtier", queue_depth=10**18)],
        "tiers[0].queue_depth: Input should be less than or equal to 65536",
    ),
    "empty disk path": (
        [disk("")],
        "tiers[0].path: empty path; name a directory, such as /var/cache/kvtier (got '')",
    ),
    "NUL in a disk path": ([disk("/var/cache/a\0b")], f"tiers[0].path: {NUL}"),
    "NUL in a CA path": ([redis(tls_ca_path="/var/cache/a\0b")], f"tiers[0].tls_ca_path: {NUL}"),
    "one disk path twice": (
        [disk("/var/cache/kvtier"), disk("/var/cache/./kvtier/", capacity_bytes="2GiB")],
        "tiers: tiers[1] has the same store (disk path /var/cache/kvtier) as tiers[0]; "
        f"{SAME_STORE} (got ['disk', 'disk'])",
    ),
    "identical Redis entries": (
        [redis("redis://:hunter2@cache:6379/0"), redis("redis://:hunter2@cache:6379/0")],
        f"tiers: tiers[1] has the same settings as tiers[0]; {SAME_STORE} (got ['redis', 'redis'])",
    ),
    "1000 entries": (
        [disk(f"/var/cache/kvtier{number}") for number in range(1000)],
        "tiers: Tuple should have at most 16 items after validation, not 1000 (got ['disk',",
    ),
}


@pytest.mark.parametrize("case", TIER_SETTINGS)
def test_tier_settings_that_would_fail_at_start_up_are_refused_by_validate(
    case: str, tmp_path: Path
) -> None:
    """The same one line from ``config validate`` and from ``kvtier serve``, which checks the
    config before it starts an engine; never the URL's password."""
    tiers, expected = TIER_SETTINGS[case]
    file = write(tmp_path / "kvtier.json", json.dumps({"tiers": tiers}))
    for argv in (
        ("config", "validate", str(file), "--no-memory-check"),
        ("serve", "--kvtier-config", str(file), "some-model"),
    ):
        result = kvtier(*argv)
        assert_refused(result, f"file {file}: {expected}")
        assert "hunter2" not in result.stderr
