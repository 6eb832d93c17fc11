"""QueuedTier: the storage-tier contract run over synchronous batch primitives.

A tier plugin subclasses :class:`QueuedTier` and writes only the store's own
I/O; the class keeps the rest of :mod:`kvtier.tiers.base`'s contract. Its
parts, in the order a request meets them:

1. :meth:`QueuedTier.put`, :meth:`~QueuedTier.get`, :meth:`~QueuedTier.contains`
   and :meth:`~QueuedTier.delete` check their arguments on the caller's thread
   and queue a request: reads (get, contains) and writes (put, delete) wait in
   two bounded queues; a request that finds its queue full is answered at once
   (misses, drops or ``False``) and counted.
2. A read sees the writes submitted before it: a get or contains of a key
   whose put is queued or being written answers from that put's record (a
   delete submitted since forgets it), so a block written down a moment ago is
   found though I/O threads take reads first.
3. A pool of I/O threads takes reads first and runs the subclass's batch
   primitive (``_read``, ``_write``, ``_exists``, ``_remove``) for each request.
   A tier built with ``put_batch_bytes`` hands ``_write`` the puts waiting
   next to each other at the head of the write queue in one call, up to that
   many record bytes (a request is never split; one that repeats a key of the
   call waits for the next), for stores whose per-call cost is high. A
   primitive whose batch is several independent calls to the store hands
   them to :meth:`~QueuedTier._all_at_once`, which runs them on the I/O
   threads at once.
4. A deadline thread answers reads still pending at their deadline as misses;
   the late result of the I/O thread is dropped.
5. :meth:`~QueuedTier.close` lets the threads finish the queued requests, then
   calls the subclass's ``_release``.
"""

from __future__ import annotations

import enum
import functools
import heapq
import itertools
import logging
import threading
import time
from abc import abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.index.base import BlockKey
from kvtier.keys import KeyNamespace
from kvtier.tiers.base import (
    Buffer,
    Cause,
    ContainsResult,
    DeleteResult,
    GetResult,
    PutResult,
    StorageTier,
    TierSpec,
    TierState,
    TierStats,
)
from kvtier.tiers.buffers import ReadBuffers

logger = logging.getLogger(__name__)

T = TypeVar("T")
Item = TypeVar("Item")


class _Op(enum.Enum):
    GET = "get"
    PUT = "put"
    CONTAINS = "contains"
    DELETE = "delete"


@dataclass(eq=False)
class _Request:
    op: _Op
    keys: tuple[BlockKey, ...]
    records: tuple[memoryview, ...]
    future: Future[Any] | None
    """Cleared once answered, so a request waiting in the deadline heap holds no payload."""
    deadline: float | None
    answered: bool = False


@dataclass(eq=False)
class _Task:
    """One call of a batch run by :meth:`QueuedTier._all_at_once`, on whichever thread takes it."""

    work: Callable[[], Any]
    future: Future[Any]

    def run(self) -> None:
        try:
            self.future.set_result(self.work())
        except BaseException as exc:  # the caller sees it, as a thread pool's would
            self.future.set_exception(exc)


class QueuedTier(StorageTier):
    """A :class:`StorageTier` over synchronous batch primitives run on a pool of I/O threads.

    Subclasses implement :meth:`_read`, :meth:`_write`, :meth:`_exists` and
    :meth:`_remove` (called on I/O threads, concurrently, never raising for a
    store failure: they count it with :meth:`_count_error` and report a miss
    or ``False``) and :meth:`_release`, and call :meth:`_start` at the end of
    their constructor. Reads (get, contains) and writes (put, delete) wait in
    two queues of ``queue_depth`` requests each; I/O threads take reads first.
    """

    def __init__(
        self,
        spec: TierSpec,
        *,
        name: str,
        namespace: str,
        io_threads: int,
        queue_depth: int,
        get_deadline_s: float | None,
        put_batch_bytes: int | None = None,
    ) -> None:
        """Set up the queues and counters; no thread runs until :meth:`_start`.

        Args:
            spec: Record size and the rank's key namespace.
            name: The tier's name, for thread names and messages.
            namespace: Tenant namespace; replaces the spec's when not empty.
            io_threads: I/O threads.
            queue_depth: Requests of each kind (reads, writes) that may wait.
            get_deadline_s: Default deadline of gets and contains, ``None`` for none.
            put_batch_bytes: Record bytes of queued puts one ``_write`` call may take
                together; ``None`` (or less than a request) runs each put on its own.
        """
        if io_threads < 1 or queue_depth < 1:
            raise ValueError(
                f"{name} tier: io_threads and queue_depth must be at least 1, got "
                f"{io_threads} and {queue_depth}"
            )
        self.name = name
        self.record_bytes = spec.record_bytes
        self.keys = KeyNamespace(
            spec.keys.model,
            spec.keys.layout_fingerprint,
            spec.keys.rank,
            spec.keys.world_size,
            namespace or spec.keys.namespace,
        )
        self.capacity_bytes = None
        self._io_threads = io_threads
        self._queue_depth = queue_depth
        self._default_deadline_s = get_deadline_s
        self._put_batch_records = (put_batch_bytes or 0) // spec.record_bytes
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._reads: deque[_Request] = deque()
        self._writes: deque[_Request] = deque()
        self._tasks: deque[_Task] = deque()
        self._writing: dict[BlockKey, memoryview] = {}
        """The record of each key whose put is queued or being written (under ``_work``)."""
        self._closed = False
        self._in_flight = 0
        """Requests queued and not yet done with by an I/O thread (under ``_work``)."""
        self._threads: list[threading.Thread] = []
        self._deadlines: list[tuple[float, int, _Request]] = []
        self._deadline_order = itertools.count()
        self._deadline_wakeup = threading.Condition(threading.Lock())
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._disabled: Cause | None = None
        self._read_buffers: ReadBuffers | None = None
        """What a subclass reads records into, if it keeps buffers: their bytes are a stat."""

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        """Read and verify ``keys``; a payload per hit, ``None`` per miss."""

    @abstractmethod
    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        """Store ``records``; whether each key is now stored. Count stores with :meth:`_count`."""

    @abstractmethod
    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is present."""

    @abstractmethod
    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Remove ``keys``; whether each was present."""

    @abstractmethod
    def _release(self) -> None:
        """Release the store after the last request finished (close files, connections)."""

    def _start(self) -> None:
        """Start the I/O threads and the deadline thread."""
        for number in range(self._io_threads):
            thread = threading.Thread(
                target=self._serve, name=f"kvtier-{self.name}-io-{number}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        reaper = threading.Thread(
            target=self._expire, name=f"kvtier-{self.name}-deadlines", daemon=True
        )
        reaper.start()
        self._threads.append(reaper)

    def _all_at_once(self, work: Callable[[Item], T], items: Sequence[Item]) -> list[Future[T]]:
        """Run ``work(item)`` for every item at once on the I/O threads; return when all
        are done, a finished future each (its result, or what it raised).

        For a primitive whose batch is several independent calls to the store (the
        objects of an s3 batch): idle I/O threads take the items before any queued
        request, and the calling thread runs those none has taken, so the batch never
        waits for a thread and at most ``io_threads`` calls run at once in the tier.
        """
        tasks = [_Task(functools.partial(work, item), Future()) for item in items]
        with self._work:
            self._tasks.extend(tasks)
            self._work.notify(len(tasks))
        for task in tasks:
            if self._claim(task):
                task.run()
        wait([task.future for task in tasks])
        return [task.future for task in tasks]

    def _claim(self, task: _Task) -> bool:
        """Take ``task`` off the queue unless another thread took it."""
        with self._work:
            try:
                self._tasks.remove(task)
            except ValueError:
                return False
        return True

    def _disable(self, cause: Cause) -> None:
        """Answer every later request at once: misses and drops counted under ``cause``."""
        self._disabled = cause

    def _count(self, **counts: int) -> None:
        """Add to the :class:`TierStats` counters named by keyword."""
        with self._stats_lock:
            self._counts.update(counts)

    def _count_error(self, cause: str | enum.Enum, keys: int = 1) -> None:
        """Count ``keys`` keys affected by a fault."""
        label = cause.value if isinstance(cause, enum.Enum) else cause
        with self._stats_lock:
            self._errors[label] += keys

    def _held_records(self) -> int | None:
        """Records held, for :attr:`TierStats.records`; ``None`` when unknown."""
        return None

    def _state(self) -> TierState:
        """The tier's state, for :attr:`TierStats.state`."""
        return TierState.UP if self._disabled is None else TierState.DISABLED

    # ------------------------------------------------------------------- public

    def put(self, keys: Sequence[BlockKey], records: Sequence[Buffer]) -> Future[PutResult]:
        if len(keys) != len(records):
            raise ValueError(
                f"{self.name} tier: a put pairs keys with records, got {len(keys)} keys "
                f"and {len(records)} records"
            )
        views = tuple(map(self._payload_view, records))
        return self._submit(_Op.PUT, keys, views, None)

    def get(
        self, keys: Sequence[BlockKey], *, deadline_s: float | None = None
    ) -> Future[GetResult]:
        return self._submit(_Op.GET, keys, (), deadline_s)

    def contains(
        self, keys: Sequence[BlockKey], *, deadline_s: float | None = None
    ) -> Future[ContainsResult]:
        return self._submit(_Op.CONTAINS, keys, (), deadline_s)

    def delete(self, keys: Sequence[BlockKey]) -> Future[DeleteResult]:
        return self._submit(_Op.DELETE, keys, (), None)

    def stats(self) -> TierStats:
        # The queue first: a request is counted before it leaves it, so when none is left
        # the counters read next hold every answer.
        with self._work:
            queued = self._in_flight
        state = self._state()
        with self._stats_lock:
            counts = dict(self._counts)
            errors = dict(self._errors)
        return TierStats(
            **counts,
            errors=errors,
            records=self._held_records(),
            read_buffer_bytes=buffers.kept_bytes if (buffers := self._read_buffers) else 0,
            queued=queued,
            state=state,
        )

    def close(self) -> None:
        with self._work:
            if self._closed:
                return
            self._closed = True
            self._work.notify_all()
        with self._deadline_wakeup:
            self._deadline_wakeup.notify_all()
        for thread in self._threads:
            thread.join()
        self._release()

    def __enter__(self) -> QueuedTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internal

    def _payload_view(self, record: Buffer) -> memoryview:
        view = memoryview(record)
        if not view.c_contiguous:
            raise ValueError(f"{self.name} tier: a record must be one contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes != self.record_bytes:
            raise ValueError(
                f"{self.name} tier: a record is {self.record_bytes} bytes, got {view.nbytes}"
            )
        return view

    def _submit(
        self,
        op: _Op,
        keys: Sequence[BlockKey],
        records: tuple[memoryview, ...],
        deadline_s: float | None,
    ) -> Future[Any]:
        keys = tuple(keys)
        for key in keys:
            if not self.keys.owns(key):
                raise ValueError(
                    f"{self.name} tier: key {bytes(key).hex()} is not of this tier's namespace; "
                    "make keys with tier.keys.keys(block_hashes)"
                )
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        is_read = op in (_Op.GET, _Op.CONTAINS)
        if deadline_s is None and is_read:
            deadline_s = self._default_deadline_s
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        request = _Request(op, keys, records, future, deadline)
        if self._closed:
            raise RuntimeError(f"{self.name} tier is closed")
        if not keys:
            self._answer(request, self._unanswered(request))
            return future
        if self._disabled is not None:
            self._count_error(self._disabled, len(keys))
            self._answer(request, self._unanswered(request))
            return future
        queue = self._reads if is_read else self._writes
        with self._work:
            if self._closed:
                raise RuntimeError(f"{self.name} tier is closed")
            full = len(queue) >= self._queue_depth
            if not full:
                queue.append(request)
                self._in_flight += 1
                self._work.notify()
                if op is _Op.PUT:
                    self._writing.update(zip(keys, records, strict=True))
                elif op is _Op.DELETE and self._writing:
                    for key in keys:
                        self._writing.pop(key, None)
        if full:
            self._count(queue_drops=len(keys))
            self._answer(request, self._unanswered(request))
        elif deadline is not None:
            with self._deadline_wakeup:
                heapq.heappush(self._deadlines, (deadline, next(self._deadline_order), request))
                self._deadline_wakeup.notify()
        return future

    def _unanswered(self, request: _Request) -> Any:
        """The result of a request the store did not answer: all misses, drops or ``False``."""
        nothing = (False,) * len(request.keys)
        if request.op is _Op.GET:
            return GetResult(request.keys, (None,) * len(request.keys))
        if request.op is _Op.PUT:
            return PutResult(request.keys, nothing)
        if request.op is _Op.CONTAINS:
            return ContainsResult(request.keys, nothing)
        return DeleteResult(request.keys, nothing)

    def _answer(self, request: _Request, result: Any) -> bool:
        """Complete ``request`` with ``result`` unless it was already answered; count it."""
        with self._lock:
            if request.answered:
                return False
            request.answered = True
            if request.op is _Op.PUT:
                writing = self._writing
                for key, record in zip(request.keys, request.records, strict=True):
                    if writing.get(key) is record:
                        del writing[key]
            future, request.future, request.records = request.future, None, ()
        assert future is not None
        if isinstance(result, GetResult):
            hits = [record for record in result.records if record is not None]
            self._count(
                hits=len(hits),
                misses=len(result.records) - len(hits),
                bytes_read=sum(record.nbytes for record in hits),
            )
        elif isinstance(result, PutResult) and not all(result.stored):
            self._count(drops=result.stored.count(False))
        future.set_result(result)
        return True

    def _next_requests(self) -> _Task | list[_Request] | None:
        """A call of a batch in progress; else the next request, with the puts queued behind
        a put that its ``_write`` takes too."""
        with self._work:
            while not self._tasks and not self._reads and not self._writes:
                if self._closed:
                    return None
                self._work.wait()
            if self._tasks:
                return self._tasks.popleft()
            if self._reads:
                return [self._reads.popleft()]
            writes = self._writes
            request = writes.popleft()
            taken = [request]
            room = self._put_batch_records - len(request.keys)
            if request.op is _Op.PUT and writes and room > 0:
                keys = set(request.keys)
                while writes and writes[0].op is _Op.PUT and len(writes[0].keys) <= room:
                    following = writes[0].keys
                    if not keys.isdisjoint(following):
                        break
                    keys.update(following)
                    room -= len(following)
                    taken.append(writes.popleft())
            return taken

    def _serve(self) -> None:
        while True:
            requests = self._next_requests()
            if requests is None:
                return
            if isinstance(requests, _Task):
                requests.run()
                continue
            if len(requests) > 1:
                self._serve_puts(requests)
            else:
                self._serve_one(requests[0])
            with self._work:
                self._in_flight -= len(requests)

    def _serve_one(self, request: _Request) -> None:
        """Run one request and answer it, unless its deadline answered it while it waited."""
        if request.answered:
            return
        try:
            result = self._run(request)
        except Exception:  # a bug in a tier must not kill its I/O thread
            self._failed(request.op, len(request.keys))
            result = self._unanswered(request)
        self._answer(request, result)

    def _serve_puts(self, requests: list[_Request]) -> None:
        """Store the records of several put requests in one ``_write`` call; answer each."""
        keys = [key for request in requests for key in request.keys]
        records = [record for request in requests for record in request.records]
        try:
            stored = self._write(keys, records)
        except Exception:  # a bug in a tier must not kill its I/O thread
            self._failed(_Op.PUT, len(keys))
            stored = [False] * len(keys)
        start = 0
        for request in requests:
            end = start + len(request.keys)
            self._answer(request, PutResult(request.keys, tuple(stored[start:end])))
            start = end

    def _failed(self, op: _Op, keys: int) -> None:
        """Log the exception being handled and count the request's keys as internal errors."""
        logger.exception("%s tier: %s of %d key(s) failed", self.name, op.value, keys)
        self._count_error(Cause.INTERNAL, keys)

    def _run(self, request: _Request) -> Any:
        keys = request.keys
        if request.op is _Op.GET:
            pending = self._being_written(keys, copy=True)
            records = self._read(keys)
            if pending:
                records = [
                    pending.get(i) if record is None else record for i, record in enumerate(records)
                ]
            return GetResult(keys, tuple(records))
        if request.op is _Op.PUT:
            return PutResult(keys, tuple(self._write(keys, request.records)))
        if request.op is _Op.CONTAINS:
            pending = self._being_written(keys, copy=False)
            held = self._exists(keys)
            return ContainsResult(keys, tuple(h or i in pending for i, h in enumerate(held)))
        return DeleteResult(keys, tuple(self._remove(keys)))

    def _being_written(self, keys: Sequence[BlockKey], *, copy: bool) -> dict[int, Any]:
        """The positions of ``keys`` whose put is queued or being written, each with a copy
        of its record if ``copy`` (the put's buffer is its caller's once written)."""
        with self._work:
            writing = self._writing
            if not writing:
                return {}
            return {
                i: (memoryview(bytearray(writing[key])) if copy else None)
                for i, key in enumerate(keys)
                if key in writing
            }

    def _expire(self) -> None:
        while True:
            expired: list[_Request] = []
            with self._deadline_wakeup:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines)[2])
                if not expired:
                    timeout = self._deadlines[0][0] - now if self._deadlines else None
                    # A deadline past what a wait can represent is woken for and re-checked.
                    if timeout is not None:
                        timeout = min(timeout, threading.TIMEOUT_MAX)
                    self._deadline_wakeup.wait(timeout)
            # Answered outside the lock: a future's callbacks may submit new requests.
            for request in expired:
                if self._answer(request, self._unanswered(request)):
                    self._count(deadline_misses=len(request.keys))
