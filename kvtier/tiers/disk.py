"""The ``disk`` tier: block records in one preallocated file per rank, with warm restart.

Each rank owns one file, ``<path>/rank<R>-of<W>.kvtier``, claimed as
:mod:`kvtier.tiers.disk_file` says: locked against a second process, opened only as a file
kvtier may have made, with other world sizes' files cleared away.
The file is a 4 KiB superblock (magic, format version,
record and slot sizes, slot count) followed by fixed-size slots; a slot is a 4 KiB
header area (the record header of :mod:`kvtier.tiers.record`, zero-padded) and the
payload, padded to a multiple of 4 KiB so every record starts on a page. Records are
written and read with positional I/O from a pool of I/O threads, through the page cache:
a write of records in consecutive slots (up to :data:`WRITE_GROUP` of them and
:data:`WRITE_GROUP_BYTES`) takes their headers (built in the I/O thread's buffer), the
caller's payloads and any padding in one ``os.pwritev``, with no copy; a read takes one
record's header and payload in one ``os.preadv`` into one new buffer (not zero-filled
first), and the payload is returned as a view of it.
A crash part-way through a write may leave any mix of the slot's old and new
pages; the seal in the header (a payload checksum, or a MAC with a key) turns every
such mix into a miss.

With ``o_direct`` the file is opened with ``O_DIRECT``, bypassing the page
cache. Every offset and length is already a multiple of 4 KiB; a write copies
the payload into the I/O thread's page-aligned slot buffer behind the header
and writes the pages holding them at once (the whole slot without a record
codec), and a read takes the whole slot (with a codec, the header's page and
then the pages of the body it names) into a page-aligned buffer of the I/O
thread's. A filesystem that refuses ``O_DIRECT`` is a start-up error.

Which key sits in which slot is a :class:`~kvtier.index.BlockIndex` (any
registered one, ``lru`` by default), so the tier evicts with the same policies
as the host tier; a get pins its slots while it reads, so they are never
overwritten under it. The index numbers its own slots; the tier maps them to
file slots, so a warm restart can put every record found back where it lies.
The tier is a :class:`~kvtier.tiers.base.RemovalLog`: the keys it evicts, finds
corrupt or deletes can be announced as removed.

Warm restart: a new tier with the same path, rank, world size and record size
reads the header area of every slot, keeps the records whose header is intact
and written for its layout fingerprint and key namespace (counting the others
by fault), and indexes them in the order they were written. Payload checksums
are checked on every read, so a torn or corrupted record is a miss. A
different record size starts the file afresh. A smaller capacity shrinks the file and
keeps the records of the slots it still has; a larger one keeps them all and adds slots.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

from kvtier.config import available_memory_bytes
from kvtier.index.base import BlockIndex, BlockKey, EventKind
from kvtier.kinds import BLOCK_INDEX
from kvtier.plugins import default_registry
from kvtier.tiers.base import Cause, RemovalLog, TierError, TierSpec
from kvtier.tiers.buffers import ReadBuffers
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.disk_file import no_direct_io, open_rank_file
from kvtier.tiers.queued import QueuedTier
from kvtier.tiers.record import (
    HEADER_FIXED_BYTES,
    MAX_KEY_BYTES,
    RecordCodec,
    RecordFault,
    tier_codec,
)

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096
SUPERBLOCK_BYTES = PAGE_BYTES
HEADER_AREA_BYTES = PAGE_BYTES
assert HEADER_FIXED_BYTES + MAX_KEY_BYTES <= HEADER_AREA_BYTES


def _whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`PAGE_BYTES`."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


_SUPERBLOCK = struct.Struct("<4sHQQQ")
_SUPERBLOCK_MAGIC = b"KVTD"
_SUPERBLOCK_VERSION = 1
_HEADER_LIMIT = HEADER_FIXED_BYTES + MAX_KEY_BYTES
"""A header area's bytes past this are never written: zeros in every slot."""
_ZEROS = memoryview(bytes(_HEADER_LIMIT))

WRITE_GROUP = 8
"""Most records of consecutive slots one ``pwritev`` writes through the page cache."""
WRITE_GROUP_BYTES = 2 << 20
"""Most payload bytes of one such ``pwritev`` (one record at least): a group's payloads are
all hashed before it is written, and should still be in the CPU's cache when they are.
Groups of 8 MiB (8 records of 1 MiB) made puts slower than a record at a time."""
RUN_RECORDS = 256
"""Most records one ``preadv`` reads ahead (the system takes up to 1,024 buffers a call)."""


_Pending = tuple[int, BlockKey, memoryview, int]
"""A record on its way to its file slot: the slot, the key, the payload and the sequence
number (a plain tuple, sorted by slot: cheaper per record than a named one)."""


class _HeaderAreas:
    """An I/O thread's page-aligned write buffer: the header areas of a group of records
    (with ``o_direct``, one slot: a header area, then the payload)."""

    def __init__(self, codec: RecordCodec, buffer: memoryview, areas: int) -> None:
        self.codec = codec
        self.buffer = buffer
        self._areas = [
            buffer[area * HEADER_AREA_BYTES : (area + 1) * HEADER_AREA_BYTES]
            for area in range(areas)
        ]
        self._ends = [0] * areas
        """Where each area's last header ended; zeros after it (the buffer starts zeroed)."""

    def seal(
        self, area: int, key: BlockKey, payload: memoryview, sequence: int
    ) -> tuple[memoryview, memoryview | bytes]:
        """Header area ``area``, holding the header of ``payload`` and zeros after it, and
        the body to write after it (see :meth:`RecordCodec.seal_into`)."""
        view = self._areas[area]
        end, body = self.codec.seal_into(view, key, payload, sequence)
        if end < self._ends[area]:
            view[end : self._ends[area]] = _ZEROS[: self._ends[area] - end]
        self._ends[area] = end
        return view, body


def _cause_of(exc: OSError) -> Cause:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return Cause.NO_SPACE
    if exc.errno == errno.EROFS:
        return Cause.READ_ONLY
    return Cause.IO


def rank_file(config: DiskTierConfig, spec: TierSpec) -> Path:
    """The file of the rank ``spec`` names, in the tier's directory."""
    return Path(config.path) / f"rank{spec.keys.rank}-of{spec.keys.world_size}.kvtier"


def aligned_buffer(nbytes: int) -> memoryview:
    """A new zero-filled, writable buffer that starts on a page, as ``O_DIRECT`` I/O needs."""
    return memoryview(mmap.mmap(-1, nbytes))


class DiskTier(QueuedTier, RemovalLog):
    """One rank's records in one file; see the module docstring for the layout."""

    def __init__(self, config: DiskTierConfig, spec: TierSpec, index: BlockIndex) -> None:
        """Open (or create) the rank's file and index the records it already holds.

        Args:
            config: The validated config.
            spec: Record size and the rank's key namespace.
            index: An empty block index with :meth:`slots_for` slots, the tier's directory.

        Raises:
            TierError: The directory cannot be created or written, it or the
                file is one the tier may not have made (see :meth:`_open`), the
                file (or a rank file of another world size in the directory) is in use
                by another process, the disk has no room for it,
                or ``o_direct`` is set and the filesystem refuses ``O_DIRECT``.
        """
        super().__init__(
            spec,
            name="disk",
            namespace=config.namespace,
            io_threads=config.io_threads,
            queue_depth=config.queue_depth,
            get_deadline_s=config.get_deadline_s,
        )
        assert spec.keys.rank is not None and spec.keys.world_size is not None
        self.slot_bytes = self.slot_bytes_for(spec.record_bytes)
        self.num_slots = index.num_slots
        self.capacity_bytes = self.num_slots * spec.record_bytes
        self.file = rank_file(config, spec)
        self._codec = tier_codec(
            config,
            self.keys.layout_fingerprint,
            spec.record_bytes,
            tier="disk",
            shared=self.shared,
            regions=spec.regions,
        )
        self._index = index
        self._index_lock = threading.Lock()
        self.o_direct = config.o_direct
        self._thread_buffers = threading.local()
        self._read_buffers = ReadBuffers(
            self.slot_bytes, align=mmap.PAGESIZE if self.o_direct else 1
        )
        self._file_slots = list(range(self.num_slots))
        padding = self.slot_bytes - HEADER_AREA_BYTES - spec.record_bytes
        self._padding = memoryview(bytes(padding)) if padding else None
        self._sequence = 0
        self._fd = open_rank_file(self.file, spec.keys.world_size, self.o_direct)
        try:
            previous_slots = self._prepare_file(config.preallocate)
            self._rebuild(previous_slots)
        except BaseException:
            os.close(self._fd)
            raise
        logger.info(
            "disk tier: %s, %d slots of %d bytes (%.2f GiB), %d record(s) found",
            self.file,
            self.num_slots,
            self.slot_bytes,
            self.num_slots * self.slot_bytes / 2**30,
            self._held_records(),
        )
        self._start()

    @staticmethod
    def slot_bytes_for(record_bytes: int) -> int:
        """File bytes of one slot: the header area and the payload rounded up to a page."""
        return HEADER_AREA_BYTES + _whole_pages(record_bytes)

    @classmethod
    def slots_for(cls, config: DiskTierConfig, spec: TierSpec) -> int:
        """How many records one rank's file holds.

        Raises:
            TierError: One rank's share of ``capacity_bytes`` holds no record.
        """
        assert spec.keys.world_size is not None
        share = config.capacity_bytes // spec.keys.world_size
        slot_bytes = cls.slot_bytes_for(spec.record_bytes)
        num_slots = (share - SUPERBLOCK_BYTES) // slot_bytes
        if num_slots < 1:
            raise TierError(
                f"disk tier: capacity_bytes {config.capacity_bytes} over "
                f"{spec.keys.world_size} rank(s) holds no record of {spec.record_bytes} bytes; "
                f"set it to at least {(SUPERBLOCK_BYTES + slot_bytes) * spec.keys.world_size}"
            )
        return num_slots

    # ----------------------------------------------------------------- start-up

    def _prepare_file(self, preallocate: bool) -> int:
        """Size the file and write its superblock; return how many slots may hold records."""
        size = SUPERBLOCK_BYTES + self.num_slots * self.slot_bytes
        previous_slots = self._read_superblock()
        try:
            if previous_slots == 0:
                os.ftruncate(self._fd, 0)
            if preallocate:
                os.ftruncate(self._fd, size)
                os.posix_fallocate(self._fd, 0, size)
            elif os.fstat(self._fd).st_size > size:
                os.ftruncate(self._fd, size)
            superblock = _SUPERBLOCK.pack(
                _SUPERBLOCK_MAGIC,
                _SUPERBLOCK_VERSION,
                self.record_bytes,
                self.slot_bytes,
                self.num_slots,
            )
            page = aligned_buffer(SUPERBLOCK_BYTES)
            page[: len(superblock)] = superblock
            os.pwrite(self._fd, page, 0)
        except OSError as exc:
            if previous_slots == 0:
                os.ftruncate(self._fd, 0)
            if self.o_direct and exc.errno == errno.EINVAL:
                raise no_direct_io(self.file, exc) from None
            if _cause_of(exc) is Cause.NO_SPACE:
                raise TierError(
                    f"disk tier: no room for {size} bytes in {self.file} ({exc.strerror}); free "
                    "space on that disk or lower capacity_bytes"
                ) from None
            raise TierError(
                f"disk tier: cannot write {self.file}: {exc.strerror}; point path at a "
                "writable directory on a local disk"
            ) from None
        return min(previous_slots, self.num_slots)

    def _read_superblock(self) -> int:
        """Slots the file held records in, or 0 when it is new or of another geometry."""
        page = aligned_buffer(SUPERBLOCK_BYTES)
        try:
            read = os.preadv(self._fd, [page], 0)
        except OSError as exc:
            if self.o_direct and exc.errno == errno.EINVAL:
                raise no_direct_io(self.file, exc) from None
            raise
        if read < _SUPERBLOCK.size:
            return 0
        magic, version, record_bytes, slot_bytes, num_slots = _SUPERBLOCK.unpack_from(page)
        if (magic, version, record_bytes, slot_bytes) == (
            _SUPERBLOCK_MAGIC,
            _SUPERBLOCK_VERSION,
            self.record_bytes,
            self.slot_bytes,
        ):
            return int(num_slots)
        logger.info(
            "disk tier: %s holds no records of %d bytes in this format; starting it empty",
            self.file,
            self.record_bytes,
        )
        return 0

    def _rebuild(self, previous_slots: int) -> None:
        """Index the intact records of this layout and namespace in the first slots."""
        found: dict[BlockKey, tuple[int, int]] = {}
        page = aligned_buffer(HEADER_AREA_BYTES)
        for file_slot in range(previous_slots):
            area = page[: os.preadv(self._fd, [page], self._offset(file_slot))]
            if not any(area[:HEADER_FIXED_BYTES]):
                continue  # never written, deleted, or past the end of a truncated file
            header = self._codec.parse(area)
            if isinstance(header, RecordFault):
                self._count_error(header)
                continue
            if not self.keys.owns(header.key):
                self._count_error(RecordFault.KEY)
                continue
            earlier = found.get(header.key)
            if earlier is None or earlier[0] < header.sequence:
                found[header.key] = (header.sequence, file_slot)
        used: set[int] = set()
        index_to_file: dict[int, int] = {}
        for key, (sequence, file_slot) in sorted(found.items(), key=lambda item: item[1]):
            slot = self._index.reserve([key])[0]
            if slot is None:
                continue
            self._index.commit([key])
            index_to_file[slot] = file_slot
            used.add(file_slot)
            self._sequence = max(self._sequence, sequence + 1)
        self._index.take_events()
        spare = iter(slot for slot in range(self.num_slots) if slot not in used)
        self._file_slots = [
            index_to_file[slot] if slot in index_to_file else next(spare)
            for slot in range(self.num_slots)
        ]

    # ---------------------------------------------------------------------- I/O

    def _offset(self, file_slot: int) -> int:
        return SUPERBLOCK_BYTES + file_slot * self.slot_bytes

    def _thread_buffer(self) -> _HeaderAreas:
        """This I/O thread's header areas, in a page-aligned buffer: one slot with
        ``o_direct``, else the header areas of a group of writes."""
        areas: _HeaderAreas | None = getattr(self._thread_buffers, "areas", None)
        if areas is None:
            count = 1 if self.o_direct else WRITE_GROUP
            size = self.slot_bytes if self.o_direct else count * HEADER_AREA_BYTES
            areas = _HeaderAreas(self._codec, aligned_buffer(size), count)
            self._thread_buffers.areas = areas
        return areas

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        with self._index_lock:
            slots = [self._index.slot_of(key) for key in keys]
            pinned = [key for key, slot in zip(keys, slots, strict=True) if slot is not None]
            self._index.pin(pinned)
        found: list[memoryview | None] = []
        untrusted: list[BlockKey] = []
        try:
            offsets = [
                None if slot is None else self._offset(self._file_slots[slot]) for slot in slots
            ]
            read_ahead = self._read_runs(offsets)
            for key, offset in zip(keys, offsets, strict=True):
                if offset is None:
                    found.append(None)
                    continue
                try:
                    payload = self._read_record(key, offset, read_ahead.get(offset))
                except OSError as exc:
                    payload = _cause_of(exc)
                if isinstance(payload, (RecordFault, Cause)):
                    self._count_error(payload)
                    if payload is not RecordFault.TENANT:  # another tenant's record stays
                        untrusted.append(key)
                    found.append(None)
                else:
                    found.append(payload)
        finally:
            with self._index_lock:
                self._index.discard(untrusted)
                self._index.unpin(pinned)
                self._index.take_events()
            self._note_removed(untrusted)
        return found

    def _read_runs(self, offsets: Sequence[int | None]) -> dict[int, memoryview]:
        """Whole slots read ahead by their offsets: each run of records in consecutive slots
        (up to :data:`RUN_RECORDS`) in one ``preadv``. The I/O thread then takes the
        interpreter back once a run instead of once a record, which is what a read waits for
        while the engine's thread runs Python. Records with a codec are read header first,
        one at a time."""
        if self._codec.codec is not None:
            return {}
        step = self.slot_bytes
        starts = sorted({offset for offset in offsets if offset is not None})
        read: dict[int, memoryview] = {}
        first = 0
        while first < len(starts):
            end = first + 1
            while (
                end < len(starts)
                and end - first < RUN_RECORDS
                and starts[end] == starts[end - 1] + step
            ):
                end += 1
            if end - first > 1:
                buffers = [self._read_buffers.take(step) for _ in range(end - first)]
                try:
                    got = os.preadv(self._fd, buffers, starts[first])
                except OSError:
                    got = 0  # read one at a time, where the fault is counted
                read.update(zip(starts[first : first + got // step], buffers, strict=False))
            first = end
        return read

    def _read_record(
        self, key: BlockKey, offset: int, slot: memoryview | None = None
    ) -> memoryview | RecordFault:
        """Header and payload in one read into a buffer of this thread's (or the whole
        ``slot`` read ahead), then every check; with a record codec the header first, then
        only the bytes it names (with ``o_direct``, the pages holding them)."""
        header_first = self._codec.codec is not None
        if header_first:
            size = HEADER_AREA_BYTES
        else:
            size = self.slot_bytes if self.o_direct else HEADER_AREA_BYTES + self.record_bytes
        if slot is None:
            slot = self._read_buffers.take(size)
            if os.preadv(self._fd, [slot], offset) < size:
                return RecordFault.LENGTH
        header = self._codec.parse(slot[:HEADER_AREA_BYTES])
        if isinstance(header, RecordFault):
            return header
        if header_first:
            wanted = header.payload_bytes
            if wanted > self.slot_bytes - HEADER_AREA_BYTES:
                return RecordFault.LENGTH
            span = _whole_pages(wanted) if self.o_direct else wanted
            body = self._read_buffers.take(span)
            if os.preadv(self._fd, [body], offset + HEADER_AREA_BYTES) < span:
                return RecordFault.LENGTH
            body = body[:wanted]
        else:
            body = slot[HEADER_AREA_BYTES : HEADER_AREA_BYTES + header.payload_bytes]
        return self._codec.unseal(key, header, body)

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        index = self._index
        with self._index_lock:
            slots = [index.reserve([key])[0] for key in keys]
            present = [
                slot is None and index.slot_of(key) is not None
                for key, slot in zip(keys, slots, strict=True)
            ]
            sequence = self._sequence
            self._sequence += len(keys)
            events = index.take_events()
            evicted = [event.key for event in events if event.kind is EventKind.EVICTED]
            self._note_removed(evicted)
        written: list[BlockKey] = []
        failed: list[BlockKey] = []
        areas = self._thread_buffer()
        file_slots = self._file_slots
        todo = [
            (file_slots[slot], key, record, sequence + position)
            for position, (key, slot, record) in enumerate(zip(keys, slots, records, strict=True))
            if slot is not None
        ]
        for group in self._groups(todo):
            try:
                self._write_group(areas, group)
            except OSError:
                # Record by record, so that each is stored, or failed and counted, on its own.
                for one in group:
                    try:
                        self._write_group(areas, [one])
                    except OSError as exc:
                        self._count_error(_cause_of(exc))
                        failed.append(one[1])
                    else:
                        written.append(one[1])
            else:
                written.extend(one[1] for one in group)
        with self._index_lock:
            index.commit(written)
            index.abort(failed)
        self._count(
            evictions=len(evicted),
            stores=len(written),
            held=present.count(True),
            bytes_written=len(written) * self.record_bytes,
        )
        done = set(written)
        return [key in done or was for key, was in zip(keys, present, strict=True)]

    def _groups(self, todo: list[_Pending]) -> list[list[_Pending]]:
        """``todo`` cut into runs of consecutive file slots, each written by one system call
        (:data:`WRITE_GROUP` records and :data:`WRITE_GROUP_BYTES` at most; one record
        with ``o_direct``)."""
        # A record codec's records are shorter than their slots: each is written alone.
        most = (
            1
            if self.o_direct or self._codec.codec is not None
            else max(1, min(WRITE_GROUP, WRITE_GROUP_BYTES // self.record_bytes))
        )
        groups: list[list[_Pending]] = []
        last: list[_Pending] = []
        for pending in sorted(todo):
            if last and len(last) < most and last[-1][0] + 1 == pending[0]:
                last.append(pending)
            else:
                last = [pending]
                groups.append(last)
        return groups

    def _write_group(self, areas: _HeaderAreas, group: list[_Pending]) -> None:
        """Write the slots of ``group`` (consecutive in the file), headers and payloads, in
        one system call through this thread's header ``areas``.

        Through the page cache each header is built in its own header area and
        the payloads are written from where they lie, with no copy: at 256 KiB
        one ``pwritev`` of 8 records costs markedly less than 8 (a loop hashing
        and writing records from one thread reached 0.87x of a bare sequential
        ``pwrite`` that way, 0.70x a record at a time). With ``o_direct`` (one
        record) the payload is first copied behind the header in the areas'
        page-aligned buffer; the checksum then reads the copy while it is still
        in the CPU's cache.
        """
        offset = self._offset(group[0][0])
        if self.o_direct:
            ((_, key, record, sequence),) = group
            payload = areas.buffer[HEADER_AREA_BYTES : HEADER_AREA_BYTES + self.record_bytes]
            payload[:] = record
            _, body = areas.seal(0, key, payload, sequence)
            if body is not payload:
                payload[: len(body)] = body
            # The pages holding the header and the body: an encoded body needs fewer.
            used = _whole_pages(HEADER_AREA_BYTES + len(body))
            self._write_all([areas.buffer[:used]], offset, used)
            return
        parts: list[memoryview | bytes] = []
        padding = self._padding
        for area, (_, key, record, sequence) in enumerate(group):
            header, body = areas.seal(area, key, record, sequence)
            parts += (header, body, padding) if padding else (header, body)
        if padding:
            parts.pop()
        self._write_all(parts, offset, sum(len(part) for part in parts))

    def _write_all(self, parts: list[memoryview | bytes], offset: int, total: int) -> None:
        """``pwritev`` all of ``parts`` (``total`` bytes) at ``offset``; a short write is
        continued."""
        while True:
            written = os.pwritev(self._fd, parts, offset)
            if written == total:
                return
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            offset += written
            total -= written
            while parts and written >= len(parts[0]):
                written -= len(parts[0])
                parts = parts[1:]
            if not parts:
                return
            parts = [parts[0][written:], *parts[1:]]

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._index_lock:
            return [self._index.slot_of(key) is not None for key in keys]

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._index_lock:
            slots = [self._index.slot_of(key) for key in keys]
            held = [key for key, slot in zip(keys, slots, strict=True) if slot is not None]
            # Pinned while the header is cleared, so the slot is not reused before that.
            self._index.pin(held)
            self._index.discard(held)
            self._index.take_events()
        self._note_removed(held)
        zero_header = aligned_buffer(HEADER_AREA_BYTES)
        try:
            for slot in slots:
                if slot is None:
                    continue
                try:
                    os.pwrite(self._fd, zero_header, self._offset(self._file_slots[slot]))
                except OSError as exc:
                    self._count_error(_cause_of(exc))
        finally:
            with self._index_lock:
                self._index.unpin(held)
        return [slot is not None for slot in slots]

    def _held_records(self) -> int | None:
        with self._index_lock:
            return self._index.stats().readable

    def _release(self) -> None:
        os.close(self._fd)

    def __repr__(self) -> str:
        return f"DiskTier({str(self.file)!r}, slots={self.num_slots})"


INDEX_BYTES_PER_SLOT = 512
"""Memory the tier's index and slot map take per slot once full, rounded up: 300 bytes
(``lru``, ``arc``, ``s3fifo``) to 450 (``prefix_arc``) measured for a million slots, with
about 90 more for the key each holds."""


def check_room(config: DiskTierConfig, spec: TierSpec, num_slots: int) -> None:
    """Refuse, before anything is allocated, a rank's file its disk cannot hold (when
    ``preallocate`` reserves it) and an index larger than the memory available.

    Raises:
        TierError: Naming ``capacity_bytes``, both numbers, and what to do.
    """
    assert spec.keys.rank is not None and spec.keys.world_size is not None
    slot_bytes = DiskTier.slot_bytes_for(spec.record_bytes)
    ranks = f"over {spec.keys.world_size} rank(s)"
    if config.preallocate:
        _check_free_space(config, spec, num_slots * slot_bytes, ranks)
    index_bytes = num_slots * INDEX_BYTES_PER_SLOT
    available = available_memory_bytes()
    if available is not None and index_bytes > available:
        raise TierError(
            f"disk tier: capacity_bytes {config.capacity_bytes} {ranks} makes {num_slots} "
            f"slots of {spec.record_bytes}-byte records, whose index needs about "
            f"{index_bytes / 2**30:.1f} GiB of memory, more than the {available / 2**30:.1f} "
            "GiB available; lower capacity_bytes"
        )


def _check_free_space(config: DiskTierConfig, spec: TierSpec, slots_bytes: int, ranks: str) -> None:
    """Refuse a rank's file of ``slots_bytes`` of slots that its filesystem has no room for."""
    file = rank_file(config, spec)
    needed = SUPERBLOCK_BYTES + slots_bytes
    try:
        existing = os.lstat(file)
        if stat.S_ISREG(existing.st_mode):
            needed -= min(needed, existing.st_blocks * 512)  # already reserved by the file
    except OSError:
        pass  # no file yet, or one that opening the tier refuses with its own message
    directory = Path(config.path).absolute()
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent  # created when the tier opens
    try:
        status = os.statvfs(directory)
    except OSError:
        return  # the tier's open names what is wrong with the path
    free = status.f_bavail * status.f_frsize
    if needed > free:
        raise TierError(
            f"disk tier: no room for {needed} more bytes in {file} ({free / 2**30:.1f} GiB free "
            f"on its filesystem, capacity_bytes {config.capacity_bytes} {ranks}); free space "
            "on that disk or lower capacity_bytes"
        )


def build_disk_tier(config: DiskTierConfig, spec: TierSpec) -> DiskTier:
    """The ``disk`` tier's factory: the room it needs checked, its block index from the
    registry, then the tier."""
    registration = default_registry().get(BLOCK_INDEX, config.eviction)
    num_slots = DiskTier.slots_for(config, spec)
    check_room(config, spec, num_slots)
    index = registration.factory(registration.config_model(), num_slots)
    return DiskTier(config, spec, index)
