"""RemoteTier: what every tier over a store shared by a fleet (Redis, Mooncake, S3) does alike.

A remote tier is a :class:`~kvtier.tiers.queued.QueuedTier` whose records
live in another process's store. The base holds, in the order a tier meets
them:

1. ``__init__`` takes the :class:`~kvtier.tiers.configs.RemoteTierConfig`
   settings: queues and threads, the record codec (sealed with the tier's
   keys, a warning without one), and the back-off
   (:class:`~kvtier.tiers.backoff.Backoff`).
2. :meth:`RemoteTier._open` connects through the subclass's function and
   starts the I/O threads; a store that does not answer is a
   :class:`~kvtier.tiers.base.TierError` when the tier is ``required``, and
   otherwise a warning and a tier that answers every request at once
   (misses and drops, counted as ``disabled``).
3. :meth:`RemoteTier._call_store` runs one batch's call to the store unless
   the tier is backing off: a failure the subclass declares in
   :attr:`RemoteTier.failures` is counted for the batch's keys under its
   cause (:attr:`RemoteTier.causes`), and one that says the store cannot be
   reached (``connection``, ``timeout``) opens or doubles the back-off
   window; the first answer closes it. A tier that calls the store several
   times per batch uses :meth:`~RemoteTier._backing_off` and
   :meth:`~RemoteTier._store_failed` itself.
4. :meth:`RemoteTier._checked` turns a record read from the store into its
   payload, or into a miss when it fails its checks: the fault is counted,
   the key remembered (:class:`FaultyRecords`) so that reads answer it as a
   miss without reading it again for ``fault_memory_s``, and the record is
   deleted when it names this tier's format, scheme and one of its keys (every
   engine holding those keys would reject it too). A record of another format
   or sealed with a key this tier lacks (an engine mid-rotation, another
   version) is left to its writer. A put of the key forgets it. Another tenant's
   record (:attr:`~kvtier.tiers.record.RecordFault.TENANT`) is only counted: its
   key is its tenant's too, whose reads must still find it.
5. :meth:`RemoteTier._count_stored` counts the records a write stored.
6. ``_release`` closes the client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

from kvtier.index.base import BlockKey
from kvtier.tiers.backoff import Backoff
from kvtier.tiers.base import (
    Buffer,
    Cause,
    ContainsResult,
    GetResult,
    PutResult,
    TierError,
    TierSpec,
    TierState,
)
from kvtier.tiers.buffers import ReadBuffers
from kvtier.tiers.configs import RemoteTierConfig
from kvtier.tiers.queued import QueuedTier, _Op, _Request
from kvtier.tiers.record import RecordFault, tier_codec

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UNREACHABLE = (Cause.CONNECTION, Cause.TIMEOUT)
"""Causes that mean the store did not answer: the tier backs off."""

FAULTY_KEYS = 65536
"""Most keys a tier remembers as faulty; beyond it the oldest is forgotten first."""


class FaultyRecords:
    """Keys whose record failed its checks, each remembered for ``ttl_s`` seconds.

    At most :data:`FAULTY_KEYS` are kept, the oldest forgotten first; a ``ttl_s``
    of 0 remembers nothing. Safe to use from several threads.
    """

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._until: OrderedDict[BlockKey, float] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: BlockKey) -> None:
        """Remember ``key`` from now for ``ttl_s``."""
        if not self._ttl_s:
            return
        with self._lock:
            self._until.pop(key, None)
            self._until[key] = time.monotonic() + self._ttl_s
            while len(self._until) > FAULTY_KEYS:
                self._until.popitem(last=False)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Forget ``keys`` (a put is writing them anew)."""
        if not self._until:
            return
        with self._lock:
            for key in keys:
                self._until.pop(key, None)

    def known(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each of ``keys`` is remembered and its time is not over."""
        if not self._until:
            return [False] * len(keys)
        now = time.monotonic()
        with self._lock:
            # Kept in the order remembered, with one ttl: the expired ones lead.
            while self._until and next(iter(self._until.values())) <= now:
                self._until.popitem(last=False)
            return [key in self._until for key in keys]


class RemoteTier(QueuedTier):
    """A :class:`QueuedTier` over a store other engines share; see the module docstring.

    Subclasses declare :attr:`failures`, :attr:`causes` and :attr:`other_cause`,
    set ``_client`` in the function they hand :meth:`_open`, and call
    :meth:`_open` at the end of their constructor.
    """

    shared = True

    failures: ClassVar[tuple[type[BaseException], ...]] = ()
    """What the store's client raises when the store, not the tier, failed."""
    causes: ClassVar[Mapping[type[BaseException] | int, Cause]] = {}
    """The cause of a failure: by the first exception class here that it is an instance
    of, or by the error code the client returned."""
    other_cause: ClassVar[Cause] = Cause.SERVER
    """The cause of a failure that :attr:`causes` does not name."""

    def __init__(
        self,
        config: RemoteTierConfig,
        spec: TierSpec,
        *,
        name: str,
        where: str,
        put_batch_bytes: int | None = None,
    ) -> None:
        """Set up queues, codec and back-off; nothing is connected until :meth:`_open`.

        Args:
            config: The tier's settings.
            spec: Record size and the rank's key namespace.
            name: The tier's name, for threads and messages.
            where: The store as messages show it (no secrets).
            put_batch_bytes: See :class:`~kvtier.tiers.queued.QueuedTier`.

        Raises:
            TierError: A record key cannot be read.
        """
        super().__init__(
            spec,
            name=name,
            namespace=config.namespace,
            io_threads=config.io_threads,
            queue_depth=config.queue_depth,
            get_deadline_s=config.get_deadline_s,
            put_batch_bytes=put_batch_bytes,
        )
        self.where = where
        self._required = config.required
        self._codec = tier_codec(
            config,
            self.keys.layout_fingerprint,
            spec.record_bytes,
            tier=name,
            shared=self.shared,
            regions=spec.regions,
        )
        self._backoff = Backoff(
            name, where, config.reconnect_backoff_s, config.reconnect_max_backoff_s
        )
        self._faulty = FaultyRecords(config.fault_memory_s)
        self._read_buffers = ReadBuffers(self._codec.max_encoded_bytes + 1)
        """What :meth:`_read` reads records into: the longest record and a byte past it."""
        self._client: Any = None

    def _open(self, connect: Callable[[], str | None], summary: str) -> None:
        """Connect with ``connect()``, then start the I/O threads.

        Args:
            connect: Sets ``_client`` and checks that the store answers; returns ``None``,
                or what is wrong and what to do about it, having released what it opened.
            summary: The store and its settings, for the log line once it answered.

        Raises:
            TierError: The store does not answer and the tier is ``required``.
        """
        problem = connect()
        if problem is None:
            logger.info("%s tier: %s, namespace %r", self.name, summary, self.keys.namespace)
        elif self._required:
            raise TierError(
                f"{self.name} tier: {problem}; or set required: false to run without this tier"
            )
        else:
            logger.warning("%s tier: %s; running with the tier disabled", self.name, problem)
            self._disable(Cause.DISABLED)
        self._start()

    def _state(self) -> TierState:
        """Disabled, backing off (its store failed and the wait is not over), or up."""
        if self._disabled is None and self._backoff.waiting():
            return TierState.BACKING_OFF
        return super()._state()

    def _cause_of(self, failure: BaseException | int) -> Cause:
        """Why the store failed: an exception its client raised, or an error code it returned."""
        if isinstance(failure, int):
            return self.causes.get(failure, self.other_cause)
        for kind, cause in self.causes.items():
            if isinstance(kind, type) and isinstance(failure, kind):
                return cause
        return self.other_cause

    def _backing_off(self, keys: int) -> bool:
        """Whether the store failed and its wait is not over; if so, count ``keys`` keys
        as ``connection`` errors."""
        if not self._backoff.waiting():
            return False
        self._count_error(Cause.CONNECTION, keys)
        return True

    def _store_failed(self, failure: BaseException) -> Cause:
        """The cause of ``failure``; one that says the store cannot be reached opens or
        doubles the back-off window."""
        cause = self._cause_of(failure)
        if cause in _UNREACHABLE:
            self._backoff.failed(str(failure))
        return cause

    def _call_store(self, keys: Sequence[BlockKey], call: Callable[[], T]) -> T | None:
        """``call()`` for the batch of ``keys`` unless backing off: its result, or ``None``
        when it failed as a whole (its keys counted under the cause)."""
        if self._backing_off(len(keys)):
            return None
        try:
            result = call()
        except self.failures as exc:
            self._count_error(self._store_failed(exc), len(keys))
            return None
        self._backoff.answered()
        return result

    def _checked(self, key: BlockKey, record: memoryview | bytes) -> memoryview | None:
        """The payload of ``record``, read from the store for ``key``; ``None`` when it fails
        its checks (counted, remembered, and deleted when this tier sealed it; see the
        module docstring); another tenant's record is only counted."""
        payload = self._codec.decode(key, record)
        if not isinstance(payload, RecordFault):
            return payload
        self._count_error(payload)
        if payload is RecordFault.TENANT:
            return None
        self._faulty.remember(key)
        if self._codec.sealed_here(key, record):
            try:
                self.delete([key])
            except RuntimeError:  # closing: the next engine to read the record deletes it
                logger.debug("%s tier: closed before a faulty record was deleted", self.name)
        return None

    def put(self, keys: Sequence[BlockKey], records: Sequence[Buffer]) -> Future[PutResult]:
        self._faulty.forget(keys)
        return super().put(keys, records)

    def _run(self, request: _Request) -> Any:
        """Run ``request``; a read answers the keys remembered as faulty as misses without
        asking the store for them."""
        if request.op not in (_Op.GET, _Op.CONTAINS):
            return super()._run(request)
        known = self._faulty.known(request.keys)
        if not any(known):
            return super()._run(request)
        asked = _Request(
            request.op,
            tuple(key for key, faulty in zip(request.keys, known, strict=True) if not faulty),
            (),
            None,
            None,
        )
        if request.op is _Op.GET:
            found = iter(super()._run(asked).records if asked.keys else ())
            return GetResult(request.keys, tuple(None if bad else next(found) for bad in known))
        present = iter(super()._run(asked).present if asked.keys else ())
        return ContainsResult(request.keys, tuple(not bad and next(present) for bad in known))

    def _count_stored(self, stored: list[bool]) -> list[bool]:
        """Count the records of a write that ``stored`` says were stored; return it."""
        written = stored.count(True)
        self._count(stores=written, bytes_written=written * self.record_bytes)
        return stored

    def _release(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
