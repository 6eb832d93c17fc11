"""Streamed CUDA copy backends: a worker thread, low-priority streams, completion by events.

The ``dma``, ``kernel`` and ``auto`` backends are one :class:`StreamCopyBackend`
each, differing only in the :class:`SegmentExecutor` that queues a planned
batch's copies on a stream. The life of a batch:

1. :meth:`StreamCopyBackend.submit` (caller's thread) validates the batch and
   records a *ready* event on the caller's current stream, so the copy is
   ordered after every kernel already queued there: a store never reads blocks
   the model is still writing, and a load never overwrites blocks that queued
   work still reads.
2. The worker thread plans the batch's segments, makes the direction's stream
   (one for stores, one for loads, so the two overlap) wait for the ready
   event, has the executor queue the copies and records a *done* event.
3. :meth:`~StreamCopyBackend.done` and :meth:`~StreamCopyBackend.wait` report
   success only once the done event completed: the engine may read loaded
   blocks only then. A failure surfaces there as :class:`CopyError`, and only
   after anything already queued for the batch stopped running.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import Field

from kvtier.config import PluginConfig
from kvtier.copy.base import CopyBackend, CopyBatch, CopyError, CopyHandle, Direction
from kvtier.copy.planner import SegmentPlanner, Segments, batch_arrays
from kvtier.cuda.bindings import CudaError, CudaUnavailable
from kvtier.cuda.driver import CudaDriver, open_driver
from kvtier.layout.base import KVLayout

logger = logging.getLogger(__name__)


def as_address_arrays(segments: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The segments' ``(dst, src, nbytes)`` as contiguous ``uint64`` arrays for the driver."""
    return tuple(  # type: ignore[return-value]
        np.ascontiguousarray(array, dtype=np.uint64)
        for array in (segments.dst, segments.src, segments.nbytes)
    )


class StreamCopyConfig(PluginConfig):
    """Settings every streamed CUDA copy backend (``dma``, ``kernel``, ``auto``) shares."""

    stream_priority: int | None = Field(
        default=None,
        ge=-(2**31),
        le=2**31 - 1,
        description=(
            "CUDA priority of the copy streams; lower numbers run first. Default: the lowest "
            "priority the device offers, so copies yield to the engine's compute."
        ),
    )


class SegmentExecutor(ABC):
    """Queues one planned batch's copies on a stream; the part that differs between backends.

    :meth:`setup` and :meth:`close` run in the thread that builds or closes the
    backend (with the driver's context active); :meth:`execute` runs in the
    backend's worker thread only.
    """

    name: str
    """The backend's registered name, for messages and thread names."""

    def setup(  # noqa: B027 - executors without per-backend state need no setup
        self, driver: CudaDriver, layout: KVLayout, host_buffer: torch.Tensor
    ) -> None:
        """Prepare for copies between ``layout`` and ``host_buffer`` (compile, allocate)."""

    @abstractmethod
    def execute(
        self, driver: CudaDriver, segments: Segments, direction: Direction, stream: int
    ) -> None:
        """Queue the copies of ``segments`` on ``stream``; return without waiting for them."""

    def close(self, driver: CudaDriver) -> None:  # noqa: B027 - executors may hold nothing
        """Release what :meth:`setup` and :meth:`execute` acquired; streams are idle by now."""


@dataclass(eq=False)
class _Job:
    handle: CopyHandle
    blocks: np.ndarray
    slots: np.ndarray
    ready_event: int | None = None
    done_event: int | None = None
    error: BaseException | None = None
    queued: threading.Event = field(default_factory=threading.Event)


class StreamCopyBackend(CopyBackend):
    """A :class:`CopyBackend` that queues batches from a worker thread onto CUDA streams.

    Args:
        layout: The engine's resolved KV layout (its regions are device memory).
        host_buffer: The host tier's ``[num_slots, layout.record_bytes]`` uint8 buffer.
        executor: Queues each batch's copies.
        driver: The CUDA driver of the layout's device.
        owns_driver: Close ``driver`` with the backend.
        stream_priority: Priority of the copy streams; ``None`` for the lowest.

    Any thread may submit; each handle is polled or waited from one thread at a time.
    """

    def __init__(
        self,
        layout: KVLayout,
        host_buffer: torch.Tensor,
        executor: SegmentExecutor,
        *,
        driver: CudaDriver,
        owns_driver: bool = False,
        stream_priority: int | None = None,
    ) -> None:
        if host_buffer.device.type != "cpu":
            raise ValueError(f"the host buffer must be in host memory, not on {host_buffer.device}")
        self._planner = SegmentPlanner.for_tensors(layout, host_buffer)
        self._executor = executor
        self._driver = driver
        self._owns_driver = owns_driver
        self._lock = threading.Lock()
        self._issued = 0
        self._jobs: dict[int, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        with driver.activated():
            priority = (
                driver.lowest_stream_priority() if stream_priority is None else stream_priority
            )
            self._streams: dict[Direction, int] = {}
            try:
                for direction in Direction:
                    self._streams[direction] = driver.stream_create(priority)
                executor.setup(driver, layout, host_buffer)
            except BaseException:
                for stream in self._streams.values():
                    driver.stream_destroy(stream)
                raise
        self._worker = threading.Thread(
            target=self._work, name=f"kvtier-{executor.name}-copy", daemon=True
        )
        self._worker.start()
        logger.info(
            "%s copy backend on CUDA device %d: %d regions, %d host slots, stream priority %d",
            executor.name,
            driver.device_index,
            len(layout.regions),
            self._planner.num_slots,
            priority,
        )

    @classmethod
    def open(
        cls,
        layout: KVLayout,
        host_buffer: torch.Tensor,
        executor: SegmentExecutor,
        *,
        stream_priority: int | None,
    ) -> StreamCopyBackend:
        """Build a backend on a driver bound to the layout's device.

        Raises:
            CudaUnavailable: The layout is not on a CUDA device or CUDA cannot be
                used; the message says which backend needs it.
        """
        try:
            driver = open_driver(layout.device)
        except CudaUnavailable as exc:
            raise CudaUnavailable(f"the {executor.name!r} copy backend {exc}") from exc
        try:
            return cls(
                layout,
                host_buffer,
                executor,
                driver=driver,
                owns_driver=True,
                stream_priority=stream_priority,
            )
        except BaseException:
            driver.close()
            raise

    @property
    def streams(self) -> dict[Direction, int]:
        """The copy stream of each direction."""
        return dict(self._streams)

    def submit(self, batch: CopyBatch) -> CopyHandle:
        """Queue ``batch`` behind the caller's current stream and return at once.

        Raises:
            CopyError: The batch names an id out of range or a destination twice,
                or the backend is closed.
        """
        blocks, slots = batch_arrays(batch, self._planner.num_blocks, self._planner.num_slots)
        error: CudaError | None = None
        ready_event: int | None = None
        try:
            with self._driver.activated():
                ready_event = self._driver.event_create()
                self._driver.event_record(ready_event, self._driver.caller_stream())
        except CudaError as exc:
            error = exc
        with self._lock:
            if self._closed:
                if ready_event is not None:
                    with self._driver.activated():
                        self._driver.event_destroy(ready_event)
                raise CopyError(f"the {self._executor.name} copy backend is closed")
            handle = CopyHandle(self._issued, batch.direction, len(batch))
            self._issued += 1
            job = _Job(handle, blocks, slots, ready_event=ready_event, error=error)
            self._jobs[handle.id] = job
            if error is None:
                self._queue.put(job)
            else:
                job.queued.set()
        return handle

    def _work(self) -> None:
        try:
            self._driver.bind_thread()
        except CudaError as exc:
            logger.error("%s copy worker cannot use the CUDA context: %s", self._executor.name, exc)
            self._fail_queued(exc)
            return
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)
            job.queued.set()

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.error = error
            job.queued.set()

    def _execute(self, job: _Job) -> None:
        direction = job.handle.direction
        stream = self._streams[direction]
        driver = self._driver
        try:
            segments = self._planner.plan_arrays(direction, job.blocks, job.slots)
            assert job.ready_event is not None
            driver.stream_wait_event(stream, job.ready_event)
            self._executor.execute(driver, segments, direction, stream)
        except Exception as exc:  # any failure belongs to this batch; the worker carries on
            job.error = exc
        try:
            job.done_event = driver.event_create()
            driver.event_record(job.done_event, stream)
        except CudaError as exc:
            job.error = job.error or exc

    def _job(self, handle: CopyHandle) -> _Job | None:
        """The pending job of ``handle``; ``None`` once it finished (or failed and was reported)."""
        with self._lock:
            issued = 0 <= handle.id < self._issued
            job = self._jobs.get(handle.id)
        if not issued or (job is not None and job.handle != handle):
            raise ValueError(f"copy handle {handle.id} was not issued by this backend")
        return job

    def done(self, handle: CopyHandle) -> bool:
        """Whether ``handle`` finished; raise :class:`CopyError` if it failed.

        A failure is raised once; after that (or after success) the handle
        reports done.

        Raises:
            CopyError: The batch failed; none of its destination blocks may be trusted.
            ValueError: This backend did not issue ``handle``.
        """
        job = self._job(handle)
        if job is None:
            return True
        if not job.queued.is_set():
            return False
        if job.done_event is not None:
            try:
                with self._driver.activated():
                    if not self._driver.event_query(job.done_event):
                        return False
            except CudaError as exc:
                job.error = job.error or exc
        self._finish(job)
        return True

    def wait(self, handle: CopyHandle) -> None:
        """Block until ``handle`` finished; raise :class:`CopyError` if it failed.

        Raises:
            CopyError: The batch failed; none of its destination blocks may be trusted.
            ValueError: This backend did not issue ``handle``.
        """
        job = self._job(handle)
        if job is None:
            return
        job.queued.wait()
        if job.done_event is not None:
            try:
                with self._driver.activated():
                    self._driver.event_synchronize(job.done_event)
            except CudaError as exc:
                job.error = job.error or exc
        self._finish(job)

    def _finish(self, job: _Job) -> None:
        with self._lock:
            if self._jobs.pop(job.handle.id, None) is None:
                return  # another thread finished it concurrently
        try:
            with self._driver.activated():
                for event in (job.ready_event, job.done_event):
                    if event is not None:
                        self._driver.event_destroy(event)
        except CudaError as exc:
            logger.warning("could not release the events of copy %d: %s", job.handle.id, exc)
        if job.error is not None:
            raise CopyError(
                f"{job.handle.direction.value} of {job.handle.num_blocks} blocks (copy "
                f"{job.handle.id}) failed in the {self._executor.name} backend: {job.error}"
            ) from job.error

    def close(self) -> None:
        """Wait for all in-flight batches and release streams, events and the executor.

        Idempotent. Handles still outstanding are spent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._jobs.values())
        self._queue.put(None)
        self._worker.join()
        for job in pending:
            try:
                self.wait(job.handle)
            except CopyError as exc:
                logger.warning("copy %d failed while closing: %s", job.handle.id, exc)
        with self._driver.activated():
            self._executor.close(self._driver)
            for stream in self._streams.values():
                self._driver.stream_destroy(stream)
        if self._owns_driver:
            self._driver.close()
