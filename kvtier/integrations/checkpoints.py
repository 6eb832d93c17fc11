"""Small random-weight checkpoints written to disk, to run an engine with kvtier without downloads.

The demo (``make demo``), ``benchmarks/vllm_ttft.py`` and the end-to-end tests
serve a model written by :func:`write_tiny_llama`: a ``transformers``
Llama built from a :class:`TinyLlamaSpec` and a fixed seed, saved with
``save_pretrained``, so any engine that loads Hugging Face checkpoints from a
directory can serve it. Beside the weights lies a byte-level BPE tokenizer
trained at creation on seeded random words, with as many tokens as the model's
vocabulary, so a served model takes text (and any benchmark client that
tokenizes runs unchanged); prompts may also be token ids. Greedy outputs are
deterministic, so two runs of the same engine can be compared token for
token. :func:`write_tiny_gemma3` writes a hybrid model (sliding-window and
full attention layers) the same way. Writing needs
``transformers``, which vLLM depends on.

Example::

    import vllm

    from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

    path = write_tiny_llama("/tmp/tiny-llama", TinyLlamaSpec(num_layers=4))
    llm = vllm.LLM(model=str(path), skip_tokenizer_init=True)
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SPEC_FILE = "kvtier_model_spec.json"
_TOKENIZER_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"
"""The tokenizer's one special token (id 0), its end-of-sequence token."""
_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of a random-weight Llama.

    The defaults make a model of 557,696 parameters whose KV cache is
    ``2 * num_layers * num_kv_heads * head_dim * 2`` bytes per token in bf16.
    """

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    """Standard deviation of the random weights; larger values give peakier logits,
    so greedy outputs depend less on rounding in how a prefix's KV was computed."""
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim < 32:
            raise ValueError(
                f"head_dim is {self.head_dim}; CPU attention needs at least 32: "
                "raise hidden_size or lower num_heads"
            )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class TinyGemma3Spec(TinyLlamaSpec):
    """Shape of a random-weight Gemma3-style hybrid: sliding-window and full attention layers.

    Layers alternate ``sliding_attention`` and ``full_attention``, so vLLM puts
    them in two kv-cache groups (a ``SlidingWindowSpec`` and a
    ``FullAttentionSpec``) of equal bytes per block. Weights are float32
    (serve it with ``dtype="float32"``); untied embeddings and no final logit
    soft-capping keep greedy outputs from collapsing to one repeated token.
    """

    num_layers: int = 4
    sliding_window: int = 64
    """Tokens a sliding-window layer attends to (the current one included)."""

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V for one token across all layers (float32 by default)."""
        return super().kv_bytes_per_token(dtype_bytes)


def write_tiny_llama(directory: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write a random-weight Llama checkpoint to ``directory`` and return its path.

    Writing is skipped when the directory already holds a checkpoint of the same
    spec, so callers can share one model across runs.

    Args:
        directory: Where to write the checkpoint; created if missing.
        spec: The model's shape and seed; the default spec when ``None``.

    Returns:
        The checkpoint directory, ready for ``vllm.LLM(model=str(path))``.
    """
    spec = spec or TinyLlamaSpec()
    path = Path(directory)
    if _written(path, spec):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    return _save(path, spec, LlamaForCausalLM, config, "bfloat16")


def write_tiny_gemma3(directory: str | Path, spec: TinyGemma3Spec | None = None) -> Path:
    """Write a random-weight Gemma3-style hybrid checkpoint to ``directory``; return its path.

    Like :func:`write_tiny_llama`, writing is skipped when the directory
    already holds a checkpoint of the same spec.
    """
    spec = spec or TinyGemma3Spec()
    path = Path(directory)
    if _written(path, spec):
        return path
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        sliding_window=spec.sliding_window,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)
        ],
        tie_word_embeddings=False,
        final_logit_softcapping=None,
        torch_dtype="float32",
    )
    return _save(path, spec, Gemma3ForCausalLM, config, "float32")


def _written(path: Path, spec: TinyLlamaSpec) -> bool:
    """Whether ``path`` holds a checkpoint of ``spec`` and its tokenizer."""
    marker = path / _SPEC_FILE
    return (
        marker.exists()
        and (path / _TOKENIZER_FILE).exists()
        and json.loads(marker.read_text()) == asdict(spec)
    )


def _training_text(seed: int, lines: int = 400, words: int = 50) -> list[str]:
    """Seeded lines of random lower-case words, some from few letters, so merges repeat."""
    rng = random.Random(seed)

    def word() -> str:
        letters = _LETTERS[: rng.choice((8, 14, 26))]
        return "".join(rng.choice(letters) for _ in range(rng.choice((1, 2, 3, 4, 5, 6, 8))))

    return [" ".join(word() for _ in range(words)) for _ in range(lines)]


def write_tokenizer(path: Path, vocab_size: int, seed: int = 0) -> None:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens and save it in ``path``.

    The 256 byte tokens come first after :data:`END_OF_TEXT`, so every text
    encodes; merges fill the rest. Training takes well under a second.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(seed), trainer)
    saved = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT)
    saved.save_pretrained(path)


def _save(path: Path, spec: TinyLlamaSpec, model_class: type, config: object, dtype: str) -> Path:
    """Build ``model_class(config)`` from the spec's seed, save it and its spec marker."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = model_class(config).to(getattr(torch, dtype))
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(path)
    write_tokenizer(path, spec.vocab_size, spec.seed)
    (path / _SPEC_FILE).write_text(json.dumps(asdict(spec)))
    logger.info("wrote a random-weight %s (%s) to %s", model_class.__name__, spec, path)
    return path
