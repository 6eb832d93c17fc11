"""The lossy ``fp8`` and ``int8`` codecs: KV values in 8 bits, a scale per block and head.

Opt-in only: a record decoded from them differs from the one stored, so the
engine's outputs change. Each region of a record (see
:class:`~kvtier.layout.base.RegionFormat`) that holds 16- or 32-bit floats is
quantised in groups: the values of one block that share their K-or-V half,
their KV head (and their layer, where a region holds several) share one
float32 scale, the group's largest magnitude over the largest 8-bit value
(448 for e4m3, 127 for int8). Adjacent regions of the same format (the layers
of a model, one after another in a record) are quantised together in one
torch call each. Regions of other types, or whose meaning the layout resolver
could not tell, are copied as they are; a block holding a value that is not
finite is stored as it is.

Encoded form, for each run of regions in record order: the run's bytes as
they are, or its scales (float32, group by group) followed by its 8-bit values
in the run's own order (version 2; version 1 wrote them group by group, which
took a permuting copy each way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.codecs.base import Codec, CodecError, CodecSpec, ErrorBound
from kvtier.codecs.configs import Fp8CodecConfig, Int8CodecConfig
from kvtier.layout.base import RecordRegion, RegionFormat

_FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SCALE_BYTES = 4


@dataclass(frozen=True)
class _Run:
    """Adjacent regions of a record encoded the same way."""

    start: int
    end: int
    dtype: torch.dtype | None
    """The values' type; ``None`` copies the bytes as they are."""
    shape: tuple[int, ...] = ()
    """The run's values, a leading axis for its regions, then one region's shape."""
    shared: tuple[int, ...] = ()
    """The axes of :attr:`shape` whose values share a scale (the others index the groups)."""
    groups: int = 0
    """Values of a run that share a scale: one group per index of the other axes."""

    @property
    def scales_shape(self) -> tuple[int, ...]:
        """:attr:`shape` with the :attr:`shared` axes cut to one: the scales, broadcastable
        over the values."""
        return tuple(1 if axis in self.shared else size for axis, size in enumerate(self.shape))

    @property
    def encoded_bytes(self) -> int:
        if self.dtype is None:
            return self.end - self.start
        return self.groups * _SCALE_BYTES + math.prod(self.shape)


def _quantisable(region: RecordRegion) -> bool:
    known = region.format
    if known is None or known.dtype not in _FLOATS:
        return False
    return math.prod(known.shape) * _FLOATS[known.dtype].itemsize == region.nbytes


def _runs(spec: CodecSpec) -> tuple[_Run, ...]:
    """The record cut into runs; the whole record copied when the regions do not tile it."""
    regions = spec.regions
    offsets = [region.offset_bytes for region in regions]
    ends = [region.offset_bytes + region.nbytes for region in regions]
    if not regions or offsets[0] != 0 or ends[-1] != spec.record_bytes or offsets[1:] != ends[:-1]:
        return (_Run(0, spec.record_bytes, None),)
    runs: list[_Run] = []
    members: list[RecordRegion] = []

    def close() -> None:
        first = members[0]
        end = first.offset_bytes + sum(member.nbytes for member in members)
        if not _quantisable(first):
            runs.append(_Run(first.offset_bytes, end, None))
            return
        known: RegionFormat = first.format  # type: ignore[assignment]
        shape = (len(members), *known.shape)
        scale_axes = (0, *(axis + 1 for axis in known.scale_axes))
        shared = tuple(axis for axis in range(len(shape)) if axis not in scale_axes)
        groups = math.prod(shape[axis] for axis in scale_axes)
        runs.append(_Run(first.offset_bytes, end, _FLOATS[known.dtype], shape, shared, groups))

    for region in regions:
        if members and not (
            region.format == members[0].format
            and (region.format is None or _quantisable(region) == _quantisable(members[0]))
        ):
            close()
            members = []
        members.append(region)
    close()
    return tuple(runs)


def _writable(buffer: memoryview | bytes | bytearray) -> bytearray | memoryview:
    """``buffer`` itself when torch may wrap it without a warning, else a copy."""
    view = memoryview(buffer)
    return view if not view.readonly else bytearray(view)


class QuantisedCodec(Codec):
    """Quantises KV values to ``fp8`` (e4m3) or ``int8`` with per-block, per-head scales."""

    version = 2

    def __init__(self, config: Fp8CodecConfig | Int8CodecConfig, spec: CodecSpec) -> None:
        self.name = config.type
        self.record_bytes = spec.record_bytes
        self.runs = _runs(spec)
        self.encoded_bytes = sum(run.encoded_bytes for run in self.runs)
        self.stores_as_is = all(run.dtype is None for run in self.runs)
        """Whether the layout left nothing to quantise: records are then stored as they are."""
        if config.type == "fp8":
            self._code = torch.float8_e4m3fn
            self._largest = float(torch.finfo(torch.float8_e4m3fn).max)
            # Rounding to 3 mantissa bits (2**-4 of a value), e4m3's subnormal step
            # (2**-10 of a scale unit), then the decoded value rounded to bf16 (2**-8).
            self._bound = ErrorBound(
                relative=2**-4 + 2**-8 * (1 + 2**-4) + 1e-6,
                of_block_max=2**-10 / self._largest * (1 + 2**-8) + 1e-6,
            )
        else:
            self._code = torch.int8
            self._largest = 127.0
            # Rounding to the nearest step (half a step: 1/254 of the group's largest
            # magnitude), then the decoded value rounded to bf16.
            self._bound = ErrorBound(
                relative=2**-8 + 1e-6, of_block_max=(1 + 2**-8) / (2 * self._largest) + 1e-6
            )

    @property
    def error_bound(self) -> ErrorBound:
        return self._bound

    def encode(self, payload: memoryview) -> memoryview | bytes | bytearray:
        if self.stores_as_is:
            return payload
        source = torch.frombuffer(_writable(payload), dtype=torch.uint8)
        out = torch.empty(self.encoded_bytes, dtype=torch.uint8)
        at = 0
        for run in self.runs:
            piece = source[run.start : run.end]
            if run.dtype is None:
                out[at : at + len(piece)] = piece
                at += len(piece)
                continue
            values = piece.view(run.dtype).reshape(run.shape).float()
            largest = values.abs().amax(dim=run.shared, keepdim=True)
            if not bool(torch.isfinite(largest).all()):
                return payload
            scales = torch.where(largest > 0, largest / self._largest, 1.0)
            values.div_(scales)
            if self._code is torch.int8:
                values.round_()
            values.clamp_(-self._largest, self._largest)
            out[at : at + run.groups * _SCALE_BYTES].view(torch.float32).copy_(scales.reshape(-1))
            at += run.groups * _SCALE_BYTES
            count = math.prod(run.shape)
            out[at : at + count].view(self._code).view(run.shape).copy_(values)
            at += count
        return memoryview(out.numpy())

    def decode(self, encoded: memoryview) -> memoryview:
        if len(encoded) != self.encoded_bytes:
            raise CodecError(
                f"{self.name}: an encoded record is {self.encoded_bytes} bytes, got {len(encoded)}"
            )
        source = torch.frombuffer(_writable(encoded), dtype=torch.uint8)
        out = torch.empty(self.record_bytes, dtype=torch.uint8)
        at = 0
        for run in self.runs:
            if run.dtype is None:
                out[run.start : run.end] = source[at : at + run.end - run.start]
                at += run.end - run.start
                continue
            scales = source[at : at + run.groups * _SCALE_BYTES].view(torch.float32)
            at += run.groups * _SCALE_BYTES
            count = math.prod(run.shape)
            values = self._widened(source[at : at + count]).view(run.shape)
            at += count
            values.mul_(scales.view(run.scales_shape))
            out[run.start : run.end].view(run.dtype).view(run.shape).copy_(values)
        return memoryview(out.numpy())

    def _widened(self, codes: torch.Tensor) -> torch.Tensor:
        """The 8-bit ``codes`` (as bytes) as new float32 values, before scaling."""
        if self._code is torch.int8:
            return codes.view(torch.int8).float()
        # torch widens fp8 one value at a time on CPU; a table of the 256 codes is 3x faster.
        return torch.from_numpy(np.take(_FP8_VALUES, codes.numpy()))


_FP8_VALUES = (
    torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
)
"""The float32 value of each e4m3 code."""


def build(config: Fp8CodecConfig | Int8CodecConfig, spec: CodecSpec) -> QuantisedCodec:
    """Build the ``fp8`` or ``int8`` codec for one tier's records."""
    return QuantisedCodec(config, spec)
