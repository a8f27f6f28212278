"""Tensor helpers shared by the kernel tests and the interpreted checks (tests/worker/interpreted/): distances in
bits (ulps, same_bits), and inputs laid out as the model lays them out (slab_caches, rope_rows, random_norms)."""

from __future__ import annotations

import torch

from worker.model import llama as reference


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (same dtype; +0 and -0 are equal)."""
    assert a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16, torch.float32)
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    sign = 1 << (8 * a.element_size() - 1)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(ints).long()
        return torch.where(i < 0, -(i + sign), i)  # negative floats count down from -0

    return (ordered(a) - ordered(b)).abs()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def slab_caches(slots: int, layers: int, kv: int, ctx: int, hd: int, dtype: torch.dtype,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the session table lays them out: (slots, layers, KV, blocks, block, hd) strided views of one byte
    slab."""
    from cuda_state import BufferSpec, StateSpec
    from cuda_state.backend import zeroed_views

    shape = (layers, kv, ctx, hd)
    views = zeroed_views(StateSpec((BufferSpec("k", shape, dtype, 2), BufferSpec("v", shape, dtype, 2))), slots, device)
    return views["k"], views["v"]


def blocked(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V given by position, (slots, KV, ctx, hd), copied into the session table's layout of one layer: layer 1
    of two in slab_caches, (slots, KV, blocks, block, hd) views; the positions past ctx in the last block are NaN."""
    slots, kv, ctx, hd = k.shape
    k_all, v_all = slab_caches(slots, 2, kv, ctx, hd, k.dtype, str(k.device))
    k_all.fill_(float("nan"))
    v_all.fill_(float("nan"))
    kb, vb = k_all[:, 1], v_all[:, 1]
    blocks, block = kb.shape[2], kb.shape[3]
    pad = (0, 0, 0, blocks * block - ctx)
    kb.copy_(torch.nn.functional.pad(k, pad, value=float("nan")).unflatten(2, (blocks, block)))
    vb.copy_(torch.nn.functional.pad(v, pad, value=float("nan")).unflatten(2, (blocks, block)))
    return kb, vb


def rope_rows(hd: int, theta: float, ctx: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """worker.model.llama's rope tables for head_dim `hd`, at `positions`: cos, sin (T, hd) fp32."""
    from dataclasses import replace

    from worker.model.config import PRESETS

    config = replace(PRESETS["tiny"], dim=hd, n_heads=1, rope_theta=theta)  # only head_dim and theta matter
    cos, sin = reference.rope_tables(config, ctx, positions.device)
    return cos[positions], sin[positions]


def random_norms(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """The weights with every norm's weight drawn around 1 (random models have norms of ones)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (1 + 0.3 * torch.randn(w.shape, generator=gen)) if name.endswith("norm") else w
            for name, w in weights.items()}
