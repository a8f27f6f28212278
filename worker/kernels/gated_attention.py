"""Qwen3.5's gated full attention around the shared attention kernels (worker.model.qwen3_5), in two launches:

- `norm_rope_store`: from the q|k|v product, each head's query (its gate beside it) and key normed as
  offset_rms_norm does (fp32, times 1 + weight, rounded once), the first rotary_dim dims of each turned by RoPE as
  worker.model.layers.apply_rope does (fp32, rounded once), the queries written out and the key and value stored in
  the caches at each row's slot and position. In torch this is two norm launches, about a dozen small kernels of
  RoPE's slicing, negating, concatenating and rounding, and two indexed stores.
- `sigmoid_gate`: the attention's output times sigmoid(gate), each rounded to the model dtype as torch rounds them.

A program serves one row and one head: the norm's sum is over a block laid out as worker.kernels.norms lays out a
row of head_dim (one warp), so the normed values are the norm kernel's bits, and a row never depends on the others
in its step. The rotated half of RoPE needs each dim's partner (d + rotary/2, or d - rotary/2 negated): the partner
is loaded and normed again with the same scale and weight, which gives the same bits as the normed row's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.kernels.attention import spare_views
from worker.kernels.fused import STRICT, _interpreted, check_slab_store
from worker.kernels.pdl import launch_options, wait_then_release


@triton.jit
def _norm_rope_store_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, QNorm, KNorm, Cos, Sin, Q, K, V, Slots, Positions, anchor,
    stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh,
    stride_ks, stride_kh, stride_kb, stride_kt,
    stride_vs, stride_vh, stride_vb, stride_vt,
    inv_d, eps,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,  # positions per block of the slot layout (cuda_state.spec)
    PDL: tl.constexpr,
):
    """Grid (rows, HEADS + KV_HEADS): program (t, h) writes Q[t, h] (h < HEADS), or stores key h - HEADS and its value
    in K and V at Slots[t], Positions[t]. QKV[t] is [HEADS x (query, gate) | KV_HEADS keys | KV_HEADS values]."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < HEAD_DIM
    half: tl.constexpr = ROTARY // 2
    turned = cols < ROTARY
    partner = tl.where(cols < half, cols + half, cols - half)
    row = QKV + t * stride_qkv
    is_query = head < HEADS
    if is_query:
        src = row + head * 2 * HEAD_DIM
        weight = QNorm
    else:
        src = row + 2 * HEADS * HEAD_DIM + (head - HEADS) * HEAD_DIM
        weight = KNorm
    x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) * inv_d + eps)  # as worker.kernels.norms._norm_kernel
    dtype = Q.dtype.element_ty
    normed = ((x * scale) * tl.load(weight + cols, mask=ok, other=0.0)).to(dtype)
    xp = tl.load(src + partner, mask=turned, other=0.0).to(tl.float32)
    normed_p = ((xp * scale) * tl.load(weight + partner, mask=turned, other=0.0)).to(dtype).to(tl.float32)
    rotated = tl.where(cols < half, -normed_p, normed_p)
    cos = tl.load(Cos + t * stride_cos + cols, mask=turned, other=0.0)
    sin = tl.load(Sin + t * stride_sin + cols, mask=turned, other=0.0)
    y = tl.where(turned, (normed.to(tl.float32) * cos + rotated * sin).to(dtype), normed)
    if is_query:
        tl.store(Q + t * stride_qt + head * stride_qh + cols, y, mask=ok)
    else:
        kv = head - HEADS
        slot = tl.load(Slots + t).to(tl.int64) - anchor
        pos = tl.load(Positions + t).to(tl.int64)
        k_at = K + slot * stride_ks + kv * stride_kh + (pos // BLOCK_T) * stride_kb + (pos % BLOCK_T) * stride_kt
        tl.store(k_at + cols, y.to(K.dtype.element_ty), mask=ok)
        value = tl.load(src + KV_HEADS * HEAD_DIM + cols, mask=ok, other=0.0)  # the values follow the keys
        v_at = V + slot * stride_vs + kv * stride_vh + (pos // BLOCK_T) * stride_vb + (pos % BLOCK_T) * stride_vt
        tl.store(v_at + cols, value.to(V.dtype.element_ty), mask=ok)


def norm_rope_store(
    qkv: torch.Tensor,  # (T, 2 * H * hd + 2 * KV * hd): each head's query and gate, then the keys, then the values
    q_norm: torch.Tensor,  # (hd,) fp32: 1 + the query norm's weight
    k_norm: torch.Tensor,  # (hd,) fp32
    cos: torch.Tensor,  # (T, rotary_dim) fp32: the rope table's rows at each row's position
    sin: torch.Tensor,  # (T, rotary_dim) fp32
    k_cache: torch.Tensor,  # (num_slots, KV, blocks, block, hd), any strides with a contiguous hd; last slot mapped
    v_cache: torch.Tensor,  # same
    slots: torch.Tensor,  # (T,) int64: the slot each row writes
    positions: torch.Tensor,  # (T,) int64: the position each row writes
    n_heads: int,
    eps: float,
) -> torch.Tensor:
    """The rows' queries, normed and turned (T, H, hd) in qkv's dtype; their keys (normed, turned) and values stored
    in the caches at each row's slot and position. One launch (see the module docstring)."""
    rows = qkv.shape[0]
    kv_heads, head_dim = check_slab_store(k_cache, v_cache, slots, positions, rows)
    rotary = cos.shape[1]
    if qkv.shape[1] != (2 * n_heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not ({rows}, {(2 * n_heads + 2 * kv_heads) * head_dim}) "
                         "with contiguous rows")
    if rotary % 2 or rotary > head_dim or cos.shape != (rows, rotary) or sin.shape != (rows, rotary):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be ({rows}, an even rotary_dim "
                         f"<= {head_dim})")
    if cos.stride(1) != 1 or sin.stride(1) != 1 or not slots.is_contiguous() or not positions.is_contiguous():
        raise ValueError("cos and sin must have contiguous rows, slots and positions be contiguous")
    out = torch.empty((rows, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return out
    anchor, k_anchor, v_anchor = spare_views(k_cache, v_cache)  # K and V as views of the always mapped spare slot
    _norm_rope_store_kernel[(rows, n_heads + kv_heads)](
        qkv, q_norm, k_norm, cos, sin, out, k_anchor, v_anchor, slots, positions, anchor,
        qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        *k_cache.stride()[:4], *v_cache.stride()[:4], 1.0 / head_dim, eps,
        HEADS=n_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, ROTARY=rotary, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=k_cache.shape[3], num_warps=4 if head_dim >= 1024 else 1, **STRICT, **launch_options(qkv),
    )
    return out


@triton.jit
def _sigmoid_gate_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, Gate, Out, stride_x, stride_g, stride_o,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, heads): Out[t, head] = X[t, head] * sigmoid(Gate[t, head's gate]), each rounded to the dtype."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < HEAD_DIM
    dtype = Out.dtype.element_ty
    g = tl.load(Gate + t * stride_g + head * 2 * HEAD_DIM + cols, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)  # expf, as torch's CUDA sigmoid
    else:
        e = tl.exp(-g)
    gate = tl.math.div_rn(1.0, 1.0 + e).to(dtype).to(tl.float32)
    x = tl.load(X + t * stride_x + head * HEAD_DIM + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + head * HEAD_DIM + cols, (x * gate).to(dtype), mask=ok)


def sigmoid_gate(attn: torch.Tensor, qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """attn (T, H, hd) times sigmoid of each head's gate (the second half of its query in qkv, as norm_rope_store
    reads it): (T, H * hd) in attn's dtype."""
    rows, heads, head_dim = attn.shape
    if heads != n_heads or attn.stride(2) != 1 or attn.stride(1) != head_dim or qkv.stride(1) != 1:
        raise ValueError(f"attn {tuple(attn.shape)} must be ({rows}, {n_heads}, hd) with contiguous heads")
    if qkv.shape[0] != rows or qkv.shape[1] < 2 * n_heads * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} holds no gate for ({rows}, {n_heads}, {head_dim})")
    out = torch.empty((rows, heads * head_dim), dtype=attn.dtype, device=attn.device)
    if rows:
        _sigmoid_gate_kernel[(rows, heads)](
            attn, qkv[:, head_dim:], out, attn.stride(0), qkv.stride(0), out.stride(0), HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), LIBDEVICE_EXP=not _interpreted(), num_warps=1, **STRICT,
            **launch_options(attn))
    return out
