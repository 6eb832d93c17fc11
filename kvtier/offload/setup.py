"""The fixed facts every scheduler-side piece reads: the tier's index, block size, groups, ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.config.model import (
    DEFAULT_PIN_MAX_S,
    DEFAULT_PIN_SHARE,
    DEFAULT_REPORT_DEADLINE_S,
    PrefetchConfig,
)
from kvtier.index.base import BlockIndex
from kvtier.keys import KeyNamespace
from kvtier.models import WritePolicy

StoreMode = Literal["eager", "lazy"]
GroupBlockIds = Sequence[Sequence[int]]
"""Device block ids per kv-cache group: ``block_ids[group][position]``."""


@dataclass(frozen=True)
class ManagerSetup:
    """What an :class:`~kvtier.offload.OffloadManager` was built with; never changes after."""

    index: BlockIndex
    """The host tier's block index (its ``num_slots`` are the tier's slots)."""
    block_tokens: int
    """Tokens per block (the engine's block size)."""
    record_bytes: int
    """Bytes of one block's record on one rank, for the byte counters."""
    world_size: int = 1
    """Number of workers that each execute every plan; a batch completes when all of them
    reported it."""
    store_mode: StoreMode = "eager"
    """``"eager"`` stores newly computed full blocks of running requests; ``"lazy"`` stores
    only blocks the engine offers from its eviction frontier."""
    num_groups: int = 1
    """Number of kv-cache groups (several for hybrid models)."""
    namespace: KeyNamespace = field(default_factory=KeyNamespace)
    """Namespaces engine hashes into keys."""
    null_block_id: int | None = None
    """A device block id that stands for "no block" (skipped by stores and loads), if the
    engine has one."""
    group_windows: Sequence[int | None] | None = None
    """Per kv-cache group, ``None`` when a prefix needs all its blocks (full attention), or
    ``w`` when only its last ``w`` blocks matter (sliding window: the blocks the window
    spans; Mamba state: 1). Such a group loads and requires for a hit only those blocks, and
    stores, in either mode, only blocks that were among a request's last ``w`` at the end of
    a step (where a hit can start). ``None`` means full attention everywhere."""
    report_deadline_s: float = DEFAULT_REPORT_DEADLINE_S
    """Seconds after planning by which every worker must have reported a batch; later, the
    batch fails (see :meth:`OffloadManager.process`)."""
    write_policies: tuple[WritePolicy, ...] = ()
    """One per storage tier the workers have below the host tier, in their order: host
    misses are looked up there (promotions), and host-tier blocks are written there as
    each tier's policy says (:mod:`~kvtier.offload.moves`). Empty: no lower tiers."""
    clock: Callable[[], float] = time.monotonic
    """Monotonic time in seconds (tests pass a manual clock)."""
    record_events: bool = False
    """Keep the index's stored/evicted events for :meth:`OffloadManager.take_events`, and
    the lower tiers' stores and removals the workers report for
    :meth:`OffloadManager.take_tier_events`; otherwise they are only counted."""
    pin_share: float = DEFAULT_PIN_SHARE
    """Share of the tier's slots that requests' timed pins may hold (see
    :mod:`~kvtier.offload.pins`); 0: none."""
    pin_max_s: float = DEFAULT_PIN_MAX_S
    """The longest timed pin a request gets, in seconds."""
    prefetch: PrefetchConfig | None = None
    """How blocks below the host tier are read ahead for waiting requests
    (:mod:`~kvtier.offload.prefetch`); ``None``: the config's defaults."""
    windows: tuple[int | None, ...] = field(init=False)
    """``group_windows`` with one entry per group."""
    through_tiers: tuple[int, ...] = field(init=False)
    """Positions of the ``write_through`` tiers."""
    reuse_tiers: tuple[int, ...] = field(init=False)
    """Positions of the ``write_through_admitted`` tiers."""
    back_tiers: tuple[int, ...] = field(init=False)
    """Positions of the ``write_back`` tiers."""

    def __post_init__(self) -> None:
        for name in ("block_tokens", "record_bytes", "world_size", "num_groups"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.report_deadline_s <= 0:
            raise ValueError(f"report_deadline_s must be positive, got {self.report_deadline_s}")
        if not 0 <= self.pin_share <= 1 or self.pin_max_s <= 0:
            raise ValueError(
                f"pin_share must be within [0, 1] and pin_max_s positive, got {self.pin_share} "
                f"and {self.pin_max_s}"
            )
        if self.store_mode not in ("eager", "lazy"):
            raise ValueError(f"store_mode must be 'eager' or 'lazy', got {self.store_mode!r}")
        given = self.group_windows
        windows = (None,) * self.num_groups if given is None else tuple(given)
        if len(windows) != self.num_groups or any(w is not None and w <= 0 for w in windows):
            raise ValueError(
                f"group_windows needs one entry per kv-cache group ({self.num_groups}), each "
                f"None or a positive block count; got {given!r}"
            )
        object.__setattr__(self, "windows", windows)
        for name, policy in (
            ("through_tiers", "write_through"),
            ("reuse_tiers", "write_through_admitted"),
            ("back_tiers", "write_back"),
        ):
            tiers = tuple(i for i, each in enumerate(self.write_policies) if each == policy)
            object.__setattr__(self, name, tiers)
        if len(self.through_tiers + self.reuse_tiers + self.back_tiers) != len(self.write_policies):
            raise ValueError(
                "write_policies must each be write_through, write_through_admitted or "
                f"write_back; got {self.write_policies!r}"
            )

    @property
    def lower_tiers(self) -> bool:
        """Whether workers have storage tiers below the host tier."""
        return bool(self.write_policies)

    @property
    def windowed(self) -> bool:
        """Whether some group needs only the last few blocks of a hit (sliding window, Mamba)."""
        return any(window is not None for window in self.windows)

    def ready_blocks(self, block_hashes: Sequence[bytes], computed_tokens: int) -> int:
        """Full blocks of a request whose KV is written and whose hash is known."""
        return min(len(block_hashes), computed_tokens // self.block_tokens)
