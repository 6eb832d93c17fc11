"""Record codecs: what a storage tier does to a block's bytes before sealing them."""

from kvtier.codecs.base import Codec, CodecError, CodecSpec, ErrorBound

__all__ = ["Codec", "CodecError", "CodecSpec", "ErrorBound"]
