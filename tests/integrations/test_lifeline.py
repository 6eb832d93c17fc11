"""An engine process stops once the process that started it is killed, and only then."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvtier

FRONT = """
import multiprocessing, sys, time

def engine(interval_s):
    from kvtier.integrations.lifeline import stop_with_parent
    assert stop_with_parent("the test engine", interval_s)
    time.sleep(120)

if __name__ == "__main__":
    child = multiprocessing.get_context(sys.argv[1]).Process(target=engine, args=(0.1,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(120)
"""
"""A front process that starts an engine process watching it, prints its pid and waits."""


def gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` exits (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_an_engine_process_stops_when_its_front_process_is_killed(
    tmp_path: Path, start_method: str
) -> None:
    script = tmp_path / "front.py"
    script.write_text(FRONT)
    root = str(Path(kvtier.__file__).resolve().parents[1])
    front = subprocess.Popen(
        [sys.executable, str(script), start_method],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert front.stdout is not None
        engine = int(front.stdout.readline())
        assert not gone(engine, 1.0), "the engine stopped while its front process lived"
        front.kill()
        front.wait()
        assert gone(engine, 10.0)
    finally:
        front.kill()
        front.wait()
        if not gone(engine, 0):
            os.kill(engine, signal.SIGKILL)


def test_a_process_started_otherwise_is_not_watched() -> None:
    from kvtier.integrations.lifeline import stop_with_parent

    assert not stop_with_parent("this test")
