"""The built-in record codecs, held to the codec contract, and what each promises beyond it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.codecs.base import Codec, CodecSpec
from kvtier.codecs.configs import Fp8CodecConfig, Int8CodecConfig, LosslessCodecConfig
from kvtier.codecs.quantised import QuantisedCodec
from kvtier.testing.contracts_codec import CASES, CodecContract


class TestFp8(CodecContract):
    @pytest.fixture
    def make_codec(self) -> Callable[[CodecSpec], Codec]:
        return lambda spec: QuantisedCodec(Fp8CodecConfig(), spec)


class TestInt8(CodecContract):
    @pytest.fixture
    def make_codec(self) -> Callable[[CodecSpec], Codec]:
        return lambda spec: QuantisedCodec(Int8CodecConfig(), spec)


class TestLossless(CodecContract):
    @pytest.fixture(params=[("bit", "lz4"), ("byte", "zstd")], ids=["bit-lz4", "byte-zstd"])
    def make_codec(self, request: pytest.FixtureRequest) -> Callable[[CodecSpec], Codec]:
        pytest.importorskip("blosc2", reason="the lossless codec needs kvtier's compress extra")
        from kvtier.codecs.lossless import LosslessCodec

        shuffle, compressor = request.param
        config = LosslessCodecConfig(shuffle=shuffle, compressor=compressor)
        return lambda spec: LosslessCodec(config, spec)


def test_the_shuffle_setting_is_the_one_compressed_with() -> None:
    """Bit planes of bf16 values let lz4 find the runs of equal exponent bits that byte
    planes hide from it; a record made either way decodes under the other setting."""
    pytest.importorskip("blosc2", reason="the lossless codec needs kvtier's compress extra")
    from kvtier.codecs.lossless import LosslessCodec

    spec = CodecSpec(256 << 10, ())
    values = torch.randn(spec.record_bytes // 2).to(torch.bfloat16)
    record = memoryview(bytes(values.view(torch.uint8).numpy()))
    bit, byte = (LosslessCodec(LosslessCodecConfig(shuffle=s), spec) for s in ("bit", "byte"))
    by_bits, by_bytes = bit.encode(record), byte.encode(record)
    assert len(by_bits) < len(by_bytes)
    assert bytes(byte.decode(memoryview(by_bits))) == bytes(record)
    assert bytes(bit.decode(memoryview(by_bytes))) == bytes(record)


@pytest.mark.parametrize("config", [Fp8CodecConfig(), Int8CodecConfig()], ids=["fp8", "int8"])
def test_quantised_records_are_half_as_large(config: Fp8CodecConfig | Int8CodecConfig) -> None:
    case = CASES["flash_attn_nhd_bf16"]()
    codec = QuantisedCodec(config, case.spec)
    encoded = codec.encode(memoryview(case.records[0]))
    assert len(encoded) == codec.encoded_bytes
    # 8 bits a value, and one float32 scale per block, layer, K or V, and head.
    scales = 3 * 2 * 2
    assert codec.encoded_bytes == case.spec.record_bytes // 2 + 4 * scales


def test_each_head_gets_its_own_scale() -> None:
    """A quiet head next to a loud one keeps its precision: its error is measured on its own
    magnitude, not the block's."""
    case = CASES["flash_attn_nhd_bf16"]()
    codec = QuantisedCodec(Int8CodecConfig(), case.spec)
    region = case.spec.regions[0]
    assert region.format is not None and region.format.shape == (16, 2, 8)
    record = case.records[0]
    decoded = bytes(codec.decode(memoryview(bytes(codec.encode(memoryview(record))))))
    end = region.nbytes
    before = torch.frombuffer(bytearray(record[:end]), dtype=torch.bfloat16).float()
    after = torch.frombuffer(bytearray(decoded[:end]), dtype=torch.bfloat16).float()
    before, after = before.reshape(16, 2, 8), after.reshape(16, 2, 8)
    for head in range(2):
        largest = before[:, head].abs().max()
        assert (after[:, head] - before[:, head]).abs().max() <= largest / 127


def test_regions_the_layout_cannot_read_are_stored_as_they_are() -> None:
    case = CASES["mamba"]()
    codec = QuantisedCodec(Fp8CodecConfig(), case.spec)
    assert codec.stores_as_is
    assert codec.encode(memoryview(case.records[0])) == memoryview(case.records[0])
