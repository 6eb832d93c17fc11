"""Owns timed pins: prompt blocks that requests asked to keep in the host tier for a while.

A request whose control sets ``pin_s`` (:class:`~kvtier.offload.control.RequestControl`)
names its prompt's blocks when the engine allocates it (:meth:`TimedPins.want`).
Each of them is pinned in the host tier's index once it is readable (its store
may still be in flight then, or come from another request later), and unpinned
when the pin's time is over, counted from the request's allocation. A block
several requests pin is pinned once, until the latest of their ends.

Pins never hold more than ``pin_share`` of the tier's slots: a block past that
share waits, unpinned, until a pin expires or its own time is over, so timed
pins cannot keep the tier from admitting new blocks beyond that share.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from kvtier.index.base import BlockKey
from kvtier.offload.setup import ManagerSetup

logger = logging.getLogger(__name__)


class TimedPins:
    """The host tier's timed pins and the blocks waiting to be pinned."""

    def __init__(self, setup: ManagerSetup) -> None:
        self.setup = setup
        self.budget = int(setup.pin_share * setup.index.num_slots)
        """The most blocks pinned at once."""
        self.until: dict[BlockKey, float] = {}
        """Pinned blocks and when their pins end (``setup.clock`` time)."""
        self.wanted: dict[str, tuple[tuple[BlockKey, ...], float]] = {}
        """Per request, its blocks not pinned yet and when its pin ends."""
        self.next_expiry = math.inf

    @property
    def idle(self) -> bool:
        """Whether no block is pinned or waits to be."""
        return not self.active

    @property
    def active(self) -> bool:
        """Whether some block is pinned or waits to be."""
        return bool(self.until or self.wanted)

    def want(self, request_id: str, keys: Sequence[BlockKey], seconds: float) -> None:
        """Pin ``keys`` for ``seconds`` (at most ``pin_max_s``) from now, as each is readable."""
        if not self.budget or not keys:
            return
        now = self.setup.clock()
        until = now + min(seconds, self.setup.pin_max_s)
        self.wanted[request_id] = (tuple(keys), until)
        self.next_expiry = min(self.next_expiry, until)
        self.pin_readable()

    def expire(self, now: float) -> None:
        """Unpin the blocks, and forget the waiting ones, whose time is over at ``now``."""
        if now < self.next_expiry:
            return
        over = [key for key, until in self.until.items() if until <= now]
        if over:
            self.setup.index.unpin(over)
            for key in over:
                del self.until[key]
            logger.debug("%d timed pins expired", len(over))
        for request_id in [r for r, (_, until) in self.wanted.items() if until <= now]:
            del self.wanted[request_id]
        self.next_expiry = min(
            [*self.until.values(), *(until for _, until in self.wanted.values())],
            default=math.inf,
        )

    def pin_readable(self) -> None:
        """Pin the waiting blocks that are readable now, while the share lasts."""
        index, pinned = self.setup.index, self.until
        for request_id, (keys, until) in list(self.wanted.items()):
            waiting: list[BlockKey] = []
            for key in keys:
                if key in pinned:
                    pinned[key] = max(pinned[key], until)
                elif index.slot_of(key) is None or len(pinned) >= self.budget:
                    waiting.append(key)
                else:
                    index.pin([key])
                    pinned[key] = until
            if waiting:
                self.wanted[request_id] = (tuple(waiting), until)
            else:
                del self.wanted[request_id]

    def reset(self) -> None:
        """Unpin every block and forget the waiting ones (the tier is being emptied)."""
        if self.until:
            self.setup.index.unpin(list(self.until))
        self.until.clear()
        self.wanted.clear()
        self.next_expiry = math.inf
