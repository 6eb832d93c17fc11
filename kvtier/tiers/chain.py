"""One rank's tiers below the host tier: lookups read down the chain, demotions write to all.

One :class:`TierChain` per rank holds the storage tiers the config lists, in
order, each built by its plugin for this rank's :class:`~kvtier.tiers.base.TierSpec`.

- :meth:`TierChain.fetch` looks blocks up tier by tier: each tier is asked
  for the blocks from the first one the tiers before it did not have, so the
  result is the longest prefix found across the chain. Every read runs on the
  tiers' own threads; the caller polls the returned :class:`Fetch`.
- :meth:`TierChain.store` hands copies of records to every tier; a tier whose
  queue is full drops them and counts it.
- :meth:`TierChain.take_counts` returns what each tier's counters gained since
  the last call, for the worker's report.

Nothing here blocks: a tier that is slow answers misses at its deadline, a
full queue answers at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict
from typing import TYPE_CHECKING

from kvtier.keys import KeyNamespace
from kvtier.kinds import STORAGE_TIER
from kvtier.tiers.base import GetResult, StorageTier, TierSpec, TierStats

if TYPE_CHECKING:
    from kvtier.config.model import KVTierConfig
    from kvtier.plugins import Registry

logger = logging.getLogger(__name__)


class Fetch:
    """Blocks being read down the chain; :attr:`done` once every tier that was asked answered."""

    def __init__(self, chain: TierChain, group: int, block_hashes: Sequence[bytes]) -> None:
        self._chain = chain
        self._group = group
        self._hashes = tuple(block_hashes)
        self.records: list[memoryview] = []
        """Payloads of the leading blocks found, in order (complete once :attr:`done`)."""
        self.sources: list[str] = []
        """The tier each of :attr:`records` came from."""
        self._done = threading.Event()
        self._ask(0)

    @property
    def done(self) -> bool:
        """Whether the search is over."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the search to end; whether it has."""
        return self._done.wait(timeout_s)

    def _ask(self, position: int) -> None:
        start = len(self.records)
        if start == len(self._hashes) or position == len(self._chain.tiers):
            self._done.set()
            return
        name, tier = self._chain.tiers[position]
        keys = tier.keys.keys(self._hashes[start:], self._group)
        future = tier.get(keys)
        future.add_done_callback(lambda answered: self._answered(position, name, answered))

    def _answered(self, position: int, name: str, future: Future[GetResult]) -> None:
        for record in future.result().records:
            if record is None:
                break
            self.records.append(record)
            self.sources.append(name)
        self._ask(position + 1)


class TierChain:
    """This rank's storage tiers below the host tier, in lookup order."""

    def __init__(self, tiers: Sequence[tuple[str, StorageTier]]) -> None:
        """Use ``tiers``: (name, tier) pairs, searched in this order; names must differ."""
        names = [name for name, _ in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        self.tiers = tuple(tiers)
        self._reported: dict[str, TierStats] = {name: TierStats() for name in names}

    @classmethod
    def from_config(
        cls,
        config: KVTierConfig,
        *,
        record_bytes: int,
        keys: KeyNamespace,
        registry: Registry,
    ) -> TierChain:
        """Build each tier of ``config.tiers`` for one rank.

        Args:
            config: The validated config; its ``namespace`` goes into every key
                (a tier's own ``namespace`` setting overrides it).
            record_bytes: Bytes of one block record.
            keys: The rank's namespace: model, layout fingerprint, rank and world size.
            registry: The plugins that build the tiers.

        Raises:
            kvtier.tiers.TierError: A tier cannot start (the tiers built before it are closed).
        """
        spec = TierSpec(
            record_bytes,
            KeyNamespace(
                keys.model, keys.layout_fingerprint, keys.rank, keys.world_size, config.namespace
            ),
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
        return cls(built)

    def fetch(self, group: int, block_hashes: Sequence[bytes]) -> Fetch:
        """Start looking up the blocks of ``group`` named by ``block_hashes``; returns at once."""
        return Fetch(self, group, block_hashes)

    def store(self, group: int, block_hashes: Sequence[bytes], records: Sequence[bytes]) -> None:
        """Queue ``records`` (stable copies) under their blocks' keys in every tier."""
        for _, tier in self.tiers:
            tier.put(tier.keys.keys(block_hashes, group), records)

    def take_counts(self) -> dict[str, dict[str, int]]:
        """Per tier, the counters that grew since the last call (``errors.<cause>`` per fault)."""
        grown: dict[str, dict[str, int]] = {}
        for name, tier in self.tiers:
            now, last = tier.stats(), self._reported[name]
            self._reported[name] = now
            counts = {
                field: value - getattr(last, field)
                for field, value in asdict(now).items()
                if isinstance(value, int) and field != "records" and value != getattr(last, field)
            }
            for cause, value in now.errors.items():
                if value != last.errors.get(cause, 0):
                    counts[f"errors.{cause}"] = value - last.errors.get(cause, 0)
            if counts:
                grown[name] = counts
        return grown

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
