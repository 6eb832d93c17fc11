"""The record format: every way a record can be wrong is a named fault, never a payload."""

from __future__ import annotations

import hashlib
import logging
import struct
import zlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvtier.codecs import Codec, CodecError, ErrorBound
from kvtier.tiers.record import (
    FORMAT_VERSION,
    HEADER_FIXED_BYTES,
    MAGIC,
    RecordCodec,
    RecordFault,
    RecordHeader,
    RecordKeys,
    Scheme,
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


# ---------------------------------------------------------------- keyed records

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
KEYS = RecordKeys([SECRET])
MAC = RecordCodec("layout-a", RECORD, keys=KEYS)
AEAD = RecordCodec("layout-a", RECORD, keys=KEYS, encrypt=True)


def reforged(record: bytes, payload: bytes, *, key: bytes = KEY) -> bytes:
    """What a writer without the key can do: keep a record's header, put another payload
    (and key) in, and recompute every checksum with the public ``xxhash``."""
    header = bytearray(record[:HEADER_FIXED_BYTES])
    struct.pack_into("<H", header, 6, len(key))
    struct.pack_into("<B", header, HEADER_FIXED_BYTES - 36, Scheme.CHECKSUM)
    struct.pack_into("<Q", header, HEADER_FIXED_BYTES - 16, xxh3_64_intdigest(payload))
    struct.pack_into("<Q", header, HEADER_FIXED_BYTES - 8, 0)
    struct.pack_into("<Q", header, HEADER_FIXED_BYTES - 8, xxh3_64_intdigest(bytes(header) + key))
    return bytes(header) + key + payload


@pytest.mark.parametrize("codec", [MAC, AEAD], ids=["mac", "aead"])
def test_a_keyed_record_round_trips(codec: RecordCodec) -> None:
    record = codec.encode(KEY, PAYLOAD, sequence=7)
    assert bytes(codec.decode(KEY, record)) == PAYLOAD  # type: ignore[arg-type]
    header = codec.parse(record)
    assert isinstance(header, RecordHeader) and header.sequence == 7
    assert (PAYLOAD[:64] in record) is (codec is MAC), "only the AEAD hides the payload"


def test_the_forgery_checksums_allow_is_a_miss_for_a_keyed_tier() -> None:
    evil = bytes(RECORD)
    forged_record = reforged(CODEC.encode(KEY, PAYLOAD), evil)
    assert bytes(CODEC.decode(KEY, forged_record)) == evil, "checksums only detect damage"
    for codec in (MAC, AEAD):
        assert codec.decode(KEY, reforged(codec.encode(KEY, PAYLOAD), evil)) is RecordFault.AUTH
        assert codec.decode(KEY, CODEC.encode(KEY, PAYLOAD)) is RecordFault.AUTH
    assert CODEC.decode(KEY, MAC.encode(KEY, PAYLOAD)) is RecordFault.AUTH


@pytest.mark.parametrize("codec", [MAC, AEAD], ids=["mac", "aead"])
def test_a_keyed_record_replayed_elsewhere_is_a_miss(codec: RecordCodec) -> None:
    record = codec.encode(KEY, PAYLOAD)
    other_key = KEY[:-1] + b"\x08"
    assert codec.decode(other_key, record) is RecordFault.KEY
    # the key rewritten to the one asked for, under the same seal
    moved = record[:HEADER_FIXED_BYTES] + other_key + record[HEADER_FIXED_BYTES + len(KEY) :]
    assert codec.decode(other_key, moved) is RecordFault.AUTH
    other_layout = RecordCodec("layout-b", RECORD, keys=KEYS, encrypt=codec is AEAD)
    assert codec.decode(KEY, other_layout.encode(KEY, PAYLOAD)) is RecordFault.FINGERPRINT
    refingerprinted = bytearray(other_layout.encode(KEY, PAYLOAD))
    refingerprinted[16:32] = record[16:32]
    assert codec.decode(KEY, bytes(refingerprinted)) is RecordFault.AUTH
    # sequence, padding, key id, nonce, seal, payload: none checked before the seal
    for position in (33, 42, 45, 50, HEADER_FIXED_BYTES - 1, -1):
        assert codec.decode(KEY, flip(record, position)) is RecordFault.AUTH, position


def gcm_tag(associated: list[bytes], plaintext: bytes, nonce: bytes) -> bytes:
    """The AES-256-GCM tag under the MAC key derived from ``SECRET``, built independently."""
    mac_key = hashlib.blake2b(b"kvtier record mac", key=SECRET, digest_size=32).digest()
    encryptor = Cipher(algorithms.AES(mac_key), modes.GCM(nonce)).encryptor()
    for data in associated:
        encryptor.authenticate_additional_data(data)
    encryptor.update(plaintext)
    encryptor.finalize()
    return encryptor.tag


def test_the_mac_is_the_gcm_tag_of_the_header_with_the_payload_as_associated_data() -> None:
    """Format version 3's MAC; version 2's (header and payload both associated data) is
    another tag, and a version 2 record is a version fault."""
    record = MAC.encode(KEY, PAYLOAD)
    header = MAC.parse(record)
    assert isinstance(header, RecordHeader)
    assert header.seal == gcm_tag([PAYLOAD], header.sealed, header.nonce)
    version_2_seal = gcm_tag([header.sealed, PAYLOAD], b"", header.nonce)
    assert version_2_seal != header.seal
    resealed = bytearray(record)
    resealed[HEADER_FIXED_BYTES - 16 : HEADER_FIXED_BYTES] = version_2_seal
    assert MAC.decode(KEY, bytes(resealed)) is RecordFault.AUTH
    struct.pack_into("<H", resealed, 4, 2)
    assert MAC.decode(KEY, bytes(resealed)) is RecordFault.VERSION


def test_rotation_the_first_key_seals_and_every_key_verifies() -> None:
    old = RecordCodec("layout-a", RECORD, keys=RecordKeys([OTHER_SECRET]))
    rotated = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET, OTHER_SECRET]))
    old_record = old.encode(KEY, PAYLOAD)
    assert bytes(rotated.decode(KEY, old_record)) == PAYLOAD  # type: ignore[arg-type]
    assert bytes(MAC.decode(KEY, rotated.encode(KEY, PAYLOAD))) == PAYLOAD  # type: ignore[arg-type]
    assert MAC.decode(KEY, old_record) is RecordFault.AUTH


def test_every_aead_record_has_its_own_nonce() -> None:
    nonces = {AEAD.encode(KEY, PAYLOAD)[HEADER_FIXED_BYTES - 28 : HEADER_FIXED_BYTES - 16]}
    nonces |= {AEAD.encode(KEY, PAYLOAD)[HEADER_FIXED_BYTES - 28 : HEADER_FIXED_BYTES - 16]}
    assert len(nonces) == 2 and bytes(12) not in nonces


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no key given"),
        ("# only a comment\n", "no key given"),
        ("zz" * 32, "key 1 is not hex digits"),
        (SECRET.hex() + ",abc", "key 2 is not hex digits"),
        ("ab" * 31, "a key is 32 to 64 bytes, got 31"),
        ("ab" * 65, "a key is 32 to 64 bytes, got 65"),
    ],
)
def test_malformed_keys_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecordKeys.parse(text)


def test_keys_load_from_a_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated in May\n{SECRET.hex()}\n\n")
    key_file.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        RecordKeys.load(key_file, None, "disk tier")
    assert caplog.messages == [
        f"disk tier: key_file {key_file} may be read by other users (mode 640); chmod 600 it"
    ]
    key_file.chmod(0o600)
    monkeypatch.setenv("TEST_TIER_KEYS", f" {OTHER_SECRET.hex()} ")
    keys = RecordKeys.load(key_file, "TEST_TIER_KEYS", "disk tier")
    assert keys is not None and keys.signing_id == KEYS.signing_id
    assert keys.mac_key(RecordKeys([OTHER_SECRET]).signing_id) is not None
    assert RecordKeys.load(None, None, "disk tier") is None
    with pytest.raises(ValueError, match=r"^disk tier: cannot read key_file .*missing: No such"):
        RecordKeys.load(tmp_path / "missing", None, "disk tier")
    with pytest.raises(ValueError, match=r"^redis tier: environment variable UNSET_TIER_KEY "):
        RecordKeys.load(None, "UNSET_TIER_KEY", "redis tier")
    monkeypatch.setenv("TEST_TIER_KEYS", "short")
    with pytest.raises(ValueError, match=r"^redis tier: \$TEST_TIER_KEYS: key 1 is not hex"):
        RecordKeys.load(None, "TEST_TIER_KEYS", "redis tier")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2 * RECORD), st.integers(0, 255), st.sampled_from(["mac", "aead"]))
def test_no_change_to_a_keyed_record_yields_another_payload(
    position: int, value: int, scheme: str
) -> None:
    codec = MAC if scheme == "mac" else AEAD
    damaged = bytearray(codec.encode(KEY, PAYLOAD))
    if position < len(damaged):
        damaged[position] = value
    else:
        del damaged[position - len(damaged) :]
    result = codec.decode(KEY, bytes(damaged))
    assert isinstance(result, RecordFault) or bytes(result) == PAYLOAD


class Zlib(Codec):
    """A lossless codec of the standard library, to test the record format's part."""

    def __init__(self, version: int = 1) -> None:
        self.version = version

    @property
    def error_bound(self) -> ErrorBound:
        return ErrorBound()

    def encode(self, payload: memoryview) -> bytes:
        return zlib.compress(payload, 1)

    def decode(self, encoded: memoryview) -> bytes:
        try:
            return zlib.decompress(encoded)
        except zlib.error as exc:
            raise CodecError(str(exc)) from None


SEALING_KEYS = RecordKeys([bytes(range(32))])
COMPRESSIBLE = bytes(RECORD // 4) + PAYLOAD[: RECORD - RECORD // 4]


@pytest.mark.parametrize(
    ("keys", "encrypt"),
    [(None, False), (SEALING_KEYS, False), (SEALING_KEYS, True)],
    ids=["unkeyed", "keyed", "encrypted"],
)
def test_a_codec_encodes_before_sealing_and_decodes_after(
    keys: RecordKeys | None, encrypt: bool
) -> None:
    codec = RecordCodec(
        "layout-a", RECORD, keys=keys, encrypt=encrypt, codec=Zlib(), codec_name="z"
    )
    record = codec.encode(KEY, COMPRESSIBLE)
    assert len(record) < codec.encoded_bytes(KEY)
    header = codec.parse(record)
    assert isinstance(header, RecordHeader) and header.encoded
    assert header.payload_bytes == len(record) - header.header_bytes
    assert bytes(codec.decode(KEY, record)) == COMPRESSIBLE
    assert codec.decode(KEY, flip(record, len(record) - 1)) in (
        RecordFault.CHECKSUM,
        RecordFault.AUTH,
    )


def test_a_payload_the_codec_cannot_shrink_is_stored_as_it_is() -> None:
    codec = RecordCodec("layout-a", RECORD, codec=Zlib(), codec_name="z")
    incompressible = hashlib.shake_256(b"noise").digest(RECORD)
    record = codec.encode(KEY, incompressible)
    header = codec.parse(record)
    assert isinstance(header, RecordHeader) and not header.encoded
    assert bytes(codec.decode(KEY, record)) == incompressible
    assert bytes(CODEC.decode(KEY, record)) == incompressible  # any reader reads it


@pytest.mark.parametrize(
    "reader",
    [
        RecordCodec("layout-a", RECORD),
        RecordCodec("layout-a", RECORD, codec=Zlib(), codec_name="other"),
        RecordCodec("layout-a", RECORD, codec=Zlib(version=2), codec_name="z"),
    ],
    ids=["no codec", "another codec", "another version"],
)
def test_a_record_of_another_codec_is_a_codec_fault(reader: RecordCodec) -> None:
    writer = RecordCodec("layout-a", RECORD, codec=Zlib(), codec_name="z")
    assert reader.decode(KEY, writer.encode(KEY, COMPRESSIBLE)) is RecordFault.CODEC


def test_a_payload_the_codec_cannot_decode_is_a_codec_fault() -> None:
    class Broken(Zlib):
        def decode(self, encoded: memoryview) -> bytes:
            return bytes(RECORD - 1)

    writer = RecordCodec("layout-a", RECORD, codec=Zlib(), codec_name="z")
    record = writer.encode(KEY, COMPRESSIBLE)
    assert (
        RecordCodec("layout-a", RECORD, codec=Broken(), codec_name="z").decode(KEY, record)
        is RecordFault.CODEC
    )
