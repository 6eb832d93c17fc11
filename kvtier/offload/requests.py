"""Owns the request table: each request's blocks, store progress and loads, and window logic.

A request is tracked from its first allocation until the engine may free its
blocks. Requests that may give the next plan work are marked *due*; a plan
looks at those only, so a step in which no request filled a block costs the
same whatever the number of running requests. Groups with a window (sliding
window, Mamba) need only a hit's last ``window`` blocks; the table works out
which of their blocks a later hit can read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

from kvtier.index.base import BlockKey
from kvtier.offload.messages import DeviceBlock
from kvtier.offload.setup import GroupBlockIds, ManagerSetup

if TYPE_CHECKING:
    from kvtier.offload.control import RequestControl


@dataclass(frozen=True)
class PendingLoad:
    """A load accepted by the engine and not planned yet; its host slots are pinned."""

    group: int
    keys: tuple[BlockKey, ...]
    blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass
class RequestState:
    request_id: str
    num_groups: int
    block_hashes: Sequence[bytes] = ()
    block_ids: list[list[int]] = field(default_factory=list)
    store_cursor: list[int] = field(default_factory=list)
    computed_tokens: int = 0
    pending_loads: list[PendingLoad] = field(default_factory=list)
    unavailable: list[DeviceBlock] = field(default_factory=list)
    batches: set[int] = field(default_factory=set)
    load_batches: set[int] = field(default_factory=set)
    finished: bool = False
    hold_announced: bool = False
    engine_frees_blocks: bool = False
    """The engine frees the finished request's blocks itself: its hold is never announced."""
    load_end: int = 0
    """Block position after the last one loaded from the tier."""
    admitted: bool = False
    """Whether its tier hit since it (re)started was counted in the observations."""
    same_step: bool = False
    """Its pending loads are for the step that runs it (:meth:`OffloadManager.allocated`)."""
    seq: int = 0
    """Order of arrival: plans take requests' loads and stores in this order."""
    seen: tuple[int, int] = (-1, -1)
    """Full blocks computed and block hashes known when a step last gave it work to check."""
    control: RequestControl | None = None
    """What the request asked of kvtier (``None``: nothing)."""
    store_limit: int | None = None
    """The most leading blocks it may store (``None``: no limit), from its control."""

    def __post_init__(self) -> None:
        if not self.block_ids:
            self.clear_blocks()

    def clear_blocks(self) -> None:
        """Forget the request's device blocks and restart store progress in every group."""
        self.block_ids = [[] for _ in range(self.num_groups)]
        self.store_cursor = [0] * self.num_groups
        self.seen = (-1, -1)


class RequestTable:
    """The requests the manager tracks, which of them are due, and which may not load again."""

    def __init__(self, setup: ManagerSetup) -> None:
        self.setup = setup
        self.requests: dict[str, RequestState] = {}
        self.due: set[str] = set()
        self._next_seq = 0
        self.released: list[str] = []
        # Requests whose load failed recompute instead: asked again, they get no tier hit.
        self.load_failed: set[str] = set()
        # Lazy mode, per windowed group: device block -> the key it held while inside the
        # window at the end of a step (where a later hit may start); other blocks are not stored.
        self.window_blocks: list[dict[int, BlockKey]] = [{} for _ in range(setup.num_groups)]
        # Lazy mode, per group: device block -> the key it held when a request whose control
        # limits its stores gave it back; the block is not stored while it holds that key.
        self.unstorable: list[dict[int, BlockKey]] = [{} for _ in range(setup.num_groups)]
        self._looked_up: tuple[Sequence[bytes], int, dict[int, list[BlockKey]]] | None = None
        self.salts: dict[str, bytes] = {}
        """Per request that names a tenant's salt (vLLM's ``cache_salt``), the salt: its blocks'
        records are sealed for that tenant in the lower tiers (:mod:`kvtier.tiers.record`)."""
        self.block_salts: dict[BlockKey, bytes] = {}
        """The salt of each host-tier block a salted request stored or promoted, until it is
        demoted: its writes down the chain are sealed for that tenant."""
        self.lazy_salts: list[dict[int, tuple[BlockKey, bytes]]] = [
            {} for _ in range(setup.num_groups)
        ]
        """Lazy mode, per group: device block -> the key it held and its tenant's salt when a
        salted request gave it back; a store of it from the eviction frontier takes the salt."""

    @property
    def idle(self) -> bool:
        """Whether no request is due or released and not announced yet."""
        return not (self.due or self.released)

    def get(self, request_id: str) -> RequestState | None:
        return self.requests.get(request_id)

    def state(self, request_id: str) -> RequestState:
        """The request's state, tracked from now on if it was not.

        Raises:
            ValueError: The request already finished (request ids must be unique).
        """
        state = self.requests.get(request_id)
        if state is None:
            state = RequestState(request_id, self.setup.num_groups, seq=self._next_seq)
            self._next_seq += 1
            self.requests[request_id] = state
            self.setup.index.request_started(request_id)
        elif state.finished:
            raise ValueError(f"request {request_id} already finished; request ids must be unique")
        return state

    def take_due(self) -> list[RequestState]:
        """The requests marked as possibly having work, in order of arrival; unmarks them."""
        due = [self.requests[r] for r in self.due if r in self.requests]
        self.due.clear()
        due.sort(key=attrgetter("seq"))
        return due

    def release(self, request_id: str) -> None:
        """Stop tracking a finished request; the next :class:`Progress` names it."""
        del self.requests[request_id]
        self.salts.pop(request_id, None)
        self.released.append(request_id)

    def forget_salts(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` will not enter the host tier (a store or promotion given up): their
        salts are not needed."""
        if self.block_salts:
            for key in keys:
                self.block_salts.pop(key, None)

    def take_released(self) -> tuple[str, ...]:
        released, self.released = tuple(self.released), []
        return released

    def refuse_reload(self, request_id: str) -> None:
        """A load of the request failed: until it finishes, it gets no tier hit."""
        state = self.requests.get(request_id)
        if state is not None and not state.finished:
            self.load_failed.add(request_id)

    def cancel_pending_loads(self, state: RequestState) -> None:
        for pending in state.pending_loads:
            self.setup.index.unpin(pending.keys)
        state.pending_loads.clear()
        state.same_step = False

    def restart(self, request_id: str) -> None:
        """The engine took the request's blocks back: drop its loads, restart its stores."""
        state = self.requests.get(request_id)
        if state is None:
            return
        self.cancel_pending_loads(state)
        state.unavailable.clear()
        self.note_unstorable_blocks(state)
        self.note_salted_blocks(state)
        state.clear_blocks()
        state.computed_tokens = 0
        state.load_end = 0
        state.admitted = False

    def storable_blocks(self, state: RequestState) -> int:
        """How many leading blocks of the request are computed, full, and within its store
        limit."""
        ready = self.setup.ready_blocks(state.block_hashes, state.computed_tokens)
        return ready if state.store_limit is None else min(ready, state.store_limit)

    def has_unstored_blocks(self, state: RequestState) -> bool:
        """Eager mode: whether some computed full block of the request is not stored yet."""
        setup = self.setup
        if setup.store_mode != "eager":
            return False
        ready = self.storable_blocks(state)
        return any(
            state.store_cursor[group] < min(ready, len(state.block_ids[group]))
            for group in range(setup.num_groups)
        )

    def scheduled(
        self,
        request_id: str,
        num_computed_tokens: int,
        new_block_ids: GroupBlockIds | None,
        block_hashes: Sequence[bytes] | None,
        resumed: bool,
    ) -> bool:
        """Record a step of a running request; mark it due if it has blocks to store. Returns
        whether the step may have given it work (most decode steps fill no block and bring
        no hash or block: they only move its computed tokens)."""
        block_tokens = self.setup.block_tokens
        state = self.requests.get(request_id)
        if (
            state is not None
            and not resumed
            and not state.finished
            and (new_block_ids is None or not any(new_block_ids))
            and (block_hashes is None or block_hashes is state.block_hashes)
            and (num_computed_tokens // block_tokens, len(state.block_hashes)) == state.seen
        ):
            state.computed_tokens = num_computed_tokens
            return False
        state = self.state(request_id)
        if block_hashes is not None:
            state.block_hashes = block_hashes
        if resumed:
            state.clear_blocks()
        if new_block_ids is not None:
            for group, ids in enumerate(new_block_ids[: self.setup.num_groups]):
                if ids:
                    state.block_ids[group].extend(ids)
        state.computed_tokens = num_computed_tokens
        state.seen = (num_computed_tokens // block_tokens, len(state.block_hashes))
        self.note_window_blocks(state)
        if self.has_unstored_blocks(state):
            self.due.add(request_id)
        return True

    def finish(
        self, request_id: str, num_computed_tokens: int | None, engine_frees_blocks: bool
    ) -> bool:
        """The request finished: whether it stays tracked (held) until its copies are over."""
        self.load_failed.discard(request_id)
        state = self.requests.get(request_id)
        if state is None:
            self.salts.pop(request_id, None)
            return False
        self.setup.index.request_finished(request_id)
        self.cancel_pending_loads(state)
        state.unavailable.clear()
        if num_computed_tokens is not None:
            state.computed_tokens = max(state.computed_tokens, num_computed_tokens)
            self.note_window_blocks(state)
        self.note_unstorable_blocks(state)
        self.note_salted_blocks(state)
        state.finished = True
        state.engine_frees_blocks = engine_frees_blocks
        if state.batches or self.has_unstored_blocks(state):
            self.due.add(request_id)  # its hold is announced by the next plan
            return True
        del self.requests[request_id]
        self.salts.pop(request_id, None)
        return False

    def announce_holds(self, due: Sequence[RequestState]) -> dict[str, tuple[int, ...]]:
        """The finished due requests' holds, once each: the batches that free their blocks.

        A request whose blocks the engine frees itself is not announced, and one with
        no batch left is released at once.
        """
        holds: dict[str, tuple[int, ...]] = {}
        for state in due:
            if not state.finished or state.hold_announced:
                continue
            state.hold_announced = True
            if not state.engine_frees_blocks:
                holds[state.request_id] = tuple(sorted(state.batches))
            if not state.batches:
                self.release(state.request_id)
        return holds

    def hits(
        self,
        block_hashes: Sequence[bytes],
        num_computed_tokens: int,
        num_tokens: int,
        last_block: bool = False,
    ) -> tuple[int, Sequence[bytes], int]:
        """The first block past the engine's hit, the blocks wanted from the tier (never the
        last token's, but with ``last_block`` the full block holding it) and how many of them
        are a hit in every group; the keys made are kept for :meth:`looked_up`."""
        setup = self.setup
        first = num_computed_tokens // setup.block_tokens
        wanted_tokens = num_tokens - num_computed_tokens - (0 if last_block else 1)
        limit = max(0, wanted_tokens) // setup.block_tokens
        wanted = block_hashes[first : first + limit]
        hits = len(wanted)
        looked_up: dict[int, list[BlockKey]] = {}
        for group, window in enumerate(setup.windows):
            if window is None and hits:
                keys = looked_up[group] = setup.namespace.keys(wanted[:hits], group)
                hits = min(hits, setup.index.lookup(keys))
        self._looked_up = (block_hashes, first, looked_up)
        for group, window in enumerate(setup.windows):
            if window is not None:
                hits = self._windowed_hits(wanted, hits, group, window)
        return first, wanted, hits

    def looked_up(self, block_hashes: Sequence[bytes], first: int) -> dict[int, list[BlockKey]]:
        """The keys the last :meth:`hits` made, per group without a window, if it was asked
        about the same hashes (the same sequence) from the same block; forgets them."""
        last, self._looked_up = self._looked_up, None
        if last is not None and last[0] is block_hashes and last[1] == first:
            return last[2]
        return {}

    def _windowed_hits(self, wanted: Sequence[bytes], hits: int, group: int, window: int) -> int:
        """The longest hit ``<= hits`` whose last ``window`` blocks ``group`` holds."""
        setup = self.setup
        keys = setup.namespace.keys(wanted[:hits], group)
        while hits > 0:
            start = max(0, hits - window)
            readable = setup.index.lookup(keys[start:hits])
            if readable == hits - start:
                return hits
            # the first missing block rules out every hit whose window contains it
            hits = start + readable
        return 0

    def note_window_blocks(self, state: RequestState) -> None:
        """Lazy mode: remember the windowed groups' blocks a hit at the request's end needs.

        A hit can start where a step left the request (a finished, preempted or
        repeated request starts from there); a windowed group's block that was
        never among the last ``window`` blocks at such a point is never read
        back, so lazy mode does not store it when it reaches the eviction
        frontier (vLLM frees sliding-window blocks while their request runs).
        """
        setup = self.setup
        if setup.store_mode != "lazy":
            return
        ready = setup.ready_blocks(state.block_hashes, state.computed_tokens)
        for group, window in enumerate(setup.windows):
            if window is None:
                continue
            group_ids = state.block_ids[group]
            stop = min(ready, len(group_ids))
            start = max(0, stop - window)
            keys = setup.namespace.keys(state.block_hashes[start:stop], group)
            for block_id, key in zip(group_ids[start:stop], keys, strict=True):
                if block_id != setup.null_block_id:
                    self.window_blocks[group][block_id] = key

    def note_salted_blocks(self, state: RequestState) -> None:
        """Lazy mode: remember the tenant salt of the blocks a salted request gives back, for
        when the engine offers them from its eviction frontier."""
        salt = self.salts.get(state.request_id) if self.salts else None
        setup = self.setup
        if salt is None or setup.store_mode != "lazy":
            return
        ready = setup.ready_blocks(state.block_hashes, state.computed_tokens)
        for group in range(setup.num_groups):
            group_ids = state.block_ids[group][:ready]
            keys = setup.namespace.keys(state.block_hashes[: len(group_ids)], group)
            salted = self.lazy_salts[group]
            for block_id, key in zip(group_ids, keys, strict=True):
                salted[block_id] = (key, salt)

    def note_unstorable_blocks(self, state: RequestState) -> None:
        """Lazy mode: remember the request's blocks past its store limit as it gives them back.

        The engine offers them from its eviction frontier later, when no request
        owns them any more; while a block holds the key it had here, it is not stored.
        """
        setup, limit = self.setup, state.store_limit
        if limit is None or setup.store_mode != "lazy":
            return
        ready = setup.ready_blocks(state.block_hashes, state.computed_tokens)
        for group in range(setup.num_groups):
            group_ids = state.block_ids[group][limit:ready]
            keys = setup.namespace.keys(state.block_hashes[limit : limit + len(group_ids)], group)
            for block_id, key in zip(group_ids, keys, strict=True):
                if block_id != setup.null_block_id:
                    self.unstorable[group][block_id] = key

    def reset(self) -> None:
        """After the tier was emptied: forget pending loads' blocks and store nothing older."""
        setup = self.setup
        for state in self.requests.values():
            for pending in state.pending_loads:
                setup.index.discard(pending.keys)
            ready = setup.ready_blocks(state.block_hashes, state.computed_tokens)
            # a cursor past the request's known blocks just means "nothing to store yet"
            skip = max(ready, state.load_end)
            state.store_cursor = [max(cursor, skip) for cursor in state.store_cursor]
