"""Owns planning: accepted tier hits become loads, computed or frontier blocks become stores.

Loads: :meth:`Planner.accept_hit` pins the host slots of the blocks the engine
accepted and queues them on the request; :meth:`Planner.plan_loads` turns the
due requests' queued loads into transfers. Stores: eager mode stores the new
full blocks of due requests (:meth:`Planner.plan_eager_stores`), lazy mode the
candidates the engine offers from its eviction frontier
(:meth:`Planner.plan_lazy_stores`), while host slots last.

A request's control (:class:`~kvtier.offload.control.RequestControl`) is read
here: eager stores stop at its store limit (lazy stores skip the blocks past it,
:meth:`RequestTable.note_unstorable_blocks
<kvtier.offload.requests.RequestTable.note_unstorable_blocks>`), the blocks it
stores or loads get its eviction priority (in eager mode; lazy stores have no
request), and its prompt's blocks are handed to the timed pins.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.copy.base import Direction
from kvtier.index.base import BlockKey, PrioritizedEviction
from kvtier.offload.frontier import EvictionFrontier, FrontierMemory
from kvtier.offload.ledger import BatchLedger
from kvtier.offload.messages import NO_PLAN, DeviceBlock, LazyCandidate, Transfer, TransferPlan
from kvtier.offload.moves import LowerTierMoves
from kvtier.offload.pins import TimedPins
from kvtier.offload.requests import PendingLoad, RequestState, RequestTable
from kvtier.offload.setup import GroupBlockIds, ManagerSetup
from kvtier.offload.stats import Counters

if TYPE_CHECKING:
    from kvtier.offload.control import RequestControl

logger = logging.getLogger(__name__)

_GroupStores = list[tuple[list[int], list[int], list[BlockKey], set[str]]]
"""Per group: device blocks, host slots, keys and requests of the stores being planned."""


class Planner:
    """Plans loads and stores over the request table, recording them in the ledger."""

    def __init__(
        self,
        setup: ManagerSetup,
        requests: RequestTable,
        ledger: BatchLedger,
        moves: LowerTierMoves,
        counters: Counters,
        pins: TimedPins,
    ) -> None:
        self.setup = setup
        self.requests = requests
        self.ledger = ledger
        self.moves = moves
        self.counters = counters
        self.pins = pins
        self.frontier = FrontierMemory(setup, ledger)
        self.flush = False
        """A preemption came: the next plan makes workers wait for copies in flight."""

    @property
    def idle(self) -> bool:
        """Whether no preemption waits for the next plan's flush."""
        return not self.flush

    def plan(
        self,
        lazy_candidates: Sequence[LazyCandidate],
        frontier: EvictionFrontier | None,
        idle: bool,
    ) -> TransferPlan:
        """This step's plan (:meth:`OffloadManager.build_plan`)."""
        requests, moves = self.requests, self.moves
        lazy = self.setup.store_mode == "lazy"
        offered = self.frontier.offer(frontier) if frontier is not None and lazy else []
        if offered:
            lazy_candidates = [*lazy_candidates, *(candidate for _, candidate in offered)]
        if not (requests.due or self.flush or lazy_candidates or moves.has_work) and not (
            idle and moves.promotions
        ):
            return NO_PLAN  # most decode steps
        if moves.unread:
            moves.read_again(idle)
        if moves.prefetches.refill_due:
            moves.refill()
        now = self.setup.clock()
        due = requests.take_due()
        loads, unavailable, same_step = self.plan_loads(due, now)
        if lazy:
            stores = self.plan_lazy_stores(lazy_candidates, now)
        else:
            stores = self.plan_eager_stores(due, now)
        self.frontier.taken(offered)
        plan = TransferPlan(
            stores=tuple(stores),
            loads=tuple(loads),
            flush=self.flush,
            holds=requests.announce_holds(due),
            unavailable=unavailable,
            promotions=moves.take_promotions(),
            demotions=moves.writes.take_demotions(),
            write_throughs=moves.writes.take_write_throughs(),
            same_step=same_step,
            idle=idle and bool(moves.promotions),
        )
        self.flush = False
        return plan

    def allocated(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        block_ids: GroupBlockIds,
        num_computed_tokens: int,
        num_external_tokens: int,
        same_step: bool,
        control: RequestControl | None,
    ) -> None:
        """The engine allocated the request (:meth:`OffloadManager.allocated`): take its
        control, touch its own hits in the tier's policy and queue the load of the tier's."""
        setup = self.setup
        if same_step and setup.num_groups > 1:
            raise ValueError(
                f"request {request_id}: a same-step load needs one kv-cache group, but there "
                f"are {setup.num_groups}; load it a step ahead"
            )
        state = self.requests.state(request_id)
        state.block_hashes = block_hashes
        if control is not None and state.control is None:  # not again after a preemption
            self.take_control(state, control)
        first = num_computed_tokens // setup.block_tokens
        for group in range(setup.num_groups):
            setup.index.touch(setup.namespace.keys(block_hashes[:first], group))
        looked_up = self.requests.looked_up(block_hashes, first)
        self.accept_hit(state, block_ids, first, num_external_tokens, looked_up, same_step)

    def take_control(self, state: RequestState, control: RequestControl) -> None:
        """Keep the request's control; hand its prompt's blocks to the timed pins."""
        setup = self.setup
        state.control = control
        state.store_limit = control.store_limit(setup.block_tokens)
        if control.pin_s is None:
            return
        count = len(state.block_hashes)
        if control.store_max_tokens is not None:
            count = min(count, control.store_max_tokens // setup.block_tokens)
        keys: list[BlockKey] = []
        for group, window in enumerate(setup.windows):
            start = 0 if window is None else max(0, count - window)
            keys.extend(setup.namespace.keys(state.block_hashes[start:count], group))
        self.pins.want(state.request_id, keys, control.pin_s)

    def prioritize(self, state: RequestState, keys: Sequence[BlockKey]) -> None:
        """Give ``keys`` the eviction priority the request asked for, if it asked for one."""
        control, index = state.control, self.setup.index
        if control is not None and control.priority != "normal" and keys:
            if isinstance(index, PrioritizedEviction):
                index.prioritize(keys, control.priority)

    def accept_hit(
        self,
        state: RequestState,
        block_ids: GroupBlockIds,
        first: int,
        num_external_tokens: int,
        looked_up: dict[int, list[BlockKey]],
        same_step: bool,
    ) -> None:
        """Queue the load of the tier hit the engine accepted, from block position ``first``.

        ``num_external_tokens / block_tokens`` blocks, rounded up (a same-step hit
        may end one token short of a block, whose last token the engine computes
        again), are loaded into ``block_ids[group][position]`` in every group (a
        group with a window: its last ``window`` of them). Their host slots are
        pinned now, so no store can evict them before the load ran; a block that
        is no longer readable is reported to the engine as a failed load
        (recompute) by the next plan. ``looked_up``: the keys the lookup made.
        """
        setup, counters = self.setup, self.counters
        count = -(-num_external_tokens // setup.block_tokens)
        if not state.admitted:
            state.admitted = True
            counters.observe(counters.observations.request_hit_tokens, count * setup.block_tokens)
        if count == 0:
            return
        counters.add("hit_tokens", count * setup.block_tokens)
        state.load_end = first + count
        state.same_step = same_step
        self.requests.due.add(state.request_id)
        hashes = state.block_hashes[first : first + count]
        index = setup.index
        for group in range(setup.num_groups):
            group_ids = block_ids[group][first : first + count] if group < len(block_ids) else []
            if len(group_ids) != len(hashes):
                raise ValueError(
                    f"request {state.request_id}: group {group} has {len(group_ids)} device "
                    f"blocks at positions {first}..{first + count - 1}, but {len(hashes)} tier "
                    "blocks were accepted; pass the request's block ids from position 0 for "
                    "every group"
                )
            window = setup.windows[group]
            skip = 0 if window is None else max(0, count - window)
            blocks = list(group_ids[skip:])
            keys = looked_up.get(group, [])[:count] if window is None else []
            if len(keys) < count:
                keys = setup.namespace.keys(hashes[skip:], group)
            if setup.null_block_id in blocks:
                kept = [i for i, block_id in enumerate(blocks) if block_id != setup.null_block_id]
                keys, blocks = [keys[i] for i in kept], [blocks[i] for i in kept]
            readable = index.lookup(keys)
            if readable:
                pinned = tuple(keys[:readable])
                slots = tuple(index.pin(pinned))
                self.prioritize(state, pinned)
                self.moves.reused(pinned)
                state.pending_loads.append(
                    PendingLoad(group, pinned, tuple(blocks[:readable]), slots)
                )
            if readable < len(keys):
                logger.warning(
                    "request %s: %d of %d tier blocks of group %d are no longer readable; "
                    "they will be recomputed",
                    state.request_id,
                    len(keys) - readable,
                    len(keys),
                    group,
                )
                state.unavailable.extend(DeviceBlock(group, b) for b in blocks[readable:])
                self.counters.add("load_failures", len(keys) - readable)

    def plan_loads(
        self, due: Sequence[RequestState], now: float
    ) -> tuple[list[Transfer], dict[str, tuple[int, ...]], frozenset[str]]:
        """The due requests' queued loads, their unreadable blocks and the same-step requests."""
        loads: list[Transfer] = []
        unavailable: dict[str, tuple[int, ...]] = {}
        same_step: set[str] = set()
        observations = self.counters.observations
        for state in due:
            if state.same_step:
                same_step.add(state.request_id)
            for pending in state.pending_loads:
                transfer = Transfer(
                    self.ledger.new_batch_id(),
                    Direction.LOAD,
                    pending.group,
                    pending.blocks,
                    pending.slots,
                    state.request_id,
                )
                self.ledger.add_load(transfer, pending.keys, state, now)
                loads.append(transfer)
                self.counters.observe(observations.load_blocks, len(transfer))
            state.same_step = False
            state.pending_loads.clear()
            if state.unavailable:
                unavailable[state.request_id] = tuple(b.block_id for b in state.unavailable)
                self.ledger.unavailable[state.request_id] = tuple(state.unavailable)
                state.unavailable.clear()
        return loads, unavailable, frozenset(same_step)

    def plan_eager_stores(self, due: Sequence[RequestState], now: float) -> list[Transfer]:
        """Store the due requests' computed full blocks not stored yet, while slots last.

        Per request and group, one reserve of the blocks past its store cursor; the
        granted ones join the group's batch with list extends, not per block.
        """
        setup, index, namespace = self.setup, self.setup.index, self.setup.namespace
        null, windows = setup.null_block_id, setup.windows
        prefixes = [namespace.prefix(group) for group in range(setup.num_groups)]
        storable_blocks = self.requests.storable_blocks
        per_group: _GroupStores = []
        out_of_space = False
        reserved_now: set[BlockKey] = set()
        salts, block_salts = self.requests.salts, self.requests.block_salts
        for state in due:
            if state.hold_announced:
                continue
            if out_of_space:
                self.requests.due.add(state.request_id)  # retried next step
                continue
            ready = storable_blocks(state)
            block_hashes, cursors = state.block_hashes, state.store_cursor
            for group, prefix in enumerate(prefixes):
                group_ids = state.block_ids[group]
                start, stop = cursors[group], min(ready, len(group_ids))
                window = windows[group]
                if window is not None:
                    # blocks that left the window may already be back in the engine's pool
                    start = max(start, stop - window)
                if start >= stop:
                    cursors[group] = max(cursors[group], stop)
                    continue
                blocks = group_ids[start:stop]
                if null is not None and null in blocks:
                    positions = [pos for pos in range(start, stop) if group_ids[pos] != null]
                    blocks = [group_ids[pos] for pos in positions]
                    keys = [prefix + block_hashes[pos] for pos in positions]
                else:
                    positions = range(start, stop)
                    keys = [prefix + block_hash for block_hash in block_hashes[start:stop]]
                parent = prefix + block_hashes[start - 1] if start else None
                slots = index.reserve(keys, parent) if keys else []
                salt = salts.get(state.request_id) if salts else None
                if salt is not None:
                    granted = zip(keys, slots, strict=True)
                    block_salts.update((key, salt) for key, slot in granted if slot is not None)
                if state.control is not None:
                    granted = zip(keys, slots, strict=True)
                    self.prioritize(state, [key for key, slot in granted if slot is not None])
                cursor = stop
                if not per_group:  # the first request with blocks to store this step
                    per_group = [([], [], [], set()) for _ in range(setup.num_groups)]
                block_list, slot_list, key_list, requests = per_group[group]
                if None not in slots:
                    block_list.extend(blocks)
                    slot_list.extend(slots)
                    key_list.extend(keys)
                    reserved_now.update(keys)
                    if keys:
                        requests.add(state.request_id)
                else:
                    for pos, block, key, slot in zip(positions, blocks, keys, slots, strict=True):
                        if slot is not None:
                            block_list.append(block)
                            slot_list.append(slot)
                            key_list.append(key)
                            requests.add(state.request_id)
                            reserved_now.add(key)
                        elif (
                            cursor == stop
                            and key not in reserved_now
                            and not self.ledger.present(key)
                            and self._no_space()
                        ):
                            # retry from here next step; later keys of the chain got no slot
                            cursor = pos
                            out_of_space = True
                cursors[group] = cursor
                if out_of_space:
                    self.requests.due.add(state.request_id)
                    break
        return self._store_transfers(per_group, now)

    def plan_lazy_stores(self, candidates: Sequence[LazyCandidate], now: float) -> list[Transfer]:
        """Store the frontier candidates the tier does not hold, while slots last."""
        setup, index = self.setup, self.setup.index
        per_group: _GroupStores = [([], [], [], set()) for _ in range(setup.num_groups)]
        wanted: dict[BlockKey, LazyCandidate] = {}
        for candidate in candidates:
            if candidate.block_id == setup.null_block_id:
                continue
            if not 0 <= candidate.group < setup.num_groups:
                raise ValueError(
                    f"lazy candidate names kv-cache group {candidate.group}, "
                    f"but the manager has {setup.num_groups} groups"
                )
            key = setup.namespace.key(candidate.block_hash, candidate.group)
            if key in wanted or self.ledger.present(key):
                continue
            unstorable = self.requests.unstorable[candidate.group]
            if unstorable and unstorable.get(candidate.block_id) == key:
                continue
            if (
                setup.windows[candidate.group] is not None
                and self.requests.window_blocks[candidate.group].get(candidate.block_id) != key
            ):
                continue
            wanted[key] = candidate
        # With room for all, slots are taken in the prompt's order: the engine frees a
        # request's blocks last first, so candidates come in reverse. A later hit then
        # reads slots that count up along the prompt, as eager stores leave them, and
        # its load is a few runs in one direction. Without room, the candidates nearest
        # eviction go first.
        slots: dict[BlockKey, int] = {}
        backwards = len(wanted) <= index.stats().free
        for key in reversed(wanted) if backwards else wanted:
            (slot,) = index.reserve([key], lazy=True)
            if slot is not None:
                slots[key] = slot
            elif self._no_space():
                break
        lazy_salts, block_salts = self.requests.lazy_salts, self.requests.block_salts
        for key, candidate in wanted.items():
            if key in slots:
                blocks, slot_list, key_list, _ = per_group[candidate.group]
                blocks.append(candidate.block_id)
                slot_list.append(slots[key])
                key_list.append(key)
                salted = lazy_salts[candidate.group].get(candidate.block_id)
                if salted is not None and salted[0] == key:
                    block_salts[key] = salted[1]
        return self._store_transfers(per_group, now)

    def _no_space(self) -> bool:
        stats = self.setup.index.stats()
        # discarded slots are pinned too, but hold no readable block
        return stats.free == 0 and stats.readable == stats.pinned - stats.discarded

    def _store_transfers(self, per_group: _GroupStores, now: float) -> list[Transfer]:
        transfers = []
        observations = self.counters.observations
        # a worker closing gracefully writes the blocks still in the host tier to the tiers
        # that lack them: the write_back ones, and write_through ones if no plan wrote them
        named = bool(self.setup.back_tiers or self.setup.through_tiers)
        split = self.setup.namespace.split
        block_salts = self.requests.block_salts if named else None
        for group, (blocks, slots, keys, requests) in enumerate(per_group):
            if not blocks:
                continue
            transfer = Transfer(
                self.ledger.new_batch_id(),
                Direction.STORE,
                group,
                tuple(blocks),
                tuple(slots),
                block_hashes=tuple(split(key)[1] for key in keys) if named else (),
                salts=tuple(block_salts.get(key) for key in keys) if block_salts else (),
            )
            self.ledger.add_store(transfer, tuple(keys), requests, now)
            transfers.append(transfer)
            self.counters.observe(observations.store_blocks, len(transfer))
        return transfers
