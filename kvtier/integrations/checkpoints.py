"""Small random-weight checkpoints written to disk, to run an engine with kvtier without downloads.

The demo (``make demo``), ``benchmarks/vllm_ttft.py`` and the end-to-end tests
all serve a model written by :func:`write_tiny_llama`: a ``transformers``
Llama built from a :class:`TinyLlamaSpec` and a fixed seed, saved with
``save_pretrained``, so any engine that loads Hugging Face checkpoints from a
directory can serve it. Prompts are token ids (there is no tokenizer), and
greedy outputs are deterministic, so two runs of the same engine can be
compared token for token. Writing needs ``transformers``, which vLLM
depends on.

Example::

    import vllm

    from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

    path = write_tiny_llama("/tmp/tiny-llama", TinyLlamaSpec(num_layers=4))
    llm = vllm.LLM(model=str(path), skip_tokenizer_init=True)
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SPEC_FILE = "kvtier_model_spec.json"


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of a random-weight Llama.

    The defaults make a model of about 2 M parameters whose KV cache is
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
    marker = path / _SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
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
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(path)
    marker.write_text(json.dumps(asdict(spec)))
    logger.info("wrote a random-weight Llama (%s) to %s", spec, path)
    return path
