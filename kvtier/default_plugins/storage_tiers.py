"""Built-in storage tiers below the host tier, each imported only when a config picks it."""

from __future__ import annotations

from kvtier.api import LazyFactory, Register, StorageTierFactory, hookimpl
from kvtier.tiers import configs


@hookimpl
def register_storage_tiers(register: Register[StorageTierFactory]) -> None:
    register("disk", LazyFactory("kvtier.tiers.disk", "build_disk_tier"), configs.DiskTierConfig)
    register(
        "redis", LazyFactory("kvtier.tiers.redis", "build_redis_tier"), configs.RedisTierConfig
    )
    register(
        "mooncake",
        LazyFactory("kvtier.tiers.mooncake", "build_mooncake_tier"),
        configs.MooncakeTierConfig,
    )
    register("s3", LazyFactory("kvtier.tiers.s3", "build_s3_tier"), configs.S3TierConfig)
