"""Logit bias and the penalties on the GPU (worker.engine.penalties): one launch changes a step's penalized rows, one
counts their samples.

A step's penalized rows in torch ops took ~18 launches and, for the count, an accumulating index_put whose host side
alone took ~0.4 ms: on a one-session step of ~3-6 ms that ran ahead of the device, the host fell behind it (H100,
random:llama3-8b, one session: 170.7 -> 140.1 tokens/s). These two launches compute the torch ops' numbers bit for bit
(each operation rounded on its own: no FMA, IEEE division), which the GPU tests check against the CPU's torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.fused import STRICT

BLOCK = 2048  # vocabulary entries a program
WARPS = 4


@triton.jit
def _penalties_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Logits, Out, At, Pool, Bias, Counts, Context, Factors, vocab, stride_logits, stride_out, stride_pool,
    BLOCK: tl.constexpr,
):
    """Grid (penalized rows, cdiv(vocab, BLOCK)): Out[At[i]] = row At[i] of Logits changed by pool row Pool[i]."""
    i = tl.program_id(0)
    at = tl.load(At + i)
    row = tl.load(Pool + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    pooled = row * stride_pool + cols
    x = tl.load(Logits + at * stride_logits + cols, mask=ok, other=0.0)
    x = x + tl.load(Bias + pooled, mask=ok, other=0.0)
    counts = tl.load(Counts + pooled, mask=ok, other=0)
    answered = counts > 0
    seen = (tl.load(Context + pooled, mask=ok, other=0) != 0) | answered
    repetition = tl.load(Factors + row * 3)
    frequency = tl.load(Factors + row * 3 + 1)
    presence = tl.load(Factors + row * 3 + 2)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    x = x - frequency * counts.to(tl.float32)
    x = x - presence * answered.to(tl.float32)
    tl.store(Out + at * stride_out + cols, x, mask=ok)


@triton.jit
def _count_kernel(Ids, At, Pool, Counts, stride_pool):  # type: ignore[no-untyped-def]  # Triton reads the signature
    """Grid (penalized rows,): Counts[Pool[i], Ids[At[i]]] += 1."""
    i = tl.program_id(0)
    token = tl.load(Ids + tl.load(At + i))
    tl.atomic_add(Counts + tl.load(Pool + i) * stride_pool + token, 1)


def apply_penalties(logits: torch.Tensor, at: torch.Tensor, pool: torch.Tensor, bias: torch.Tensor,
                    counts: torch.Tensor, context: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` (R, vocab) float32 with rows `at` changed by the pool's rows `pool` (worker.engine.penalties:
    bias, counts and context (rows, vocab), factors (rows, 3): repetition, frequency, presence)."""
    vocab = logits.shape[1]
    out = logits.clone()
    if at.numel():
        _penalties_kernel[(at.numel(), triton.cdiv(vocab, BLOCK))](
            logits, out, at, pool, bias, counts, context.view(torch.int8), factors, vocab,
            logits.stride(0), out.stride(0), counts.stride(0), BLOCK=BLOCK, num_warps=WARPS, **STRICT)
    return out


def count_samples(counts: torch.Tensor, ids: torch.Tensor, at: torch.Tensor, pool: torch.Tensor) -> None:
    """counts[pool[i], ids[at[i]]] += 1 for each penalized row i (each pool row at most once a step)."""
    if at.numel():
        _count_kernel[(at.numel(),)](ids, at, pool, counts, counts.stride(0), num_warps=1)
