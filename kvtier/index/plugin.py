"""Built-in block indexes."""

from __future__ import annotations

import kvtier
from kvtier.hookspecs import Register
from kvtier.index import arc, lru, prefix_arc, s3fifo


@kvtier.hookimpl
def register_block_indexes(register: Register) -> None:
    register("lru", lru.build, lru.LRUConfig)
    register("arc", arc.build, arc.ARCConfig)
    register("s3fifo", s3fifo.build, s3fifo.S3FIFOConfig)
    register("prefix_arc", prefix_arc.build, prefix_arc.PrefixARCConfig)
