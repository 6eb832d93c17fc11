"""Config models of the built-in record codecs, importable without numpy, torch or blosc2."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier.models import PluginConfig


class LosslessCodecConfig(PluginConfig):
    """Byte-plane shuffle of the 16-bit values, then a fast compressor (blosc2): bit-exact."""

    type: Literal["lossless"] = "lossless"
    compressor: Literal["zstd", "lz4"] = Field(
        "zstd",
        description=(
            "Compressor after the shuffle: zstd makes records smaller, lz4 decodes faster "
            "(see the codec page's table for both on real-model KV)."
        ),
    )
    level: int = Field(
        1,
        ge=1,
        le=9,
        description="Compression level, 1 (fastest) to 9 (smallest); past 1 encodes far slower.",
    )


class Fp8CodecConfig(PluginConfig):
    """Lossy, opt-in: KV values as fp8 (e4m3) with a scale per block, K or V, and head."""

    type: Literal["fp8"] = "fp8"


class Int8CodecConfig(PluginConfig):
    """Lossy, opt-in: KV values as int8 with a scale per block, K or V, and head."""

    type: Literal["int8"] = "int8"
