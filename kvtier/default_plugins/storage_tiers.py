"""Built-in storage tiers below the host tier, each imported only when a config picks it."""

from __future__ import annotations

from kvtier.api import LazyFactory, Register, StorageTierFactory, hookimpl
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.mooncake_config import MooncakeTierConfig
from kvtier.tiers.redis_config import RedisTierConfig
from kvtier.tiers.s3_config import S3TierConfig


@hookimpl
def register_storage_tiers(register: Register[StorageTierFactory]) -> None:
    register("disk", LazyFactory("kvtier.tiers.disk", "build_disk_tier"), DiskTierConfig)
    register("redis", LazyFactory("kvtier.tiers.redis", "build_redis_tier"), RedisTierConfig)
    register(
        "mooncake", LazyFactory("kvtier.tiers.mooncake", "build_mooncake_tier"), MooncakeTierConfig
    )
    register("s3", LazyFactory("kvtier.tiers.s3", "build_s3_tier"), S3TierConfig)
