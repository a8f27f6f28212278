"""Qwen3.5's gated attention kernels (worker.kernels.gated_attention) at the published Qwen3.5-35B-A3B attention shape
(16 heads of 256 with their gates, 2 KV heads, RoPE over the first 64 dims), in bf16 on the GPU, against the steps they
replace: worker.kernels.norms' per-head norm, worker.model.layers' RoPE in torch, cuda_state's store, and torch's
sigmoid and product. The same bits: queries, the stored keys and values, and the gated output; a row alone gives its
bits in a batch.

Run on the GPU machine: `python -m pytest -m gpu tests/worker/gpu/test_gated_attention.py`."""

from __future__ import annotations

import pytest
import torch

from cuda_state import store_positions
from worker.model.config import PRESETS
from worker.model.qwen3_5 import partial_rope

from .device import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")]

SLOTS, CONTEXT, BLOCK = 6, 64, 16


def shape() -> tuple[int, int, int, int, float]:
    c = PRESETS["qwen3.5-35b-a3b"]
    return c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, c.norm_eps


def inputs(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    heads, kv, hd, rotary, _ = shape()
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*s: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*s, generator=gen, device="cuda")

    angles = rand(CONTEXT, rotary // 2, scale=3.0)
    cos_table, sin_table = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, CONTEXT, (rows,), generator=gen, device="cuda")
    return {"qkv": rand(rows, (2 * heads + 2 * kv) * hd).to(torch.bfloat16),
            "q_norm": 1 + rand(hd, scale=0.1), "k_norm": 1 + rand(hd, scale=0.1),
            "cos": cos_table[positions], "sin": sin_table[positions], "positions": positions,
            "slots": torch.randperm(SLOTS - 1, generator=gen, device="cuda")[:rows]}


def caches() -> tuple[torch.Tensor, torch.Tensor]:
    _, kv, hd, _, _ = shape()
    return (torch.zeros(SLOTS, kv, CONTEXT // BLOCK, BLOCK, hd, dtype=torch.bfloat16, device="cuda"),
            torch.zeros(SLOTS, kv, CONTEXT // BLOCK, BLOCK, hd, dtype=torch.bfloat16, device="cuda"))


def reference(i: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What worker.model.qwen3_5 ran before: the norm kernel per head, RoPE in torch, the indexed stores."""
    from worker.kernels.norms import offset_rms_norm

    heads, kv, hd, _, eps = shape()
    rows = i["qkv"].shape[0]
    qg, key, value = i["qkv"].split([2 * heads * hd, kv * hd, kv * hd], dim=-1)
    q = offset_rms_norm(qg.reshape(rows * heads, 2 * hd)[:, :hd], i["q_norm"], eps).view(rows, heads, hd)
    key = offset_rms_norm(key.reshape(rows * kv, hd), i["k_norm"], eps).view(rows, kv, hd)
    q, key = partial_rope(q, i["cos"], i["sin"]), partial_rope(key, i["cos"], i["sin"])
    k_cache, v_cache = caches()
    store_positions(k_cache, i["slots"], i["positions"], key)
    store_positions(v_cache, i["slots"], i["positions"], value.reshape(rows, kv, hd))
    return q, k_cache, v_cache


def fused(i: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from worker.kernels.gated_attention import norm_rope_store

    heads, _, _, _, eps = shape()
    k_cache, v_cache = caches()
    q = norm_rope_store(i["qkv"], i["q_norm"], i["k_norm"], i["cos"], i["sin"], k_cache, v_cache, i["slots"],
                        i["positions"], heads, eps)
    return q, k_cache, v_cache


def test_norm_rope_store_gives_the_separate_steps_bits() -> None:
    i = inputs(5)
    for got, want in zip(fused(i), reference(i), strict=True):
        assert torch.equal(got, want)


def test_a_row_alone_gives_its_bits_in_a_batch() -> None:
    i = inputs(5, seed=1)
    q, k_cache, v_cache = fused(i)
    alone = fused({name: t[3:4] for name, t in i.items() if name not in ("q_norm", "k_norm")}
                  | {"q_norm": i["q_norm"], "k_norm": i["k_norm"]})
    slot = int(i["slots"][3])
    assert torch.equal(alone[0][0], q[3])
    assert torch.equal(alone[1][slot], k_cache[slot]) and torch.equal(alone[2][slot], v_cache[slot])


def test_the_output_gate_gives_torchs_bits() -> None:
    from worker.kernels.gated_attention import sigmoid_gate

    heads, _, hd, _, _ = shape()
    i = inputs(7, seed=2)
    attn = torch.randn(7, heads, hd, device="cuda").to(torch.bfloat16)
    gate = i["qkv"][:, : 2 * heads * hd].reshape(7, heads, 2 * hd)[:, :, hd:].reshape(7, heads * hd)
    assert torch.equal(sigmoid_gate(attn, i["qkv"], heads), attn.reshape(7, heads * hd) * torch.sigmoid(gate))
