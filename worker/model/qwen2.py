"""Qwen2 and Qwen2.5 (transformers' `qwen2`): the Llama decoder with a bias on the q, k and v products."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.model.config import ModelConfig
from worker.model.hf_config import read_common, refuse_unknown
from worker.model.llama import Llama

# Hugging Face tensor names this family adds to Llama's, per layer.
HF_LAYER_NAMES = {
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}


class Qwen2(Llama):
    qkv_bias = True


def read_hf_config(cfg: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    refuse_unknown(cfg, (), where)
    return ModelConfig(**read_common(cfg, name, "qwen2", where), qkv_bias=True)
