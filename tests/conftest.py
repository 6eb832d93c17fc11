"""What every test folder shares: where the checkout is, loading a script of it, the benchmarks'
modules and the fields their JSON holds, small tmpfs mounts (a full or read-only disk), an
in-process vLLM engine's environment, and a directory of its own for vLLM's sockets."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """Import a script that is not in a package (a benchmark, the docs hooks) by its path.

    The module is entered in ``sys.modules`` under its name, as an import would,
    so that its dataclasses can resolve their annotations.
    """
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def field_names(value: Any) -> set[str]:
    """Every key of every object in a JSON value, at any depth (a benchmark's documented fields)."""
    if isinstance(value, dict):
        return set(value).union(*(field_names(item) for item in value.values()))
    if isinstance(value, list):
        return set().union(*(field_names(item) for item in value))
    return set()


def mount_tmpfs(target: Path, size_bytes: int, *, read_only: bool = False) -> bool:
    """Mount a tmpfs of ``size_bytes`` on ``target``; ``False`` if this process may not."""
    target.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes}" + (",ro" if read_only else "")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def unmount(target: Path) -> None:
    """Undo :func:`mount_tmpfs`, even while files on it are still open."""
    subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


@pytest.fixture(scope="session")
def benchmarks_on_path() -> Iterator[None]:
    """``benchmarks/`` on ``sys.path``, as a benchmark run as a script has it, so its modules
    (``vllm_bench``, ``null_connector``) import by the names the benchmarks use."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
        yield


@pytest.fixture
def in_process_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small vLLM engine in the test's own process, rounding the same way whatever shares
    its step."""
    for name, value in {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_ATTN_SPLIT_KV": "0",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session", autouse=True)
def vllm_socket_directory() -> Iterator[None]:
    """Point ``VLLM_RPC_BASE_PATH`` at a directory removed after the session.

    vLLM opens its ZMQ sockets there (the system's temporary directory by
    default) and leaves some behind: each ``make test`` left 37 in ``/tmp``.
    Engines the tests start in other processes inherit the setting. One that
    is already set is kept.
    """
    if "VLLM_RPC_BASE_PATH" in os.environ:
        yield
        return
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-tests-vllm-") as directory,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setenv("VLLM_RPC_BASE_PATH", directory)
        yield
