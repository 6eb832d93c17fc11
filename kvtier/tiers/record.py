"""The record format below the host tier: a checked header, then the block's bytes.

Every record a lower tier writes is a header followed by the payload (the
block's host-tier record, ``record_bytes`` long). The header, little-endian:

- magic (4 bytes): ``b"KVTR"``;
- format version (2): :data:`FORMAT_VERSION`;
- key length (2): bytes of the key that ends the header;
- payload length (8);
- layout fingerprint (16): BLAKE2b digest of the layout fingerprint;
- sequence (8): the writer's counter (the disk tier orders a warm restart by it);
- payload checksum (8): XXH3-64 of the payload;
- header checksum (8): XXH3-64 of the header, this field zeroed, and the key;
- key: the full namespaced block key.

:meth:`RecordCodec.verify` checks a record against the key it was asked for
and returns the first :class:`RecordFault` it finds, or ``None``. Records are
plain bytes: nothing read from a tier is ever unpickled or evaluated.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

import xxhash

from kvtier.index.base import BlockKey

MAGIC = b"KVTR"
FORMAT_VERSION = 1
"""Version of the record header written by this code; others are read as faults."""

_FIXED = struct.Struct("<4sHHQ16sQQQ")
_VERSIONED = struct.Struct("<4sH")
_CHECKSUM_OFFSET = _FIXED.size - 8
_SUMMED = struct.Struct("<Q")
HEADER_FIXED_BYTES = _FIXED.size
"""Bytes of the header before the key."""
MAX_KEY_BYTES = 1024
"""Longest key a record may carry."""


class RecordFault(enum.Enum):
    """Why a record read from a tier was not returned; each is counted under its value."""

    VERSION = "version"
    """Not a record of this format: wrong magic or an unknown format version."""
    CHECKSUM = "checksum"
    """The header or the payload does not match its checksum (corrupted or torn)."""
    FINGERPRINT = "fingerprint"
    """Written for another layout."""
    KEY = "key"
    """Written for another key or another namespace."""
    LENGTH = "length"
    """Shorter or longer than a record of this layout."""


@dataclass(frozen=True)
class RecordHeader:
    """The fields of a parsed, self-consistent header."""

    key: BlockKey
    payload_bytes: int
    sequence: int
    checksum: int
    header_bytes: int
    """Bytes of the header including its key: where the payload starts."""


def fingerprint_digest(layout_fingerprint: str) -> bytes:
    """The 16 bytes a header carries for ``layout_fingerprint``."""
    return hashlib.blake2b(layout_fingerprint.encode(), digest_size=16).digest()


def payload_checksum(payload: memoryview | bytes) -> int:
    """XXH3-64 of a payload."""
    return xxhash.xxh3_64_intdigest(payload)


class RecordCodec:
    """Writes and checks the records of one layout (fingerprint and record size)."""

    def __init__(self, layout_fingerprint: str, record_bytes: int) -> None:
        if record_bytes <= 0:
            raise ValueError(f"record_bytes must be positive, got {record_bytes}")
        self.fingerprint = fingerprint_digest(layout_fingerprint)
        self.record_bytes = record_bytes

    def header(self, key: BlockKey, checksum: int, sequence: int = 0) -> bytes:
        """The header of a ``record_bytes`` payload whose checksum is ``checksum``."""
        buffer = bytearray(HEADER_FIXED_BYTES + len(key))
        self.header_into(buffer, key, checksum, sequence)
        return bytes(buffer)

    def header_into(
        self, buffer: bytearray | memoryview, key: BlockKey, checksum: int, sequence: int = 0
    ) -> int:
        """Write the header of :meth:`header` at the start of ``buffer``; return its length."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a record key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        end = HEADER_FIXED_BYTES + len(key)
        _FIXED.pack_into(
            buffer,
            0,
            MAGIC,
            FORMAT_VERSION,
            len(key),
            self.record_bytes,
            self.fingerprint,
            sequence,
            checksum,
            0,
        )
        buffer[HEADER_FIXED_BYTES:end] = key
        _SUMMED.pack_into(buffer, _CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(buffer[:end]))
        return end

    def parse(self, data: memoryview | bytes) -> RecordHeader | RecordFault:
        """Parse the header at the start of ``data`` and check everything but the payload.

        ``data`` may hold only the header area (the disk tier's scan reads no
        payloads); the key is not compared, since the caller may not know it.
        """
        if len(data) >= _VERSIONED.size and _VERSIONED.unpack_from(data) != (MAGIC, FORMAT_VERSION):
            return RecordFault.VERSION
        if len(data) < HEADER_FIXED_BYTES:
            return RecordFault.LENGTH
        _, _, key_bytes, payload_bytes, fingerprint, sequence, checksum, summed = (
            _FIXED.unpack_from(data)
        )
        end = HEADER_FIXED_BYTES + key_bytes
        if not 0 < key_bytes <= MAX_KEY_BYTES or len(data) < end:
            return RecordFault.LENGTH
        view = memoryview(data)
        digest = xxhash.xxh3_64()
        digest.update(view[:_CHECKSUM_OFFSET])
        digest.update(bytes(8))
        digest.update(view[HEADER_FIXED_BYTES:end])
        if digest.intdigest() != summed:
            return RecordFault.CHECKSUM
        if fingerprint != self.fingerprint:
            return RecordFault.FINGERPRINT
        if payload_bytes != self.record_bytes:
            return RecordFault.LENGTH
        return RecordHeader(
            bytes(view[HEADER_FIXED_BYTES:end]), payload_bytes, sequence, checksum, end
        )

    def verify(
        self, key: BlockKey, header: RecordHeader | RecordFault, payload: memoryview | bytes
    ) -> RecordFault | None:
        """Check a parsed header and its payload against the ``key`` that was asked for."""
        if isinstance(header, RecordFault):
            return header
        if header.key != key:
            return RecordFault.KEY
        if len(payload) != header.payload_bytes:
            return RecordFault.LENGTH
        if payload_checksum(payload) != header.checksum:
            return RecordFault.CHECKSUM
        return None

    def _payload(self, payload: memoryview | bytes) -> memoryview | bytes:
        if len(payload) != self.record_bytes:
            raise ValueError(f"a payload is {self.record_bytes} bytes, got {len(payload)}")
        return payload

    def encode(self, key: BlockKey, payload: memoryview | bytes, sequence: int = 0) -> bytes:
        """Header and payload as one bytes object (for stores that take one value per key)."""
        payload = self._payload(payload)
        return b"".join((self.header(key, payload_checksum(payload), sequence), payload))

    @property
    def max_encoded_bytes(self) -> int:
        """Bytes of the longest record :meth:`encode_into` may write (the longest key's)."""
        return HEADER_FIXED_BYTES + MAX_KEY_BYTES + self.record_bytes

    def encode_into(
        self, buffer: bytearray, key: BlockKey, payload: memoryview | bytes, sequence: int = 0
    ) -> memoryview:
        """Write header and payload into ``buffer`` (at least :attr:`max_encoded_bytes` long).

        Returns:
            The record: a view of the start of ``buffer``, valid until it is written again.
        """
        payload = self._payload(payload)
        start = self.header_into(buffer, key, payload_checksum(payload), sequence)
        end = start + len(payload)
        buffer[start:end] = payload
        return memoryview(buffer)[:end]

    def decode(self, key: BlockKey, record: memoryview | bytes) -> memoryview | RecordFault:
        """The payload of a record read from a store that keeps one value per key, or a fault."""
        view = memoryview(record)
        header = self.parse(view)
        payload = view[header.header_bytes :] if isinstance(header, RecordHeader) else view
        fault = self.verify(key, header, payload)
        return payload if fault is None else fault
