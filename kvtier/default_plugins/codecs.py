"""Built-in record codecs, each imported (with numpy, torch or blosc2) only when a tier uses it."""

from __future__ import annotations

from kvtier.api import CodecFactory, LazyFactory, Register, hookimpl
from kvtier.codecs.configs import Fp8CodecConfig, Int8CodecConfig, LosslessCodecConfig


@hookimpl
def register_codecs(register: Register[CodecFactory]) -> None:
    register("lossless", LazyFactory("kvtier.codecs.lossless", "build"), LosslessCodecConfig)
    register("fp8", LazyFactory("kvtier.codecs.quantised", "build"), Fp8CodecConfig)
    register("int8", LazyFactory("kvtier.codecs.quantised", "build"), Int8CodecConfig)
