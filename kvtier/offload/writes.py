"""Owns the writes from the host tier down the chain: write-throughs and demotions.

Blocks go down the chain as each lower tier's write policy
(:data:`~kvtier.models.WritePolicy`) says, each at most once per tier while it
stays in the host tier. The next plan has workers copy them out of their
slots, before anything reuses the slots, and queue them to the tiers named:

- a store made readable is *written through* to the ``write_through`` tiers;
- a block the engine loads from the host tier for the first time (a reuse) is
  written through to the ``write_through_admitted`` tiers;
- a block the host tier evicts is *demoted* to the ``write_back`` tiers.

A block promoted from below is never written through: it is held below
already (whoever stored it wrote it through), and written back on eviction as
a stored one is (a disk tier skips a record it holds).

With ``write_back`` or ``write_through`` tiers, stores carry their blocks'
hashes, and a worker keeps, per slot, the tiers its block is owed to: a
graceful close (:meth:`~kvtier.offload.worker.OffloadWorker.close`) writes the
blocks still in their slots to the ``write_back`` tiers, and to the
``write_through`` tiers the blocks whose write-through no plan carried yet (the
engine's last stores are made readable by its last report, and no plan
follows). A write-through, a demotion, a new copy into the slot or a reset (a
demotion to no tier) settles what a slot owes.
Every write is a put on a tier's bounded queue: a full queue drops it, counted
by the tier, and it is not tried again.

The blocks written lately are remembered, so that a promotion of blocks this
engine wrote itself reads them at once instead of probing first
(:mod:`~kvtier.offload.moves`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.index.base import BlockKey
from kvtier.offload.ledger import BatchLedger
from kvtier.offload.messages import Demotion
from kvtier.offload.setup import ManagerSetup
from kvtier.offload.stats import Counters

WRITTEN_KEYS = 1 << 16
"""Blocks this engine last wrote down the chain that a promotion reads without probing first
(about 6 MiB of keys)."""


class LowerTierWrites:
    """The blocks to write down the chain at the next plan, and the slots that hold them."""

    def __init__(self, setup: ManagerSetup, ledger: BatchLedger, counters: Counters) -> None:
        self.setup = setup
        self.ledger = ledger
        self.counters = counters
        # Slots of readable blocks, to find an evicted block's bytes.
        self._slots: dict[BlockKey, int] = {}
        # Readable blocks a reuse does not write through again: written already, or promoted.
        self._reused: set[BlockKey] = set()
        # Blocks to write in the next plan, with the slot that still holds each and the
        # positions of the tiers to write: evicted ones (demotions), kept ones (write-throughs).
        self.demotions: dict[BlockKey, tuple[int, tuple[int, ...]]] = {}
        self.write_throughs: dict[BlockKey, tuple[int, tuple[int, ...]]] = {}
        # The blocks last written down the chain (at most WRITTEN_KEYS), with their salts.
        self._written: OrderedDict[BlockKey, bytes] = OrderedDict()

    @property
    def pending(self) -> bool:
        """Whether writes wait for the next plan."""
        return bool(self.demotions or self.write_throughs)

    def written_down(self, block_hashes: Sequence[bytes], salt: bytes | None) -> bool:
        """Whether this engine wrote every one of the blocks down the chain lately, for the
        tenant of ``salt``: their promotion reads them at once instead of probing first (a
        tier that dropped or evicted one since answers a read finding fewer)."""
        written, salt = self._written, salt or b""
        return bool(written) and all(
            written.get(key) == salt for key in self.setup.namespace.keys(block_hashes, 0)
        )

    def take_demotions(self) -> tuple[Demotion, ...]:
        """Blocks evicted since the last plan, per group and tiers, with the slots that still
        hold them."""
        if not self.demotions:
            return ()
        self.counters.add("demoted_blocks", sum(bool(t) for _, t in self.demotions.values()))
        return self._messages(self.demotions, evicted=True)

    def take_write_throughs(self) -> tuple[Demotion, ...]:
        """Blocks to write through since the last plan, per group and tiers, with their slots."""
        if not self.write_throughs:
            return ()
        self.counters.add("written_through_blocks", len(self.write_throughs))
        return self._messages(self.write_throughs, evicted=False)

    def _messages(
        self, writes: dict[BlockKey, tuple[int, tuple[int, ...]]], *, evicted: bool
    ) -> tuple[Demotion, ...]:
        """``writes`` as one message per group, tiers and tenant salt; empties ``writes``.
        The salts of ``evicted`` blocks are forgotten."""
        batches: dict[tuple[int, tuple[int, ...], bytes], tuple[list[bytes], list[int]]] = {}
        block_salts = self.ledger.requests.block_salts
        salt_of = block_salts.pop if evicted else block_salts.get
        written = self._written
        for key, (slot, tiers) in writes.items():
            group, block_hash = self.setup.namespace.split(key)
            salt = salt_of(key, b"") if block_salts else b""
            hashes, slots = batches.setdefault((group, tiers, salt), ([], []))
            hashes.append(block_hash)
            slots.append(slot)
            if tiers:
                written[key] = salt
                written.move_to_end(key)
        while len(written) > WRITTEN_KEYS:
            written.popitem(last=False)
        writes.clear()
        return tuple(
            Demotion(group, tuple(hashes), tuple(slots), tiers, salt or None)
            for (group, tiers, salt), (hashes, slots) in sorted(batches.items())
        )

    def committed(self, committed: Iterable[tuple[Sequence[BlockKey], Sequence[int]]]) -> None:
        """Stores made readable: remember their slots, to write them down the chain."""
        through = self.setup.through_tiers
        for keys, slots in committed:
            self._slots.update(zip(keys, slots, strict=True))
            if through:
                self.write_throughs.update(
                    (key, (slot, through)) for key, slot in zip(keys, slots, strict=True)
                )

    def promoted(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """Blocks read from below into these slots are readable: written back on eviction,
        never written through on reuse."""
        self._slots.update(zip(keys, slots, strict=False))
        if self.setup.reuse_tiers:
            self._reused.update(keys)

    def reused(self, keys: Iterable[BlockKey]) -> None:
        """The engine loads these readable blocks from the host tier: write the ones not
        written yet through to the ``write_through_admitted`` tiers."""
        tiers = self.setup.reuse_tiers
        for key in keys:
            slot = self._slots.get(key)
            if slot is None or key in self._reused:
                continue
            self._reused.add(key)
            planned = self.write_throughs.get(key)
            self.write_throughs[key] = (slot, tiers if planned is None else planned[1] + tiers)

    def evicted(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` left the host tier: those whose slots are known are demoted."""
        slots, reused, demotions = self._slots, self._reused, self.demotions
        back, block_salts = self.setup.back_tiers, self.ledger.requests.block_salts
        for key in keys:
            slot = slots.pop(key, None)
            if slot is not None:
                reused.discard(key)
                if back:
                    demotions[key] = (slot, back)
                    continue  # its salt goes with its demotion
            if block_salts:
                block_salts.pop(key, None)

    def reset(self) -> None:
        """Forget every block without writing it: with ``write_back`` or ``write_through``
        tiers, every block the workers may still write on closing leaves as a demotion to no
        tier, so that none of them is written."""
        self._written.clear()
        forgotten = {key: slot for key, (slot, _) in self.demotions.items()}
        forgotten.update(self._slots)
        self.demotions.clear()
        if self.setup.back_tiers or self.setup.through_tiers:
            self.demotions.update((key, (slot, ())) for key, slot in forgotten.items())
        self._slots.clear()
        self._reused.clear()
        self.write_throughs.clear()
        self.ledger.requests.block_salts.clear()  # what is demoted now goes to no tier
