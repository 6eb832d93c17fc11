"""The ``s3`` tier: block records in an S3-compatible object store, several blocks per object.

**Objects.** A put's keys arrive in prefix order. The tier cuts them into
runs of consecutive keys and writes each run as one object, named after the
run's last key: ``<prefix><hex of the key>``. A run ends at a *chunk end*, a
key whose XXH3-64 is a multiple of ``chunk_blocks`` (so runs average
``chunk_blocks`` blocks), or at the end of the put. Whether a key ends a chunk
depends on the key alone, so every engine cuts a shared prefix at the same
keys, whichever block its put or get started at.

An object is a key table, then the records. The table: magic ``b"KVTC"``,
version (2 bytes), record count (2), table length in bytes (4), then per
record its key length (2), record length (4) and key. Each record is
encoded by :class:`~kvtier.tiers.record.RecordCodec` exactly as the other
tiers write one, so each block in an object is checked on its own, and
sealed with the tier's key when it has one (``key_file``, ``key_env``); the
table only says where to look.

**Lookups.** A get reads the object of every chunk end among its keys and
of its last key, whole, and takes every asked-for key it finds in them: a
prefix of ``N`` blocks costs about ``N / chunk_blocks + 1`` GETs, found or
not. Keys still missing then have their own names tried, at most
``chunk_blocks`` of them: they find runs that ended where a put ended (a
prefix stored shorter than the one now asked for). A presence check reads
only the key tables (a ranged GET of the first 16 KiB). A delete rewrites
each object that holds a deleted key without it, or deletes the object.
The objects of one batch are read, written or rewritten at once, on the tier's
``io_threads`` I/O threads (the batch's own among them, see
:meth:`~kvtier.tiers.queued.QueuedTier._all_at_once`), so a lookup takes
about one round trip per pass, not one per object.

**Failures** never reach the caller. ``404`` is a miss. Throttling (``503
SlowDown``, ``500``) is retried with jittered doubling waits while the
batch's deadline allows (the get deadline for reads, ``put_deadline_s`` for
writes); then its keys are misses or drops counted as ``server``. A server
that cannot be reached or times out is a ``connection`` or ``timeout`` miss
or drop and opens a back-off window (:class:`~kvtier.tiers.backoff.Backoff`).

Credentials come only from the AWS chain that boto3 reads (environment,
shared config files and ``profile``, container and instance roles).
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import xxhash

from kvtier.index.base import BlockKey
from kvtier.tiers.base import Cause, TierSpec
from kvtier.tiers.record import MAX_KEY_BYTES, RecordFault
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.s3_config import MAX_CHUNK_BLOCKS, S3TierConfig

TABLE_MAGIC = b"KVTC"
TABLE_VERSION = 1
_TABLE_HEAD = struct.Struct("<4sHHI")
_ENTRY = struct.Struct("<HI")
TABLE_PROBE_BYTES = 16 << 10
"""Bytes a presence check reads from the start of an object; a longer table costs one more."""
OBJECT_CHUNKS = 16
"""An object holds at most this many times ``chunk_blocks`` blocks: a longer run between
chunk ends (about one in nine million at this bound) is cut, and the cut piece is found
by the lookup's own-name tries. A read asks for no more than such an object's bytes."""
MAX_TABLE_BYTES = _TABLE_HEAD.size + OBJECT_CHUNKS * MAX_CHUNK_BLOCKS * (
    _ENTRY.size + MAX_KEY_BYTES
)
"""A table claiming more than the largest object's is a damaged object."""

_THROTTLED_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "InternalError"}
)
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_FIRST_RETRY_WAIT_S = 0.02
_MAX_RETRY_WAIT_S = 1.0

_FAILURES = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)
"""What a request to the store raises when the store, not the tier, failed."""

T = TypeVar("T")
Item = TypeVar("Item")


def chunk_ends(keys: Sequence[BlockKey], chunk_blocks: int) -> list[bool]:
    """Whether each key ends a chunk: its XXH3-64 is a multiple of ``chunk_blocks``."""
    return [xxhash.xxh3_64_intdigest(key) % chunk_blocks == 0 for key in keys]


def runs(keys: Sequence[BlockKey], chunk_blocks: int) -> list[range]:
    """Positions of ``keys`` cut after every chunk end, at the end, and where a run would
    outgrow an object: one object each."""
    cut: list[range] = []
    start = 0
    for position, ends in enumerate(chunk_ends(keys, chunk_blocks)):
        full = position + 1 - start == OBJECT_CHUNKS * chunk_blocks
        if ends or full or position == len(keys) - 1:
            cut.append(range(start, position + 1))
            start = position + 1
    return cut


def _status(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status)


def _missing(exc: BaseException) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code, status = _status(exc)
    return status == 404 or code in _MISSING_CODES


def _throttled(exc: BaseException) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code, status = _status(exc)
    return status in (500, 503) or code in _THROTTLED_CODES


class _ObjectTable:
    """Where each record of an object lies, from its (untrusted) key table."""

    def __init__(self, spans: dict[BlockKey, tuple[int, int]]) -> None:
        self.spans = spans
        """Key to (start, end) of its record in the object."""

    @classmethod
    def parse(cls, data: memoryview | bytes) -> _ObjectTable | RecordFault:
        """The table at the start of ``data`` (which may stop after the table)."""
        declared = declared_table_bytes(data)
        if isinstance(declared, RecordFault):
            return declared
        if len(data) < declared:
            return RecordFault.LENGTH
        count = _TABLE_HEAD.unpack_from(data)[2]
        spans: dict[BlockKey, tuple[int, int]] = {}
        at, start = _TABLE_HEAD.size, declared
        for _ in range(count):
            if at + _ENTRY.size > declared:
                return RecordFault.LENGTH
            key_bytes, record_bytes = _ENTRY.unpack_from(data, at)
            at += _ENTRY.size
            if at + key_bytes > declared:
                return RecordFault.LENGTH
            key = bytes(data[at : at + key_bytes])
            at += key_bytes
            spans.setdefault(key, (start, start + record_bytes))
            start += record_bytes
        return cls(spans)


def declared_table_bytes(data: memoryview | bytes) -> int | RecordFault:
    """The table length an object's first bytes declare, or why they are no table."""
    if len(data) < _TABLE_HEAD.size:
        return RecordFault.LENGTH
    magic, version, _, declared = _TABLE_HEAD.unpack_from(data)
    if (magic, version) != (TABLE_MAGIC, TABLE_VERSION):
        return RecordFault.VERSION
    if not _TABLE_HEAD.size <= declared <= MAX_TABLE_BYTES:
        return RecordFault.LENGTH
    return int(declared)


def table_bytes(keys: Sequence[BlockKey]) -> int:
    """Bytes of the key table of an object holding ``keys``."""
    return _TABLE_HEAD.size + sum(_ENTRY.size + len(key) for key in keys)


def pack_table(buffer: bytearray, keys: Sequence[BlockKey], lengths: Sequence[int]) -> None:
    """Write the key table of ``keys`` and their record ``lengths`` at the start of ``buffer``."""
    _TABLE_HEAD.pack_into(buffer, 0, TABLE_MAGIC, TABLE_VERSION, len(keys), table_bytes(keys))
    at = _TABLE_HEAD.size
    for key, length in zip(keys, lengths, strict=True):
        _ENTRY.pack_into(buffer, at, len(key), length)
        at += _ENTRY.size
        buffer[at : at + len(key)] = key
        at += len(key)


class S3Tier(RemoteTier):
    """Records in an S3 bucket, several consecutive blocks per object; see the module docstring."""

    failures = _FAILURES
    causes = {
        botocore.exceptions.ReadTimeoutError: Cause.TIMEOUT,
        botocore.exceptions.ConnectTimeoutError: Cause.TIMEOUT,
        botocore.exceptions.HTTPClientError: Cause.CONNECTION,
        botocore.exceptions.ConnectionError: Cause.CONNECTION,
        OSError: Cause.CONNECTION,
    }

    def __init__(self, config: S3TierConfig, spec: TierSpec) -> None:
        """Make the client and check that the bucket answers.

        Raises:
            TierError: No credentials, no region, or a bucket that cannot be
                reached, while ``required`` is true.
        """
        endpoint = config.endpoint_url or "AWS S3"
        where = f"s3://{config.bucket}/{config.prefix} at {endpoint}"
        super().__init__(config, spec, name="s3", where=where)
        self.bucket = config.bucket
        self.prefix = config.prefix
        self.endpoint = endpoint
        self.chunk_blocks = config.chunk_blocks
        self._get_deadline_s = config.get_deadline_s
        self._put_deadline_s = config.put_deadline_s
        most = OBJECT_CHUNKS * self.chunk_blocks
        self._max_object_bytes = MAX_TABLE_BYTES + most * self._codec.max_encoded_bytes
        """Bytes a read asks for at most: an object far larger is not read whole, and its
        records past this are length misses."""
        self._open(
            lambda: self._connect(config),
            f"{where}, {self.chunk_blocks} block(s) per object on average",
        )

    def _connect(self, config: S3TierConfig) -> str | None:
        try:
            self._client = self._make_client(config)
            self._client.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            problem = self._startup_problem(exc)
            self._release()
            return problem
        return None

    def _make_client(self, config: S3TierConfig) -> Any:
        session = boto3.session.Session(profile_name=config.profile, region_name=config.region)
        region = session.region_name
        if region is None and config.endpoint_url is not None:
            region = "us-east-1"  # S3-compatible servers sign with any region; AWS needs its own
        client_config = botocore.config.Config(
            region_name=region,
            connect_timeout=config.timeout_s,
            read_timeout=config.timeout_s,
            # Throttling is retried here, within the batch's deadline; outages back off.
            retries={"total_max_attempts": 1},
            max_pool_connections=config.io_threads,
            s3={"addressing_style": config.addressing_style},
            # Every record carries its own checksum; S3-compatible servers that predate
            # the newer checksum headers refuse requests that carry them.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=client_config,
            verify=None if config.tls_ca_path is None else str(config.tls_ca_path),
        )

    def _startup_problem(self, exc: BaseException) -> str:
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return (
                f"no AWS credentials for {self.where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE (or profile), or run with an instance role"
            )
        if isinstance(exc, botocore.exceptions.ProfileNotFound):
            return (
                f"profile {exc.kwargs.get('profile')!r} is not in the AWS config files: fix "
                "profile (or AWS_PROFILE), or set AWS_CONFIG_FILE"
            )
        if isinstance(exc, botocore.exceptions.NoRegionError):
            return f"no region for {self.where}: set region (or AWS_REGION)"
        if isinstance(exc, botocore.exceptions.ClientError):
            code, status = _status(exc)
            if status == 404 or code in _MISSING_CODES:
                return f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it"
            if status == 403:
                return (
                    f"access to {self.where} denied ({code}): allow s3:GetObject, s3:PutObject, "
                    "s3:DeleteObject and s3:ListBucket to these credentials"
                )
            return f"{self.where} answered {status} {code}: check bucket, region, endpoint_url"
        return f"cannot reach {self.where}: {exc}; start the server or fix endpoint_url"

    def _name(self, key: BlockKey) -> str:
        return self.prefix + key.hex()

    # ---------------------------------------------------------------- requests

    def _call(self, request: Callable[[], T], deadline: float | None) -> T:
        """``request()``, retried while it is throttled and ``deadline`` allows."""
        wait = _FIRST_RETRY_WAIT_S
        while True:
            try:
                return request()
            except botocore.exceptions.ClientError as exc:
                if not _throttled(exc):
                    raise
                pause = wait * random.uniform(0.5, 1.0)
                if deadline is not None and time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                wait = min(2 * wait, _MAX_RETRY_WAIT_S)

    def _read_deadline(self) -> float | None:
        if self._get_deadline_s is None:
            return None
        return time.monotonic() + self._get_deadline_s

    def _get_object(self, key: BlockKey, deadline: float | None, *, table_only: bool) -> Any:
        """The bytes of the object named after ``key`` (its table's first bytes if
        ``table_only``), or ``None`` when there is none."""
        name = self._name(key)

        def read(first: int, last: int) -> bytes:
            options: dict[str, Any] = {"Bucket": self.bucket, "Key": name}
            options["Range"] = f"bytes={first}-{last}"
            return self._client.get_object(**options)["Body"].read()  # type: ignore[no-any-return]

        try:
            if not table_only:
                return self._call(lambda: read(0, self._max_object_bytes - 1), deadline)
            data = self._call(lambda: read(0, TABLE_PROBE_BYTES - 1), deadline)
            declared = declared_table_bytes(data)
            if isinstance(declared, int) and len(data) < declared:
                data += self._call(lambda: read(len(data), declared - 1), deadline)
            return data
        except botocore.exceptions.ClientError as exc:
            if _missing(exc):
                return None
            raise

    def _each(
        self, request: Callable[[Item], T], items: Sequence[Item]
    ) -> tuple[list[tuple[Item, T]], list[BaseException]]:
        """``request(item)`` for every item at once on the I/O threads: the items done, each
        with its result, and what the store raised for the others."""
        done: list[tuple[Item, T]] = []
        failed: list[BaseException] = []
        for item, future in zip(items, self._all_at_once(request, items), strict=True):
            failure = future.exception()
            if failure is None:
                done.append((item, future.result()))
            elif isinstance(failure, _FAILURES):
                failed.append(failure)
            else:
                raise failure
        return done, failed

    def _settle(self, failed: Sequence[BaseException], lost: int) -> None:
        """After a batch: count the ``lost`` keys under the first failure's cause, or note
        that the store answered every request."""
        if failed:
            self._count_error(self._store_failed(failed[0]), lost)
        else:
            self._backoff.answered()

    def _search(
        self,
        keys: Sequence[BlockKey],
        deadline: float | None,
        *,
        table_only: bool,
    ) -> dict[BlockKey, tuple[BlockKey, Any, tuple[int, int]]]:
        """Find ``keys``: for each found, the name key of its object, the object's bytes
        and the record's span. Keys not found because the store failed are counted."""
        found: dict[BlockKey, tuple[BlockKey, Any, tuple[int, int]]] = {}
        if self._backing_off(len(keys)):
            return found
        wanted = set(keys)
        tried: set[BlockKey] = set()
        failures: list[BaseException] = []

        def read(name_key: BlockKey) -> Any:
            return self._get_object(name_key, deadline, table_only=table_only)

        def look(name_keys: Sequence[BlockKey]) -> None:
            tried.update(name_keys)
            done, failed = self._each(read, name_keys)
            failures.extend(failed)
            for name_key, data in done:
                if data is None:
                    continue
                table = _ObjectTable.parse(data)
                if isinstance(table, RecordFault):
                    self._count_error(table)
                    continue
                for key in wanted.intersection(table.spans).difference(found):
                    found[key] = (name_key, data, table.spans[key])

        ends = chunk_ends(keys, self.chunk_blocks)
        look(
            list(
                dict.fromkeys(
                    [*(key for key, end in zip(keys, ends, strict=True) if end), keys[-1]]
                )
            )
        )
        if not failures:
            look(
                [key for key in dict.fromkeys(keys) if key not in found and key not in tried][
                    : self.chunk_blocks
                ]
            )
        self._settle(failures, len(keys) - len(found))
        return found

    # ------------------------------------------------------------------ batches

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        found = self._search(keys, self._read_deadline(), table_only=False)
        payloads: list[memoryview | None] = []
        for key in keys:
            if key not in found:
                payloads.append(None)
                continue
            _, data, (start, end) = found[key]
            payloads.append(self._checked(key, memoryview(data)[start:end]))
        return payloads

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        found = self._search(keys, self._read_deadline(), table_only=True)
        return [key in found for key in keys]

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        stored = [False] * len(keys)
        if self._backing_off(len(keys)):
            return stored
        deadline = time.monotonic() + self._put_deadline_s

        def put(run: range) -> None:
            body = self._encode([keys[i] for i in run], [records[i] for i in run])
            self._put_object(keys[run[-1]], body, deadline)

        done, failed = self._each(put, runs(keys, self.chunk_blocks))
        for run, _ in done:
            for position in run:
                stored[position] = True
        self._settle(failed, stored.count(False))
        return self._count_stored(stored)

    def _put_object(self, name_key: BlockKey, body: bytearray, deadline: float | None) -> None:
        self._call(
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=self._name(name_key), Body=body
            ),
            deadline,
        )

    def _encode(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> bytearray:
        """One object: the key table, then each record as the codec encodes it."""
        start = table_bytes(keys)
        body = bytearray(start + len(keys) * self._codec.max_encoded_bytes)
        view = memoryview(body)
        lengths = []
        at = start
        for key, record in zip(keys, records, strict=True):
            length = len(self._codec.encode_into(view[at:], key, record))  # type: ignore[arg-type]
            lengths.append(length)
            at += length
        view.release()
        del body[at:]
        pack_table(body, keys, lengths)
        return body

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        found = self._search(keys, self._read_deadline(), table_only=False)
        objects = list({name_key: data for name_key, data, _ in found.values()}.items())
        if not objects:  # the search asked nothing (backing off) or found nothing
            return [False] * len(keys)

        def remove(item: tuple[BlockKey, bytes]) -> set[BlockKey]:
            name_key, data = item
            table = _ObjectTable.parse(data)
            assert isinstance(table, _ObjectTable)  # parsed already by the search
            gone = {key for key in table.spans if key in found and found[key][0] == name_key}
            self._rewrite(name_key, data, table, [key for key in table.spans if key not in gone])
            return gone

        done, failed = self._each(remove, objects)
        removed: set[BlockKey] = set().union(*(gone for _, gone in done))
        self._settle(failed, len(found) - len(removed))
        return [key in removed for key in keys]

    def _rewrite(
        self, name_key: BlockKey, data: bytes, table: _ObjectTable, kept: Sequence[BlockKey]
    ) -> None:
        """Write the object named after ``name_key`` anew with only ``kept``'s records."""
        name = self._name(name_key)
        if not kept:
            self._call(
                lambda: self._client.delete_object(Bucket=self.bucket, Key=name),
                self._read_deadline(),
            )
            return
        spans = [table.spans[key] for key in kept]
        start = table_bytes(kept)
        body = bytearray(start)
        for first, last in spans:
            body += data[first:last]
        pack_table(body, kept, [last - first for first, last in spans])
        self._put_object(name_key, body, time.monotonic() + self._put_deadline_s)

    def __repr__(self) -> str:
        return f"S3Tier({self.where!r}, namespace={self.keys.namespace!r})"


def build_s3_tier(config: S3TierConfig, spec: TierSpec) -> S3Tier:
    """The ``s3`` tier's factory."""
    return S3Tier(config, spec)
