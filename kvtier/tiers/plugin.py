"""Built-in storage tiers below the host tier: ``disk`` and ``redis``."""

from __future__ import annotations

import kvtier
from kvtier.hookspecs import Register
from kvtier.tiers import disk, redis


@kvtier.hookimpl
def register_storage_tiers(register: Register) -> None:
    register("disk", disk.build_disk_tier, disk.DiskTierConfig)
    register("redis", redis.build_redis_tier, redis.RedisTierConfig)
