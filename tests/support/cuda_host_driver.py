"""A :class:`~kvtier.cuda.driver.CudaDriver` on host memory, for testing without a GPU.

Streams are FIFO queues that the driver drains as soon as their head can run;
copies are ``memmove``; an event completes when its stream drains past it; a
stream waiting on an event runs on only once the event completed. Tests can
:meth:`HostDriver.hold` a stream (as if a long kernel ran on it), queue their
own work on it with :meth:`HostDriver.enqueue`, make any call fail with
:meth:`HostDriver.fail_on`, and read the ordered :attr:`HostDriver.calls`.

Mapped host memory gets device addresses :data:`MAPPED_OFFSET` above its host
addresses, and the emulated copy kernel rejects plain host addresses, so a
backend that forgets to translate them fails loudly instead of passing by luck.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.cuda.bindings import CudaError
from kvtier.cuda.driver import CudaDriver, KernelArg

MAPPED_OFFSET = 1 << 52
"""Device address of mapped host memory minus its host address."""

SYNCHRONIZE_TIMEOUT_S = 30.0
"""How long :meth:`HostDriver.event_synchronize` waits before it reports a hang."""


@dataclass
class _Event:
    recorded: int = 0
    completed: int = 0
    error: CudaError | None = None


@dataclass
class _Stream:
    priority: int
    ops: deque[tuple[str, object]] = field(default_factory=deque)
    held: bool = False


class HostDriver(CudaDriver):
    """Runs the CUDA seam's calls on host memory.

    Args:
        memcpy_batch: Whether to offer :meth:`memcpy_batch` (as a CUDA 12.8+
            driver does); without it backends copy segment by segment.
        compute_capability: What :meth:`compute_capability` reports.
        device_index: What :attr:`device_index` reports.
    """

    def __init__(
        self,
        *,
        memcpy_batch: bool = True,
        compute_capability: tuple[int, int] = (9, 0),
        device_index: int = 0,
    ) -> None:
        self.device_index = device_index
        self._has_memcpy_batch = memcpy_batch
        self._compute_capability = compute_capability
        self._cond = threading.Condition(threading.RLock())
        self._handles = itertools.count(1)
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, _Event] = {}
        self._registered: dict[int, int] = {}
        self._allocations: dict[int, np.ndarray] = {}
        self._kernels: dict[int, str] = {}
        self._failures: dict[str, tuple[int, CudaError]] = {}
        self.calls: list[tuple[object, ...]] = []
        """Every call as ``(name, *arguments)``, in the order the driver received them."""
        self.compute_stream = self.stream_create(0)
        """The stream :meth:`caller_stream` returns: the simulated engine's compute stream."""
        self.calls.clear()
        self.closed = False

    # -- test controls ---------------------------------------------------------------------

    def fail_on(self, call: str, *, after: int = 0, message: str = "injected failure") -> None:
        """Make the ``after``-th next call of method ``call`` (0: the next one) raise CudaError."""
        with self._cond:
            self._failures[call] = (after, CudaError(f"{call} failed: {message}"))

    def hold(self, stream: int) -> None:
        """Stop running work queued on ``stream`` until :meth:`release`."""
        with self._cond:
            self._streams[stream].held = True

    def release(self, stream: int) -> None:
        """Run ``stream``'s queued work again."""
        with self._cond:
            self._streams[stream].held = False
            self._run()

    def enqueue(self, stream: int, work: Callable[[], None]) -> None:
        """Queue ``work`` on ``stream`` (the simulated engine writing its KV cache, say)."""
        with self._cond:
            self._streams[stream].ops.append(("call", work))
            self._run()

    def priority_of(self, stream: int) -> int:
        """The priority ``stream`` was created with."""
        return self._streams[stream].priority

    def calls_named(self, name: str) -> list[tuple[object, ...]]:
        """The logged calls of method ``name``."""
        with self._cond:
            return [call for call in self.calls if call[0] == name]

    @property
    def live_events(self) -> int:
        """Events created and not yet destroyed."""
        return len(self._events)

    @property
    def live_streams(self) -> int:
        """Streams created (besides the compute stream) and not yet destroyed."""
        return len(self._streams) - 1

    @property
    def live_allocations(self) -> int:
        """Mapped host allocations not yet freed."""
        return len(self._allocations)

    # -- internals --------------------------------------------------------------------------

    def _enter(self, name: str, *args: object) -> None:
        self.calls.append((name, *args))
        failure = self._failures.get(name)
        if failure is not None:
            after, error = failure
            if after == 0:
                del self._failures[name]
                raise error
            self._failures[name] = (after - 1, error)

    def _run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for stream in self._streams.values():
                while stream.ops and not stream.held:
                    kind, payload = stream.ops[0]
                    if kind == "wait":
                        event_handle, generation = payload  # type: ignore[misc]
                        event = self._events.get(event_handle)
                        if event is not None and event.completed < generation:
                            break
                    stream.ops.popleft()
                    progressed = True
                    if kind == "call":
                        payload()  # type: ignore[operator]
                    elif kind == "record":
                        event_handle, generation = payload  # type: ignore[misc]
                        event = self._events.get(event_handle)
                        if event is not None:
                            event.completed = max(event.completed, generation)
        self._cond.notify_all()

    def _queue(self, stream: int, kind: str, payload: object) -> None:
        if stream not in self._streams:
            raise CudaError(f"invalid stream handle {stream}")
        self._streams[stream].ops.append((kind, payload))
        self._run()

    def _mapped_to_host(self, address: int) -> int | None:
        for base, nbytes in self._mapped_ranges():
            if base + MAPPED_OFFSET <= address < base + MAPPED_OFFSET + nbytes:
                return address - MAPPED_OFFSET
        return None

    def _mapped_ranges(self) -> list[tuple[int, int]]:
        ranges = list(self._registered.items())
        ranges += [(address, array.nbytes) for address, array in self._allocations.items()]
        return ranges

    def _host_range_of(self, address: int) -> tuple[int, int] | None:
        for base, nbytes in self._mapped_ranges():
            if base <= address < base + nbytes:
                return base, nbytes
        return None

    def _check_plain(self, *addresses: int) -> None:
        for address in addresses:
            if address >= MAPPED_OFFSET:
                raise CudaError(
                    f"illegal address {address:#x}: a device-mapped host address given to a copy"
                )

    # -- CudaDriver -------------------------------------------------------------------------

    def driver_version(self) -> int:
        return 13000 if self._has_memcpy_batch else 12060

    def compute_capability(self) -> tuple[int, int]:
        return self._compute_capability

    def host_register(self, address: int, nbytes: int) -> None:
        with self._cond:
            self._enter("host_register", address, nbytes)
            for base, size in self._registered.items():
                if base < address + nbytes and address < base + size:
                    raise CudaError(
                        f"host_register failed: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED "
                        f"({address:#x}+{nbytes} overlaps {base:#x}+{size})"
                    )
            self._registered[address] = nbytes

    def host_unregister(self, address: int) -> None:
        with self._cond:
            self._enter("host_unregister", address)
            if address not in self._registered:
                raise CudaError(f"host_unregister failed: {address:#x} is not registered")
            del self._registered[address]

    @property
    def registered(self) -> dict[int, int]:
        """Registered host ranges, start address to bytes."""
        with self._cond:
            return dict(self._registered)

    def host_device_pointer(self, address: int) -> int:
        with self._cond:
            self._enter("host_device_pointer", address)
            if self._host_range_of(address) is None:
                raise CudaError(
                    f"cuMemHostGetDevicePointer failed: CUDA_ERROR_INVALID_VALUE ({address:#x} is "
                    "not page-locked host memory)"
                )
            return address + MAPPED_OFFSET

    def host_alloc_mapped(self, nbytes: int) -> int:
        with self._cond:
            self._enter("host_alloc_mapped", nbytes)
            array = np.zeros(nbytes, dtype=np.uint8)
            self._allocations[array.ctypes.data] = array
            return int(array.ctypes.data)

    def host_free(self, address: int) -> None:
        with self._cond:
            self._enter("host_free", address)
            if self._allocations.pop(address, None) is None:
                raise CudaError(f"host_free failed: {address:#x} was not allocated here")

    def lowest_stream_priority(self) -> int:
        return 0

    def stream_create(self, priority: int) -> int:
        with self._cond:
            self._enter("stream_create", priority)
            handle = next(self._handles)
            self._streams[handle] = _Stream(priority)
            return handle

    def stream_destroy(self, stream: int) -> None:
        with self._cond:
            self._enter("stream_destroy", stream)
            if self._streams.pop(stream, None) is None:
                raise CudaError(f"stream_destroy failed: invalid stream handle {stream}")

    def caller_stream(self) -> int:
        return self.compute_stream

    def event_create(self) -> int:
        with self._cond:
            self._enter("event_create")
            handle = next(self._handles)
            self._events[handle] = _Event()
            return handle

    def event_destroy(self, event: int) -> None:
        with self._cond:
            self._enter("event_destroy", event)
            if self._events.pop(event, None) is None:
                raise CudaError(f"event_destroy failed: invalid event handle {event}")

    def event_record(self, event: int, stream: int) -> None:
        with self._cond:
            self._enter("event_record", event, stream)
            state = self._events[event]
            state.recorded += 1
            self._queue(stream, "record", (event, state.recorded))

    def stream_wait_event(self, stream: int, event: int) -> None:
        with self._cond:
            self._enter("stream_wait_event", stream, event)
            self._queue(stream, "wait", (event, self._events[event].recorded))

    def event_query(self, event: int) -> bool:
        with self._cond:
            self._enter("event_query", event)
            state = self._events[event]
            if state.error is not None:
                raise state.error
            return state.completed >= state.recorded

    def event_synchronize(self, event: int) -> None:
        with self._cond:
            self._enter("event_synchronize", event)
            state = self._events[event]
            if not self._cond.wait_for(
                lambda: state.completed >= state.recorded, timeout=SYNCHRONIZE_TIMEOUT_S
            ):
                raise CudaError(
                    f"event_synchronize: event {event} did not complete in "
                    f"{SYNCHRONIZE_TIMEOUT_S} s (a held stream was never released)"
                )

    @property
    def has_memcpy_batch(self) -> bool:
        return self._has_memcpy_batch

    def memcpy_batch(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int
    ) -> None:
        with self._cond:
            self._enter("memcpy_batch", len(sizes), stream)
            if not self._has_memcpy_batch:
                raise CudaError("memcpy_batch is not available on this driver")
            for array in (dsts, srcs, sizes):
                if array.dtype != np.uint64 or len(array) != len(sizes):
                    raise ValueError("memcpy_batch takes three uint64 arrays of one length")
            copies = list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True))
            for dst, src, _ in copies:
                self._check_plain(dst, src)

            def run() -> None:
                for dst, src, nbytes in copies:
                    ctypes.memmove(dst, src, nbytes)

            self._queue(stream, "call", run)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        with self._cond:
            self._enter("memcpy_async", dst, src, nbytes, stream)
            self._check_plain(dst, src)
            self._queue(stream, "call", lambda: ctypes.memmove(dst, src, nbytes))

    def load_kernel(self, source: str, name: str) -> int:
        with self._cond:
            self._enter("load_kernel", hashlib.sha256(source.encode()).hexdigest()[:12], name)
            if f"void {name}(" not in source:
                raise CudaError(f"cuModuleGetFunction failed: no kernel named {name!r} in source")
            handle = next(self._handles)
            self._kernels[handle] = name
            return handle

    def launch_kernel(
        self,
        kernel: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        stream: int,
    ) -> None:
        with self._cond:
            values = tuple(int(arg.value) for arg in args)
            self._enter("launch_kernel", self._kernels.get(kernel), grid, block, values, stream)
            if self._kernels.get(kernel) != "kvtier_copy_segments":
                raise CudaError(f"cuLaunchKernel failed: unknown kernel handle {kernel}")
            self._queue(stream, "call", lambda: self._emulate_copy_segments(grid, values))

    def _emulate_copy_segments(self, grid: tuple[int, int, int], values: tuple[int, ...]) -> None:
        """The copy kernel: thread block ``x`` copies row ``x`` of the mapped segment table."""
        table_address, num_rows = values
        host_table = self._mapped_to_host(table_address)
        if host_table is None:
            raise CudaError(
                f"kernel read its segment table from unmapped address {table_address:#x}"
            )
        table = np.frombuffer(
            (ctypes.c_uint64 * (3 * num_rows)).from_address(host_table), dtype=np.uint64
        ).reshape(num_rows, 3)
        for row in range(min(grid[0], num_rows)):
            src, dst, nbytes = (int(value) for value in table[row])
            ctypes.memmove(self._kernel_address(dst), self._kernel_address(src), nbytes)

    def _kernel_address(self, address: int) -> int:
        host = self._mapped_to_host(address)
        if host is not None:
            return host
        if self._host_range_of(address) is not None:
            raise CudaError(
                f"kernel dereferenced host address {address:#x} without its device mapping"
            )
        return address

    def close(self) -> None:
        self.closed = True
