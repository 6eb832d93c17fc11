"""``prefix_arc``: ARC adapted to prefix chains of KV blocks.

A KV tier is not a generic cache: a block is only readable through its whole
prefix (lookup stops at the first missing block), every request walks its chain
root first, and reuse comes in long gaps. Six changes to ARC (see
:mod:`kvtier.index.arc`) use that:

- **Tail first.** A request touches its chain root to leaf, so a plain recency
  order ranks the root oldest and evicts it first, which cuts off every block
  after it. Here each request's chain is re-ranked leaf to root: the deepest
  block of the least recent chain goes first and the chain shrinks from its end.
- **Orphans first.** When a block leaves, its cached children can no longer be
  reached by a prefix lookup; they move to an orphan queue that is evicted
  before anything else (a hit, possible once the parent is stored again, takes
  a block back out of it).
- **Long memory.** Reuse gaps in serving traces are often many times the tier's
  size, beyond what ARC's ghost lists (one tier's worth) remember. Keys that
  fall off the ghost lists are kept in a longer history (``history_factor``
  times the slot count); a key stored again while remembered there is known to
  be reused, goes straight to the frequent list, and, like a hit in ARC's
  frequent ghost list, moves the target towards a larger frequent list.
- **Learned low-value blocks.** Each newly stored block gets a class: whether
  its chain is new or extends a cached prefix, and its distance from the end
  of what the request stored (0, 1, 2, 3+). The policy counts, per class, how
  many stored blocks are used again while it still remembers them. A block of
  a class reused at under ``low_value_ratio`` of the overall rate is placed
  first in line for eviction. What is worth little is learned from the trace,
  not assumed: in one workload a request's last blocks are rarely reused, in
  another (multi-turn chat) they are the next turn's prefix.
- **Adaptive admission.** A block seen for the first time is often never used
  again, or only after a gap longer than a small tier holds, where storing it
  only pushes out blocks that do come back; in a large tier the same blocks are
  worth their slots. Two small shadow caches, fed the same hashed sample of the
  keys (spatial sampling, capacity scaled by the sampling rate), replay the
  choice both ways: one stores every block, the other only a block seen before
  (remembered for ``first_sight_memory_factor`` times the slot count). A
  saturating counter of which shadow hits more picks, as the trace goes, whether
  the tier stores blocks on first sight or only on second sight; a declined
  block's descendants in the same chain are declined too (they could not be
  reached). So the admission filter turns itself on where it pays (small tiers
  against a working set of one-shot blocks) and off where it does not.
- **Recency when it pays.** ARC's target adapts one ghost hit at a time and
  starts at an empty recency list, and reuse after a long gap keeps pushing it
  towards the frequency list; in a large tier on a conversation-like workload
  that starves the recency list and falls below plain LRU. So victims follow
  one of two rules: ARC's target, or recency alone (the least recently used
  block of both lists, chains still ranked leaf first). A third shadow, the
  same ARC on the same key sample, duels with the shadow that stores every
  block under LRU; a saturating counter of which one hits more picks the rule.
  The tier starts on recency and takes ARC's rule once ARC's shadow is ahead,
  its target then starting from the recency list's current size.

Everything is O(1) amortized per operation: ordered dicts for the lists (their
values are use stamps, so the least recent of two list heads is one
comparison), each chain is re-ranked at most a few times per request, and the
shadows see only the sampled keys.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import compress, pairwise
from operator import ne
from typing import Literal
from zlib import crc32

from pydantic import Field

from kvtier.index.arc import ARCShadow, adapted_target_t1, arc_prefers_t1, first_evictable
from kvtier.index.base import BlockKey
from kvtier.index.policy import EvictionPolicy
from kvtier.models import PluginConfig

TAIL_BUCKETS = 4
"""Stored blocks are classed by distance from their chain's end: 0, 1, 2, or 3 and more."""
NUM_CLASSES = 2 * TAIL_BUCKETS
"""Classes: (new chain or extension of a cached prefix) x tail bucket."""
PRIOR_WEIGHT = 10.0
"""Pseudo-count pulling a class's reuse rate towards the overall rate until it has data."""
SAMPLE_SPACE = 1 << 16
"""Keys are sampled for the shadow caches by the low 16 bits of their CRC-32."""
SAMPLE_MASK = SAMPLE_SPACE - 1
MIN_SHADOW_SLOTS = 128
"""Slots of the smallest shadow cache; a tier too small for its sample rate samples more."""
MAX_MEMORY_FACTOR = 1024.0
"""Largest multiple of the slot count a memory of keys may be configured to hold."""
DUEL_LIMIT = 256
"""Bound of the counters of shadow hits, so a change of workload turns a choice within a few
hundred sampled hits."""
HELD, IN_B1, IN_B2, IN_HISTORY = range(4)
"""Where a key is: held by the tier; once evicted, remembered in ARC's ghost list ``b1`` or
``b2`` or in the long history. A remembered key's place is ``ticket << 2 | list``, with a ticket
counted per eviction, so that a queue entry left behind when the key was stored again (and
maybe evicted again since) no longer matches it."""

Admission = Literal["adaptive", "all"]
Eviction = Literal["adaptive", "arc", "recency"]


class PrefixARCConfig(PluginConfig):
    """ARC with tail-first chains, orphan eviction and a long reuse history."""

    type: Literal["prefix_arc"] = "prefix_arc"
    history_factor: float = Field(
        default=4.0,
        ge=0.0,
        le=MAX_MEMORY_FACTOR,
        description=(
            "Evicted keys remembered beyond ARC's ghost lists, as a multiple of the slot count "
            "(about 16 bytes of memory per remembered key plus the key itself); a remembered key "
            "stored again is treated as reused."
        ),
    )
    low_value_ratio: float = Field(
        default=0.5,
        ge=0.0,
        description=(
            "A newly stored block whose class (new chain or extension of a cached prefix, and "
            "distance from the chain's end) has been reused at less than this fraction of the "
            "overall reuse rate is placed first in line for eviction; 0 turns this off."
        ),
    )
    admission: Admission = Field(
        default="adaptive",
        description=(
            "'adaptive': shadow caches on a sample of the keys decide, as the workload goes, "
            "whether a block seen for the first time is stored or only a block seen before; "
            "'all': store every block."
        ),
    )
    eviction: Eviction = Field(
        default="adaptive",
        description=(
            "'adaptive': shadow caches on a sample of the keys decide, as the workload goes, "
            "whether victims follow ARC's adaptive target or recency alone (the least recently "
            "used block); 'arc' or 'recency': always that rule."
        ),
    )
    first_sight_memory_factor: float = Field(
        default=16.0,
        gt=0.0,
        le=MAX_MEMORY_FACTOR,
        description=(
            "Keys seen once and not stored that adaptive admission remembers, as a multiple of "
            "the slot count (about 100 bytes of memory per key plus the key itself)."
        ),
    )
    sample_rate: float = Field(
        default=0.0625,
        gt=0.0,
        le=1.0,
        description=(
            "Share of the keys the shadow caches of adaptive admission and eviction replay; each "
            "shadow holds this share of the slot count (at least 128 slots: a smaller tier "
            "samples more)."
        ),
    )


class _Memory:
    """A queue of evicted keys, oldest first, each with the place it had when queued.

    Two deques in step instead of one of pairs, so that queueing a key allocates nothing the
    garbage collector tracks. An entry is live while the key's place (``where``) still equals
    the one queued with it. The policy's hot path appends to both deques itself.
    """

    __slots__ = ("keys", "places")

    def __init__(self) -> None:
        self.keys: deque[BlockKey] = deque()
        self.places: deque[int] = deque()

    def move_oldest(self, other: _Memory, where: dict[BlockKey, int], place: int) -> None:
        """Move the oldest live key to the end of ``other``, whose list ``place`` names."""
        keys, places = self.keys, self.places
        key, queued = keys.popleft(), places.popleft()
        while where.get(key) != queued:
            key, queued = keys.popleft(), places.popleft()
        where[key] = place
        other.keys.append(key)
        other.places.append(place)

    def sweep(self, where: dict[BlockKey, int]) -> None:
        """Drop the entries that are no longer live."""
        pairs = zip(self.keys, self.places, strict=True)
        live = [(key, place) for key, place in pairs if where.get(key) == place]
        self.keys = deque(key for key, _ in live)
        self.places = deque(place for _, place in live)


class _Duels:
    """The shadow caches of adaptive admission and eviction, fed a hashed sample of the keys,
    and the choices their duels make (see the module docstring)."""

    def __init__(
        self,
        num_slots: int,
        history_factor: float,
        first_sight_memory_factor: float,
        sample_rate: float,
        admission: Admission,
        eviction: Eviction,
    ) -> None:
        self.num_slots = num_slots
        self.adaptive = admission == "adaptive"
        self.second_sight = False
        # A shadow of a few slots only measures noise: small tiers sample more of their keys.
        sample_rate = max(sample_rate, min(1.0, MIN_SHADOW_SLOTS / num_slots))
        self.sample_below = max(1, round(sample_rate * SAMPLE_SPACE))
        self.slots = max(1, round(num_slots * sample_rate))
        self.seen_size = max(1, int(self.slots * first_sight_memory_factor))
        self.every: OrderedDict[BlockKey, None] = OrderedDict()
        self.second: OrderedDict[BlockKey, None] = OrderedDict()
        self.seen: OrderedDict[BlockKey, None] = OrderedDict()
        # Sampled keys that may be in the tier, so that a hit needs no hashing to be sampled.
        self.sampled: set[BlockKey] = set()
        self.duel = 0
        # Adaptive eviction: the same ARC on the sampled keys, against ``every`` (LRU); the tier
        # starts on recency and follows ARC's target while its shadow is ahead.
        self.recency = eviction != "arc"
        self.rule_duel = 0
        self.arc = (
            ARCShadow(self.slots, int(self.slots * history_factor))
            if eviction == "adaptive"
            else None
        )
        self.sampling = self.adaptive or self.arc is not None

    def reference(self, key: BlockKey) -> bool:
        """Replay a use of sampled ``key``; return whether victims just turned from recency to
        ARC's target."""
        limit = self.slots
        every = self.every
        every_hit = key in every
        if every_hit:
            every.move_to_end(key)
        else:
            every[key] = None
            if len(every) > limit:
                every.popitem(last=False)
        if self.adaptive:
            # The second-sight shadow stores a key only when its memory of keys seen once
            # remembers it.
            second = self.second
            if key in second:
                second.move_to_end(key)
                score = every_hit - 1
            else:
                score = int(every_hit)
                if _seen_before(self.seen, key, self.seen_size):
                    second[key] = None
                    if len(second) > limit:
                        second.popitem(last=False)
            if score:
                self.duel = max(-DUEL_LIMIT, min(DUEL_LIMIT, self.duel + score))
                self.second_sight = self.duel < 0
        if self.arc is not None and self.arc.reference(key) != every_hit:
            self.rule_duel = max(-DUEL_LIMIT, min(DUEL_LIMIT, self.rule_duel + 2 * every_hit - 1))
            if self.recency and self.rule_duel < 0:
                self.recency = False
                return True
            if not self.recency and self.rule_duel > 0:
                self.recency = True
        return False

    def note_sampled(self, key: BlockKey, held: dict[BlockKey, BlockKey | None]) -> None:
        """Remember that ``key``, about to be stored, is sampled (its hits go to the shadows);
        ``held``: the keys the tier holds."""
        sampled = self.sampled
        sampled.add(key)
        # Keys that left the tier (or were never stored: no free slot, an aborted store) are
        # dropped in a sweep once there are twice as many as slots: O(1) amortized per key.
        if len(sampled) > 2 * self.num_slots:
            sampled.intersection_update([key for key in sampled if key in held])


class _ReuseClasses:
    """Reuse learning (see the module docstring): the class of each newly stored block not
    reused yet, and per class how many blocks were stored and reused, halved every few tiers'
    worth of stores so that they follow the workload."""

    __slots__ = ("ratio", "of_key", "stored", "reused", "decay_every", "since_decay")

    def __init__(self, ratio: float, decay_every: int) -> None:
        self.ratio = ratio
        self.of_key: dict[BlockKey, int] = {}
        """A stored key's class until its first reuse, kept while the key is remembered."""
        self.stored = [0.0] * NUM_CLASSES
        self.reused = [0.0] * NUM_CLASSES
        self.decay_every = decay_every
        self.since_decay = 0

    def reuse(self, key: BlockKey) -> None:
        """A held or remembered key is used again: its class, if it still has one, was reused."""
        cls = self.of_key.pop(key, None)
        if cls is not None:
            self.reused[cls] += 1.0

    def classify(
        self, walk: list[BlockKey], origin: int, t1: OrderedDict[BlockKey, int]
    ) -> list[BlockKey]:
        """Class a chain's newly stored blocks, leaf first (``walk``), those still in t1 (not
        hit, not gone): one class per distance from the leaf for the last few, one for the
        rest, ``origin`` telling a new chain from an extension. Returns those of a low-value
        class, leaf first."""
        stored, reused, classes = self.stored, self.reused, self.of_key
        prior, bar = _low_value_bar(stored, reused, self.ratio)
        demoted = []
        deep = TAIL_BUCKETS - 1
        for distance, key in enumerate(walk[:deep]):
            if key in t1:
                cls = origin + distance
                # Classes only grow along the walk: each is tested on its counts from before
                # this chain, the first time it is met.
                low = (reused[cls] + prior) / (stored[cls] + PRIOR_WEIGHT) < bar
                classes[key] = cls
                stored[cls] += 1.0
                if low:
                    demoted.append(key)
        rest = [key for key in walk[deep:] if key in t1]
        if rest:
            cls = origin + deep
            classes.update(dict.fromkeys(rest, cls))
            if (reused[cls] + prior) / (stored[cls] + PRIOR_WEIGHT) < bar:
                demoted += rest
            stored[cls] += len(rest)
        return demoted

    def count_stores(self, count: int) -> None:
        """``count`` more blocks were stored; halve the counts every ``decay_every``."""
        self.since_decay += count
        if self.since_decay >= self.decay_every:
            self.since_decay = 0
            self.stored = [each / 2 for each in self.stored]
            self.reused = [each / 2 for each in self.reused]


class PrefixARCPolicy(EvictionPolicy):
    """ARC over prefix chains; ``num_slots`` sizes the ghost lists and the history."""

    def __init__(
        self,
        num_slots: int,
        history_factor: float = 4.0,
        low_value_ratio: float = 0.5,
        admission: Admission = "adaptive",
        first_sight_memory_factor: float = 16.0,
        sample_rate: float = 0.0625,
        eviction: Eviction = "adaptive",
    ) -> None:
        self.num_slots = num_slots
        self.history_size = int(num_slots * history_factor)
        self.target_t1 = 0.0
        # What the policy knows of each key it holds or remembers, in dicts keyed by the key
        # (no object per key: a step's blocks start no garbage collection). ``_where``: every
        # such key's place (HELD, or where it is remembered); ``_parent``: a held key's prefix
        # parent; ``_children``: a held key's cached children (one key, or a set of keys).
        self._where: dict[BlockKey, int] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._children: dict[BlockKey, BlockKey | set[BlockKey]] = {}
        self._tickets = 0
        # Values are the keys' use stamps from ``_clock``, increasing along each list; stamp 0
        # marks a block put first in line for eviction.
        self._t1: OrderedDict[BlockKey, int] = OrderedDict()
        self._t2: OrderedDict[BlockKey, int] = OrderedDict()
        self._clock = 0
        self._orphans: OrderedDict[BlockKey, None] = OrderedDict()
        # Evicted keys: ARC's ghost lists b1 and b2, and the long history of keys they forget,
        # each a queue, oldest first. A key stored again leaves its entry behind, dropped when
        # its queue gets there or in a sweep once there are more such entries than remembered
        # keys (``_forgotten`` counts them).
        self._b1 = _Memory()
        self._b2 = _Memory()
        self._history = _Memory()
        self._b1_len = self._b2_len = self._history_len = 0  # live entries
        self._forgotten = 0
        self._incoming_in_b2 = False
        # The chain being touched (root first), how much of it is already ranked leaf first, and
        # how much of it is in a list (new blocks join the recency list when their chain is
        # ranked, so that they go in leaf first).
        self._chain: list[BlockKey] = []
        self._ranked = 0
        self._placed = 0
        self._first_new: int | None = None
        # Whether a block stored since the chain was last placed came back from the memory of
        # evicted keys (into t2, at once): the others join t1 in one update.
        self._returned = False
        self._reuse = _ReuseClasses(low_value_ratio, max(1, self.history_size + 2 * num_slots))
        # Adaptive admission: keys seen once and not stored, the last key declined (its
        # descendants are declined too); the shadow caches and their choices.
        self._seen: OrderedDict[BlockKey, None] = OrderedDict()
        self._seen_size = max(1, int(num_slots * first_sight_memory_factor))
        self._declined: BlockKey | None = None
        self._duels = _Duels(
            num_slots, history_factor, first_sight_memory_factor, sample_rate, admission, eviction
        )

    @property
    def second_sight(self) -> bool:
        """Whether adaptive admission stores only blocks seen before, now."""
        return self._duels.second_sight

    @property
    def recency(self) -> bool:
        """Whether victims follow recency alone now (else ARC's target)."""
        return self._duels.recency

    def state(self) -> dict[str, float]:
        """ARC's target and lists, and the two duels: ``second_sight`` (admission on second
        sight only) and ``recency`` (victims by recency alone) are 1 while chosen."""
        counters = {
            "target_t1": self.target_t1,
            "t1": len(self._t1),
            "t2": len(self._t2),
            "orphans": len(self._orphans),
            "history": self._history_len,
            "second_sight": float(self.second_sight),
            "admission_duel": self._duels.duel,
            "recency": float(self.recency),
            "eviction_duel": self._duels.rule_duel,
        }
        if self._duels.arc is not None:
            counters["shadow_arc_target_t1"] = self._duels.arc.target_t1
        return counters

    # Chain ranking.

    def _rank_chain(self) -> None:
        """Rank the chain touched so far leaf first: its deepest block becomes the oldest.

        Callers skip a chain that is ranked already (``_ranked`` at its length), except
        :meth:`_end_chain`, which ranks a chain that stored blocks once more in any case.
        """
        chain, placed, t1, t2 = self._chain, self._placed, self._t1, self._t2
        clock = self._clock
        end = len(chain)
        if placed < end and not self._returned:
            # The blocks stored since the chain was last placed, none of them in t2, join t1
            # deepest first.
            joining = chain[placed:end]
            joining.reverse()
            t1.update(zip(joining, range(clock + 1, clock + 1 + len(joining)), strict=True))
            clock += len(joining)
            end = placed
        for position in range(end - 1, -1, -1):
            key = chain[position]
            clock += 1
            if key in t2:
                t2.move_to_end(key)
                t2[key] = clock
            elif position >= placed:
                t1[key] = clock
            elif key in t1:
                t1.move_to_end(key)
                t1[key] = clock
        self._clock = clock
        self._ranked = self._placed = len(chain)
        self._returned = False

    def _end_chain(self) -> None:
        """Rank the finished chain leaf first, and class the blocks it stored."""
        chain, first = self._chain, self._first_new
        if first is None:
            if self._ranked != len(chain):
                self._rank_chain()
        else:
            t1 = self._t1
            if len(chain) == 1 and not self._placed and not self._returned:
                # ``_rank_chain`` of a chain of one new block (a decode step's), inline.
                self._clock += 1
                t1[chain[0]] = self._clock
            else:
                self._rank_chain()
            origin = 0
            # (Only a held key has a parent entry.)
            if first and self._parent.get(chain[first]) is not None:
                origin = TAIL_BUCKETS
            walk = chain[first:]
            walk.reverse()
            # Root first, so that the chain's deepest low-value block ends up first in line.
            move_to_end = t1.move_to_end
            for key in reversed(self._reuse.classify(walk, origin, t1)):
                move_to_end(key, last=False)
                t1[key] = 0
            self._reuse.count_stores(len(chain) - first)
        chain.clear()
        self._ranked = self._placed = 0
        self._first_new = None
        self._returned = False

    def _add_child(self, parent: BlockKey, child: BlockKey) -> None:
        """List ``child`` as a cached child of ``parent``, if this tier holds ``parent``."""
        if parent not in self._parent:  # not held
            return
        # Most blocks have one cached child: store it bare and make a set only for a second one.
        children = self._children
        siblings = children.get(parent)
        if siblings is None:
            children[parent] = child
        elif type(siblings) is set:
            siblings.add(child)
        elif siblings != child:
            children[parent] = {siblings, child}

    # Adaptive admission.

    def _shadow_reference(self, key: BlockKey) -> None:
        """Replay a use of sampled ``key`` in the shadow caches; update the choices."""
        if self._duels.reference(key):
            # ARC's target starts from the split that recency left.
            self.target_t1 = float(len(self._t1))

    def _admit_on_second_sight(self, key: BlockKey, parent: BlockKey | None) -> bool:
        """Whether ``key`` was seen before (and its parent was not just declined)."""
        if parent is not None and parent == self._declined:
            _remember(self._seen, key, self._seen_size)
            self._declined = key
            return False
        if key in self._where:
            self._declined = None
            return True
        if _seen_before(self._seen, key, self._seen_size):
            self._declined = None
            return True
        self._declined = key
        return False

    # EvictionPolicy.

    def admit(self, key: BlockKey, parent: BlockKey | None) -> bool:
        return self.admit_all((key,), parent)[0]

    def admit_all(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> list[bool]:
        # A store that starts a new chain ends the previous one before any victim is chosen.
        chain = self._chain
        if chain and parent != chain[-1]:
            self._end_chain()
        where, duels = self._where, self._duels
        sampling, sample_below = duels.sampling, duels.sample_below
        admitted = []
        for key in keys:
            # As in ARC, a ghost hit moves the target before the victim for ``key`` is chosen;
            # reuse after a gap longer than the ghost lists remember also argues for a larger
            # t2. A key offered for a slot is not held: its place says where it is remembered.
            place = where.get(key)
            if place is None:
                self._incoming_in_b2 = False
            else:
                remembered = place & 3
                self._incoming_in_b2 = remembered == IN_B2
                self.target_t1 = adapted_target_t1(
                    self.target_t1,
                    self.num_slots,
                    self._b1_len,
                    self._b2_len,
                    in_b1=remembered == IN_B1,
                    toward_t2=remembered != IN_B1,
                )
            if sampling and crc32(key) & SAMPLE_MASK < sample_below:
                self._shadow_reference(key)
                duels.note_sampled(key, self._parent)
            admitted.append(not duels.second_sight or self._admit_on_second_sight(key, parent))
            parent = key
        return admitted

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._insert_one(key, parent)

    def inserted_all(self, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
        # A commit is a few chains, each often long: find where each starts (a key whose parent
        # is not the key before it), and insert the rest of a chain of new keys in bulk.
        count = len(keys)
        if count != len(parents):
            raise ValueError(f"{count} keys but {len(parents)} parents")
        if not count:
            return
        starts = [0, *compress(range(1, count), map(ne, parents[1:], keys[:-1])), count]
        where = self._where
        singles: list[int] = []  # a run of chains of one key each, after the first chain
        for start, stop in pairwise(starts):
            if stop - start == 1 and start:
                singles.append(start)
                continue
            if singles:
                self._insert_singles(singles, keys, parents)
                singles = []
            self._insert_one(keys[start], parents[start])
            if stop - start > 1:
                rest = keys[start + 1 : stop]
                if where.keys().isdisjoint(rest):
                    # Each key's parent is the key before it, just inserted and held; none
                    # was remembered: nothing but the chain's own links changes.
                    linked = keys[start : stop - 1]
                    where.update(dict.fromkeys(rest, HELD))
                    self._parent.update(zip(rest, linked, strict=True))
                    self._children.update(zip(linked, rest, strict=True))
                    self._chain.extend(rest)
                else:
                    for key, parent in zip(rest, parents[start + 1 : stop], strict=True):
                        self._insert_one(key, parent)
        if singles:
            self._insert_singles(singles, keys, parents)

    def _insert_singles(
        self, positions: list[int], keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]
    ) -> None:
        """:meth:`_insert_one` of ``keys`` at ``positions``, each a chain of its own that
        follows the chain inserted last: a decode step's stores, a block each of many
        requests. New keys take one loop that ends each chain as :meth:`_end_chain` would
        (ranked into t1, classed as a new chain's tail, maybe put first in line) and leaves
        the last one open; keys the policy holds or remembers, or a run during which the
        class counts decay, take :meth:`_insert_one` each."""
        run = [keys[position] for position in positions]
        where, reuse = self._where, self._reuse
        self._end_chain()  # every chain of the run starts a new one
        last = len(run) - 1
        if not where.keys().isdisjoint(run) or reuse.since_decay + last >= reuse.decay_every:
            for position in positions:
                self._insert_one(keys[position], parents[position])
            return
        held, add_child, t1 = self._parent, self._add_child, self._t1
        stored, reused, classes, ratio = reuse.stored, reuse.reused, reuse.of_key, reuse.ratio
        clock = self._clock
        demoted = []
        for count, position in enumerate(positions):
            key, parent = keys[position], parents[position]
            where[key] = HELD
            held[key] = parent
            add_child(parent, key)
            if count == last:
                break
            # ``_end_chain`` of a chain of one new block: tail class 0 of a new chain.
            clock += 1
            t1[key] = clock
            classes[key] = 0
            prior, bar = _low_value_bar(stored, reused, ratio)
            if (reused[0] + prior) / (stored[0] + PRIOR_WEIGHT) < bar:
                demoted.append(key)
            stored[0] += 1.0
        # As each chain's end would have: the later a demoted key, the nearer the front.
        move_to_end = t1.move_to_end
        for key in demoted:
            move_to_end(key, last=False)
            t1[key] = 0
        self._clock = clock
        reuse.count_stores(last)
        self._chain.append(run[-1])
        self._first_new = 0

    def _insert_one(self, key: BlockKey, parent: BlockKey | None) -> None:
        """:meth:`inserted` of one key."""
        where, held, children = self._where, self._parent, self._children
        chain, t2 = self._chain, self._t2
        remembered = where.get(key)
        where[key] = HELD
        held[key] = parent
        if remembered is not None:
            self._forget(remembered & 3)
        # A parent this tier does not hold may sit in a faster tier (a lazy store writes a
        # chain leaf first, as the engine evicts it): only a parent evicted from here
        # orphans. (``_add_child``, inline: this runs per block stored.)
        if parent is not None and parent in held:
            siblings = children.get(parent)
            if siblings is None:
                children[parent] = key
            elif type(siblings) is set:
                siblings.add(key)
            elif siblings != key:
                children[parent] = {siblings, key}
        if chain:
            if parent != chain[-1]:
                self._end_chain()
                self._first_new = 0
            elif self._first_new is None:
                self._first_new = len(chain)
        else:
            self._first_new = 0
        chain.append(key)
        if remembered is None:
            # A new block joins the recency list when its chain is ranked (leaf first).
            return
        self._reuse.reuse(key)
        self._clock += 1
        t2[key] = self._clock
        self._returned = True

    def _forget(self, where: int) -> None:
        """An evicted key remembered in list ``where`` is stored again: its queue entry is left
        behind, no longer live."""
        if where == IN_B1:
            self._b1_len -= 1
        elif where == IN_B2:
            self._b2_len -= 1
        else:
            self._history_len -= 1
        self._forgotten += 1
        if self._forgotten > self._b1_len + self._b2_len + self._history_len:
            # Drop the entries of keys stored again from the queues of evicted keys.
            for queue in (self._b1, self._b2, self._history):
                queue.sweep(self._where)
            self._forgotten = 0

    def accessed(self, key: BlockKey) -> None:
        self.accessed_all((key,))

    def accessed_all(self, keys: Sequence[BlockKey]) -> None:
        if not keys:
            return
        # One pin or touch is one request's chain, or the next part of it.
        chain, held = self._chain, self._parent
        if chain and held[keys[0]] != chain[-1]:
            self._end_chain()
        elif self._placed != len(chain):
            self._rank_chain()
        chain.extend(keys)
        # Hits go to the frequency list leaf first, so that a chain of hits alone is ranked.
        sampled, t1, t2, reuse = self._duels.sampled, self._t1, self._t2, self._reuse.reuse
        move_to_end = t2.move_to_end
        clock = self._clock
        for key in reversed(keys):
            if key in sampled:
                self._shadow_reference(key)
            clock += 1
            try:
                move_to_end(key)
            except KeyError:
                if t1.pop(key, None) is None:
                    # A hit on an orphan means its parent was stored again: it is reachable again.
                    del self._orphans[key]
                    parent = held[key]
                    if parent is not None:
                        self._add_child(parent, key)
                # A first hit: the block's class was reused (only blocks never hit have one).
                reuse(key)
            t2[key] = clock
        self._clock = clock
        self._placed = len(chain)
        self._returned = False
        if len(chain) == len(keys):
            self._ranked = len(chain)

    def removed(self, key: BlockKey) -> None:
        if self._ranked != len(self._chain):
            self._rank_chain()
        t1, t2, where = self._t1, self._t2, self._where
        b1_len, b2_len, history_len = self._b1_len, self._b2_len, self._history_len
        parent = self._parent.pop(key)
        if t1.pop(key, None) is not None:
            self._tickets += 1
            place = where[key] = self._tickets << 2 | IN_B1
            queue = self._b1
            queue.keys.append(key)
            queue.places.append(place)
            b1_len += 1
        elif t2.pop(key, None) is not None:
            self._tickets += 1
            place = where[key] = self._tickets << 2 | IN_B2
            queue = self._b2
            queue.keys.append(key)
            queue.places.append(place)
            b2_len += 1
        else:
            del self._orphans[key]
            del where[key]
            self._reuse.of_key.pop(key, None)
        # The parent that listed the key among its cached children, if it still does.
        children = self._children
        if parent is not None:
            siblings = children.get(parent)
            if siblings == key:
                del children[parent]
            elif type(siblings) is set:
                siblings.discard(key)
        orphaned = children.pop(key, None)
        if orphaned is not None:
            orphans = self._orphans
            for child in orphaned if type(orphaned) is set else (orphaned,):
                t1.pop(child, None)
                t2.pop(child, None)
                orphans[child] = None
        # As in ARC, t1 and b1 hold at most a tier's worth of keys and the four lists twice that;
        # keys the ghost lists forget move to the long history, which forgets its oldest (each
        # queue skips the entries of keys stored again that it meets on the way).
        num_slots, history = self.num_slots, self._history
        if b1_len and len(t1) + b1_len > num_slots:
            self._tickets += 1
            self._b1.move_oldest(history, where, self._tickets << 2 | IN_HISTORY)
            b1_len -= 1
            history_len += 1
        if b2_len and len(t1) + len(t2) + b1_len + b2_len > 2 * num_slots:
            self._tickets += 1
            self._b2.move_oldest(history, where, self._tickets << 2 | IN_HISTORY)
            b2_len -= 1
            history_len += 1
        keys, places = history.keys, history.places
        while history_len > self.history_size:
            forgotten, place = keys.popleft(), places.popleft()
            if where.get(forgotten) == place:
                del where[forgotten]
                self._reuse.of_key.pop(forgotten, None)
                history_len -= 1
        self._b1_len, self._b2_len, self._history_len = b1_len, b2_len, history_len

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        if self._orphans:
            key = first_evictable(self._orphans, evictable)
            if key is not None:
                return key
        if self._ranked != len(self._chain):
            self._rank_chain()
        t1, t2 = self._t1, self._t2
        if self._duels.recency:
            # The list whose first key was used less recently gives the victim, else the other.
            from_t1 = bool(t1) and (not t2 or t1[next(iter(t1))] <= t2[next(iter(t2))])
        else:
            from_t1 = arc_prefers_t1(len(t1), self.target_t1, self._incoming_in_b2)
        first, second = (t1, t2) if from_t1 else (t2, t1)
        # The oldest key of the chosen list is the victim unless pinned (or being written).
        for key in first:
            if evictable(key):
                return key
        return first_evictable(second, evictable)


def _low_value_bar(stored: list[float], reused: list[float], ratio: float) -> tuple[float, float]:
    """The prior pseudo-reuses of a class, and the bar under which its reuse rate is low.

    A class is of low value when ``(reused + prior) / (stored + PRIOR_WEIGHT) < bar``: its
    reuse rate, pulled towards the overall rate, is under ``ratio`` of it.
    """
    overall = (sum(reused) + 1.0) / (sum(stored) + 2.0)
    return PRIOR_WEIGHT * overall, ratio * overall


def _remember(seen: OrderedDict[BlockKey, None], key: BlockKey, size: int) -> None:
    """Remember ``key`` in ``seen`` as its newest entry, forgetting the oldest beyond ``size``."""
    seen[key] = None
    seen.move_to_end(key)
    if len(seen) > size:
        seen.popitem(last=False)


def _seen_before(seen: OrderedDict[BlockKey, None], key: BlockKey, size: int) -> bool:
    """Whether ``seen`` remembers ``key`` (then forget it), else remember it."""
    if key in seen:
        del seen[key]
        return True
    seen[key] = None
    if len(seen) > size:
        seen.popitem(last=False)
    return False


def build(config: PrefixARCConfig, num_slots: int) -> PrefixARCPolicy:
    """The ``prefix_arc`` policy's factory."""
    return PrefixARCPolicy(
        num_slots,
        config.history_factor,
        config.low_value_ratio,
        config.admission,
        config.first_sight_memory_factor,
        config.sample_rate,
        config.eviction,
    )
