"""The ``disk`` tier: block records in one preallocated file per rank, with warm restart.

Each rank owns one file, ``<path>/rank<R>-of<W>.kvtier``, locked against a
second process. The file is a 4 KiB superblock (magic, format version, record
and slot sizes, slot count) followed by fixed-size slots; a slot is a 4 KiB
header area (the record header of :mod:`kvtier.tiers.record`, zero-padded)
and the payload, padded to a multiple of 4 KiB so every record starts on a
page. Records are written and read with positional I/O (``os.pwrite``,
``os.preadv``) from a pool of I/O threads, through the page cache. A write
puts the payload first and its header last; a crash part-way through leaves
the slot's previous header over a mixed payload, which the payload checksum
turns into a miss. A read takes header and payload in one ``os.preadv``.

Which key sits in which slot is a :class:`~kvtier.index.BlockIndex` (any
registered one, ``lru`` by default), so the tier evicts with the same policies
as the host tier; a get pins its slots while it reads, so they are never
overwritten under it. The index numbers its own slots; the tier maps them to
file slots, so a warm restart can put every record found back where it lies.

Warm restart: a new tier with the same path, rank, world size and record size
reads the header area of every slot, keeps the records whose header is intact
and written for its layout fingerprint and key namespace (counting the others
by fault), and indexes them in the order they were written. Payload checksums
are checked on every read, so a torn or corrupted record is a miss. A
different record size starts the file afresh.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

from kvtier.index.base import BlockIndex, BlockKey, EventKind
from kvtier.plugins import default_registry
from kvtier.tiers.base import Cause, QueuedTier, TierError, TierSpec
from kvtier.tiers.configs import DiskTierConfig
from kvtier.tiers.record import (
    HEADER_FIXED_BYTES,
    MAX_KEY_BYTES,
    RecordCodec,
    RecordFault,
    payload_checksum,
)

logger = logging.getLogger(__name__)

PAGE_BYTES = 4096
SUPERBLOCK_BYTES = PAGE_BYTES
HEADER_AREA_BYTES = PAGE_BYTES
assert HEADER_FIXED_BYTES + MAX_KEY_BYTES <= HEADER_AREA_BYTES

_SUPERBLOCK = struct.Struct("<4sHQQQ")
_SUPERBLOCK_MAGIC = b"KVTD"
_SUPERBLOCK_VERSION = 1
_ZERO_HEADER = bytes(HEADER_AREA_BYTES)


def _cause_of(exc: OSError) -> Cause:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return Cause.NO_SPACE
    if exc.errno == errno.EROFS:
        return Cause.READ_ONLY
    return Cause.IO


class DiskTier(QueuedTier):
    """One rank's records in one file; see the module docstring for the layout."""

    def __init__(self, config: DiskTierConfig, spec: TierSpec, index: BlockIndex) -> None:
        """Open (or create) the rank's file and index the records it already holds.

        Args:
            config: The validated config.
            spec: Record size and the rank's key namespace.
            index: An empty block index with :meth:`slots_for` slots, the tier's directory.

        Raises:
            TierError: The directory cannot be created or written, the file is
                in use by another process, or the disk has no room for it.
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
        self.file = Path(config.path) / f"rank{spec.keys.rank}-of{spec.keys.world_size}.kvtier"
        self._codec = RecordCodec(self.keys.layout_fingerprint, spec.record_bytes)
        self._index = index
        self._index_lock = threading.Lock()
        self._header_buffers = threading.local()
        self._file_slots = list(range(self.num_slots))
        self._sequence = 0
        self._fd = self._open(config)
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
        return HEADER_AREA_BYTES + -(-record_bytes // PAGE_BYTES) * PAGE_BYTES

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

    def _open(self, config: DiskTierConfig) -> int:
        what = "create the directory"
        try:
            Path(config.path).mkdir(parents=True, exist_ok=True)
            what = "open"
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierError(
                f"disk tier: cannot {what} {self.file if what == 'open' else config.path}: "
                f"{exc.strerror}; point path at a writable directory on a local disk"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise TierError(
                f"disk tier: {self.file} is in use by another kvtier process; give each "
                "engine its own path"
            ) from None
        return fd

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
            os.pwrite(self._fd, superblock.ljust(SUPERBLOCK_BYTES, b"\0"), 0)
        except OSError as exc:
            if previous_slots == 0:
                os.ftruncate(self._fd, 0)
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
        data = os.pread(self._fd, _SUPERBLOCK.size, 0)
        if len(data) < _SUPERBLOCK.size:
            return 0
        magic, version, record_bytes, slot_bytes, num_slots = _SUPERBLOCK.unpack(data)
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
        for file_slot in range(previous_slots):
            area = os.pread(self._fd, HEADER_AREA_BYTES, self._offset(file_slot))
            if not any(area[:HEADER_FIXED_BYTES]):
                continue  # never written, or deleted
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

    def _header_buffer(self) -> bytearray:
        buffer: bytearray | None = getattr(self._header_buffers, "buffer", None)
        if buffer is None:
            buffer = self._header_buffers.buffer = bytearray(HEADER_AREA_BYTES)
        return buffer

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        with self._index_lock:
            slots = [self._index.slot_of(key) for key in keys]
            pinned = [key for key, slot in zip(keys, slots, strict=True) if slot is not None]
            self._index.pin(pinned)
        found: list[memoryview | None] = []
        untrusted: list[BlockKey] = []
        try:
            for key, slot in zip(keys, slots, strict=True):
                if slot is None:
                    found.append(None)
                    continue
                try:
                    payload = self._read_record(key, self._offset(self._file_slots[slot]))
                except OSError as exc:
                    payload = _cause_of(exc)
                if isinstance(payload, (RecordFault, Cause)):
                    self._count_error(payload)
                    untrusted.append(key)
                    found.append(None)
                else:
                    found.append(payload)
        finally:
            with self._index_lock:
                self._index.discard(untrusted)
                self._index.unpin(pinned)
                self._index.take_events()
        return found

    def _read_record(self, key: BlockKey, offset: int) -> memoryview | RecordFault:
        """Header and payload in one ``preadv``, then every check."""
        header_area = self._header_buffer()
        payload = bytearray(self.record_bytes)
        read = os.preadv(self._fd, [header_area, payload], offset)
        if read != HEADER_AREA_BYTES + self.record_bytes:
            return RecordFault.LENGTH
        fault = self._codec.verify(key, self._codec.parse(header_area), payload)
        return memoryview(payload) if fault is None else fault

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        with self._index_lock:
            slots = [self._index.reserve([key])[0] for key in keys]
            present = [
                slot is None and self._index.slot_of(key) is not None
                for key, slot in zip(keys, slots, strict=True)
            ]
            sequence = self._sequence
            self._sequence += len(keys)
            evicted = sum(event.kind is EventKind.EVICTED for event in self._index.take_events())
        self._count(evictions=evicted)
        written: list[BlockKey] = []
        failed: list[BlockKey] = []
        for position, (key, slot, record) in enumerate(zip(keys, slots, records, strict=True)):
            if slot is None:
                continue
            try:
                self._write_record(
                    key, record, sequence + position, self._offset(self._file_slots[slot])
                )
            except OSError as exc:
                self._count_error(_cause_of(exc))
                failed.append(key)
            else:
                written.append(key)
        with self._index_lock:
            self._index.commit(written)
            self._index.abort(failed)
        self._count(stores=len(written), bytes_written=len(written) * self.record_bytes)
        done = set(written)
        return [key in done or was for key, was in zip(keys, present, strict=True)]

    def _write_record(self, key: BlockKey, record: memoryview, sequence: int, offset: int) -> None:
        """The payload, then its header: a header is only written over a complete payload."""
        checksum = payload_checksum(record)
        self._write_all(record, offset + HEADER_AREA_BYTES)
        header = self._codec.header(key, checksum, sequence)
        self._write_all(header.ljust(HEADER_AREA_BYTES, b"\0"), offset)

    def _write_all(self, data: bytes | memoryview, offset: int) -> None:
        """``pwrite`` all of ``data`` at ``offset``; a short write is continued."""
        written = os.pwrite(self._fd, data, offset)
        view = memoryview(data)[written:]
        while view:
            offset += written
            written = os.pwrite(self._fd, view, offset)
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]

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
        try:
            for slot in slots:
                if slot is None:
                    continue
                try:
                    os.pwrite(self._fd, _ZERO_HEADER, self._offset(self._file_slots[slot]))
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


def build_disk_tier(config: DiskTierConfig, spec: TierSpec) -> DiskTier:
    """The ``disk`` tier's factory: its block index from the registry, then the tier."""
    registration = default_registry().get("block_indexes", config.eviction)
    num_slots = DiskTier.slots_for(config, spec)
    index = registration.factory(registration.config_model(), num_slots)
    return DiskTier(config, spec, index)
