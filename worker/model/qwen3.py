"""Qwen3 dense (transformers' `qwen3`): the Llama decoder with an RMSNorm over each head of q and k before RoPE,
and a head size set apart from hidden_size / num_attention_heads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worker.model.config import ModelConfig
from worker.model.hf_config import read_common, refuse, refuse_unknown
from worker.model.layers import rms_norm
from worker.model.llama import Layer, Llama

# Hugging Face tensor names this family adds to Llama's, per layer.
HF_LAYER_NAMES = {
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}


class Qwen3(Llama):
    qk_norm = True

    def before_rope(self, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
        """q and k normed head by head (RMSNorm over head_dim with the layer's q_norm / k_norm), v as it is; on the
        GPU in one kernel, in place (worker.kernels.fused.head_rms_norm)."""
        assert layer.q_norm is not None and layer.k_norm is not None
        c = self.config
        if self.kernels.head_norm is not None:
            normed: torch.Tensor = self.kernels.head_norm(qkv, layer.q_norm, layer.k_norm, c.n_heads, c.n_kv_heads,
                                                          c.norm_eps)
            return normed
        rows, q_size, kv_size = qkv.shape[0], c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = rms_norm(q.reshape(rows, c.n_heads, c.head_dim), layer.q_norm, c.norm_eps).reshape(rows, q_size)
        k = rms_norm(k.reshape(rows, c.n_kv_heads, c.head_dim), layer.k_norm, c.norm_eps).reshape(rows, kv_size)
        return torch.cat([q, k, v], dim=-1)


def read_hf_config(cfg: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    refuse_unknown(cfg, ("attention_bias",), where)
    if cfg.get("attention_bias"):
        raise refuse(where, "attention_bias", cfg["attention_bias"], "Qwen3 without biases only")
    common = read_common(cfg, name, "qwen3", where)
    # Qwen3's head size is its own field even where it equals hidden / heads, 128 when absent (transformers' default)
    head_dim = cfg.get("head_dim", 128)
    if head_dim is not None:
        common["explicit_head_dim"] = int(head_dim)
    return ModelConfig(**common, qk_norm=True)
