"""The hybrid model's RMSNorms in Triton (worker.model.qwen3_5), one program per row.

- `offset_rms_norm`: Qwen3.5's norm, x * rsqrt(mean(x^2) + eps) * (1 + weight) in fp32, rounded once to x's dtype
  (the pack holds 1 + weight in fp32): the layers' norms, the final norm, and q and k per head.
- `gated_rms_norm`: the DeltaNet output's norm, weight * norm(x) rounded to x's dtype, times silu(gate) in fp32,
  rounded again (transformers' Qwen3_5RMSNormGated).

Torch computes each in ~7 launches; and its reduction may split a row's sum over several blocks when a step has few
rows, so a row's bits would depend on the step's size. Here a row's sum is one program's, over a block whose layout
depends on the row width only: a row comes out the same in every bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.fused import STRICT
from worker.kernels.pdl import launch_options, wait_then_release


@triton.jit
def rms_normed(x, inv_n, eps):  # type: ignore[no-untyped-def]  # Triton reads the signature
    """A row (fp32, masked columns 0) times rsqrt(mean square + eps), in fp32: every norm here starts so (and
    worker.kernels.moe's combine, which norms the rows it writes for the next layer)."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 0) * inv_n + eps))


def norm_warps(n: int) -> int:
    """The warps of a program that norms rows of n: its sum's order depends on them, so every kernel that norms a
    row takes these."""
    return 4 if n >= 1024 else 1


@triton.jit
def _norm_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, W, Gate, Out, stride_x, stride_g, stride_out, n, inv_n, eps,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows,): row r of X normed (see the module docstring)."""
    wait_then_release(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + r * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    normed = rms_normed(x, inv_n, eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    if GATED:
        y = (w * normed.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)  # weight * norm(x), in x's dtype
        z = tl.load(Gate + r * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        y = y * (z / (1.0 + tl.exp(-z)))
    else:
        y = normed * w
    tl.store(Out + r * stride_out + cols, y.to(dtype), mask=ok)


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be (rows, n) with contiguous rows, got {tuple(t.shape)} {t.stride()}")


def offset_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, n), rows any stride: norm(x) * (1 + weight), weight_plus_one (n,) fp32. (rows, n) in x's dtype."""
    _rows(x, "x")
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device) if out is None else out
    if rows:
        _norm_kernel[(rows,)](x, weight_plus_one, x, out, x.stride(0), 0, out.stride(0), n, 1.0 / n, eps,
                              GATED=False, BLOCK=triton.next_power_of_2(n), num_warps=norm_warps(n),
                              **STRICT, **launch_options(x))
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x, gate (rows, n): weight * norm(x) * silu(gate), in x's dtype."""
    _rows(x, "x")
    _rows(gate, "gate")
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device) if out is None else out
    if rows:
        _norm_kernel[(rows,)](x, weight, gate, out, x.stride(0), gate.stride(0), out.stride(0), n, 1.0 / n, eps,
                              GATED=True, BLOCK=triton.next_power_of_2(n), num_warps=norm_warps(n),
                              **STRICT, **launch_options(x))
    return out
