"""The ``mooncake`` tier: block records in a Mooncake Store shared by a fleet of engines.

Each record is one Mooncake object, ``kvtier:<hex of the key>``, holding the
record header of :mod:`kvtier.tiers.record` and the body (the payload, or its
ciphertext), sealed with the tier's keys when it has any. Each tier object
(one per rank) has its own store client; a batch is one client call:

- put: ``batch_put_from_multi_buffers``, header and body sent from where
  they are (the body is never joined to its header), with the config's
  replica count and soft pin;
- get: ``batch_get_into``, each record read into a buffer of the I/O
  thread's (:class:`~kvtier.tiers.buffers.ReadBuffers`) whose payload view is
  returned;
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

import socket
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.index.base import BlockKey
from kvtier.tiers.base import Cause, TierSpec
from kvtier.tiers.mooncake_config import MooncakeTierConfig
from kvtier.tiers.record import RecordFault
from kvtier.tiers.remote import RemoteTier

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


class _Unanswered(Exception):
    """A batch's every object failed its RPC: the master did not answer."""


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


class MooncakeTier(RemoteTier):
    """Records in a Mooncake Store, one object per record; see the module docstring."""

    failures = (_Unanswered,)
    causes = {
        _Unanswered: Cause.CONNECTION,
        RPC_FAIL: Cause.CONNECTION,
        NO_AVAILABLE_HANDLE: Cause.NO_SPACE,
        TRANSFER_FAIL: Cause.IO,
    }

    def __init__(self, config: MooncakeTierConfig, spec: TierSpec) -> None:
        """Build this rank's store client and mount its segment, if it lends one.

        Raises:
            TierError: The master does not answer (or the client cannot start) and
                ``required`` is true, or a record key cannot be read.
        """
        super().__init__(
            config,
            spec,
            name="mooncake",
            where=f"the master at {config.master_address}",
            put_batch_bytes=config.put_batch_bytes,
        )
        from mooncake.store import ReplicateConfig, SoftPinAction

        self.master_address = config.master_address
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        if config.soft_pin_ttl_s is not None:
            self._replicate.soft_pin_action = SoftPinAction.ENABLE
            self._replicate.soft_pin_ttl_ms = round(config.soft_pin_ttl_s * 1000)
        self._open(
            lambda: self._connect(config), f"master {config.master_address}, {config.protocol}"
        )

    def _connect(self, config: MooncakeTierConfig) -> str | None:
        from mooncake.store import MooncakeDistributedStore

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
                return None
            client.close()
            problem = f"the store client's setup failed with code {status}"
        return (
            f"cannot use the store of the master at {config.master_address}: {problem}; start "
            "mooncake_master, or fix master_address and metadata_server"
        )

    @staticmethod
    def _name(key: BlockKey) -> str:
        return KEY_PREFIX + key.hex()

    def _batch(self, keys: Sequence[BlockKey], call: Callable[[], list[int]]) -> list[int] | None:
        """Run one client call unless backing off: a code per key, or ``None`` (counted)."""

        def answered() -> list[int]:
            codes = list(call())
            if codes and all(code == RPC_FAIL for code in codes):
                raise _Unanswered("it did not answer an RPC")
            return codes

        return self._call_store(keys, answered)

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        client = self._client
        buffers = [self._read_buffers.take(self._codec.encoded_bytes(key)) for key in keys]
        addresses = [_address(buffer)[0] for buffer in buffers]
        sizes = [len(buffer) for buffer in buffers]
        names = [self._name(key) for key in keys]
        codes = self._batch(keys, lambda: client.batch_get_into(names, addresses, sizes))
        if codes is None:
            return [None] * len(keys)
        found: list[memoryview | None] = []
        for key, buffer, code in zip(keys, buffers, codes, strict=True):
            if code >= 0:
                found.append(self._checked(key, buffer[:code]))
                continue
            if code == INVALID_PARAMS:  # longer than a record of this layout
                self._count_error(RecordFault.LENGTH)
            elif code != OBJECT_NOT_FOUND:
                self._count_error(self._cause_of(code))
            found.append(None)
        return found

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
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
                self._count_error(self._cause_of(code))
                stored.append(False)
        return self._count_stored(stored)

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        client = self._client
        names = [self._name(key) for key in keys]
        codes = self._batch(keys, lambda: client.batch_is_exist(names))
        if codes is None:
            return [False] * len(keys)
        present = []
        for code in codes:
            if code < 0:
                self._count_error(self._cause_of(code))
            present.append(code == 1)
        return present

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        client = self._client
        names = [self._name(key) for key in keys]
        codes = self._batch(keys, lambda: client.batch_remove(names, force=True))
        if codes is None:
            return [False] * len(keys)
        removed = []
        for code in codes:
            if code not in (OK, OBJECT_NOT_FOUND):
                self._count_error(self._cause_of(code))
            removed.append(code == OK)
        return removed

    def __repr__(self) -> str:
        return f"MooncakeTier({self.master_address!r}, namespace={self.keys.namespace!r})"


def build_mooncake_tier(config: MooncakeTierConfig, spec: TierSpec) -> MooncakeTier:
    """The ``mooncake`` tier's factory."""
    return MooncakeTier(config, spec)
