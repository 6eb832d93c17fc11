"""The storage-tier contract: block records below the host tier, asynchronous and bounded.

A storage tier keeps block records (the bytes of one host-tier slot: a
block's bytes from every region, see :mod:`kvtier.tiers.host`) in a larger,
slower store such as local disk or a shared Redis. One tier object serves one
rank. Primitives, in the order they are called:

1. ``factory(config, spec)``, registered through
   :func:`~kvtier.hookspecs.register_storage_tiers`, builds the tier from its
   validated config and a :class:`TierSpec` (the record size and the rank's
   :class:`~kvtier.keys.KeyNamespace`). It raises :class:`TierError` when the
   tier cannot start (a missing or read-only path, a full disk, a server that
   does not answer), naming what is wrong and what to do.
2. :attr:`StorageTier.keys` namespaces engine block hashes into the keys this
   tier stores: the spec's namespace, with the config's tenant ``namespace``
   when one is set. A key of any other namespace is refused with ``ValueError``.
3. :meth:`StorageTier.put` queues records under keys and returns a future at
   once. The records' buffers must stay unchanged until the future is done.
4. :meth:`StorageTier.get` queues reads and returns a future of the payloads
   (``None`` for each miss). A get still pending at its deadline is answered
   as all misses; its late result is dropped.
5. :meth:`StorageTier.contains` and :meth:`StorageTier.delete` ask about and
   remove keys, also asynchronously.
6. :meth:`StorageTier.stats` returns the counters, the requests still queued and the
   tier's state at any time.
7. :meth:`StorageTier.close` finishes queued requests, then releases the store.

A tier that knows which of its records went away (evicted to make room,
dropped as corrupt, deleted) also is a :class:`RemovalLog`: after
:meth:`RemovalLog.watch_removals` it keeps their keys for
:meth:`RemovalLog.take_removed`. A shared store that evicts on its own
(Redis's ``maxmemory`` policy, an object store's lifecycle rules) does not
tell, and is not one.

All I/O runs on the tier's own threads; a call only validates its arguments
and queues. Queues are bounded: when the tier is slow, a put that finds its
queue full is dropped and a get is answered as misses, at once and counted,
never blocking the caller. Futures complete on a tier thread (or on the
caller's, when a request is answered at once) and never hold an exception: a
failure of the store is a miss, a drop or ``False``, counted in
:class:`TierStats` by cause. A record that fails its header checks (see
:mod:`kvtier.tiers.record`) is a miss, never a wrong payload. Only misuse
raises, at the call: a record of the wrong size, a key of another namespace, a
call after :meth:`~StorageTier.close`.

:class:`~kvtier.tiers.queued.QueuedTier` implements all of this over four
synchronous batch primitives, so a tier plugin writes only the store-specific I/O.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.index.base import BlockKey
from kvtier.keys import KeyNamespace
from kvtier.layout.base import RecordRegion

Buffer = Any
"""A C-contiguous object with the buffer protocol (``bytes``, ``memoryview``, a numpy array)."""


class TierError(RuntimeError):
    """A storage tier cannot start; the message names what is wrong and what to do."""


class Cause(str, enum.Enum):
    """Why keys were missed or dropped, beyond a record fault; counted in ``TierStats.errors``."""

    IO = "io"
    """The store's I/O failed (an ``OSError`` other than the ones below)."""
    NO_SPACE = "no_space"
    """The store is full (a full disk, a Redis at ``maxmemory`` that refuses writes)."""
    READ_ONLY = "read_only"
    """The store refused a write because it is read-only."""
    CONNECTION = "connection"
    """The store's server could not be reached, or is backed off after a failure."""
    TIMEOUT = "timeout"
    """The store did not answer within its timeout."""
    SERVER = "server"
    """The store's server answered with an error."""
    DISABLED = "disabled"
    """The tier started disabled (an optional store that was down at start-up)."""
    INTERNAL = "internal"
    """An unexpected exception in the tier's own code (logged with its traceback)."""


class TierState(enum.IntEnum):
    """Whether a tier calls its store, as :attr:`TierStats.state` and the ``tier_state`` gauge
    give it (a number, so ranks and engines can take the worst)."""

    UP = 0
    """The tier calls its store for each batch."""
    BACKING_OFF = 1
    """The store stopped answering: requests are answered at once until its back-off
    window ends (a shared tier, see :mod:`kvtier.tiers.backoff`)."""
    DISABLED = 2
    """The tier started without its store and answers every request at once."""


@dataclass(frozen=True)
class TierSpec:
    """What a tier is built for: one rank's records and keys.

    ``keys`` must name the rank and the world size: each rank stores its own
    shard of a block, under its own key.
    """

    record_bytes: int
    keys: KeyNamespace
    regions: tuple[RecordRegion, ...] = ()
    """What each region of a record holds, from the layout resolver, for the tier's record
    codec; empty when the tier is built without a layout."""

    def __post_init__(self) -> None:
        if self.record_bytes <= 0:
            raise ValueError(f"record_bytes must be positive, got {self.record_bytes}")
        if self.keys.rank is None or self.keys.world_size is None:
            raise ValueError(
                "a storage tier stores each rank's shard under its own key: build the spec's "
                "KeyNamespace with rank= and world_size="
            )
        if not 0 <= self.keys.rank < self.keys.world_size:
            raise ValueError(
                f"rank {self.keys.rank} is outside a world of {self.keys.world_size} rank(s)"
            )


@dataclass(frozen=True)
class GetResult:
    """Payloads of a get, in key order; ``None`` where the key was missed."""

    keys: tuple[BlockKey, ...]
    records: tuple[memoryview | None, ...]

    @property
    def hits(self) -> int:
        """How many keys were found."""
        return sum(record is not None for record in self.records)


@dataclass(frozen=True)
class PutResult:
    """Whether each key of a put is now stored (written, or already there)."""

    keys: tuple[BlockKey, ...]
    stored: tuple[bool, ...]


@dataclass(frozen=True)
class ContainsResult:
    """Whether each key was present when the tier looked."""

    keys: tuple[BlockKey, ...]
    present: tuple[bool, ...]


@dataclass(frozen=True)
class DeleteResult:
    """Whether each key was present and is now removed."""

    keys: tuple[BlockKey, ...]
    deleted: tuple[bool, ...]


@dataclass(frozen=True)
class TierStats:
    """Counters since the tier was built; every count is of keys, not requests."""

    hits: int = 0
    """Keys a get returned."""
    misses: int = 0
    """Keys a get did not return, whatever the reason."""
    stores: int = 0
    """Keys written."""
    drops: int = 0
    """Keys a put did not store: refused by a full queue, failed, or not admitted."""
    held: int = 0
    """Keys a put found already stored and answered as stored without writing them again:
    every key a put is handed is counted once, in ``stores``, ``drops`` or ``held``."""
    queue_drops: int = 0
    """Keys of requests answered at once because the tier's queue was full."""
    deadline_misses: int = 0
    """Keys of gets and contains answered as misses at their deadline."""
    evictions: int = 0
    """Records the tier evicted to make room."""
    read_buffer_bytes: int = 0
    """Bytes of the buffers the tier's I/O threads read records into and keep for the next
    reads (:class:`~kvtier.tiers.buffers.ReadBuffers`); kept until the tier closes, so it
    only grows, to a bound per I/O thread."""
    bytes_read: int = 0
    """Payload bytes gets returned."""
    bytes_written: int = 0
    """Payload bytes written."""
    errors: dict[str, int] = field(default_factory=dict)
    """Keys affected by each fault, by a :class:`~kvtier.tiers.record.RecordFault` or
    :class:`Cause` value."""
    records: int | None = None
    """Records held, where the tier knows (the disk tier does; a shared store does not)."""
    queued: int = 0
    """A gauge, not a counter: requests waiting in the tier's queues or being run. Read
    before the counters, so once it is 0 the counters hold every request answered."""
    state: TierState = TierState.UP
    """A gauge: whether the tier calls its store, backs off, or is disabled."""


class StorageTier(ABC):
    """A store of block records below the host tier; see the module docstring for the protocol."""

    keys: KeyNamespace
    """Namespaces block hashes into this tier's keys."""
    record_bytes: int
    """Size of every record's payload."""
    capacity_bytes: int | None
    """Payload bytes the tier holds at most; ``None`` when the store decides (a shared server)."""
    shared: bool = False
    """Whether other processes can write the store (a server, a directory others may
    write): such a tier warns at start-up when it has no key to seal its records with."""

    @abstractmethod
    def put(self, keys: Sequence[BlockKey], records: Sequence[Buffer]) -> Future[PutResult]:
        """Queue ``records`` (each ``record_bytes`` long) under ``keys``; return at once."""

    @abstractmethod
    def get(
        self, keys: Sequence[BlockKey], *, deadline_s: float | None = None
    ) -> Future[GetResult]:
        """Queue reads of ``keys``; keys still pending after ``deadline_s`` seconds are misses.

        ``deadline_s=None`` uses the tier's configured deadline.
        """

    @abstractmethod
    def contains(
        self, keys: Sequence[BlockKey], *, deadline_s: float | None = None
    ) -> Future[ContainsResult]:
        """Queue a presence check of ``keys``; a present key may still miss on a later get."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> Future[DeleteResult]:
        """Queue the removal of ``keys``."""

    @abstractmethod
    def stats(self) -> TierStats:
        """The counters now."""

    @abstractmethod
    def close(self) -> None:
        """Finish queued requests, stop the tier's threads and release the store. Idempotent."""


class RemovalLog:
    """Mixin of a tier that knows the records it removes, so that they can be announced.

    Off until :meth:`watch_removals`: a tier nobody asks keeps no keys. The
    tier calls :meth:`_note_removed` from any thread.
    """

    _removed: list[BlockKey] | None = None
    _removed_lock: threading.Lock

    def watch_removals(self) -> None:
        """Keep the keys of records removed from now on, for :meth:`take_removed`."""
        self._removed_lock = threading.Lock()
        self._removed = []

    def take_removed(self) -> list[BlockKey]:
        """Return and forget the keys of the records removed since the last call."""
        if not self._removed:  # most calls; a key noted meanwhile is taken by the next one
            return []
        with self._removed_lock:
            removed, self._removed = self._removed, []
        return removed

    def _note_removed(self, keys: Sequence[BlockKey]) -> None:
        """Keep ``keys`` (records this tier no longer holds) if removals are watched."""
        if self._removed is None or not keys:
            return
        with self._removed_lock:
            self._removed.extend(keys)
