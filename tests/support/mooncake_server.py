"""A real Mooncake Store for tests: ``mooncake_master`` and one ``mooncake_client`` holding memory.

The master listens on 127.0.0.1 on free ports, serves the transfer engines'
metadata itself (``--enable_http_metadata_server``, so no etcd), and the
client process lends the store one segment of memory, so records outlive
the tiers that wrote them. :meth:`MooncakeStore.clear` empties the store and
restarts it if its memory is gone. :meth:`MooncakeStore.stop` stops both (tests call
it from a fixture's teardown); :meth:`~MooncakeStore.kill_master` and
:meth:`~MooncakeStore.start_master` take the master away and bring it back on
the same ports, for fault tests. :func:`mooncake_binaries` returns ``None``
when the ``mooncake-transfer-engine-non-cuda`` wheel is not installed, for
tests to skip with that reason.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import IO, Any

from tests.support.redis_server import free_port

START_TIMEOUT_S = 20.0
CLEAR_TIMEOUT_S = 5.0
"""How long an emptied store may take to report all its memory free."""
PROBE_KEY = "kvtier-test-probe"
PROBE_BYTES = 4096
SEGMENT_BYTES = 256 << 20
"""Memory the store's client process lends by default."""


def mooncake_binaries() -> Path | None:
    """The folder of ``mooncake_master`` and ``mooncake_client``, or ``None`` if not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location)
        if (folder / "mooncake_master").is_file() and (folder / "mooncake_client").is_file():
            return folder
    return None


class MooncakeStore:
    """A master and one memory-holding client on 127.0.0.1, started by :meth:`start`."""

    def __init__(self, directory: Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        folder = mooncake_binaries()
        if folder is None:
            raise RuntimeError(
                "mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)"
            )
        self.folder = folder
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._pick_ports()
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    def _pick_ports(self) -> None:
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.client_port = free_port()

    @property
    def master_address(self) -> str:
        """``127.0.0.1:<rpc port>``."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The master's own metadata server, ``http://127.0.0.1:<port>/metadata``."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def tier_settings(self) -> dict[str, object]:
        """The ``mooncake`` tier settings that reach this store."""
        return {
            "type": "mooncake",
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
        }

    def _log(self, name: str) -> IO[bytes]:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / name).open("ab")
        self._logs.append(log)
        return log

    def start(self) -> MooncakeStore:
        """Start the master and the client that lends memory; wait until the memory is mounted."""
        try:
            self.start_master()
            self.holder = subprocess.Popen(
                [
                    str(self.folder / "mooncake_client"),
                    "-host=127.0.0.1",
                    f"-port={self.client_port}",
                    f"-master_server_address={self.master_address}",
                    f"-metadata_server={self.metadata_server}",
                    f"-global_segment_size={self.segment_bytes}",
                    "-protocol=tcp",
                ],
                stdout=self._log("client.log"),
                stderr=subprocess.STDOUT,
            )
            self.wait_until_mounted()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Start the master on this store's ports (again, after :meth:`kill_master`)."""
        self.master = subprocess.Popen(
            [
                str(self.folder / "mooncake_master"),
                "-rpc_address=127.0.0.1",
                f"-rpc_port={self.rpc_port}",
                "-enable_http_metadata_server=true",
                "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.metadata_port}",
                "-metrics_host=127.0.0.1",
                f"-metrics_port={self.metrics_port}",
            ],
            stdout=self._log("master.log"),
            stderr=subprocess.STDOUT,
        )

    def wait_until_mounted(self) -> None:
        """Wait until the master answers and holds the client's segment."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.metric("master_total_capacity_bytes") < self.segment_bytes:
            running = (("mooncake_master", self.master), ("mooncake_client", self.holder))
            for name, process in running:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {process.returncode}; see {self.directory}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Mooncake store on port {self.rpc_port} did not mount its memory in "
                    f"{START_TIMEOUT_S:g} s; see the logs in {self.directory}"
                )
            time.sleep(0.05)

    def client(self) -> Any:
        """A bare store client of this store that lends no memory; the caller closes it."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        status = client.setup(
            "127.0.0.1", self.metadata_server, 0, 16 << 20, "tcp", "", self.master_address
        )
        if status != 0:
            raise RuntimeError(f"a client of the store on port {self.rpc_port} failed: {status}")
        return client

    def clear(self) -> None:
        """Remove every object from the store and check that all its memory is usable again.

        A store that lost its memory (the lending client exited, or the master unmounted it),
        refuses a small put, or keeps memory allocated after the removal is restarted on new
        ports with a warning that says what was found, so one broken store fails no later
        test that uses it (callers read :meth:`tier_settings` after this call); a restarted
        store that is still broken raises.
        """
        problem = self._empty()
        if problem is None:
            return
        warnings.warn(
            f"the Mooncake store on port {self.rpc_port} was restarted: {problem}; "
            f"its logs are in {self.directory}",
            RuntimeWarning,
            stacklevel=2,
        )
        self.stop()
        self._pick_ports()  # another process may hold one of them now
        self.start()
        problem = self._empty()
        if problem is not None:
            raise RuntimeError(f"the restarted Mooncake store on port {self.rpc_port}: {problem}")

    def _empty(self) -> str | None:
        """Remove every object, then put and remove a small probe; what is wrong with the
        store, or ``None``."""
        try:
            client = self.client()
        except RuntimeError as exc:
            return str(exc)
        try:
            client.remove_all(force=True)
            probe = client.put(PROBE_KEY, bytes(PROBE_BYTES))
            if probe == 0:
                client.remove(PROBE_KEY)
        finally:
            client.close()
        deadline = time.monotonic() + CLEAR_TIMEOUT_S
        while True:
            if self.holder is None or self.holder.poll() is not None:
                code = None if self.holder is None else self.holder.returncode
                return f"mooncake_client exited with {code}"
            if probe != 0:
                return f"a put of {PROBE_BYTES} bytes failed with {probe}"
            capacity = self.metric("master_total_capacity_bytes")
            allocated = self.metric("master_allocated_bytes")
            if capacity >= self.segment_bytes and allocated == 0:
                return None
            if time.monotonic() > deadline:
                return (
                    f"{allocated} bytes allocated of {capacity} (it lends {self.segment_bytes}) "
                    "after removing every object"
                )
            time.sleep(0.05)

    def metric(self, name: str) -> int:
        """One of the master's counters or gauges (0 while it does not answer)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                found = re.search(rb"^%b (\d+)" % name.encode(), reply.read(), re.MULTILINE)
        except (OSError, urllib.error.URLError):
            return 0
        return int(found.group(1)) if found else 0

    def kill_master(self) -> None:
        """Kill the master at once (``SIGKILL``): it forgets every object it knew."""
        if self.master is not None:
            self.master.kill()
            self.master.wait(timeout=10)
            self.master = None

    def stop(self) -> None:
        """Stop the client process and the master if they run. Idempotent."""
        for process in (self.holder, self.master):
            if process is None:
                continue
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.holder = self.master = None
        for log in self._logs:
            log.close()
        self._logs.clear()
