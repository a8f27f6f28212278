"""Fused elementwise kernels for the GPU layer body: one launch where torch eager needs many.

What each replaces, per layer of a decode step (kernel counts as torch eager launches them):

- `add_rms_norm` (2 per layer): the residual add and the RMSNorm after it. Torch: 1 add + ~7 for
  rms_norm (float cast, pow, mean, add eps, rsqrt, mul, cast back, mul by the weight). ~18 -> 2.
- `rope_and_store` (1 per layer): RoPE on q and k and the K/V cache write. Torch: ~8 for each
  apply_rope (cast, slices, neg, cat, muls, add, cast), plus 2 index_put for the cache. ~18 -> 1.
- `silu_mul` (1 per layer): silu(gate) * up. Torch: 2 -> 1.
- `rms_norm`: the first layer's input norm (once per forward; the later ones fuse the residual add).
- `head_rms_norm` (1 per layer, Qwen3): the RMSNorm of each head of q and k before RoPE, in place.
  Torch: ~7 for each of the two norms, plus the split and the cat. ~17 -> 1.

With the four cuBLAS GEMMs and the attention kernel a layer is 9 launches (10 when attention splits
the keys), against ~45 in eager torch.

Numbers: every kernel rounds exactly where worker.model.llama's torch code rounds, so the GPU path stays
comparable with the reference (and with itself across batch sizes):
- the residual add is done in fp32 and rounded once to the model dtype, as `h + y` is in bf16;
- rms_norm normalises in fp32, rounds to the model dtype, then multiplies by the weight and rounds
  again (`weight * xf.to(dtype)`); the mean is sum * (1/dim) as torch's CUDA mean computes it.
  Only the order of the sum of squares differs from torch's reduction: rarely, the normed value
  lands one ulp apart before the weight multiplies it (<= 2 ulps out; ~1e-4 of elements in fp16 tests);
- RoPE is x*cos + rotate_half(x)*sin in fp32, each product and the sum rounded separately (FMA
  contraction is off for every kernel here: `enable_fp_fusion=False`), then rounded to the dtype;
- silu is x / (1 + exp(-x)) in fp32 with libdevice's expf and an IEEE division, as torch's CUDA
  silu, rounded to the dtype; the product with up is rounded again, as `F.silu(gate) * up`.
  (libdevice's expf is meant to match CUDA's expf; the tests allow the same rare last-bit flips.)

Batch invariance: every program reads and writes one row (one token) only; no reduction crosses
rows, so a row's numbers do not depend on what else is in the batch or on the batch size.

Capture safety: no host syncs and no allocations besides the outputs (which callers may pass).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.kernels.attention import spare_views
from worker.kernels.pdl import launch_options, wait_then_release

NORM_WARPS = 4
ROPE_WARPS = 2
SILU_BLOCK = 1024  # elements of one row per silu_mul program
SILU_WARPS = 4
# torch rounds after each elementwise op; an FMA would round once and change the last bit.
STRICT = dict(enable_fp_fusion=False)


def _interpreted() -> bool:
    """Triton's CPU interpreter has no libdevice: silu uses tl.exp (numpy's) there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- RMSNorm --------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, Residual, W, Out, ResidualOut,
    stride_x, stride_r, stride_o, stride_ro,
    dim, inv_dim, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows,): Out[row] = rms_norm(X[row] (+ Residual[row])); the sum also goes to ResidualOut."""
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ResidualOut.dtype.element_ty)  # rounded once, as h + y
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, _normed(x.to(tl.float32), w, inv_dim, eps, Out.dtype.element_ty), mask=mask)


@triton.jit
def _normed(xf, w, inv_dim, eps, DTYPE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
    """RMS norm of the fp32 vector `xf` as worker.model.llama.rms_norm: normalised in fp32, rounded to DTYPE, then
    times the weight `w` and rounded again."""
    mean_square = tl.sum(xf * xf, 0) * inv_dim
    normed = (xf * tl.math.rsqrt(mean_square + eps)).to(DTYPE)  # rounded before the weight
    return (w.to(tl.float32) * normed.to(tl.float32)).to(DTYPE)


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape != (rows, cols) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be ({rows}, {cols}) with a contiguous last dimension, got {tuple(t.shape)}")


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
    rows, dim = x.shape
    if weight.shape != (dim,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be ({dim},) contiguous, got {tuple(weight.shape)}")
    _check_rows("out", out, rows, dim)
    if out.dtype != x.dtype:
        raise ValueError(f"out ({out.dtype}) must have x's dtype ({x.dtype}): the norm rounds to it")
    if residual is not None:
        assert residual_out is not None
        _check_rows("residual", residual, rows, dim)
        _check_rows("residual_out", residual_out, rows, dim)
    if rows == 0:
        return
    res = residual if residual is not None else x  # unused pointers when HAS_RESIDUAL is off
    res_out = residual_out if residual_out is not None else out
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, res_out,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        dim, 1.0 / dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim), num_warps=NORM_WARPS, **STRICT,
        **launch_options(x),
    )


def rms_norm(
    x: torch.Tensor,  # (T, dim), contiguous last dimension
    weight: torch.Tensor,  # (dim,) in x's dtype
    eps: float,
    out: torch.Tensor | None = None,  # (T, dim) preallocated output
) -> torch.Tensor:
    """worker.model.llama.rms_norm in one launch: weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)."""
    _check_rows("x", x, x.shape[0], x.shape[-1])
    out = torch.empty_like(x) if out is None else out
    _launch_norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor,  # (T, dim): the block's output
    residual: torch.Tensor,  # (T, dim): the residual stream
    weight: torch.Tensor,  # (dim,)
    eps: float,
    out: torch.Tensor | None = None,  # (T, dim) preallocated normed output
    residual_out: torch.Tensor | None = None,  # (T, dim) preallocated new residual; may be `residual` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch; the sum rounded to the dtype once."""
    _check_rows("x", x, x.shape[0], x.shape[-1])
    if x.dtype != residual.dtype:
        raise ValueError(f"x ({x.dtype}) and residual ({residual.dtype}) must share a dtype")
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    _launch_norm(x, residual, weight, eps, out, residual_out)
    return out, residual_out


@triton.jit
def _head_rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, QW, KW, stride_qkv, inv_dim, eps,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, heads + kv_heads): head j of row `row` (q heads, then k heads) normed in place, as _rms_norm_kernel
    normalises a row: fp32, rounded to the dtype, then times the weight (QW for q heads, KW for k heads)."""
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEAD_DIM
    ptrs = QKV + row * stride_qkv + head * HEAD_DIM + offs
    xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if head < HEADS:
        w = tl.load(QW + offs, mask=mask, other=0.0)
    else:
        w = tl.load(KW + offs, mask=mask, other=0.0)
    tl.store(ptrs, _normed(xf, w, inv_dim, eps, QKV.dtype.element_ty), mask=mask)


def head_rms_norm(
    qkv: torch.Tensor,  # (T, (H + 2 KV) * hd): the fused projection, [q | k | v]; q and k normed in place
    q_weight: torch.Tensor,  # (hd,) in qkv's dtype
    k_weight: torch.Tensor,  # (hd,)
    n_heads: int,
    n_kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """Qwen3's norm of each head of q and k before RoPE (worker.model.qwen3.Qwen3.before_rope) in one launch, in
    place: each head as rms_norm normalises a row. Returns qkv."""
    rows, width = qkv.shape
    head_dim = q_weight.shape[0]
    if width != (n_heads + 2 * n_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not (T, {(n_heads + 2 * n_kv_heads) * head_dim}) contiguous")
    if k_weight.shape != (head_dim,) or q_weight.stride(0) != 1 or k_weight.stride(0) != 1:
        raise ValueError(f"q and k weights must be ({head_dim},) contiguous")
    if rows:
        _head_rms_norm_kernel[(rows, n_heads + n_kv_heads)](
            qkv, q_weight, k_weight, qkv.stride(0), 1.0 / head_dim, eps,
            HEADS=n_heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim), num_warps=1, **STRICT,
            **launch_options(qkv),
        )
    return qkv


# -- RoPE and the K/V cache write -----------------------------------------------------------------


@triton.jit
def _rotate_half(  # type: ignore[no-untyped-def]  # Triton reads the signature
    ptrs, mask, cos1, cos2, sin1, sin2, HALF: tl.constexpr,
):
    """RoPE of heads whose first halves are at `ptrs`: (x1*cos1 - x2*sin1, x2*cos2 + x1*sin2) in fp32."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos1 + (-x2) * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _rope_store_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, Cos, Sin, Q, K, V, Slots, Positions, anchor,
    stride_qkv, stride_cos, stride_sin, stride_slot, stride_pos,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_kb, stride_kt,
    stride_vs, stride_vh, stride_vb, stride_vt,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2
    HEADS_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,  # positions per block of the slot layout (cuda_state.spec)
    PDL: tl.constexpr,
):
    """Grid (T,): token t's q heads -> Q[t]; its k (rotated) and v -> the caches at slot, position.

    QKV[t] is [q heads | k heads | v heads], HEAD_DIM each. K and V point at slot `anchor`, always
    mapped (see rope_and_store); token t writes slot Slots[t], offset from there.
    """
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t * stride_slot).to(tl.int64) - anchor
    pos = tl.load(Positions + t * stride_pos).to(tl.int64)
    k_pos = (pos // BLOCK_T) * stride_kb + (pos % BLOCK_T) * stride_kt  # block, then row within it
    v_pos = (pos // BLOCK_T) * stride_vb + (pos % BLOCK_T) * stride_vt
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos1 = tl.load(Cos + t * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(Cos + t * stride_cos + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(Sin + t * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(Sin + t * stride_sin + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    row = QKV + t * stride_qkv

    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h < HEADS)[:, None] & d_mask[None, :]
    q1, q2 = _rotate_half(row + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask, cos1, cos2, sin1, sin2, HALF)
    q_ptrs = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(q_ptrs, q1.to(Q.dtype.element_ty), mask=mask)
    tl.store(q_ptrs + HALF, q2.to(Q.dtype.element_ty), mask=mask)

    offs_kv = tl.arange(0, KV_PAD)
    mask = (offs_kv < KV_HEADS)[:, None] & d_mask[None, :]
    k_src = row + (HEADS + offs_kv[:, None]) * HEAD_DIM + offs_d[None, :]
    k1, k2 = _rotate_half(k_src, mask, cos1, cos2, sin1, sin2, HALF)
    k_ptrs = K + slot * stride_ks + offs_kv[:, None] * stride_kh + k_pos + offs_d[None, :]
    tl.store(k_ptrs, k1.to(K.dtype.element_ty), mask=mask)
    tl.store(k_ptrs + HALF, k2.to(K.dtype.element_ty), mask=mask)

    offs_dv = tl.arange(0, BLOCK_D)
    mask = (offs_kv < KV_HEADS)[:, None] & (offs_dv < HEAD_DIM)[None, :]
    v = tl.load(row + (HEADS + KV_HEADS + offs_kv[:, None]) * HEAD_DIM + offs_dv[None, :], mask=mask, other=0.0)
    v_ptrs = V + slot * stride_vs + offs_kv[:, None] * stride_vh + v_pos + offs_dv[None, :]
    tl.store(v_ptrs, v.to(V.dtype.element_ty), mask=mask)


def check_slab_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     tokens: int, kv_heads: int | None = None, head_dim: int | None = None) -> tuple[int, int]:
    """The K and V caches a kernel stores `tokens` rows' keys and values in, at slots[t], positions[t]: (slots,
    kv_heads, blocks, block, head_dim) alike with a contiguous head dim (kv_heads and head_dim as given, or the
    caches' own). Their kv_heads and head_dim."""
    heads_named = "kv_heads" if kv_heads is None else kv_heads
    dim_named = "head_dim" if head_dim is None else head_dim
    if k_cache.dim() != 5 or (kv_heads is not None and k_cache.shape[1] != kv_heads) or (
            head_dim is not None and k_cache.shape[4] != head_dim):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} is not (slots, {heads_named}, blocks, block, {dim_named})")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head dimension of k_cache and v_cache must be contiguous")
    if slots.shape != (tokens,) or positions.shape != (tokens,):
        raise ValueError(f"slots {tuple(slots.shape)} and positions {tuple(positions.shape)} must be ({tokens},)")
    return k_cache.shape[1], k_cache.shape[4]


def _check_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> None:
    tokens = qkv.shape[0]
    _check_rows("qkv", qkv, tokens, (heads + 2 * kv_heads) * head_dim)
    _check_rows("cos", cos, tokens, head_dim)
    _check_rows("sin", sin, tokens, head_dim)
    if head_dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {head_dim}")
    check_slab_store(k_cache, v_cache, slots, positions, tokens, kv_heads, head_dim)
    if out.shape != (tokens, heads, head_dim) or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be ({tokens}, {heads}, {head_dim}) with a contiguous last dimension")


def rope_and_store(
    qkv: torch.Tensor,  # (T, (H + 2*KV) * hd): the fused projection, [q | k | v]
    cos: torch.Tensor,  # (T, hd) fp32: the rope table's rows at each token's position
    sin: torch.Tensor,  # (T, hd) fp32
    k_cache: torch.Tensor,  # (num_slots, KV, blocks, block, hd), any strides with a contiguous hd; last slot mapped
    v_cache: torch.Tensor,  # same
    slots: torch.Tensor,  # (T,) int64: the slot each token writes
    positions: torch.Tensor,  # (T,) int64: the position each token writes
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    out: torch.Tensor | None = None,  # (T, H, hd) preallocated q
) -> torch.Tensor:
    """q = rope(q) (T, H, hd); K/V of position p (block p // block, row p % block) of each slot = rope(k), v. One
    launch.

    As worker.model.llama.apply_rope plus the cache write: rotated in fp32, rounded to the cache's dtype.
    """
    tokens = qkv.shape[0]
    out = torch.empty((tokens, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device) if out is None else out
    _check_rope(qkv, cos, sin, k_cache, v_cache, slots, positions, out, n_heads, n_kv_heads, head_dim)
    if tokens == 0:
        return out
    anchor, k_anchor, v_anchor = spare_views(k_cache, v_cache)  # K and V as views of the always mapped spare slot
    _rope_store_kernel[(tokens,)](
        qkv, cos, sin, out, k_anchor, v_anchor, slots, positions, anchor,
        qkv.stride(0), cos.stride(0), sin.stride(0), slots.stride(0), positions.stride(0),
        out.stride(0), out.stride(1),
        *k_cache.stride()[:4], *v_cache.stride()[:4],
        HEADS=n_heads, KV_HEADS=n_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        HEADS_PAD=triton.next_power_of_2(n_heads), KV_PAD=triton.next_power_of_2(n_kv_heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=k_cache.shape[3], num_warps=ROPE_WARPS, **STRICT, **launch_options(qkv),
    )
    return out


# -- SiLU-gated product ---------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    GateUp, Out,
    stride_g, stride_o,
    ffn,
    BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    """Grid (rows, cdiv(ffn, BLOCK)): Out[row] = silu(gate) * up, GateUp[row] = [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ffn
    gate = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + ffn + offs, mask=mask, other=0.0)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)  # expf, as torch's CUDA silu (tl.exp is the approximate ex2 path)
    else:
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(Out.dtype.element_ty)  # F.silu's result, in the dtype
    tl.store(Out + row * stride_o + offs, (act.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


def silu_mul(
    gate_up: torch.Tensor,  # (T, 2 * ffn): [gate | up], as Layer.w_gate_up produces it
    out: torch.Tensor | None = None,  # (T, ffn) preallocated output
) -> torch.Tensor:
    """F.silu(gate) * up in one launch, rounded as torch rounds each of the two ops."""
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even width, got {width}")
    ffn = width // 2
    _check_rows("gate_up", gate_up, rows, width)
    out = torch.empty((rows, ffn), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    _check_rows("out", out, rows, ffn)
    if rows == 0:
        return out
    _silu_mul_kernel[(rows, triton.cdiv(ffn, SILU_BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), ffn,
        BLOCK=SILU_BLOCK, LIBDEVICE_EXP=not _interpreted(), num_warps=SILU_WARPS, **STRICT,
    )
    return out
