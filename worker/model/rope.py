"""Rotary position embedding: the inverse frequencies of every scaling the supported families use, and the cos/sin
tables the model reads by position.

The arithmetic follows transformers' modeling_rope_utils and LlamaRotaryEmbedding step by step, in the same
dtypes (frequencies in float32, angles as float32 products, cos and sin in float32 scaled by the attention
factor), so a model's fp32 numbers are transformers' bit for bit. GGUF files may carry `rope_freqs`, a divisor
per frequency (llama.cpp's form of Llama 3's scaling): it divides the plain frequencies instead.
"""

from __future__ import annotations

import math

import torch

from worker.model.config import ModelConfig, ModelLoadError, RopeScaling


def inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, float32 (rotary_dim / 2,); the factor cos and sin are scaled by). A partial rotary
    embedding (Qwen3.5) turns only the first rotary_dim dims of each head, with frequencies of that width."""
    r = config.rope_scaling
    dim = config.rotary_dim
    base = config.rope_theta
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if r.kind in ("default", "dynamic"):  # dynamic NTK equals the plain frequencies within the context length
        return plain, 1.0
    if r.kind == "linear":
        return plain / r.factor, 1.0
    if r.kind == "llama3":
        return _llama3(plain, r), 1.0
    if r.kind == "yarn":
        return _yarn(dim, base, r, config.context_length)
    raise ModelLoadError(f"rope scaling {r.kind!r} is not implemented")


def _llama3(freq: torch.Tensor, r: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = r.original_context / r.low_freq_factor
    high_freq_wavelen = r.original_context / r.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / r.factor, freq)
    smooth = (r.original_context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, r: RopeScaling, context_length: int) -> tuple[torch.Tensor, float]:
    factor = r.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = r.attention_factor
    if attention is None:
        if r.mscale and r.mscale_all_dim:
            attention = float(mscale(factor, r.mscale) / mscale(factor, r.mscale_all_dim))
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(r.original_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left as it was (extrapolated)
    return interpolation * (1 - keep) + extrapolation * keep, attention


def rope_tables(config: ModelConfig, max_context: int, device: torch.device,
                freq_divisors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_context, rotary_dim), rotate-half layout, float32. `freq_divisors`: GGUF's rope_freqs."""
    freq, scale = inv_freq(config)
    if freq_divisors is not None:
        freq = freq / freq_divisors.float().cpu()
    angles = torch.arange(max_context)[:, None].float() * freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)
