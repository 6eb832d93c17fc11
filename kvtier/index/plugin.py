"""Built-in block indexes."""

from __future__ import annotations

import kvtier
from kvtier.hookspecs import Register
from kvtier.index import lru


@kvtier.hookimpl
def register_block_indexes(register: Register) -> None:
    register("lru", lru.build, lru.LRUConfig)
