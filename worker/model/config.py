"""The shape of a Llama-family model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    context_length: int  # what the model was trained for; a worker may serve less
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        return cls(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=int(cfg["num_attention_heads"]),
            n_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            ffn_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


# Same architecture as SmolLM2-135M-Instruct: used with seeded random weights where the real file
# cannot go (the GPU machine), and in a tiny form for fast tests.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="random-smollm2-135m", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
        ffn_dim=1536, norm_eps=1e-5, rope_theta=100000.0, context_length=8192,
    ),
    "tiny": ModelConfig(
        name="random-tiny", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_dim=128, norm_eps=1e-5, rope_theta=10000.0, context_length=4096,
    ),
}
