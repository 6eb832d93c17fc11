"""Built-in eviction policies (each also a block index of the same name).

They are pure Python (no torch) and hold their config models, so they are
imported when the plugins load.
"""

from __future__ import annotations

from kvtier.api import EvictionPolicyFactory, Register, hookimpl
from kvtier.index import arc, lru, prefix_arc, s3fifo


@hookimpl
def register_eviction_policies(register: Register[EvictionPolicyFactory]) -> None:
    register("lru", lru.build, lru.LRUConfig)
    register("arc", arc.build, arc.ARCConfig)
    register("s3fifo", s3fifo.build, s3fifo.S3FIFOConfig)
    register("prefix_arc", prefix_arc.build, prefix_arc.PrefixARCConfig)
