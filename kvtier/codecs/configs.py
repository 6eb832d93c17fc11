"""Config models of the built-in record codecs, importable without numpy, torch or blosc2."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier.models import PluginConfig


class LosslessCodecConfig(PluginConfig):
    """The values' bit or byte planes shuffled apart, then a fast compressor (blosc2): bit-exact."""

    type: Literal["lossless"] = "lossless"
    shuffle: Literal["bit", "byte"] = Field(
        "bit",
        description=(
            "How the values are split before compressing: bit planes (each exponent bit a run "
            "of its own, which lz4 finds) or byte planes (high and low bytes apart)."
        ),
    )
    compressor: Literal["lz4", "zstd"] = Field(
        "lz4",
        description=(
            "Compressor after the shuffle: lz4 is fast on bit planes; zstd finds more in byte "
            "planes but encodes several times slower (see the codec page's table)."
        ),
    )
    level: int = Field(
        5,
        ge=1,
        le=9,
        description="Compression level, 1 (fastest) to 9 (smallest).",
    )


class Fp8CodecConfig(PluginConfig):
    """Lossy, opt-in: KV values as fp8 (e4m3) with a scale per block, K or V, and head."""

    type: Literal["fp8"] = "fp8"


class Int8CodecConfig(PluginConfig):
    """Lossy, opt-in: KV values as int8 with a scale per block, K or V, and head."""

    type: Literal["int8"] = "int8"
