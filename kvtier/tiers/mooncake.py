"""The ``mooncake`` tier: block records in a Mooncake Store shared by a fleet of engines.

Each record is one Mooncake object, ``kvtier:<hex of the key>``, holding the
record header of :mod:`kvtier.tiers.record` and the body (the payload, or its
ciphertext), sealed with the tier's keys when it has any. Each tier object
(one per rank) has its own store client; a batch is one client call:

- put: ``batch_put_from_multi_buffers``, header and body sent from where
  they are (the body is never joined to its header), with the config's
  replica count and soft pin;
- get: ``batch_get_into``, each record read into a buffer of its own whose
  payload view is returned;
- contains: ``batch_is_exist``; delete: ``batch_remove`` with ``force`` (the
  master refuses to remove an object read within its lease, 10 s by default,
  which would make a delete after a get fail for no reason a caller could act on).

Capacity and eviction are the store's: segments lent by its clients
(``global_segment_bytes``) or by ``mooncake_client`` servers, evicted by the
master near its watermark. The tier never assumes a key written is still
there; a write the store refuses for space is a drop counted as ``no_space``.

Failures never reach the caller: a batch the master does not answer is a
miss (get) or a drop (put), counted by cause, and opens a back-off window
(``reconnect_backoff_s``, doubling up to ``reconnect_max_backoff_s``) during
which requests are answered at once without calling the client. A restarted
master knows none of the records written before (they become misses); the
store's servers mount their segments again and the tier writes anew.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.index.base import BlockKey
from kvtier.tiers.backoff import Backoff
from kvtier.tiers.base import Cause, TierError, TierSpec
from kvtier.tiers.configs import MooncakeTierConfig
from kvtier.tiers.queued import QueuedTier
from kvtier.tiers.record import RecordFault, tier_codec

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvtier:"
"""Every object name the tier writes starts with this."""

CONNECT_TIMEOUT_S = 2.0
"""How long start-up waits for the master's port before the client is built (the client
itself retries a master that does not answer for about 90 s)."""

# The store's error codes (mooncake-store's ErrorCode) that the tier tells apart.
OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900


def _cause_of(code: int) -> Cause:
    if code == RPC_FAIL:
        return Cause.CONNECTION
    if code == NO_AVAILABLE_HANDLE:
        return Cause.NO_SPACE
    if code == TRANSFER_FAIL:
        return Cause.IO
    return Cause.SERVER


def _address(buffer: memoryview | bytes | bytearray) -> tuple[int, np.ndarray]:
    """The address of ``buffer``'s first byte, and the array that keeps it alive."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return array.ctypes.data, array


def _master_answers(address: str) -> str | None:
    """``None`` when the master's port accepts a connection, else why not."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return str(exc) or type(exc).__name__
    return None


class MooncakeTier(QueuedTier):
    """Records in a Mooncake Store, one object per record; see the module docstring."""

    shared = True

    def __init__(self, config: MooncakeTierConfig, spec: TierSpec) -> None:
        """Build this rank's store client and mount its segment, if it lends one.

        Raises:
            TierError: The master does not answer (or the client cannot start) and
                ``required`` is true, or a record key cannot be read.
        """
        super().__init__(
            spec,
            name="mooncake",
            namespace=config.namespace,
            io_threads=config.io_threads,
            queue_depth=config.queue_depth,
            get_deadline_s=config.get_deadline_s,
            put_batch_bytes=config.put_batch_bytes,
        )
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

        self.master_address = config.master_address
        self._codec = tier_codec(
            config,
            self.keys.layout_fingerprint,
            spec.record_bytes,
            tier="mooncake",
            shared=self.shared,
        )
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        if config.soft_pin_ttl_s is not None:
            self._replicate.soft_pin_action = SoftPinAction.ENABLE
            self._replicate.soft_pin_ttl_ms = round(config.soft_pin_ttl_s * 1000)
        self._backoff = Backoff(
            "mooncake",
            f"the master at {config.master_address}",
            config.reconnect_backoff_s,
            config.reconnect_max_backoff_s,
        )
        self._client: MooncakeDistributedStore | None = None
        problem = _master_answers(config.master_address)
        if problem is None:
            client = MooncakeDistributedStore()
            status = client.setup(
                config.local_hostname,
                config.metadata_server,
                config.global_segment_bytes,
                config.local_buffer_bytes,
                config.protocol,
                config.rdma_devices,
                config.master_address,
            )
            if status == OK:
                self._client = client
            else:
                client.close()
                problem = f"the store client's setup failed with code {status}"
        if problem is not None:
            if config.required:
                raise TierError(
                    f"mooncake tier: cannot use the store of the master at "
                    f"{config.master_address}: {problem}; start mooncake_master, fix "
                    "master_address and metadata_server, or set required: false to run without "
                    "this tier"
                )
            logger.warning(
                "mooncake tier: cannot use the master at %s (%s); running with the tier disabled",
                config.master_address,
                problem,
            )
            self._disable(Cause.DISABLED)
        else:
            logger.info(
                "mooncake tier: master %s, %s, namespace %r",
                config.master_address,
                config.protocol,
                self.keys.namespace,
            )
        self._start()

    @staticmethod
    def _name(key: BlockKey) -> str:
        return KEY_PREFIX + key.hex()

    def _batch(self, keys: Sequence[BlockKey], call: Callable[[], list[int]]) -> list[int] | None:
        """Run one client call unless backing off: a code per key, or ``None`` (counted)."""
        if self._backoff.waiting():
            self._count_error(Cause.CONNECTION, len(keys))
            return None
        codes = list(call())
        if codes and all(code == RPC_FAIL for code in codes):
            self._backoff.failed("it did not answer an RPC")
            self._count_error(Cause.CONNECTION, len(keys))
            return None
        self._backoff.answered()
        return codes

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        assert self._client is not None
        client = self._client
        buffers = [bytearray(self._codec.encoded_bytes(key)) for key in keys]
        addresses = [_address(buffer)[0] for buffer in buffers]
        sizes = [len(buffer) for buffer in buffers]
        names = [self._name(key) for key in keys]
        codes = self._batch(keys, lambda: client.batch_get_into(names, addresses, sizes))
        if codes is None:
            return [None] * len(keys)
        found: list[memoryview | None] = []
        for key, buffer, code in zip(keys, buffers, codes, strict=True):
            if code >= 0:
                payload = self._codec.decode(key, memoryview(buffer)[:code])
                if isinstance(payload, RecordFault):
                    self._count_error(payload)
                    payload = None
                found.append(payload)
                continue
            if code == INVALID_PARAMS:  # longer than a record of this layout
                self._count_error(RecordFault.LENGTH)
            elif code != OBJECT_NOT_FOUND:
                self._count_error(_cause_of(code))
            found.append(None)
        return found

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        assert self._client is not None
        client = self._client
        sealed = [
            self._codec.header(key, record) for key, record in zip(keys, records, strict=True)
        ]
        # The arrays keep each buffer's address valid until the call returns.
        held = [(_address(header), _address(body)) for header, body in sealed]
        pointers = [[header[0], body[0]] for header, body in held]
        sizes = [[len(header), len(body)] for header, body in sealed]
        names = [self._name(key) for key in keys]
        codes = self._batch(
            keys,
            lambda: client.batch_put_from_multi_buffers(names, pointers, sizes, self._replicate),
        )
        if codes is None:
            return [False] * len(keys)
        stored = []
        for code in codes:
            if code in (OK, OBJECT_ALREADY_EXISTS):
                stored.append(True)
            else:
                self._count_error(_cause_of(code))
                stored.append(False)
        written = stored.count(True)
        self._count(stores=written, bytes_written=written * self.record_bytes)
        return stored

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        assert self._client is not None
        client = self._client
        names = [self._name(key) for key in keys]
        codes = self._batch(keys, lambda: client.batch_is_exist(names))
        if codes is None:
            return [False] * len(keys)
        present = []
        for code in codes:
            if code < 0:
                self._count_error(_cause_of(code))
            present.append(code == 1)
        return present

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        assert self._client is not None
        client = self._client
        names = [self._name(key) for key in keys]
        codes = self._batch(keys, lambda: client.batch_remove(names, force=True))
        if codes is None:
            return [False] * len(keys)
        removed = []
        for code in codes:
            if code not in (OK, OBJECT_NOT_FOUND):
                self._count_error(_cause_of(code))
            removed.append(code == OK)
        return removed

    def _release(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __repr__(self) -> str:
        return f"MooncakeTier({self.master_address!r}, namespace={self.keys.namespace!r})"


def build_mooncake_tier(config: MooncakeTierConfig, spec: TierSpec) -> MooncakeTier:
    """The ``mooncake`` tier's factory."""
    return MooncakeTier(config, spec)
