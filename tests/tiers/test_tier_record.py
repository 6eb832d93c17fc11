"""The record format: every way a record can be wrong is a named fault, never a payload."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvtier.tiers.record import (
    FORMAT_VERSION,
    HEADER_FIXED_BYTES,
    MAGIC,
    RecordCodec,
    RecordFault,
    RecordHeader,
)

RECORD = 1000
KEY = b"namespace-and-group" + b"\x07" * 32
PAYLOAD = bytes(range(256)) * 3 + bytes(RECORD - 768)
CODEC = RecordCodec("layout-a", RECORD)


def test_a_record_round_trips_without_copying_the_payload() -> None:
    record = CODEC.encode(KEY, PAYLOAD, sequence=41)
    payload = CODEC.decode(KEY, record)
    assert isinstance(payload, memoryview) and bytes(payload) == PAYLOAD
    assert payload.obj is record
    header = CODEC.parse(record)
    assert isinstance(header, RecordHeader)
    assert (header.key, header.payload_bytes, header.sequence) == (KEY, RECORD, 41)
    assert header.header_bytes == HEADER_FIXED_BYTES + len(KEY)
    assert record[:4] == MAGIC


def flip(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0x01
    return bytes(changed)


def forged(*, version: int = FORMAT_VERSION, payload_bytes: int = RECORD) -> bytes:
    """A record whose header checksum is right but whose fields say something else."""
    record = bytearray(CODEC.encode(KEY, PAYLOAD))
    struct.pack_into("<H", record, 4, version)
    struct.pack_into("<Q", record, 8, payload_bytes)
    struct.pack_into("<Q", record, HEADER_FIXED_BYTES - 8, 0)
    summed = xxh3_64_intdigest(bytes(record[:HEADER_FIXED_BYTES]) + KEY)
    struct.pack_into("<Q", record, HEADER_FIXED_BYTES - 8, summed)
    return bytes(record)


WHOLE = CODEC.encode(KEY, PAYLOAD)


@pytest.mark.parametrize(
    ("record", "key", "fault"),
    [
        pytest.param(flip(WHOLE, len(WHOLE) - 1), KEY, RecordFault.CHECKSUM, id="payload-bit"),
        pytest.param(flip(WHOLE, 30), KEY, RecordFault.CHECKSUM, id="fingerprint-bit"),
        pytest.param(flip(WHOLE, HEADER_FIXED_BYTES + 3), KEY, RecordFault.CHECKSUM, id="key-bit"),
        pytest.param(WHOLE, KEY[:-1] + b"\x08", RecordFault.KEY, id="other-key"),
        pytest.param(
            RecordCodec("layout-b", RECORD).encode(KEY, PAYLOAD),
            KEY,
            RecordFault.FINGERPRINT,
            id="other-layout",
        ),
        pytest.param(WHOLE[:-1], KEY, RecordFault.LENGTH, id="payload-cut"),
        pytest.param(WHOLE + b"\0", KEY, RecordFault.LENGTH, id="payload-longer"),
        pytest.param(WHOLE[: HEADER_FIXED_BYTES - 1], KEY, RecordFault.LENGTH, id="header-cut"),
        pytest.param(WHOLE[: HEADER_FIXED_BYTES + 2], KEY, RecordFault.LENGTH, id="key-cut"),
        pytest.param(forged(payload_bytes=RECORD + 1), KEY, RecordFault.LENGTH, id="forged-length"),
        pytest.param(
            forged(version=FORMAT_VERSION + 1), KEY, RecordFault.VERSION, id="forged-version"
        ),
        pytest.param(b"JUNK" + WHOLE[4:], KEY, RecordFault.VERSION, id="magic"),
        pytest.param(b"\x80\x04\x95" + bytes(200), KEY, RecordFault.VERSION, id="pickle"),
        pytest.param(b"", KEY, RecordFault.LENGTH, id="empty"),
    ],
)
def test_each_fault_is_named(record: bytes, key: bytes, fault: RecordFault) -> None:
    assert CODEC.decode(key, record) is fault


def test_a_record_for_another_record_size_is_a_length_fault() -> None:
    smaller = RecordCodec("layout-a", RECORD - 8)
    assert CODEC.decode(KEY, smaller.encode(KEY, PAYLOAD[:-8])) is RecordFault.LENGTH


def test_keys_and_payloads_are_checked_when_encoding() -> None:
    with pytest.raises(ValueError, match="1 to 1024 bytes"):
        CODEC.header(b"", 0)
    with pytest.raises(ValueError, match="1 to 1024 bytes"):
        CODEC.header(b"k" * 1025, 0)
    with pytest.raises(ValueError, match=f"a payload is {RECORD} bytes, got {RECORD - 1}"):
        CODEC.encode(KEY, PAYLOAD[:-1])
    buffer = bytearray(CODEC.max_encoded_bytes)
    with pytest.raises(ValueError, match="a payload is"):
        CODEC.encode_into(buffer, KEY, PAYLOAD + b"x")


def test_a_record_encoded_into_a_buffer_equals_the_joined_one() -> None:
    buffer = bytearray(b"\xee" * CODEC.max_encoded_bytes)
    assert bytes(CODEC.encode_into(buffer, KEY, PAYLOAD, sequence=3)) == CODEC.encode(
        KEY, PAYLOAD, sequence=3
    )


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2 * RECORD), st.integers(0, 2 * RECORD), st.integers(0, 255))
def test_no_damage_to_a_record_yields_another_payload(
    noise: bytes, position: int, value: int
) -> None:
    """Arbitrary bytes, or a record with any byte changed or cut, decode to a fault or to
    the record's own payload, never to anything else, and never raise."""
    damaged = bytearray(WHOLE)
    if position < len(damaged):
        damaged[position] = value
    else:
        del damaged[position - len(damaged) :]
    for data in (noise, bytes(damaged), bytes(damaged[: position % (len(damaged) + 1)])):
        result = CODEC.decode(KEY, data)
        assert isinstance(result, RecordFault) or bytes(result) == PAYLOAD
