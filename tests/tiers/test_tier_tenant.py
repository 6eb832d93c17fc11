"""Tenants' records: sealed under keys derived from the tier's and the tenant's salt."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.keys import TenantKey
from kvtier.testing.contracts_tier import block_hashes, fetch, make_spec, payloads, store
from kvtier.tiers.base import TierSpec
from kvtier.tiers.disk import SUPERBLOCK_BYTES, DiskTier, DiskTierConfig, build_disk_tier
from kvtier.tiers.record import (
    HEADER_FIXED_BYTES,
    RecordCodec,
    RecordFault,
    RecordHeader,
    RecordKeys,
)

RECORD = 1000
KEY = b"namespace-and-group" + b"\x07" * 32
PAYLOAD = bytes(range(256)) * 3 + bytes(RECORD - 768)
SECRET = bytes(range(32))
OLD_SECRET = bytes(range(1, 33))
SALT_A = b"tenant-a-salt-0123456789"
SALT_B = b"tenant-b-salt-9876543210"
TENANT_BYTE = HEADER_FIXED_BYTES - 43
"""Where the header's tenant byte sits: after the scheme, before the key id."""


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 written out, to check the derivation against an independent computation."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def test_the_reference_hkdf_meets_rfc_5869_test_case_1() -> None:
    okm = hkdf_sha256(
        bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"),
        bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42,
    )  # fmt: skip
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
def test_a_tenants_keys_are_hkdf_sha256_of_each_tier_key_with_the_salt(encrypt: bool) -> None:
    tenant = RecordKeys([SECRET, OLD_SECRET]).for_tenant(SALT_A)
    expected = RecordKeys(
        [hkdf_sha256(secret, b"", b"kvtier tenant record key\x00" + SALT_A, 32)
         for secret in (SECRET, OLD_SECRET)]
    )  # fmt: skip
    assert tenant.signing_id == expected.signing_id
    assert tenant.aead_key(expected.signing_id) == expected.aead_key(expected.signing_id)
    assert tenant.signing_id != RecordKeys([SECRET]).signing_id
    codec = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET]), encrypt=encrypt)
    record = codec.encode(TenantKey(KEY, SALT_A), PAYLOAD)
    header = codec.parse(record)
    assert isinstance(header, RecordHeader) and header.tenant
    assert header.key_id == expected.signing_id


def test_a_tenants_keys_are_derived_once_per_salt() -> None:
    keys = RecordKeys([SECRET])
    assert keys.for_tenant(SALT_A) is keys.for_tenant(bytes(SALT_A))
    assert keys.for_tenant(SALT_A) is not keys.for_tenant(SALT_B)


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
def test_a_tenants_record_is_a_miss_for_any_other_salt_or_none(encrypt: bool) -> None:
    codec = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET]), encrypt=encrypt)
    record = codec.encode(TenantKey(KEY, SALT_A), PAYLOAD)
    assert bytes(codec.decode(TenantKey(KEY, SALT_A), record)) == PAYLOAD  # type: ignore[arg-type]
    assert codec.decode(TenantKey(KEY, SALT_B), record) is RecordFault.TENANT
    assert codec.decode(KEY, record) is RecordFault.TENANT
    plain = codec.encode(KEY, PAYLOAD)
    assert codec.decode(TenantKey(KEY, SALT_A), plain) is RecordFault.TENANT
    # Another tenant's record may be valid: it is never taken for a damaged one (and deleted).
    assert not codec.sealed_here(TenantKey(KEY, SALT_B), record)
    assert not codec.sealed_here(KEY, record)
    assert codec.sealed_here(TenantKey(KEY, SALT_A), record)


def test_a_writer_without_the_salt_cannot_forge_a_tenants_record() -> None:
    codec = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET]))
    forged = bytearray(codec.encode(TenantKey(KEY, SALT_B), b"\xee" * RECORD))
    assert codec.decode(TenantKey(KEY, SALT_A), bytes(forged)) is RecordFault.TENANT
    # Claiming the tenant's key id does not help: the seal is still under B's key.
    real = codec.encode(TenantKey(KEY, SALT_A), PAYLOAD)
    forged[TENANT_BYTE + 1 : TENANT_BYTE + 7] = real[TENANT_BYTE + 1 : TENANT_BYTE + 7]
    assert codec.decode(TenantKey(KEY, SALT_A), bytes(forged)) is RecordFault.AUTH
    assert codec.sealed_here(TenantKey(KEY, SALT_A), bytes(forged))


def test_rotation_reads_a_tenants_records_of_every_key_in_the_ring() -> None:
    old = RecordCodec("layout-a", RECORD, keys=RecordKeys([OLD_SECRET]))
    rotated = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET, OLD_SECRET]))
    retired = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET]))
    record = old.encode(TenantKey(KEY, SALT_A), PAYLOAD)
    assert bytes(rotated.decode(TenantKey(KEY, SALT_A), record)) == PAYLOAD  # type: ignore[arg-type]
    assert rotated.decode(TenantKey(KEY, SALT_B), record) is RecordFault.TENANT
    assert retired.decode(TenantKey(KEY, SALT_A), record) is RecordFault.TENANT
    assert not retired.sealed_here(TenantKey(KEY, SALT_A), record)  # a key it lacks
    new = rotated.encode(TenantKey(KEY, SALT_A), PAYLOAD)
    assert bytes(retired.decode(TenantKey(KEY, SALT_A), new)) == PAYLOAD  # type: ignore[arg-type]


def test_the_salt_is_never_written_and_plain_records_are_unchanged() -> None:
    codec = RecordCodec("layout-a", RECORD, keys=RecordKeys([SECRET]))
    assert SALT_A not in codec.encode(TenantKey(KEY, SALT_A), PAYLOAD)
    plain = codec.encode(KEY, PAYLOAD)
    assert plain[TENANT_BYTE : TENANT_BYTE + 3] == bytes(3)
    assert codec.parse(plain).tenant is False  # type: ignore[union-attr]
    # A tier without a key has nothing to derive from: a tenant's record is a plain one.
    checksums = RecordCodec("layout-a", RECORD)
    assert checksums.encode(TenantKey(KEY, SALT_A), PAYLOAD) == checksums.encode(KEY, PAYLOAD)
    plain = checksums.encode(KEY, PAYLOAD)
    assert bytes(checksums.decode(TenantKey(KEY, SALT_B), plain)) == PAYLOAD  # type: ignore[arg-type]


def test_a_tenant_byte_on_a_checksummed_record_is_a_version_fault() -> None:
    checksums = RecordCodec("layout-a", RECORD)
    record = bytearray(checksums.encode(KEY, PAYLOAD))
    record[TENANT_BYTE] = 1
    assert checksums.parse(bytes(record)) is RecordFault.VERSION


DISK_RECORD = 8192 + 100


@pytest.fixture
def open_disk(tmp_path: Path) -> Iterator[Callable[[], DiskTier]]:
    """Builds keyed disk tiers on one file, one at a time; closes them all at the end."""
    key_file = tmp_path / "tier.key"
    key_file.write_text(SECRET.hex() + "\n")
    key_file.chmod(0o600)
    built: list[DiskTier] = []
    spec: TierSpec = make_spec(record_bytes=DISK_RECORD)

    def build() -> DiskTier:
        config = DiskTierConfig(
            path=tmp_path / "tier",
            capacity_bytes=SUPERBLOCK_BYTES + 8 * DiskTier.slot_bytes_for(DISK_RECORD),
            key_file=key_file,
        )
        built.append(build_disk_tier(config, spec))
        return built[-1]

    yield build
    for tier in built:
        tier.close()


def test_on_one_store_a_tenants_records_hit_only_with_its_salt(
    open_disk: Callable[[], DiskTier],
) -> None:
    tier = open_disk()
    hashes = block_hashes("tenants", 3)
    records = payloads(3, DISK_RECORD)
    store(tier, tier.keys.keys(hashes, 0, SALT_A), records)
    assert fetch(tier, tier.keys.keys(hashes, 0, SALT_A)) == records
    assert fetch(tier, tier.keys.keys(hashes, 0, SALT_B)) == [None] * 3
    assert fetch(tier, tier.keys.keys(hashes)) == [None] * 3
    assert tier.stats().errors == {"tenant": 6}
    assert fetch(tier, tier.keys.keys(hashes, 0, SALT_A)) == records  # the misses left them
    tier.close()
    again = open_disk()  # a warm restart keeps a tenant's records, though it cannot check them
    assert again.stats().records == 3
    assert fetch(again, again.keys.keys(hashes, 0, SALT_A)) == records
