"""The random-weight checkpoint writer shared by the demo, the benchmark and end-to-end tests."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvtier.integrations.checkpoints import END_OF_TEXT, TinyLlamaSpec, write_tiny_llama


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({"hidden_size": 130}, "not a multiple of num_heads"),
        ({"num_kv_heads": 3}, "not a multiple of num_kv_heads"),
        ({"hidden_size": 64}, "CPU attention needs at least 32"),
    ],
)
def test_spec_rejects_shapes_engines_cannot_serve(shape: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyLlamaSpec(**shape)


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    spec = TinyLlamaSpec(num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=2)
    assert spec.kv_bytes_per_token() == 2 * 3 * 2 * 64 * 2
    assert spec.kv_bytes_per_token(dtype_bytes=4) == 2 * 3 * 2 * 64 * 4


def test_an_existing_checkpoint_of_the_same_spec_is_kept(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(seed=3)
    (tmp_path / "kvtier_model_spec.json").write_text(json.dumps(asdict(spec)))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert write_tiny_llama(tmp_path, spec) == tmp_path
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "kvtier_model_spec.json",
        "tokenizer.json",
    ]


def test_the_default_model_has_its_documented_size_and_a_tokenizer_of_its_vocabulary(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    spec = TinyLlamaSpec()
    path = write_tiny_llama(tmp_path, spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert sum(parameter.numel() for parameter in model.parameters()) == 557_696
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == spec.vocab_size
    assert tokenizer.eos_token == END_OF_TEXT
    text = "the quick brown fox, 42 ünïcode"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < spec.vocab_size
    assert tokenizer.decode(ids) == text
