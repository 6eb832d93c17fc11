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

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal
from zlib import crc32

from pydantic import Field

from kvtier.index.arc import ARCShadow, adapted_target_t1, arc_victim, first_evictable
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
        # Per held key, ``[parent, cached children]``: no child (``None``), one key, or a set.
        self._links: dict[BlockKey, list[Any]] = {}
        # Values are use stamps from ``_clock``, increasing along each list; 0 marks a block put
        # first in line for eviction.
        self._t1: OrderedDict[BlockKey, int] = OrderedDict()
        self._t2: OrderedDict[BlockKey, int] = OrderedDict()
        self._clock = 0
        self._orphans: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._history: OrderedDict[BlockKey, None] = OrderedDict()
        self._incoming_in_b2 = False
        # The chain being touched (root first), how much of it is already ranked leaf first, and
        # how much of it is in a list (new blocks join the recency list when their chain is
        # ranked, so that they go in leaf first).
        self._chain: list[BlockKey] = []
        self._ranked = 0
        self._placed = 0
        self._first_new: int | None = None
        # Reuse learning: the class of each stored key not yet reused (while the tier or its
        # memory still knows it), and per class how many keys were stored and reused.
        self.low_value_ratio = low_value_ratio
        self._class: dict[BlockKey, int] = {}
        self._stored = [0.0] * NUM_CLASSES
        self._reused = [0.0] * NUM_CLASSES
        self._decay_every = max(1, self.history_size + 2 * num_slots)
        self._since_decay = 0
        # Adaptive admission: keys seen once and not stored, the last key declined (its
        # descendants are declined too), and the two shadow caches with their hit counter.
        self.adaptive = admission == "adaptive"
        self.second_sight = False
        self._seen: OrderedDict[BlockKey, None] = OrderedDict()
        self._seen_size = max(1, int(num_slots * first_sight_memory_factor))
        self._declined: BlockKey | None = None
        # A shadow of a few slots only measures noise: small tiers sample more of their keys.
        sample_rate = max(sample_rate, min(1.0, MIN_SHADOW_SLOTS / num_slots))
        self._sample_below = max(1, round(sample_rate * SAMPLE_SPACE))
        self._shadow_slots = max(1, round(num_slots * sample_rate))
        self._shadow_seen_size = max(1, int(self._shadow_slots * first_sight_memory_factor))
        self._shadow_all: OrderedDict[BlockKey, None] = OrderedDict()
        self._shadow_second: OrderedDict[BlockKey, None] = OrderedDict()
        self._shadow_seen: OrderedDict[BlockKey, None] = OrderedDict()
        # Sampled keys that may be in the tier, so that a hit needs no hashing to be sampled.
        self._sampled: set[BlockKey] = set()
        self._duel = 0
        # Adaptive eviction: the same ARC on the sampled keys, against ``_shadow_all`` (LRU);
        # the tier starts on recency and follows ARC's target while its shadow is ahead.
        self.adaptive_eviction = eviction == "adaptive"
        self.recency = eviction != "arc"
        self._rule_duel = 0
        if self.adaptive_eviction:
            shadow_history = int(self._shadow_slots * history_factor)
            self._shadow_arc = ARCShadow(self._shadow_slots, shadow_history)
        self._sampling = self.adaptive or self.adaptive_eviction

    def state(self) -> dict[str, float]:
        """ARC's target and lists, and the two duels: ``second_sight`` (admission on second
        sight only) and ``recency`` (victims by recency alone) are 1 while chosen."""
        counters = {
            "target_t1": self.target_t1,
            "t1": len(self._t1),
            "t2": len(self._t2),
            "orphans": len(self._orphans),
            "history": len(self._history),
            "second_sight": float(self.second_sight),
            "admission_duel": self._duel,
            "recency": float(self.recency),
            "eviction_duel": self._rule_duel,
        }
        if self.adaptive_eviction:
            counters["shadow_arc_target_t1"] = self._shadow_arc.target_t1
        return counters

    # Chain ranking.

    def _rank_chain(self) -> None:
        """Rank the chain touched so far leaf first: its deepest block becomes the oldest."""
        if self._ranked == len(self._chain):
            return
        chain, placed, t1, t2 = self._chain, self._placed, self._t1, self._t2
        clock = self._clock
        for position in range(len(chain) - 1, -1, -1):
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

    def _end_chain(self) -> None:
        """Rank the finished chain leaf first, and class the blocks it stored (one pass)."""
        chain, first = self._chain, self._first_new
        if first is None:
            self._rank_chain()
        else:
            t1, t2, classes, stored = self._t1, self._t2, self._class, self._stored
            link = self._links.get(chain[first])
            origin = 0 if first == 0 or link is None or link[0] is None else TAIL_BUCKETS
            low = self._low_value_classes()
            last = len(chain) - 1
            placed = self._placed
            demoted = []
            clock = self._clock
            for position in range(last, -1, -1):
                key = chain[position]
                clock += 1
                if key in t2:
                    t2.move_to_end(key)
                    t2[key] = clock
                    continue
                if position >= placed:
                    t1[key] = clock
                elif key in t1:
                    t1.move_to_end(key)
                    t1[key] = clock
                else:
                    continue
                if position >= first:
                    distance = last - position
                    cls = origin + (distance if distance < TAIL_BUCKETS else TAIL_BUCKETS - 1)
                    classes[key] = cls
                    stored[cls] += 1.0
                    if low[cls]:
                        demoted.append(key)
            self._clock = clock
            # Root first, so that the chain's deepest low-value block ends up first in line.
            for key in reversed(demoted):
                t1.move_to_end(key, last=False)
                t1[key] = 0
            self._count_towards_decay(len(chain) - first)
        chain.clear()
        self._ranked = self._placed = 0
        self._first_new = None

    def _add_child(self, parent: BlockKey, child: BlockKey) -> None:
        """Record ``child`` as a cached child of ``parent``, if this tier holds ``parent``."""
        link = self._links.get(parent)
        if link is None:
            return
        # Most blocks have one cached child: store it bare and make a set only for a second one.
        siblings = link[1]
        if siblings is None:
            link[1] = child
        elif isinstance(siblings, set):
            siblings.add(child)
        elif siblings != child:
            link[1] = {siblings, child}

    # Reuse learning.

    def _low_value_classes(self) -> list[bool]:
        """Per class, whether its reuse rate is under ``low_value_ratio`` of the overall rate."""
        stored, reused = self._stored, self._reused
        overall = (sum(reused) + 1.0) / (sum(stored) + 2.0)
        bar = self.low_value_ratio * overall
        return [
            (reused[cls] + PRIOR_WEIGHT * overall) / (stored[cls] + PRIOR_WEIGHT) < bar
            for cls in range(NUM_CLASSES)
        ]

    def _count_towards_decay(self, stored_blocks: int) -> None:
        """Halve the class counts every few tiers' worth of stores, so they follow the workload."""
        self._since_decay += stored_blocks
        if self._since_decay >= self._decay_every:
            self._since_decay = 0
            self._stored = [count / 2 for count in self._stored]
            self._reused = [count / 2 for count in self._reused]

    def _credit_reuse(self, key: BlockKey) -> None:
        cls = self._class.pop(key, None)
        if cls is not None:
            self._reused[cls] += 1.0

    # Adaptive admission.

    def _shadow_reference(self, key: BlockKey) -> None:
        """Replay a use of sampled ``key`` in the shadow caches; update the choices."""
        limit = self._shadow_slots
        every = self._shadow_all
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
            second = self._shadow_second
            if key in second:
                second.move_to_end(key)
                score = every_hit - 1
            else:
                score = int(every_hit)
                if _seen_before(self._shadow_seen, key, self._shadow_seen_size):
                    second[key] = None
                    if len(second) > limit:
                        second.popitem(last=False)
            if score:
                self._duel = max(-DUEL_LIMIT, min(DUEL_LIMIT, self._duel + score))
                self.second_sight = self._duel < 0
        if self.adaptive_eviction and self._shadow_arc.reference(key) != every_hit:
            self._rule_duel = max(-DUEL_LIMIT, min(DUEL_LIMIT, self._rule_duel + 2 * every_hit - 1))
            if self.recency and self._rule_duel < 0:
                # ARC's target starts from the split that recency left.
                self.recency = False
                self.target_t1 = float(len(self._t1))
            elif not self.recency and self._rule_duel > 0:
                self.recency = True

    def _note_sampled(self, key: BlockKey) -> None:
        """Remember that ``key``, about to be stored, is sampled (its hits go to the shadows)."""
        sampled = self._sampled
        sampled.add(key)
        # Keys that left the tier (or were never stored: no free slot, an aborted store) are
        # dropped in a sweep once there are twice as many as slots: O(1) amortized per key.
        if len(sampled) > 2 * self.num_slots:
            sampled.intersection_update(self._links)

    def _admit_on_second_sight(self, key: BlockKey, parent: BlockKey | None) -> bool:
        """Whether ``key`` was seen before (and its parent was not just declined)."""
        if parent is not None and parent == self._declined:
            _remember(self._seen, key, self._seen_size)
            self._declined = key
            return False
        if key in self._b1 or key in self._b2 or key in self._history:
            self._declined = None
            return True
        if _seen_before(self._seen, key, self._seen_size):
            self._declined = None
            return True
        self._declined = key
        return False

    # EvictionPolicy.

    def admit(self, key: BlockKey, parent: BlockKey | None) -> bool:
        # A store that starts a new chain ends the previous one before any victim is chosen.
        chain = self._chain
        if chain and parent != chain[-1]:
            self._end_chain()
        # As in ARC, a ghost hit moves the target before the victim for ``key`` is chosen; reuse
        # after a gap longer than the ghost lists remember also argues for a larger t2.
        b1, b2 = self._b1, self._b2
        in_b2 = self._incoming_in_b2 = key in b2
        if in_b2 or key in b1 or key in self._history:
            self.target_t1 = adapted_target_t1(
                self.target_t1,
                self.num_slots,
                len(b1),
                len(b2),
                in_b1=key in b1,
                toward_t2=in_b2 or key in self._history,
            )
        if self._sampling and crc32(key) & SAMPLE_MASK < self._sample_below:
            self._shadow_reference(key)
            self._note_sampled(key)
        return not self.second_sight or self._admit_on_second_sight(key, parent)

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        chain = self._chain
        self._links[key] = [parent, None]
        # A parent this tier does not hold may sit in a faster tier (a lazy store writes a
        # chain leaf first, as the engine evicts it): only a parent evicted from here orphans.
        if parent is not None:
            self._add_child(parent, key)
        if chain and parent != chain[-1]:
            self._end_chain()
        if self._first_new is None:
            self._first_new = len(chain)
        chain.append(key)
        if key in self._b1:
            del self._b1[key]
        elif key in self._b2:
            del self._b2[key]
        elif key in self._history:
            del self._history[key]
        else:
            # A new block joins the recency list when its chain is ranked (leaf first).
            return
        self._credit_reuse(key)
        self._clock += 1
        self._t2[key] = self._clock

    def accessed(self, key: BlockKey) -> None:
        self.accessed_all((key,))

    def accessed_all(self, keys: Sequence[BlockKey]) -> None:
        if not keys:
            return
        # One pin or touch is one request's chain, or the next part of it.
        chain, links = self._chain, self._links
        if chain and links[keys[0]][0] != chain[-1]:
            self._end_chain()
        elif self._placed != len(chain):
            self._rank_chain()
        chain.extend(keys)
        # Hits go to the frequency list leaf first, so that a chain of hits alone is ranked.
        sampled, classes, t1, t2 = self._sampled, self._class, self._t1, self._t2
        clock = self._clock
        for key in reversed(keys):
            if key in sampled:
                self._shadow_reference(key)
            clock += 1
            if key in t2:
                t2.move_to_end(key)
            else:
                # A first hit: the block's class was reused (only blocks never hit have one).
                cls = classes.pop(key, None)
                if cls is not None:
                    self._reused[cls] += 1.0
                if t1.pop(key, None) is None:
                    # A hit on an orphan means its parent was stored again: it is reachable again.
                    del self._orphans[key]
                    parent = links[key][0]
                    if parent is not None:
                        self._add_child(parent, key)
            t2[key] = clock
        self._clock = clock
        self._placed = len(chain)
        if len(chain) == len(keys):
            self._ranked = len(chain)

    def removed(self, key: BlockKey) -> None:
        if self._ranked != len(self._chain):
            self._rank_chain()
        links = self._links
        parent, orphaned = links.pop(key)
        if parent is not None:
            link = links.get(parent)
            if link is not None:
                siblings = link[1]
                if siblings == key:
                    link[1] = None
                elif isinstance(siblings, set):
                    siblings.discard(key)
        if orphaned is not None:
            for child in orphaned if isinstance(orphaned, set) else (orphaned,):
                self._t1.pop(child, None)
                self._t2.pop(child, None)
                self._orphans[child] = None
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if t1.pop(key, None) is not None:
            b1[key] = None
        elif t2.pop(key, None) is not None:
            b2[key] = None
        else:
            del self._orphans[key]
            self._class.pop(key, None)
        # Keys the ghost lists forget move to the long history, which forgets its oldest.
        num_slots, history = self.num_slots, self._history
        if len(t1) + len(b1) > num_slots and b1:
            history[b1.popitem(last=False)[0]] = None
        if len(t1) + len(t2) + len(b1) + len(b2) > 2 * num_slots and b2:
            history[b2.popitem(last=False)[0]] = None
        while len(history) > self.history_size:
            self._class.pop(history.popitem(last=False)[0], None)

    def victim(self, evictable: Callable[[BlockKey], bool]) -> BlockKey | None:
        if self._orphans:
            key = first_evictable(self._orphans, evictable)
            if key is not None:
                return key
        if self._ranked != len(self._chain):
            self._rank_chain()
        if self.recency:
            # The list whose first key was used less recently gives the victim, else the other.
            t1, t2 = self._t1, self._t2
            if t1 and (not t2 or t1[next(iter(t1))] <= t2[next(iter(t2))]):
                first, second = t1, t2
            else:
                first, second = t2, t1
            key = first_evictable(first, evictable)
            return key if key is not None else first_evictable(second, evictable)
        return arc_victim(self._t1, self._t2, self.target_t1, self._incoming_in_b2, evictable)


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
