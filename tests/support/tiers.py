"""An in-memory storage tier whose I/O can be held back, for tests of the queueing rules.

:class:`MemoryTier` is a :class:`~kvtier.tiers.queued.QueuedTier` over a dict
of encoded records (so reads go through the same header checks as a real
tier). Its I/O threads wait for :attr:`MemoryTier.gate` before each batch, so
a test can make the tier as slow as it likes: clear the gate, fill the
queues, see puts dropped and gets missed at their deadline, then set it again.

:func:`memory_tier_registry` registers it as storage tier type ``memory``, whose
every read takes ``read_delay_s``, for code that builds its tiers from a config
(an engine's connector): a deliberately slow lower tier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

import kvtier
from kvtier.config import PluginConfig
from kvtier.index.base import BlockKey
from kvtier.tiers.base import StorageTier, TierSpec
from kvtier.tiers.queued import QueuedTier
from kvtier.tiers.record import RecordCodec, RecordFault, RecordKeys

if TYPE_CHECKING:
    from kvtier.plugins import Registry

GATE_TIMEOUT_S = 30.0
"""An I/O thread never waits for the gate longer than this."""


class MemoryTier(QueuedTier):
    """Records in a dict; I/O waits for :attr:`gate`."""

    def __init__(
        self,
        spec: TierSpec,
        *,
        namespace: str = "",
        io_threads: int = 1,
        queue_depth: int = 4,
        get_deadline_s: float | None = None,
        store: dict[BlockKey, bytes] | None = None,
        fail: Callable[[str, Sequence[BlockKey]], None] | None = None,
        put_batch_bytes: int | None = None,
        record_keys: RecordKeys | None = None,
    ) -> None:
        """Build a tier over ``store`` (a new dict if ``None``; share one to share a store).

        ``fail(op, keys)`` runs before each batch (``op`` is ``"read"``,
        ``"write"``, ``"exists"`` or ``"remove"``) and may raise to make it fail.
        ``record_keys``: seal records with these keys (checksums without).
        """
        super().__init__(
            spec,
            name="memory",
            namespace=namespace,
            io_threads=io_threads,
            queue_depth=queue_depth,
            get_deadline_s=get_deadline_s,
            put_batch_bytes=put_batch_bytes,
        )
        self.gate = threading.Event()
        self.gate.set()
        self.store: dict[BlockKey, bytes] = {} if store is None else store
        self.batches: list[tuple[str, tuple[BlockKey, ...]]] = []
        """Each batch run, in the order the I/O threads started them."""
        self._fail = fail
        self._codec = RecordCodec(self.keys.layout_fingerprint, spec.record_bytes, keys=record_keys)
        self._start()

    def close(self) -> None:
        """Open the gate, so held-back batches finish, then close."""
        self.gate.set()
        super().close()

    def _release(self) -> None:
        """Nothing to release: the store belongs to whoever passed it in."""

    def _enter(self, op: str, keys: Sequence[BlockKey]) -> None:
        self.gate.wait(GATE_TIMEOUT_S)
        self.batches.append((op, tuple(keys)))
        if self._fail is not None:
            self._fail(op, keys)

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        self._enter("read", keys)
        found: list[memoryview | None] = []
        for key in keys:
            record = self.store.get(key)
            payload = None if record is None else self._codec.decode(key, record)
            if isinstance(payload, RecordFault):
                self._count_error(payload)
                payload = None
            found.append(payload)
        return found

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        self._enter("write", keys)
        for key, record in zip(keys, records, strict=True):
            self.store[key] = self._codec.encode(key, record)
        self._count(stores=len(keys), bytes_written=len(keys) * self.record_bytes)
        return [True] * len(keys)

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._enter("exists", keys)
        return [key in self.store for key in keys]

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._enter("remove", keys)
        return [self.store.pop(key, None) is not None for key in keys]


class MemoryTierConfig(PluginConfig):
    """A :class:`MemoryTier` whose reads and presence checks each take ``read_delay_s`` (tests
    and benchmarks)."""

    type: Literal["memory"] = Field(
        default="memory", description="Keep records in this process's memory (tests only)."
    )
    read_delay_s: float = Field(
        0.0, ge=0, description="Seconds every batch read or presence check waits before it runs."
    )


class _MemoryTierPlugin:
    def __init__(self, store: dict[BlockKey, bytes]) -> None:
        self.store = store

    @kvtier.hookimpl
    def register_storage_tiers(self, register: Callable[..., None]) -> None:
        def build(config: MemoryTierConfig, spec: TierSpec) -> StorageTier:
            delay_s = config.read_delay_s

            def slow_reads(op: str, keys: Sequence[BlockKey]) -> None:
                if op in ("read", "exists") and delay_s:
                    time.sleep(delay_s)

            return MemoryTier(spec, store=self.store, fail=slow_reads)

        register("memory", build, MemoryTierConfig)


def memory_tier_registry(store: dict[BlockKey, bytes] | None = None) -> Registry:
    """The built-in plugins plus storage tier type ``memory`` over ``store`` (a new dict if
    ``None``; every tier the registry builds shares it, as engines sharing a store would).

    Returns:
        A registry to stand in for :func:`kvtier.plugins.default_registry` (tests patch
        ``kvtier.plugins._default_registry`` with it) while a config names ``{"type": "memory"}``.
    """
    from kvtier.plugins import build_plugin_manager, collect

    manager = build_plugin_manager()
    manager.register(
        _MemoryTierPlugin({} if store is None else store), name="kvtier-testing-memory-tier"
    )
    return collect(manager)
