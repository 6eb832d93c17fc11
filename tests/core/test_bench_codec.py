"""The codec benchmark runs a model end to end on tiny sizes and reports every codec."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.cli import bench_codec

pytest.importorskip("transformers")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_codec.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_report_has_ratio_speeds_and_errors_per_head(tmp_path: Path) -> None:
    output = tmp_path / "codec.json"
    args = _args(
        "--codecs", "fp8,int8", "--tokens", "64", "--block-tokens", "16", "--repeats", "1",
        "--output", str(output),
    )  # fmt: skip
    assert bench_codec.run(args) == 0
    report = json.loads(output.read_text())
    assert report["records"] == 4 and report["block_tokens"] == 16
    # 4 layers, K and V, 4 KV heads of 64 bf16 values, 16 tokens
    assert report["record_bytes"] == 4 * 2 * 4 * 64 * 2 * 16
    for result in report["results"]:
        assert result["ratio"] > 1.9 and result["stored_as_is"] == 0
        assert result["encode_gbps"] > 0 and result["decode_gbps"] > 0
        assert len(result["heads"]) == 4 * 2 * 4
        assert 0 < result["mean_abs_error"] <= result["max_abs_error"]
        worst = max(head["max_abs_error"] / head["max_abs_value"] for head in result["heads"])
        assert worst < (0.07 if result["codec"] == "fp8" else 0.01)


def test_codec_settings_are_read_from_the_name() -> None:
    assert bench_codec.parse_codec("lossless:compressor=lz4:level=3") == {
        "type": "lossless",
        "compressor": "lz4",
        "level": 3,
    }


def test_an_unknown_codec_fails_naming_the_installed_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _args("--codecs", "gzip", "--tokens", "32", "--block-tokens", "16", "--repeats", "1")
    assert bench_codec.run(args) == 1
    assert "no record codec named 'gzip'; installed: fp8, int8" in capsys.readouterr().err


def test_too_few_tokens_for_a_block_is_a_usage_error() -> None:
    assert bench_codec.run(_args("--tokens", "8", "--block-tokens", "16")) == 2
