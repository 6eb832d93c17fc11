"""Contract tests for record codecs, run on KV records shaped like real engines'.

A :class:`CodecCase` is a :class:`~kvtier.codecs.base.CodecSpec` resolved
from engine tensors (the layout cases of
:mod:`kvtier.testing.contracts_layout`: FlashAttention NHD and HND,
FlashInfer, MLA latents, vLLM's CPU cache in both packings, cross-layer
blocks, Mamba states) and block records
read from them, filled with values whose heads differ in magnitude by orders
of ten, as real KV's do, and a few records a codec must not stumble on (all
zeros, values that are not finite).

:class:`CodecContract` checks what every codec must guarantee: decoding an
encoded record gives ``record_bytes`` bytes within the codec's declared
:class:`~kvtier.codecs.base.ErrorBound` (bit for bit for a lossless one), the
bytes of regions that do not hold floats come back exactly, a truncated or
foreign encoded form raises :class:`~kvtier.codecs.base.CodecError` (or decodes
to a record of the right size, never anything else), and one codec serves
several threads at once. To run it against your codec, subclass it and
provide a ``make_codec`` fixture::

    import pytest
    from kvtier.testing.contracts_codec import CodecContract

    class TestMyCodec(CodecContract):
        @pytest.fixture
        def make_codec(self):
            return lambda spec: MyCodec(MyCodecConfig(), spec)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from kvtier.codecs.base import Codec, CodecError, CodecSpec
from kvtier.layout.base import RecordRegion
from kvtier.layout.resolvers import AutoResolver
from kvtier.testing.contracts_layout import (
    LayoutCase,
    block_first_case,
    cross_layer_case,
    flash_attn_case,
    mamba_case,
    vllm_cpu_packed_case,
)

FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""Element types whose values a lossy codec may change, within its bound."""


@dataclass(frozen=True)
class CodecCase:
    """A tier's records, and the spec a codec is built with for them."""

    name: str
    spec: CodecSpec
    records: tuple[bytes, ...]

    def __str__(self) -> str:
        return self.name


def _fill(layout_case: LayoutCase, seed: int) -> None:
    """KV-like values: normal, each head (the second-to-last logical dimension) scaled by its
    own power of ten, one channel in eight an outlier."""
    generator = torch.Generator().manual_seed(seed)
    for tensor, _ in layout_case.block_tensors:
        if str(tensor.dtype).removeprefix("torch.") not in FLOAT_DTYPES:
            continue
        values = torch.randn(tensor.shape, generator=generator)
        if tensor.dim() >= 2:
            heads = tensor.shape[-2]
            powers = torch.arange(heads, dtype=torch.float32) % 5 - 2
            shape = [1] * tensor.dim()
            shape[-2] = heads
            values *= (10.0**powers).reshape(shape)
        values[..., ::8] *= 20
        tensor.copy_(values.to(tensor.dtype))


def case_from_layout(layout_case: LayoutCase, seed: int = 0) -> CodecCase:
    """The records of ``layout_case``'s blocks, filled with KV-like values, and their spec."""
    _fill(layout_case, seed)
    layout = AutoResolver().resolve(layout_case.kv_caches)
    records = tuple(
        b"".join(region.view[block].numpy().tobytes() for region in layout.regions)
        for block in range(layout.num_blocks)
    )
    return CodecCase(
        layout_case.name, CodecSpec(layout.record_bytes, layout.record_regions), records
    )


def _special(case: CodecCase) -> CodecCase:
    """``case`` with records a codec must not stumble on: zeros, and values not finite."""
    size = case.spec.record_bytes
    zeros = bytes(size)
    awkward = bytearray(case.records[0])
    for region in case.spec.regions:
        known = region.format
        if known is not None and known.dtype in FLOAT_DTYPES:
            dtype = FLOAT_DTYPES[known.dtype]
            values = torch.frombuffer(awkward, dtype=torch.uint8)[
                region.offset_bytes : region.offset_bytes + region.nbytes
            ].view(dtype)
            values[0], values[-1] = math.inf, math.nan
    return CodecCase(f"{case.name}_special", case.spec, (zeros, bytes(awkward)))


CASES: dict[str, Callable[[], CodecCase]] = {
    "flash_attn_nhd_bf16": lambda: case_from_layout(flash_attn_case(dtype=torch.bfloat16)),
    "flash_attn_hnd_fp16": lambda: case_from_layout(
        flash_attn_case(dtype=torch.float16, order="HND")
    ),
    "flashinfer_bf16": lambda: case_from_layout(
        block_first_case("flashinfer", dtype=torch.bfloat16)
    ),
    "mla_bf16": lambda: case_from_layout(block_first_case("mla", dtype=torch.bfloat16)),
    "cpu_bf16": lambda: case_from_layout(block_first_case("cpu", dtype=torch.bfloat16)),
    "cpu_block_outer_bf16": lambda: case_from_layout(vllm_cpu_packed_case(block_outermost=True)),
    "cross_layer_bf16": lambda: case_from_layout(cross_layer_case(dtype=torch.bfloat16)),
    "flash_attn_nhd_fp32": lambda: case_from_layout(flash_attn_case(dtype=torch.float32)),
    "mamba": lambda: case_from_layout(mamba_case()),
    "no_layout": lambda: CodecCase(
        "no_layout", CodecSpec(4096), tuple(torch.randn(1024).numpy().tobytes() for _ in range(3))
    ),
    "special_bf16": lambda: _special(case_from_layout(flash_attn_case(dtype=torch.bfloat16))),
}
"""The cases every codec is run on, by name."""


def _check_region(region: RecordRegion, record: bytes, decoded: bytes, codec: Codec) -> None:
    start, end = region.offset_bytes, region.offset_bytes + region.nbytes
    known = region.format
    bound = codec.error_bound
    if bound.lossless or known is None or known.dtype not in FLOAT_DTYPES:
        assert decoded[start:end] == record[start:end], f"region at {start} changed"
        return
    dtype = FLOAT_DTYPES[known.dtype]
    before = torch.frombuffer(bytearray(record[start:end]), dtype=dtype).double()
    after = torch.frombuffer(bytearray(decoded[start:end]), dtype=dtype).double()
    if not bool(torch.isfinite(before).all()):
        assert decoded[start:end] == record[start:end], "values not finite were changed"
        return
    largest = float(before.abs().max())
    allowed = bound.relative * before.abs() + bound.of_block_max * largest
    excess = (after - before).abs() - allowed
    worst = int(excess.argmax())
    assert float(excess[worst]) <= 0, (
        f"value {worst} of the region at {start}: {float(before[worst])} decoded as "
        f"{float(after[worst])}, beyond the declared bound {bound}"
    )


class CodecContract:
    """What every record codec guarantees; subclass it and provide ``make_codec``."""

    @pytest.fixture
    def make_codec(self) -> Callable[[CodecSpec], Codec]:
        """Builds the codec under test for a spec."""
        raise NotImplementedError("provide a make_codec fixture: spec -> codec")

    @pytest.fixture(params=sorted(CASES))
    def case(self, request: pytest.FixtureRequest) -> CodecCase:
        return CASES[request.param]()

    def test_version_names_the_encoded_form(
        self, make_codec: Callable[[CodecSpec], Codec], case: CodecCase
    ) -> None:
        version = make_codec(case.spec).version
        assert isinstance(version, int) and 0 < version < 2**16

    def test_decoding_an_encoded_record_stays_within_the_declared_bound(
        self, make_codec: Callable[[CodecSpec], Codec], case: CodecCase
    ) -> None:
        codec = make_codec(case.spec)
        regions = case.spec.regions or (RecordRegion(0, case.spec.record_bytes, None),)
        for record in case.records:
            encoded = bytes(codec.encode(memoryview(record)))
            if len(encoded) >= len(record):
                continue  # the record format stores this record as it is
            decoded = bytes(codec.decode(memoryview(encoded)))
            assert len(decoded) == case.spec.record_bytes
            for region in regions:
                _check_region(region, record, decoded, codec)

    def test_a_damaged_encoded_form_is_an_error_or_a_record(
        self, make_codec: Callable[[CodecSpec], Codec], case: CodecCase
    ) -> None:
        codec = make_codec(case.spec)
        encoded = bytes(codec.encode(memoryview(case.records[0])))
        noise = torch.randint(0, 256, (len(encoded),), generator=torch.Generator().manual_seed(1))
        for damaged in (encoded[:-1], encoded + b"\0", bytes(noise.to(torch.uint8).numpy()), b""):
            try:
                decoded = codec.decode(memoryview(damaged))
            except CodecError:
                continue
            assert len(bytes(decoded)) == case.spec.record_bytes

    def test_one_codec_serves_threads_at_once(
        self, make_codec: Callable[[CodecSpec], Codec], case: CodecCase
    ) -> None:
        codec = make_codec(case.spec)

        def round_trip(record: bytes) -> bytes:
            encoded = codec.encode(memoryview(record))
            if len(encoded) >= len(record):
                return record
            return bytes(codec.decode(memoryview(bytes(encoded))))

        alone = [round_trip(record) for record in case.records]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(round_trip, case.records * 4))
        assert together == alone * 4
