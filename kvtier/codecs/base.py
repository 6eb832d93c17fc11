"""The record codec contract: a block's bytes made smaller before a tier seals them.

A codec is built once per tier, by ``factory(config, spec)`` registered
through :func:`~kvtier.hookspecs.register_codecs`, with a :class:`CodecSpec`
(the record size and what each region of a record holds). Then, on the
tier's I/O threads only, never on the engine's step:

1. :meth:`Codec.encode` turns a record's payload into its encoded form;
   the record format (:mod:`kvtier.tiers.record`) keeps the payload as it is
   when the encoded form is not smaller, then seals what it keeps;
2. :meth:`Codec.decode` turns an encoded form back into ``record_bytes``
   bytes, after the record's seal was checked, and raises :class:`CodecError`
   on anything it cannot decode.

Every record names the codec and the :attr:`Codec.version` that wrote it, so
a tier with another codec (or another version) reads it as a miss. A lossless
codec returns the payload bit for bit; a lossy one declares how far it may
stray in :attr:`Codec.error_bound`, which ``kvtier.testing.contracts_codec``
holds it to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvtier.layout.base import RecordRegion


class CodecError(ValueError):
    """An encoded payload cannot be decoded (truncated, or not this codec's)."""


@dataclass(frozen=True)
class CodecSpec:
    """What a codec is built for: one tier's records."""

    record_bytes: int
    regions: tuple[RecordRegion, ...] = ()
    """The regions of a record and what they hold, from the layout resolver; empty when the
    tier was built without a layout (vLLM's own offloading), when a lossy codec stores the
    record as it is."""


@dataclass(frozen=True)
class ErrorBound:
    """How far a decoded value ``y`` may be from the value ``x`` that was encoded.

    ``|y - x| <= relative * |x| + of_block_max * m``, where ``m`` is the largest
    ``|x|`` of the same region in the same block (every built-in lossy codec
    keeps a finer bound, per head, which implies this one). Lossless codecs
    declare zeros, and then ``y`` is ``x`` bit for bit.
    """

    relative: float = 0.0
    of_block_max: float = 0.0

    @property
    def lossless(self) -> bool:
        """Whether decoding returns the payload bit for bit."""
        return self.relative == 0.0 and self.of_block_max == 0.0


class Codec(ABC):
    """Encodes and decodes the payloads of one tier's records; called from its I/O threads,
    concurrently."""

    version: int = 1
    """Bumped whenever the encoded form changes, so older records are misses."""

    @property
    @abstractmethod
    def error_bound(self) -> ErrorBound:
        """How far decoded values may be from the encoded ones."""

    @abstractmethod
    def encode(self, payload: memoryview) -> bytes | bytearray | memoryview:
        """The encoded form of ``payload`` (``record_bytes`` long); any length, the record
        keeps ``payload`` itself when the result is not smaller."""

    @abstractmethod
    def decode(self, encoded: memoryview) -> bytes | bytearray | memoryview:
        """``record_bytes`` bytes decoded from ``encoded``.

        Raises:
            CodecError: ``encoded`` is not an encoded form this codec can read.
        """
