"""The fixed facts every scheduler-side piece reads: the tier's index, block size, groups, ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.index.base import BlockIndex
from kvtier.keys import KeyNamespace

StoreMode = Literal["eager", "lazy"]
GroupBlockIds = Sequence[Sequence[int]]
"""Device block ids per kv-cache group: ``block_ids[group][position]``."""


@dataclass(frozen=True)
class ManagerSetup:
    """What an :class:`~kvtier.offload.OffloadManager` was built with; never changes after."""

    index: BlockIndex
    block_tokens: int
    record_bytes: int
    world_size: int
    store_mode: StoreMode
    num_groups: int
    namespace: KeyNamespace
    null_block_id: int | None
    group_windows: tuple[int | None, ...]
    report_deadline_s: float
    lower_tiers: bool
    clock: Callable[[], float] = field(default=time.monotonic)

    def __post_init__(self) -> None:
        for name in ("block_tokens", "record_bytes", "world_size", "num_groups"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.report_deadline_s <= 0:
            raise ValueError(f"report_deadline_s must be positive, got {self.report_deadline_s}")
        if self.store_mode not in ("eager", "lazy"):
            raise ValueError(f"store_mode must be 'eager' or 'lazy', got {self.store_mode!r}")
        windows = self.group_windows
        if len(windows) != self.num_groups or any(w is not None and w <= 0 for w in windows):
            raise ValueError(
                f"group_windows needs one entry per kv-cache group ({self.num_groups}), each "
                f"None or a positive block count; got {windows!r}"
            )

    @property
    def windowed(self) -> bool:
        """Whether some group needs only the last few blocks of a hit (sliding window, Mamba)."""
        return any(window is not None for window in self.group_windows)

    def ready_blocks(self, block_hashes: Sequence[bytes], computed_tokens: int) -> int:
        """Full blocks of a request whose KV is written and whose hash is known."""
        return min(len(block_hashes), computed_tokens // self.block_tokens)
