"""The mixture-of-experts block's routed experts in Triton (worker.model.qwen3_5_moe), for decode and prefill steps:
the tokens grouped by expert, each expert's weights read once a step, as vLLM's and SGLang's fused_moe do.

`moe_block(h, x, logits, gate_up, down, top_k, scratch)` = h + (routed(x) + sigmoid(gate) * shared(x)), in four
launches:

1. `_route_kernel`, a program per token: softmax of its router logits in fp32, the top k by repeated argmax (largest
   first; a tie goes to the lower expert), the k probabilities divided by their sum and rounded to the model dtype
   (transformers' Qwen3_5MoeTopKRouter). Each (token, choice) is a pair, numbered token * pairs + choice. When the
   shared expert has the routed experts' width it is the last expert of `gate_up` and `down` and every token's last
   pair, weighted 1 (so the shared expert's MLP runs in the same two launches as the routed ones). Each pair takes
   its rank among its expert's pairs from an atomic count; the program that finishes last (an atomic ticket) places
   every pair: each expert's range of `sorted_pairs` starts at the sum of the experts before it, each count padded up
   to a multiple of BLOCK_M (the padding holds the sentinel, the pair count), a pair sits at its range's start plus
   its rank; it records each block's expert and the padded total, and sets the counts and the ticket back to zero
   for the next step (`scratch`, which the caller keeps: make it with `moe_scratch`). A step of one token (a single
   session's decode) places its pairs in the same layout from registers: each chosen expert's range is one block,
   in expert order; no atomics, no second round of reads.
2. `_expert_kernel` (gate|up), a program per block of BLOCK_M sorted pairs (one expert's) and BLOCK_N columns of the
   expert's ffn: x's rows of the block's tokens times the expert's gate and up rows, silu(gate) * up, written at each
   pair's row of `act` (pairs, ffn).
3. `_expert_kernel` (down), the same grid over the model's dim: act's rows times the expert's down rows, times the
   pair's routing weight, written at the pair's row of `pair_out` (pairs, dim).
4. `_combine_kernel`, a program per token and block of columns: its k routed pair rows summed in choice order in
   fp32, plus sigmoid(its shared-expert gate logit) * the shared expert's output (its last pair row, or the `shared`
   a caller computed apart when the widths differ), plus h. Given the next norm's weight (the next layer's input
   norm, or the final norm), a program takes the whole row and also writes it normed, so that the norm needs no
   launch of its own.

Numbers: products accumulate in fp32 over the inner dimension in BLOCK_K steps, in order, and are rounded to the
model dtype as a GEMM returns them; silu, the gated product, the weighting, the sum over the choices, the shared gate
and the residual add are rounded where transformers' torch code rounds them (the sum over the choices once, from
fp32, as torch's bf16 sum; the shared expert's weight 1 leaves its output's bits as they are).

Batch invariance: a pair's numbers depend on its own token's row, its expert and the tile configuration only (the
rows of a tl.dot are independent; a block holds one expert's pairs, in any number and any order); the tiles are fixed
per kind of step (DECODE_TILES, PREFILL_TILES), never chosen from the row count. So a session's results do not depend
on which other sessions share the step, nor on where its pairs land in the sorted order (which, the ranks coming from
atomics, may differ from one run to the next).

Capture safety: no host syncs, no shapes from data. The grids are sized by the worst case: at most
pairs + min(experts, pairs) * (BLOCK_M - 1) sorted rows (every expert chosen pads at most BLOCK_M - 1), and
programs past the padded total return before they read any weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.kernels.fused import STRICT, _interpreted
from worker.kernels.norms import norm_warps, rms_normed
from worker.kernels.pdl import launch_options, wait_then_release

PLACE_BLOCK = 1024  # pairs per step of the last route program's placing


@dataclass(frozen=True)
class ExpertTiles:
    """One expert kernel's (gate|up's or down's) columns and inner dimension per program."""

    block_n: int  # output columns per program
    block_k: int  # inner dimension per step
    warps: int
    stages: int


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # sorted pairs per program (one expert's); each expert's pairs are padded to a multiple of it
    gate_up: ExpertTiles
    down: ExpertTiles
    route_warps: int = 4  # the route kernel's (its softmax sums in an order that depends on them)


# Decode steps: at a few pairs per expert, narrow blocks of rows and columns keep many programs streaming the experts'
# weights. Prefill steps: tens of pairs per expert, so wider blocks of rows read each expert's weights fewer times.
# `python -m worker.bench.moe --sweep` on the H100 at the published shape: no configuration of its grid is more than
# 2-3% faster at 1, 16 or 64 decode tokens, or at 128 or 2,048 prompt tokens (16 or 64 tokens: 2.8-2.9 TB/s).
DECODE_TILES = MoeTiles(block_m=16, gate_up=ExpertTiles(32, 128, 4, 3), down=ExpertTiles(32, 128, 4, 3))
PREFILL_TILES = MoeTiles(block_m=64, gate_up=ExpertTiles(64, 64, 4, 3), down=ExpertTiles(64, 64, 4, 3))


@triton.jit
def _route_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Logits, Ids, Weights, Ranks, Scratch, Sorted, BlockExpert, Total,
    stride_l, n_tokens, n_experts,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SINGLE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tokens,): token t's pairs (Ids, Weights: fp32 holding model-dtype values, Ranks among its experts'
    pairs); the last program to finish places every pair (see the module docstring). Scratch (int32): the experts'
    counts, their ranges' starts, the ticket. SINGLE (one token, one program): the program places its own pairs
    from registers, as the last program would (no atomics, no scratch, Ranks not written)."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < n_experts
    logits = tl.load(Logits + t * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, 0))
    probs = e / tl.sum(e, 0)
    probs = tl.where(ok, probs, -1.0)
    choice = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    tops = tl.zeros((BLOCK_K,), dtype=tl.float32)
    total = 0.0
    # Each expert's probability and number in one int64 whose order is theirs: the probability's bits above (a
    # non-negative float orders as its bits do; the -1 of the experts past the last is below them all), then
    # BLOCK_E - 1 - its number, so that of equal probabilities the lower expert is the larger key. One reduction a
    # choice (a max) instead of two (argmax, then max).
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)
    for j in tl.static_range(TOP_K):  # kept in registers: nothing is read back from memory within the program
        key = tl.max(keys, 0)
        best = (BLOCK_E - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
        top = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        ids = tl.where(choice == j, best, ids)
        tops = tl.where(choice == j, top, tops)
        total += top  # in choice order
        keys = tl.where(cols == best, -1, keys)
    dtype = Logits.dtype.element_ty
    weights = (tops / total).to(dtype).to(tl.float32)
    PAIRS: tl.constexpr = TOP_K + SHARED
    if SHARED:  # the shared expert: the last expert, every token's last pair, weight 1
        ids = tl.where(choice == TOP_K, n_experts, ids)
        weights = tl.where(choice == TOP_K, 1.0, weights)
    mine = choice < PAIRS
    tl.store(Ids + t * PAIRS + choice, ids, mask=mine)
    tl.store(Weights + t * PAIRS + choice, weights, mask=mine)
    if SINGLE:  # each chosen expert's range is one block: its start is BLOCK_M x the chosen experts below it
        below = tl.sum(((ids[None, :] < ids[:, None]) & mine[None, :]).to(tl.int32), 1)
        slot = tl.arange(0, BLOCK_M)
        sorted_at = Sorted + below[:, None] * BLOCK_M + slot[None, :]
        tl.store(sorted_at, tl.where(slot[None, :] == 0, choice[:, None], PAIRS), mask=mine[:, None])
        tl.store(BlockExpert + below, ids, mask=mine)
        tl.store(Total, PAIRS * BLOCK_M)
        return
    experts_all = n_experts + SHARED
    counts_at = Scratch
    starts_at = Scratch + experts_all
    ticket_at = Scratch + 2 * experts_all
    ranks = tl.atomic_add(counts_at + ids, 1, mask=mine, sem="relaxed")
    tl.store(Ranks + t * PAIRS + choice, ranks, mask=mine)
    if tl.atomic_add(ticket_at, 1, sem="acq_rel") == n_tokens - 1:  # every other token's pairs are counted
        n_pairs = n_tokens * PAIRS
        experts = tl.arange(0, BLOCK_E)
        real = experts < experts_all
        counts = tl.load(counts_at + experts, mask=real, other=0, cache_modifier=".cg")
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = tl.cumsum(padded, 0) - padded
        tl.store(Total, tl.sum(padded, 0))
        tl.store(starts_at + experts, starts, mask=real)
        for pad in range(BLOCK_M - 1):  # each expert's padding: the sentinel
            tl.store(Sorted + starts + counts + pad, n_pairs, mask=real & (counts + pad < padded))
        tl.store(counts_at + experts, 0, mask=real)  # for the next step
        tl.store(ticket_at, 0)
        tl.debug_barrier()  # the starts, stored by other threads of this program, before they are read
        for base in range(0, n_pairs, BLOCK_P):
            offs = base + tl.arange(0, BLOCK_P)
            valid = offs < n_pairs
            expert = tl.load(Ids + offs, mask=valid, other=0, cache_modifier=".cg")
            at = tl.load(starts_at + expert, mask=valid, other=0) + tl.load(Ranks + offs, mask=valid, other=0,
                                                                             cache_modifier=".cg")
            tl.store(Sorted + at, offs.to(tl.int32), mask=valid)
            tl.store(BlockExpert + at // BLOCK_M, expert, mask=valid)  # every block holds a pair of its expert


@triton.jit
def _silu(x, LIBDEVICE_EXP: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
    """silu of fp32 x as torch computes it (x / (1 + expf(-x)), correctly rounded division)."""
    if LIBDEVICE_EXP:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@triton.jit
def _expert_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, W, Out, Sorted, BlockExpert, Total, Weights,
    n_pairs, N, K, stride_x, stride_we, stride_wn, stride_o,
    PAIRS: tl.constexpr,
    GATED: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (max blocks of sorted pairs, cdiv(N, BLOCK_N)). GATED (gate|up): Out[pair, n] = silu(g) * u with
    g | u = X[token] @ W[e, n | N + n].T, X the tokens' rows (pair // PAIRS). Else (down): Out[pair, n] =
    (X[pair] @ W[e, n].T) * Weights[pair], X the pairs' rows."""
    wait_then_release(PDL)
    block = tl.program_id(0)
    # The three reads at once (a block past the total reads what an earlier step left, and returns unused), so
    # that the weights' address is known one round trip after the wait instead of two.
    total = tl.load(Total)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    pairs = tl.load(Sorted + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if block * BLOCK_M >= total:
        return
    valid = pairs < n_pairs
    if GATED:
        rows = pairs // PAIRS
    else:
        rows = pairs
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None] * stride_x
    w_rows = W + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + rk
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            wu = tl.load(w_rows + N * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)
    dtype = Out.dtype.element_ty
    y = acc.to(dtype)  # the product in the model dtype, as a GEMM returns it
    if GATED:
        act = _silu(y.to(tl.float32), LIBDEVICE_EXP).to(dtype)
        y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        weight = tl.load(Weights + pairs, mask=valid, other=0.0)
        y = (y.to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(Out + pairs[:, None] * stride_o + rn[None, :], y, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    H, PairOut, Logits, Shared, Out, NormW, Normed,
    n, gate_col, stride_h, stride_p, stride_l, stride_s, stride_o, stride_normed, inv_n, eps,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tokens, cdiv(n, BLOCK)): Out[t] = H[t] + (sum_j<TOP_K PairOut[t * PAIRS + j] + sigmoid(gate) * shared),
    the gate being Logits[t, gate_col] and shared the token's last pair row (SHARED: PAIRS = TOP_K + 1) or Shared[t]
    (PAIRS = TOP_K). NORM (BLOCK >= n: the whole row in one program): also Normed[t] = Out[t] normed and times NormW
    (1 + weight, fp32), as worker.kernels.norms.offset_rms_norm computes it."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = Out.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    PAIRS: tl.constexpr = TOP_K + SHARED
    for j in tl.static_range(TOP_K):  # in choice order
        acc += tl.load(PairOut + (t * PAIRS + j) * stride_p + cols, mask=ok, other=0.0).to(tl.float32)
    routed = acc.to(dtype).to(tl.float32)
    g = tl.load(Logits + t * stride_l + gate_col).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    if SHARED:
        expert = tl.load(PairOut + (t * PAIRS + TOP_K) * stride_p + cols, mask=ok, other=0.0)
    else:
        expert = tl.load(Shared + t * stride_s + cols, mask=ok, other=0.0)
    shared = (gate * expert.to(tl.float32)).to(dtype)
    moe = (routed + shared.to(tl.float32)).to(dtype).to(tl.float32)
    h = tl.load(H + t * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    new = (h + moe).to(dtype)
    tl.store(Out + t * stride_o + cols, new, mask=ok)
    if NORM:  # the next layer's input norm (or the final norm) of the row just written
        w = tl.load(NormW + cols, mask=ok, other=0.0)
        y = rms_normed(tl.where(ok, new.to(tl.float32), 0.0), inv_n, eps) * w
        tl.store(Normed + t * stride_normed + cols, y.to(dtype), mask=ok)


def max_blocks(tokens: int, experts: int, pairs_per_token: int, block_m: int) -> int:
    """The most blocks of sorted pairs a step of `tokens` rows can need (the worst case: every chosen expert padded)."""
    pairs = tokens * pairs_per_token
    return triton.cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m)


def moe_scratch(experts: int, device: torch.device) -> torch.Tensor:
    """What the routing keeps between steps for a block of `experts` experts (the shared one included when it is one
    of them): the counts, the ranges' starts and the ticket, zero between steps (int32). One per caller and stream:
    two blocks must not run at once on one scratch."""
    return torch.zeros((2 * experts + 1,), dtype=torch.int32, device=device)


@dataclass
class Routing:
    """One step's pairs grouped by expert (what route_and_sort leaves on the device)."""

    ids: torch.Tensor  # (tokens, pairs) int32: each token's experts, largest probability first (then the shared one)
    weights: torch.Tensor  # (tokens, pairs) fp32: their weights (model-dtype values; 1 for the shared expert)
    sorted_pairs: torch.Tensor  # (max_blocks * block_m,) int32: pair numbers by expert, padded with tokens * pairs
    block_expert: torch.Tensor  # (max_blocks,) int32: each block's expert (blocks past total: read, then unused)
    total: torch.Tensor  # (1,) int32: the padded count of sorted pairs


def route_and_sort(logits: torch.Tensor, experts: int, top_k: int, tiles: MoeTiles, scratch: torch.Tensor,
                   shared: bool = False) -> Routing:
    """logits (tokens, >= experts), its first `experts` columns the router's: each token's top k (and, with `shared`,
    the shared expert, numbered `experts`, as its last pair) and the pairs grouped by expert."""
    tokens = logits.shape[0]
    if not 0 < top_k <= experts:  # a choice past the last expert would name no expert
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    device = logits.device
    pairs_per_token = top_k + int(shared)
    experts_all = experts + int(shared)
    if scratch.shape != (2 * experts_all + 1,) or scratch.dtype != torch.int32 or scratch.device != device:
        raise ValueError(f"scratch must be moe_scratch({experts_all}) on {device}")
    blocks = max_blocks(tokens, experts_all, pairs_per_token, tiles.block_m)
    ids = torch.empty((tokens, pairs_per_token), dtype=torch.int32, device=device)
    weights = torch.empty((tokens, pairs_per_token), dtype=torch.float32, device=device)
    ranks = torch.empty((tokens, pairs_per_token), dtype=torch.int32, device=device)
    sorted_pairs = torch.empty((blocks * tiles.block_m,), dtype=torch.int32, device=device)
    block_expert = torch.empty((blocks,), dtype=torch.int32, device=device)
    total = torch.empty((1,), dtype=torch.int32, device=device)
    if tokens:
        _route_kernel[(tokens,)](logits, ids, weights, ranks, scratch, sorted_pairs, block_expert, total,
                                 logits.stride(0), tokens, experts, TOP_K=top_k, SHARED=int(shared),
                                 BLOCK_E=triton.next_power_of_2(experts_all),
                                 BLOCK_K=triton.next_power_of_2(pairs_per_token), BLOCK_M=tiles.block_m,
                                 BLOCK_P=PLACE_BLOCK, SINGLE=tokens == 1, num_warps=tiles.route_warps, **STRICT,
                                 **launch_options(logits))
    return Routing(ids, weights, sorted_pairs, block_expert, total)


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: Routing,
                    tiles: MoeTiles) -> torch.Tensor:
    """Each pair's weighted expert output (tokens * pairs, dim) in x's dtype: gate_up (experts, 2 * ffn, dim), down
    (experts, dim, ffn), both contiguous."""
    tokens, dim = x.shape
    experts, ffn = down.shape[0], down.shape[2]
    pairs_per_token = routing.ids.shape[1]
    pairs = tokens * pairs_per_token
    if gate_up.shape != (experts, 2 * ffn, dim) or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError(f"gate_up must be ({experts}, {2 * ffn}, {dim}) and down ({experts}, {dim}, {ffn}), contiguous")
    if x.stride(1) != 1 or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError("x must have contiguous rows and share the weights' dtype")
    act = torch.empty((pairs, ffn), dtype=x.dtype, device=x.device)
    out = torch.empty((pairs, dim), dtype=x.dtype, device=x.device)
    blocks = routing.block_expert.shape[0]
    common = dict(LIBDEVICE_EXP=not _interpreted(), DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  BLOCK_M=tiles.block_m, **STRICT, **launch_options(x))
    gu, dn = tiles.gate_up, tiles.down
    _expert_kernel[(blocks, triton.cdiv(ffn, gu.block_n))](
        x, gate_up, act, routing.sorted_pairs, routing.block_expert, routing.total, routing.weights,
        pairs, ffn, dim, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        PAIRS=pairs_per_token, GATED=True, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, num_warps=gu.warps,
        num_stages=gu.stages, **common)
    _expert_kernel[(blocks, triton.cdiv(dim, dn.block_n))](
        act, down, out, routing.sorted_pairs, routing.block_expert, routing.total, routing.weights,
        pairs, dim, ffn, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        PAIRS=pairs_per_token, GATED=False, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.warps,
        num_stages=dn.stages, **common)
    return out


COMBINE_BLOCK = 512


def moe_block(h: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              top_k: int, scratch: torch.Tensor, shared: torch.Tensor | None = None,
              prefill: bool = False, tiles: MoeTiles | None = None, norm: torch.Tensor | None = None,
              eps: float = 0.0, normed: torch.Tensor | None = None) -> torch.Tensor:
    """h + the mixture of experts' output for the normed rows x (tokens, dim): `logits` (tokens, experts + 1) the
    router's then the shared expert's gate logit; the experts' weights gate_up (n, 2 * ffn, dim) and down
    (n, dim, ffn), where n = experts + 1 holds the shared expert last, or n = experts and `shared` (tokens, dim) is
    the shared expert's output computed apart. `scratch`: moe_scratch(n). `prefill`: the prefill steps' tiles (else
    the decode steps'; `tiles` overrides them, for benchmarks). A new (tokens, dim) tensor in h's dtype. With `norm`
    (dim,) fp32 (1 + weight) and `normed` (tokens, dim) in h's dtype, the last launch also writes the output normed
    into `normed` (offset_rms_norm(out, norm, eps): the next layer's input norm, in the same launch)."""
    tokens, dim = x.shape
    experts = logits.shape[1] - 1
    in_experts = shared is None
    if gate_up.shape[0] != experts + int(in_experts):
        raise ValueError(f"{gate_up.shape[0]} experts' weights for {experts} routed experts "
                         f"{'and the shared one' if in_experts else '(the shared output given apart)'}")
    if logits.stride(1) != 1 or logits.shape[0] != tokens:
        raise ValueError(f"logits must be ({tokens}, {experts + 1}) with contiguous rows")
    if (norm is None) != (normed is None):
        raise ValueError("norm and normed go together")
    if norm is not None and (norm.shape != (dim,) or norm.dtype != torch.float32):
        raise ValueError(f"norm must be ({dim},) fp32")
    for name, t in (("h", h), ("shared", shared), ("normed", normed)):
        if t is not None and (t.shape != (tokens, dim) or t.stride(1) != 1 or t.dtype != x.dtype):
            raise ValueError(f"{name} must be ({tokens}, {dim}) in {x.dtype} with contiguous rows")
    out = torch.empty_like(h)
    if tokens == 0:
        return out
    tiles = tiles or (PREFILL_TILES if prefill else DECODE_TILES)
    routing = route_and_sort(logits, experts, top_k, tiles, scratch, shared=in_experts)
    pair_out = experts_forward(x, gate_up, down, routing, tiles)
    shared_rows = pair_out if shared is None else shared
    # With the norm, a program takes a whole row (its sum of squares), in the norm kernel's warps (the sum's order).
    block, warps = (triton.next_power_of_2(dim), norm_warps(dim)) if norm is not None else (COMBINE_BLOCK, 4)
    _combine_kernel[(tokens, triton.cdiv(dim, block))](
        h, pair_out, logits, shared_rows, out, norm if norm is not None else h, normed if normed is not None else out,
        dim, experts, h.stride(0), pair_out.stride(0), logits.stride(0), shared_rows.stride(0), out.stride(0),
        normed.stride(0) if normed is not None else 0, 1.0 / dim, eps, TOP_K=top_k, SHARED=int(in_experts),
        NORM=norm is not None, BLOCK=block, num_warps=warps, **STRICT, **launch_options(h))
    return out
