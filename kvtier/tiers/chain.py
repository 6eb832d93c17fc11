"""One rank's tiers below the host tier: lookups read down the chain, writes go to the tiers named.

One :class:`TierChain` per rank holds the storage tiers the config lists, in
order, each built by its plugin for this rank's :class:`~kvtier.tiers.base.TierSpec`,
with its write policy (:data:`~kvtier.models.WritePolicy`).

- :meth:`TierChain.fetch` looks blocks up tier by tier: each tier is asked
  for the blocks from the first one the tiers before it did not have, so the
  result is the longest prefix found across the chain. Every read runs on the
  tiers' own threads; the caller polls the returned :class:`Fetch`.
- :meth:`TierChain.probe` asks every tier at once which blocks it holds, reading
  none, so that host slots are reserved only for blocks some tier has; each
  answer is timed as a read of no record.
- :meth:`TierChain.store` hands copies of records to the tiers named; a tier
  whose queue is full drops them and counts it.
- :meth:`TierChain.take_counts` returns what each tier's counters gained since
  the last call, :attr:`TierChain.gauges` each tier's queue and state as that
  call read them, and :meth:`TierChain.take_read_times` how long each fetch's
  reads took, for the worker's report.
- :meth:`TierChain.take_blocks` (with ``report_blocks``) returns the blocks
  each tier stored and removed since the last call, for KV-cache events: a
  store counts once the tier says it landed, a removal where the tier knows of
  it (a :class:`~kvtier.tiers.base.RemovalLog`).

Nothing here blocks: a tier that is slow answers misses at its deadline, a
full queue answers at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from kvtier.keys import KeyNamespace
from kvtier.kinds import STORAGE_TIER
from kvtier.layout.base import RecordRegion
from kvtier.models import WritePolicy, write_policy_of
from kvtier.tiers.base import (
    ContainsResult,
    GetResult,
    PutResult,
    RemovalLog,
    StorageTier,
    TierSpec,
    TierState,
    TierStats,
)

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)

_GAUGES = frozenset({"records", "queued", "state"})
"""The :class:`TierStats` fields that are no counters."""


class TierBlock(NamedTuple):
    """A block in one lower tier, as workers report its stores and removals."""

    tier: str
    """The tier's name (:func:`tier_names`)."""
    shared: bool
    """Whether the tier is a store other engines reach (:attr:`StorageTier.shared
    <kvtier.tiers.base.StorageTier.shared>`)."""
    group: int
    """The kv-cache group of the block."""
    block_hash: bytes
    """The engine's hash of the block."""


class _Asked:
    """Questions put to the tiers on their threads, over once every tier asked answered."""

    def __init__(self) -> None:
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        """Whether every tier asked answered."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every answer; whether they all came."""
        return self._done.wait(timeout_s)


class Fetch(_Asked):
    """Blocks being read down the chain; :attr:`done` once every tier that was asked answered."""

    def __init__(
        self,
        chain: TierChain,
        group: int,
        block_hashes: Sequence[bytes],
        skip: frozenset[str] = frozenset(),
        salt: bytes | None = None,
    ) -> None:
        super().__init__()
        self._chain = chain
        self._group = group
        self._hashes = tuple(block_hashes)
        self._skip = skip
        self._salt = salt
        self._asked_at = 0.0
        self.records: list[memoryview] = []
        """Payloads of the leading blocks found, in order (complete once :attr:`done`)."""
        self.sources: list[str] = []
        """The tier each of :attr:`records` came from."""
        self._ask(0)

    def _ask(self, position: int) -> None:
        tiers = self._chain.tiers
        while position < len(tiers) and tiers[position][0] in self._skip:
            position += 1
        start = len(self.records)
        if start == len(self._hashes) or position == len(tiers):
            self._done.set()
            return
        name, tier = tiers[position]
        keys = tier.keys.keys(self._hashes[start:], self._group, self._salt)
        self._asked_at = time.monotonic()
        future = tier.get(keys)
        future.add_done_callback(lambda answered: self._answered(position, name, answered))

    def _answered(self, position: int, name: str, future: Future[GetResult]) -> None:
        found = 0
        for record in future.result().records:
            if record is None:
                break
            self.records.append(record)
            self.sources.append(name)
            found += 1
        self._chain.read_times.append((name, found, time.monotonic() - self._asked_at))
        self._ask(position + 1)


class Presence(_Asked):
    """Which leading blocks the chain holds, asked of every tier at once; :attr:`held` once
    :attr:`done`."""

    def __init__(
        self,
        chain: TierChain,
        group: int,
        block_hashes: Sequence[bytes],
        skip: frozenset[str] = frozenset(),
        salt: bytes | None = None,
    ) -> None:
        super().__init__()
        tiers = [(name, tier) for name, tier in chain.tiers if name not in skip]
        self._present = [False] * len(block_hashes)
        self._left = len(tiers)
        self._lock = threading.Lock()
        self.held = 0
        """Leading blocks some tier holds, each (complete once :attr:`done`)."""
        if not tiers or not block_hashes:
            self._done.set()
            return
        asked_at = time.monotonic()
        for name, tier in tiers:
            tier.contains(tier.keys.keys(block_hashes, group, salt)).add_done_callback(
                partial(self._answered, chain, name, asked_at)
            )

    def _answered(
        self, chain: TierChain, name: str, asked_at: float, future: Future[ContainsResult]
    ) -> None:
        # timed as a read that returned no record: what a lookup pays a tier for a miss
        chain.read_times.append((name, 0, time.monotonic() - asked_at))
        answer = future.result().present if future.exception() is None else ()
        with self._lock:
            for position, present in enumerate(answer):
                self._present[position] |= present
            self._left -= 1
            if self._left:
                return
            self.held = next(
                (i for i, present in enumerate(self._present) if not present), len(self._present)
            )
        self._done.set()


class TierChain:
    """This rank's storage tiers below the host tier, in lookup order."""

    def __init__(
        self,
        tiers: Sequence[tuple[str, StorageTier]],
        write_policies: Sequence[WritePolicy] | None = None,
        *,
        report_blocks: bool = False,
    ) -> None:
        """Use ``tiers``: (name, tier) pairs, searched in this order; names must differ.

        ``write_policies``: one per tier; ``None`` writes every tier back (on eviction).
        With ``report_blocks``, keep the blocks stored and removed for :meth:`take_blocks`.
        """
        names = [name for name, _ in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        self.tiers = tuple(tiers)
        policies = ("write_back",) * len(names) if write_policies is None else write_policies
        if len(policies) != len(names):
            raise ValueError(
                f"give one write policy per tier: {len(names)} tiers, {len(policies)} policies"
            )
        self.write_policies: tuple[WritePolicy, ...] = tuple(policies)
        self.flushed_tiers = tuple(
            i for i, p in enumerate(policies) if p in ("write_back", "write_through")
        )
        """Positions of the tiers a graceful close writes the host tier's blocks they lack to:
        the write_back ones, and the write_through ones (the blocks stored last, whose
        write-through no plan carried yet)."""
        self._reported: dict[str, TierStats] = {name: TierStats() for name in names}
        self.gauges: dict[str, dict[str, int]] = {
            name: {"queued": 0, "state": int(TierState.UP)} for name in names
        }
        """Per tier, as the last :meth:`take_counts` read them: ``queued`` (requests waiting
        or running, read before the counters) and ``state`` (a :class:`TierState`)."""
        self.report_blocks = report_blocks
        self._stored: dict[TierBlock, int] = {}
        self._stored_lock = threading.Lock()
        if report_blocks:
            for _, tier in self.tiers:
                if isinstance(tier, RemovalLog):
                    tier.watch_removals()
        self.read_times: deque[tuple[str, int, float]] = deque()
        """Each read of a fetch, as it answered (on the tiers' threads): (tier, records
        returned, seconds from asking)."""

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        *,
        record_bytes: int,
        keys: KeyNamespace,
        registry: Registry,
        report_blocks: bool = False,
        regions: tuple[RecordRegion, ...] = (),
    ) -> TierChain:
        """Build each tier of ``config.tiers`` for one rank.

        Args:
            config: The validated config; its ``namespace`` goes into every key
                (a tier's own ``namespace`` setting overrides it).
            record_bytes: Bytes of one block record.
            keys: The rank's namespace: model, layout fingerprint, rank and world size.
            registry: The plugins that build the tiers.
            report_blocks: Keep the blocks stored and removed for :meth:`take_blocks`.
            regions: What each region of a record holds, for the tiers' record codecs.

        Raises:
            kvtier.tiers.TierError: A tier cannot start (the tiers built before it are closed).
        """
        spec = TierSpec(
            record_bytes,
            KeyNamespace(
                keys.model, keys.layout_fingerprint, keys.rank, keys.world_size, config.namespace
            ),
            regions,
        )
        names = tier_names(config)
        built: list[tuple[str, StorageTier]] = []
        try:
            for name, tier_config in zip(names, config.tiers, strict=True):
                built.append((name, registry.build(STORAGE_TIER, tier_config, spec)))
        except BaseException:
            for _, tier in built:
                tier.close()
            raise
        return cls(
            built,
            [write_policy_of(tier_config) for tier_config in config.tiers],
            report_blocks=report_blocks,
        )

    def fetch(
        self,
        group: int,
        block_hashes: Sequence[bytes],
        skip: frozenset[str] = frozenset(),
        salt: bytes | None = None,
    ) -> Fetch:
        """Start looking up the blocks of ``group`` named by ``block_hashes`` in every tier
        but those named in ``skip``, as records of the tenant that names ``salt`` (if any);
        returns at once."""
        return Fetch(self, group, block_hashes, skip, salt)

    def probe(
        self,
        group: int,
        block_hashes: Sequence[bytes],
        skip: frozenset[str] = frozenset(),
        salt: bytes | None = None,
    ) -> Presence:
        """Start asking every tier but those named in ``skip`` which of the blocks it holds,
        without reading them; returns at once."""
        return Presence(self, group, block_hashes, skip, salt)

    def store(
        self,
        group: int,
        block_hashes: Sequence[bytes],
        records: Sequence[bytes],
        tiers: Sequence[int],
        salt: bytes | None = None,
    ) -> list[Future[PutResult]]:
        """Queue ``records`` (stable copies) under their blocks' keys in the tiers at the
        positions ``tiers``, sealed for the tenant that names ``salt`` (if any); one future
        per tier."""
        futures = []
        for position in tiers:
            name, tier = self.tiers[position]
            future = tier.put(tier.keys.keys(block_hashes, group, salt), records)
            if self.report_blocks:
                future.add_done_callback(
                    partial(self._landed, name, tier.shared, group, tuple(block_hashes))
                )
            futures.append(future)
        return futures

    def _landed(
        self,
        name: str,
        shared: bool,
        group: int,
        block_hashes: tuple[bytes, ...],
        future: Future[PutResult],
    ) -> None:
        """Keep the blocks a put stored (on the tier's thread, or at once when refused)."""
        stored = future.result().stored
        landed = [
            TierBlock(name, shared, group, block_hash)
            for block_hash, ok in zip(block_hashes, stored, strict=True)
            if ok
        ]
        if landed:
            with self._stored_lock:
                self._stored.update(dict.fromkeys(landed, 1))

    def take_blocks(self) -> tuple[dict[TierBlock, int], dict[TierBlock, int]]:
        """The blocks stored, and removed, since the last call (each counted once: this rank).

        Empty unless the chain was built with ``report_blocks``. A removal is
        known only from a tier that is a :class:`~kvtier.tiers.base.RemovalLog`.
        """
        stored: dict[TierBlock, int] = {}
        removed: dict[TierBlock, int] = {}
        if not self.report_blocks:
            return stored, removed
        if self._stored:
            with self._stored_lock:
                stored, self._stored = self._stored, {}
        for name, tier in self.tiers:
            if isinstance(tier, RemovalLog):
                for key in tier.take_removed():
                    group, block_hash = tier.keys.split(key)
                    removed[TierBlock(name, tier.shared, group, block_hash)] = 1
        return stored, removed

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Per tier, the counters that grew since the last call (``errors.<cause>`` per fault)."""
        grown: dict[str, dict[str, int]] = {}
        for name, tier in self.tiers:
            now, last = tier.stats(), self._reported[name]
            self._reported[name] = now
            self.gauges[name] = {"queued": now.queued, "state": int(now.state)}
            counts = {
                field: value - getattr(last, field)
                for field, value in asdict(now).items()
                if isinstance(value, int) and field not in _GAUGES and value != getattr(last, field)
            }
            for cause, value in now.errors.items():
                if value != last.errors.get(cause, 0):
                    counts[f"errors.{cause}"] = value - last.errors.get(cause, 0)
            if counts:
                grown[name] = counts
        return grown

    def take_read_times(self) -> dict[str, tuple[tuple[int, float], ...]]:
        """Per tier, (records returned, seconds) of each fetch read that answered since the
        last call."""
        times: dict[str, list[tuple[int, float]]] = {}
        read_times = self.read_times
        while read_times:
            name, found, seconds = read_times.popleft()
            times.setdefault(name, []).append((found, seconds))
        return {name: tuple(each) for name, each in times.items()}

    def close(self) -> None:
        """Close every tier (each finishes its queued requests first)."""
        for name, tier in self.tiers:
            try:
                tier.close()
            except Exception:  # one tier failing to close must not keep the others open
                logger.exception("closing the %s tier failed", name)


def tier_names(config: KVTierConfig) -> list[str]:
    """The name of each tier in metrics and messages: its type, numbered when a type repeats."""
    types = [tier.type for tier in config.tiers]
    return [
        name if types.count(name) == 1 else f"{name}{types[:i].count(name)}"
        for i, name in enumerate(types)
    ]
