"""The record format below the host tier: a sealed header, then the block's bytes.

Every record a lower tier writes is a header followed by the body (the
block's host-tier record, ``record_bytes`` long, or its ciphertext). The
header, little-endian:

- magic (4 bytes): ``b"KVTR"``;
- format version (2): :data:`FORMAT_VERSION`;
- key length (2): bytes of the key that ends the header;
- payload length (8);
- layout fingerprint (16): BLAKE2b digest of the layout fingerprint;
- sequence (8): the writer's counter (the disk tier orders a warm restart by it);
- scheme (1): how the record is sealed, a :class:`Scheme`;
- tenant (1, then 2 zero bytes): 1 when the record is sealed under a tenant's key
  (below), 0 otherwise;
- key id (4): which of the tier's :class:`RecordKeys`, or of a tenant's keys derived
  from them, sealed it (zeros without a key);
- nonce (12): the nonce of a keyed scheme (zeros for checksums);
- codec (4), codec version (2), then 2 zero bytes: the record codec (see
  :mod:`kvtier.codecs`) that encoded the payload, as :func:`codec_id` names it,
  and its version; zeros for a payload stored as it is;
- seal (16): the scheme's check, below;
- key: the full namespaced block key.

The payload is the block's host-tier record, or, when the tier has a codec and
its encoded form is smaller, that form (the payload length says which): the
record is encoded first, then sealed, and a reader checks the seal before it
decodes. A reader reads a payload stored as it is whatever its own codec, and
an encoded one only with the same codec and version; any other is a miss,
counted as ``codec``.

The seal, by scheme:

- ``checksum`` (a tier without a key): XXH3-64 of the payload, then XXH3-64 of
  the header (this half of the seal zeroed) and the key. Detects damage, not forgery.
- ``mac`` (a tier with a key): the tag of AES-256-GCM under a random 96-bit
  nonce, encrypting the header before the seal and the key (the ciphertext is
  dropped) with the payload as associated data: GMAC over the payload
  (measured faster than keyed BLAKE3 and HMAC-SHA256; see
  ``benchmarks/tier_bench.py``). Nobody without the key can make a record
  that verifies, and since the key and the fingerprint are covered, a record
  copied under another key, namespace or layout is a miss.
- ``aead`` (a tier with a key and ``encrypt``): AES-256-GCM of the payload under
  a random 96-bit nonce, with the header before the seal and the key as
  associated data; the seal is the GCM tag and the body is the ciphertext.

A tenant's records: a tier with a key seals the records of a
:class:`~kvtier.keys.TenantKey` (a request that names a salt, vLLM's
``cache_salt``) under keys derived from each of its own and the salt with
HKDF-SHA256 (:meth:`RecordKeys.for_tenant`), and sets the header's tenant
byte. Only a reader asking with the same salt holds those keys: for any other
reader (another salt, or none) the record is a miss counted as ``tenant``,
never taken for a damaged one: it stays in the store. The salt itself is never
written. Records of plain keys are sealed as they were, with the tenant byte 0.

Random nonces need no state shared across processes or restarts; up to 2**32
records per key, the chance that two of them repeat stays below 2**-33.

:meth:`RecordCodec.parse` checks a header, :meth:`RecordCodec.unseal` checks a
record against the key it was asked for and returns its payload or the first
:class:`RecordFault` it finds. Records are plain bytes: nothing read from a
tier is ever unpickled or evaluated.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import logging
import os
import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.codecs.base import Codec, CodecError, CodecSpec
from kvtier.index.base import BlockKey
from kvtier.keys import TenantKey
from kvtier.kinds import RECORD_CODEC
from kvtier.layout.base import RecordRegion
from kvtier.plugins import default_registry
from kvtier.tiers.base import TierError
from kvtier.tiers.configs import RecordKeyConfig

logger = logging.getLogger(__name__)

MAGIC = b"KVTR"
FORMAT_VERSION = 4
"""Version of the record header written by this code; others are read as faults.
Version 1 had no scheme, key id or nonce and always used checksums; version 2's MAC
took the header as associated data, before the payload, where version 3 encrypts it;
version 4 names the record codec."""

_FIXED = struct.Struct("<4sHHQ16sQBB2x4s12s4sH2x16s")
_VERSIONED = struct.Struct("<4sH")
_SEAL_OFFSET = _FIXED.size - 16
_CHECKSUM_OFFSET = _SEAL_OFFSET + 8
_SUMMED = struct.Struct("<Q")
_SEAL_BYTES = 16
_NONCE_BYTES = 12
_KEY_ID_BYTES = 4
_NO_KEY_ID = bytes(_KEY_ID_BYTES)
_NO_NONCE = bytes(_NONCE_BYTES)
_NO_SEAL = bytes(_SEAL_BYTES)
_CODEC_ID_BYTES = 4
NO_CODEC = (bytes(_CODEC_ID_BYTES), 0)
"""The codec id and version of a payload stored as it is."""
HEADER_FIXED_BYTES = _FIXED.size
"""Bytes of the header before the key."""
MAX_KEY_BYTES = 1024
"""Longest key a record may carry."""
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 64
TENANTS_CACHED = 1024
"""Tenants whose derived keys a tier keeps (the least recently used are derived anew)."""
_TENANT_INFO = b"kvtier tenant record key\x00"


class RecordFault(enum.Enum):
    """Why a record read from a tier was not returned; each is counted under its value."""

    VERSION = "version"
    """Not a record of this format: wrong magic or an unknown format version."""
    CHECKSUM = "checksum"
    """The header or the payload does not match its checksum (corrupted or torn)."""
    AUTH = "auth"
    """Not sealed by any of the tier's keys: forged, altered, written without a key
    (or with one by a tier that has none), or under a key the tier no longer holds."""
    FINGERPRINT = "fingerprint"
    """Written for another layout."""
    KEY = "key"
    """Written for another key or another namespace."""
    LENGTH = "length"
    """Shorter or longer than a record of this layout."""
    CODEC = "codec"
    """Encoded by another record codec or version than the tier's, or not decodable by it."""
    TENANT = "tenant"
    """Sealed for another tenant than the key asked for (another salt, or none where the
    reader names one, or one where it names none), or under a tier key no longer held:
    another writer's record, which stays in the store."""


class Scheme(enum.IntEnum):
    """How a record is sealed."""

    CHECKSUM = 0
    MAC = 1
    AEAD = 2


_SCHEMES = frozenset(Scheme)


@dataclass(frozen=True)
class RecordHeader:
    """The fields of a parsed, self-consistent header."""

    key: BlockKey
    payload_bytes: int
    sequence: int
    header_bytes: int
    """Bytes of the header including its key: where the body starts."""
    key_id: bytes
    nonce: bytes
    seal: bytes
    tenant: bool
    """Whether the record is sealed under a tenant's keys (:meth:`RecordKeys.for_tenant`)."""
    encoded: bool
    """Whether the payload is the codec's encoded form, not the record as it is."""
    sealed: bytes
    """The header before the seal, then the key: what the MAC or the AEAD covers with
    the body."""


def fingerprint_digest(layout_fingerprint: str) -> bytes:
    """The 16 bytes a header carries for ``layout_fingerprint``."""
    return hashlib.blake2b(layout_fingerprint.encode(), digest_size=16).digest()


def payload_checksum(payload: memoryview | bytes) -> int:
    """XXH3-64 of a payload."""
    return xxhash.xxh3_64_intdigest(payload)


def codec_id(name: str, version: int) -> tuple[bytes, int]:
    """What a header carries for the record codec registered as ``name``, at ``version``."""
    if not 0 < version < 2**16:
        raise ValueError(f"record codec {name!r}: a version is 1 to 65535, got {version}")
    return hashlib.blake2b(name.encode(), digest_size=_CODEC_ID_BYTES).digest(), version


def _derived(secret: bytes, purpose: bytes, size: int) -> bytes:
    return hashlib.blake2b(purpose, key=secret, digest_size=size).digest()


_HEX_KEY = re.compile(r"[0-9a-fA-F]+")


class RecordKeys:
    """A tier's secret keys: the first seals records, every one verifies them.

    Each secret is 32 to 64 random bytes written as hex (``openssl rand -hex 32``).
    The tier never uses a secret directly: a MAC key, an AEAD key and a 4-byte key
    id that names it in headers are derived from it with keyed BLAKE2b.
    """

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("no key given")
        self._secrets = tuple(secrets)
        self._tenants = functools.lru_cache(maxsize=TENANTS_CACHED)(self._derive_for_tenant)
        self._mac: dict[bytes, AESGCM] = {}
        self._aead: dict[bytes, bytes] = {}
        for secret in secrets:
            if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
                raise ValueError(
                    f"a key is {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, got {len(secret)}"
                )
            key_id = _derived(secret, b"kvtier record key id", _KEY_ID_BYTES)
            mac = AESGCM(_derived(secret, b"kvtier record mac", 32))
            aead = _derived(secret, b"kvtier record aead", 32)
            self._mac.setdefault(key_id, mac)
            self._aead.setdefault(key_id, aead)
        self.signing_id = _derived(secrets[0], b"kvtier record key id", _KEY_ID_BYTES)
        self.signing_mac = self._mac[self.signing_id]
        self.signing_aead = AESGCM(self._aead[self.signing_id])

    @classmethod
    def parse(cls, text: str) -> RecordKeys:
        """Keys from ``text``: hex secrets separated by commas, spaces or lines (``#`` starts
        a comment that runs to the end of its line).

        Raises:
            ValueError: No key, a word that is not hex, or a key of the wrong length.
        """
        words = re.split(r"[\s,]+", re.sub(r"#[^\n]*", "", text).strip())
        words = [word for word in words if word]
        for position, word in enumerate(words, 1):
            if not _HEX_KEY.fullmatch(word) or len(word) % 2:
                raise ValueError(f"key {position} is not hex digits")
        return cls([bytes.fromhex(word) for word in words])

    @classmethod
    def load(cls, key_file: Path | None, key_env: str | None, where: str) -> RecordKeys | None:
        """The keys of ``key_file`` followed by those of ``$key_env``; ``None`` when neither
        is set.

        Raises:
            ValueError: A key cannot be read or is malformed; the message starts with
                ``where`` and names the file or variable.
        """
        texts: list[str] = []
        if key_file is not None:
            try:
                texts.append(Path(key_file).read_text())
                mode = Path(key_file).stat().st_mode
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not text"
                raise ValueError(
                    f"{where}: cannot read key_file {key_file}: {reason}; point key_file at a "
                    "readable file of hex keys, one a line"
                ) from None
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                logger.warning(
                    "%s: key_file %s may be read by other users (mode %o); chmod 600 it",
                    where,
                    key_file,
                    stat.S_IMODE(mode),
                )
        if key_env is not None:
            value = os.environ.get(key_env, "")
            if not value.strip():
                raise ValueError(
                    f"{where}: environment variable {key_env} (key_env) is not set or empty; "
                    "set it to a hex key (openssl rand -hex 32), or unset key_env"
                )
            texts.append(value)
        if not texts:
            return None
        sources = " and ".join(
            name
            for name, given in (
                (f"key_file {key_file}", key_file is not None),
                (f"${key_env}", key_env is not None),
            )
            if given
        )
        try:
            return cls.parse("\n".join(texts))
        except ValueError as exc:
            raise ValueError(
                f"{where}: {sources}: {exc}; give keys of 32 to 64 random bytes in hex "
                "(openssl rand -hex 32)"
            ) from None

    def for_tenant(self, salt: bytes) -> RecordKeys:
        """The keys of the tenant that names ``salt``: one per key of these, in the same
        order (so rotation works alike), each 32 bytes of HKDF-SHA256 of that key, with no
        HKDF salt and ``b"kvtier tenant record key\\x00" + salt`` as its info. Derived once
        per salt while it is among the last :data:`TENANTS_CACHED` asked for."""
        return self._tenants(salt)

    def _derive_for_tenant(self, salt: bytes) -> RecordKeys:
        return RecordKeys(
            [
                HKDF(
                    algorithm=hashes.SHA256(),
                    length=MIN_SECRET_BYTES,
                    salt=None,
                    info=_TENANT_INFO + salt,
                ).derive(secret)
                for secret in self._secrets
            ]
        )

    def mac_key(self, key_id: bytes) -> AESGCM | None:
        """The MAC key named ``key_id``, or ``None`` when it is not one of these keys."""
        return self._mac.get(key_id)

    def aead_key(self, key_id: bytes) -> bytes | None:
        """The AEAD key named ``key_id``, or ``None`` when it is not one of these keys."""
        return self._aead.get(key_id)


def _mac(mac_key: AESGCM, nonce: bytes, sealed: bytes, body: memoryview | bytes) -> bytes:
    """The MAC of ``sealed`` and ``body``: the GCM tag of ``sealed`` encrypted with ``body``
    as associated data. One call, so that its fixed cost is a tenth of the same tag made
    through a cipher context (about 1 against 7 µs)."""
    return mac_key.encrypt(nonce, sealed, body)[-_SEAL_BYTES:]


class RecordCodec:
    """Writes and checks the records of one layout (fingerprint and record size).

    Without ``keys`` records are sealed with checksums; with them, with a MAC, or
    with ``encrypt``, with AES-256-GCM. A record sealed any other way is a fault.
    With ``codec`` (and the name it is registered under) payloads are encoded
    before they are sealed, and decoded after.
    """

    def __init__(
        self,
        layout_fingerprint: str,
        record_bytes: int,
        *,
        keys: RecordKeys | None = None,
        encrypt: bool = False,
        codec: Codec | None = None,
        codec_name: str = "",
    ) -> None:
        if record_bytes <= 0:
            raise ValueError(f"record_bytes must be positive, got {record_bytes}")
        if encrypt and keys is None:
            raise ValueError("encrypting records needs keys")
        self.fingerprint = fingerprint_digest(layout_fingerprint)
        self.record_bytes = record_bytes
        self.keys = keys
        self.scheme = Scheme.CHECKSUM if keys is None else Scheme.AEAD if encrypt else Scheme.MAC
        self.codec = codec
        self.codec_id = NO_CODEC if codec is None else codec_id(codec_name, codec.version)

    def header(
        self, key: BlockKey, payload: memoryview | bytes, sequence: int = 0
    ) -> tuple[bytes, memoryview | bytes]:
        """The header of ``payload`` under ``key``, and the body to store after it."""
        buffer = bytearray(HEADER_FIXED_BYTES + len(key))
        _, body = self.seal_into(buffer, key, payload, sequence)
        return bytes(buffer), body

    def seal_into(
        self,
        buffer: bytearray | memoryview,
        key: BlockKey,
        payload: memoryview | bytes,
        sequence: int = 0,
    ) -> tuple[int, memoryview | bytes]:
        """Write the header of ``payload`` under ``key`` at the start of ``buffer``.

        Returns:
            The header's length, and the body to store after it: ``payload`` itself, or
            the codec's encoded form of it when that is smaller, and with ``encrypt``
            the ciphertext of either (a view of new bytes).
        """
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a record key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        payload = self._payload(payload)
        written_by = NO_CODEC
        if self.codec is not None:
            encoded = memoryview(self.codec.encode(memoryview(payload))).cast("B")
            if encoded.nbytes < len(payload):
                payload, written_by = encoded, self.codec_id
        end = HEADER_FIXED_BYTES + len(key)
        keys, tenant = self.keys, False
        if keys is not None and isinstance(key, TenantKey):
            keys, tenant = keys.for_tenant(key.salt), True
        key_id = _NO_KEY_ID if keys is None else keys.signing_id
        nonce = _NO_NONCE if keys is None else os.urandom(_NONCE_BYTES)
        _FIXED.pack_into(
            buffer,
            0,
            MAGIC,
            FORMAT_VERSION,
            len(key),
            len(payload),
            self.fingerprint,
            sequence,
            self.scheme,
            tenant,
            key_id,
            nonce,
            *written_by,
            _NO_SEAL,
        )
        buffer[HEADER_FIXED_BYTES:end] = key
        view = memoryview(buffer)
        body: memoryview | bytes = payload
        if keys is None:
            _SUMMED.pack_into(buffer, _SEAL_OFFSET, payload_checksum(payload))
            _SUMMED.pack_into(buffer, _CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(view[:end]))
            return end, body
        sealed = b"".join((view[:_SEAL_OFFSET], key))
        if self.scheme is Scheme.MAC:
            seal: bytes | memoryview = _mac(keys.signing_mac, nonce, sealed, payload)
        else:
            encrypted = memoryview(keys.signing_aead.encrypt(nonce, payload, sealed))
            body, seal = encrypted[:-_SEAL_BYTES], encrypted[-_SEAL_BYTES:]
        buffer[_SEAL_OFFSET : _SEAL_OFFSET + _SEAL_BYTES] = seal
        return end, body

    def parse(self, data: memoryview | bytes) -> RecordHeader | RecordFault:
        """Parse the header at the start of ``data`` and check everything the header alone
        can show.

        ``data`` may hold only the header area (the disk tier's scan reads no
        payloads); the key is not compared, since the caller may not know it. A
        header sealed with a MAC or an AEAD is authenticated only with its body,
        by :meth:`unseal`.
        """
        if len(data) >= _VERSIONED.size and _VERSIONED.unpack_from(data) != (MAGIC, FORMAT_VERSION):
            return RecordFault.VERSION
        if len(data) < HEADER_FIXED_BYTES:
            return RecordFault.LENGTH
        (
            _,
            _,
            key_bytes,
            payload_bytes,
            fingerprint,
            sequence,
            scheme,
            tenant,
            key_id,
            nonce,
            written_by,
            written_version,
            seal,
        ) = _FIXED.unpack_from(data)
        end = HEADER_FIXED_BYTES + key_bytes
        if not 0 < key_bytes <= MAX_KEY_BYTES or len(data) < end:
            return RecordFault.LENGTH
        view = memoryview(data)
        if scheme != self.scheme:
            return RecordFault.AUTH if scheme in _SCHEMES else RecordFault.VERSION
        if tenant > (scheme != Scheme.CHECKSUM):
            return RecordFault.VERSION
        if scheme == Scheme.CHECKSUM:
            digest = xxhash.xxh3_64()
            digest.update(view[:_CHECKSUM_OFFSET])
            digest.update(bytes(8))
            digest.update(view[HEADER_FIXED_BYTES:end])
            if digest.intdigest() != _SUMMED.unpack_from(seal, 8)[0]:
                return RecordFault.CHECKSUM
        elif self.keys is None or (not tenant and self.keys.mac_key(key_id) is None):
            # A tenant's keys are known only from the key asked for: unseal() checks them.
            return RecordFault.AUTH
        if fingerprint != self.fingerprint:
            return RecordFault.FINGERPRINT
        encoded = (written_by, written_version) != NO_CODEC
        if encoded and (written_by, written_version) != self.codec_id:
            return RecordFault.CODEC
        # An encoded payload is kept only when it is smaller than the record.
        if encoded:
            length_fits = 0 < payload_bytes < self.record_bytes
        else:
            length_fits = payload_bytes == self.record_bytes
        if not length_fits:
            return RecordFault.LENGTH
        key = bytes(view[HEADER_FIXED_BYTES:end])
        return RecordHeader(
            key,
            payload_bytes,
            sequence,
            end,
            key_id,
            nonce,
            seal,
            bool(tenant),
            encoded,
            b"".join((view[:_SEAL_OFFSET], key)),
        )

    def sealed_here(self, key: BlockKey, data: memoryview | bytes) -> bool:
        """Whether ``data``, read for ``key``, starts with a header of this format that names
        this codec's scheme and, for a keyed scheme, one of the keys ``key`` is sealed under
        (the tier's, or its tenant's for a :class:`~kvtier.keys.TenantKey`).

        Such a record that fails its checks is damaged or forged: every engine
        holding these keys rejects it alike. One that names another format, scheme,
        key or tenant may be a valid record of a writer this codec cannot read.
        """
        if len(data) < HEADER_FIXED_BYTES:
            return False
        magic, version, _, _, _, _, scheme, tenant, key_id, *_ = _FIXED.unpack_from(data)
        if (magic, version, scheme) != (MAGIC, FORMAT_VERSION, self.scheme):
            return False
        if self.keys is None:
            return True
        keys = self._keys_of(key, bool(tenant))
        return keys is not None and keys.mac_key(key_id) is not None

    def _keys_of(self, key: BlockKey, tenant: bool) -> RecordKeys | None:
        """The keys a record read for ``key`` must be sealed under, when it says it is a
        ``tenant``'s or not; ``None`` when the two disagree."""
        assert self.keys is not None
        if isinstance(key, TenantKey):
            return self.keys.for_tenant(key.salt) if tenant else None
        return None if tenant else self.keys

    def unseal(
        self, key: BlockKey, header: RecordHeader | RecordFault, body: memoryview | bytes
    ) -> memoryview | RecordFault:
        """Check a parsed header and its body against the ``key`` that was asked for.

        Returns:
            The payload (a view of ``body``, or with ``encrypt`` a new buffer of the
            plaintext, or what the codec decoded), or the first fault found.
        """
        payload = self._unsealed(key, header, body)
        if isinstance(payload, RecordFault) or isinstance(header, RecordFault):
            return payload
        if not header.encoded:
            return payload
        assert self.codec is not None  # parse() let only this codec's records through
        try:
            decoded = memoryview(self.codec.decode(payload)).cast("B")
        except CodecError:
            return RecordFault.CODEC
        if decoded.nbytes != self.record_bytes:
            return RecordFault.CODEC
        return decoded

    def _unsealed(
        self, key: BlockKey, header: RecordHeader | RecordFault, body: memoryview | bytes
    ) -> memoryview | RecordFault:
        """The checked body of a record: the payload as it was stored."""
        if isinstance(header, RecordFault):
            return header
        if header.key != key:
            return RecordFault.KEY
        if len(body) != header.payload_bytes:
            return RecordFault.LENGTH
        if self.scheme is Scheme.CHECKSUM:
            if payload_checksum(body) != _SUMMED.unpack_from(header.seal)[0]:
                return RecordFault.CHECKSUM
            return memoryview(body)
        keys = self._keys_of(key, header.tenant)
        if keys is None:
            return RecordFault.TENANT
        if self.scheme is Scheme.MAC:
            mac_key = keys.mac_key(header.key_id)
            if mac_key is None:
                return RecordFault.TENANT
            tag = _mac(mac_key, header.nonce, header.sealed, body)
            if not hmac.compare_digest(tag, header.seal):
                return RecordFault.AUTH
            return memoryview(body)
        aead_key = keys.aead_key(header.key_id)
        if aead_key is None:
            return RecordFault.TENANT
        decryptor = Cipher(
            algorithms.AES(aead_key), modes.GCM(header.nonce, header.seal)
        ).decryptor()
        decryptor.authenticate_additional_data(header.sealed)
        plain = bytearray(len(body) + 15)
        written = decryptor.update_into(body, plain)
        try:
            decryptor.finalize()
        except InvalidTag:
            return RecordFault.AUTH
        return memoryview(plain)[:written]

    def _payload(self, payload: memoryview | bytes) -> memoryview | bytes:
        if len(payload) != self.record_bytes:
            raise ValueError(f"a payload is {self.record_bytes} bytes, got {len(payload)}")
        return payload

    def encode(self, key: BlockKey, payload: memoryview | bytes, sequence: int = 0) -> bytes:
        """Header and body as one bytes object (for stores that take one value per key)."""
        return b"".join(self.header(key, payload, sequence))

    def encoded_bytes(self, key: BlockKey) -> int:
        """Bytes of a record under ``key``, at most (a codec's records may be shorter)."""
        return HEADER_FIXED_BYTES + len(key) + self.record_bytes

    @property
    def max_encoded_bytes(self) -> int:
        """Bytes of the longest record :meth:`encode_into` may write (the longest key's)."""
        return HEADER_FIXED_BYTES + MAX_KEY_BYTES + self.record_bytes

    def encode_into(
        self, buffer: bytearray, key: BlockKey, payload: memoryview | bytes, sequence: int = 0
    ) -> memoryview:
        """Write header and body into ``buffer`` (at least :attr:`max_encoded_bytes` long).

        Returns:
            The record: a view of the start of ``buffer``, valid until it is written again.
        """
        start, body = self.seal_into(buffer, key, payload, sequence)
        end = start + len(body)
        buffer[start:end] = body
        return memoryview(buffer)[:end]

    def decode(self, key: BlockKey, record: memoryview | bytes) -> memoryview | RecordFault:
        """The payload of a record read from a store that keeps one value per key, or a fault."""
        view = memoryview(record)
        header = self.parse(view)
        body = view[header.header_bytes :] if isinstance(header, RecordHeader) else view
        return self.unseal(key, header, body)


def tier_codec(
    config: RecordKeyConfig,
    layout_fingerprint: str,
    record_bytes: int,
    *,
    tier: str,
    shared: bool,
    regions: tuple[RecordRegion, ...] = (),
) -> RecordCodec:
    """The record format of a tier built from ``config``: sealed with its keys when it has
    any, its payloads encoded by its ``codec`` when it names one.

    A ``shared`` tier (a store other processes can write) without a key logs a warning:
    anyone who can write to the store can then forge its records.

    Args:
        regions: What each region of a record holds (the tier spec's), for the codec.

    Raises:
        TierError: A key cannot be read or is malformed, or the codec cannot be built.
    """
    try:
        keys = RecordKeys.load(config.key_file, config.key_env, f"{tier} tier")
    except ValueError as exc:
        raise TierError(str(exc)) from None
    if keys is None and shared:
        logger.warning(
            "%s tier: records are sealed with checksums only: anyone who can write to the "
            "store can forge what the engines read; set key_file or key_env (and require_key: "
            "true to refuse to start without one)",
            tier,
        )
    codec = None
    if config.codec is not None:
        try:
            codec = default_registry().build(
                RECORD_CODEC, config.codec, CodecSpec(record_bytes, regions)
            )
        except (ImportError, ValueError) as exc:
            raise TierError(
                f"{tier} tier: record codec {config.codec.type!r} cannot be built: {exc}"
            ) from None
    return RecordCodec(
        layout_fingerprint,
        record_bytes,
        keys=keys,
        encrypt=config.encrypt,
        codec=codec,
        codec_name="" if config.codec is None else config.codec.type,
    )
