"""The mixture-of-experts block's routed experts in Triton (worker.model.qwen3_5_moe), for decode and prefill steps:
the tokens grouped by expert, each expert's weights read once a step, as vLLM's and SGLang's fused_moe do.

`moe_block(h, x, logits, shared, gate_up, down, top_k)` = h + (routed(x) + sigmoid(gate) * shared), in six launches:

1. `_route_kernel`, a program per token: softmax of its router logits in fp32, the top k by repeated argmax (largest
   first; a tie goes to the lower expert), the k probabilities divided by their sum and rounded to the model dtype
   (transformers' Qwen3_5MoeTopKRouter). Each (token, choice) is a pair, numbered token * k + choice.
2. `_count_kernel`, a program per expert: how many pairs chose it.
3. `_place_kernel`, a program per expert: its pairs' numbers, in pair order, in its own range of `sorted_pairs`,
   which starts at the sum of the experts before it, each count padded up to a multiple of BLOCK_M (the padding holds
   the sentinel tokens * k); the expert of each block of BLOCK_M, and the padded total.
4. `_gate_up_kernel`, a program per block of BLOCK_M sorted pairs (one expert's) and BLOCK_N columns of the expert's
   ffn: x's rows of the block's tokens times the expert's gate and up rows, silu(gate) * up, written at each pair's
   row of `act` (pairs, ffn).
5. `_down_kernel`, the same grid over the model's dim: act's rows times the expert's down rows, times the pair's
   routing weight, written at the pair's row of `pair_out` (pairs, dim).
6. `_combine_kernel`, a program per token and block of columns: its k pair rows summed in choice order in fp32,
   plus sigmoid(its shared-expert gate logit) * the shared expert's output, plus h.

Numbers: products accumulate in fp32 over the inner dimension in BLOCK_K steps, in order, and are rounded to the
model dtype as a GEMM returns them; silu, the gated product, the weighting, the sum over the choices, the shared gate
and the residual add are rounded where transformers' torch code rounds them (the sum over the choices once, from
fp32, as torch's bf16 sum).

Batch invariance: a pair's numbers depend on its own token's row, its expert and the tile configuration only (the
rows of a tl.dot are independent; a block holds one expert's pairs, in any number); the tiles are fixed per kind of
step (DECODE_TILES, PREFILL_TILES), never chosen from the row count. So a session's results do not depend on which
other sessions share the step, nor on where its pairs land in the sorted order.

Capture safety: no host syncs, no shapes from data. The grids are sized by the worst case: at most
tokens * k + min(experts, tokens * k) * (BLOCK_M - 1) sorted rows (every expert chosen pads at most BLOCK_M - 1), and
programs past the padded total return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.kernels.fused import STRICT, _interpreted
from worker.kernels.pdl import launch_options, wait_then_release

SCAN_BLOCK = 1024  # pairs per step of the count and place scans


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # sorted pairs per program (one expert's)
    block_n: int  # output columns per program
    block_k: int  # inner dimension per step
    warps: int
    stages: int


# Decode steps: at a few pairs per expert, narrow blocks of rows and columns keep many programs streaming the experts'
# weights. Prefill steps: tens of pairs per expert, so wider blocks of rows read each expert's weights fewer times.
DECODE_TILES = MoeTiles(block_m=16, block_n=32, block_k=128, warps=4, stages=3)
PREFILL_TILES = MoeTiles(block_m=64, block_n=64, block_k=64, warps=4, stages=3)


@triton.jit
def _route_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Logits, Ids, Weights, stride_l, n_experts,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tokens,): Ids[t, j] (int32) and Weights[t, j] (fp32 holding model-dtype values) of token t's choices."""
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
    for j in tl.static_range(TOP_K):  # kept in registers: nothing is read back from memory within the program
        best = tl.argmax(probs, 0, tie_break_left=True)
        top = tl.max(probs, 0)
        ids = tl.where(choice == j, best.to(tl.int32), ids)
        tops = tl.where(choice == j, top, tops)
        total += top  # in choice order
        probs = tl.where(cols == best, -1.0, probs)
    dtype = Logits.dtype.element_ty
    mine = choice < TOP_K
    tl.store(Ids + t * TOP_K + choice, ids, mask=mine)
    tl.store(Weights + t * TOP_K + choice, (tops / total).to(dtype).to(tl.float32), mask=mine)


@triton.jit
def _count_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Ids, Counts, n_pairs,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (experts,): Counts[e] = the pairs that chose expert e."""
    wait_then_release(PDL)
    e = tl.program_id(0)
    count = 0
    for start in range(0, n_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(Ids + offs, mask=offs < n_pairs, other=-1)
        count += tl.sum((ids == e).to(tl.int32), 0)
    tl.store(Counts + e, count)


@triton.jit
def _place_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Ids, Counts, Sorted, BlockExpert, Total, n_pairs, n_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (experts,): expert e's pairs in its range of Sorted (padded with the sentinel n_pairs), its blocks' entries
    of BlockExpert; program 0 writes the padded total."""
    wait_then_release(PDL)
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(Counts + experts, mask=experts < n_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0), 0)
    count = tl.sum(tl.where(experts == e, counts, 0), 0)
    mine = tl.sum(tl.where(experts == e, padded, 0), 0)
    if e == 0:
        tl.store(Total, tl.sum(padded, 0))
    placed = 0
    for base in range(0, n_pairs, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        hit = (tl.load(Ids + offs, mask=offs < n_pairs, other=-1) == e).to(tl.int32)
        rank = placed + tl.cumsum(hit, 0) - 1
        tl.store(Sorted + start + rank, offs.to(tl.int32), mask=hit == 1)
        placed += tl.sum(hit, 0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(Sorted + start + count + pad, n_pairs, mask=count + pad < mine)
    for b in range(0, mine // BLOCK_M):
        tl.store(BlockExpert + start // BLOCK_M + b, e)


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
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (max blocks of sorted pairs, cdiv(N, BLOCK_N)). GATED (gate|up): Out[pair, n] = silu(g) * u with
    g | u = X[token] @ W[e, n | N + n].T, X the tokens' rows (pair // TOP_K). Else (down): Out[pair, n] =
    (X[pair] @ W[e, n].T) * Weights[pair], X the pairs' rows."""
    wait_then_release(PDL)
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(Total):
        return
    expert = tl.load(BlockExpert + block).to(tl.int64)
    pairs = tl.load(Sorted + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < n_pairs
    if GATED:
        rows = pairs // TOP_K
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
    H, PairOut, Logits, Shared, Out,
    n, gate_col, stride_h, stride_p, stride_l, stride_s, stride_o,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tokens, cdiv(n, BLOCK)): Out[t] = H[t] + (sum_j PairOut[t * TOP_K + j] + sigmoid(gate) * Shared[t]), the
    gate being Logits[t, gate_col]."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = Out.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # in choice order
        acc += tl.load(PairOut + (t * TOP_K + j) * stride_p + cols, mask=ok, other=0.0).to(tl.float32)
    routed = acc.to(dtype).to(tl.float32)
    g = tl.load(Logits + t * stride_l + gate_col).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    shared = (gate * tl.load(Shared + t * stride_s + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
    moe = (routed + shared.to(tl.float32)).to(dtype).to(tl.float32)
    h = tl.load(H + t * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + cols, (h + moe).to(dtype), mask=ok)


def max_blocks(tokens: int, experts: int, top_k: int, block_m: int) -> int:
    """The most blocks of sorted pairs a step of `tokens` rows can need (the worst case: every chosen expert padded)."""
    pairs = tokens * top_k
    return triton.cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m)


@dataclass
class Routing:
    """One step's pairs grouped by expert (what route_and_sort leaves on the device)."""

    ids: torch.Tensor  # (tokens, k) int32: each token's experts, largest probability first
    weights: torch.Tensor  # (tokens, k) fp32: their weights (model-dtype values)
    sorted_pairs: torch.Tensor  # (max_blocks * block_m,) int32: pair numbers by expert, padded with tokens * k
    block_expert: torch.Tensor  # (max_blocks,) int32: each block's expert (blocks past total: unread)
    total: torch.Tensor  # (1,) int32: the padded count of sorted pairs


def route_and_sort(logits: torch.Tensor, experts: int, top_k: int, tiles: MoeTiles) -> Routing:
    """logits (tokens, >= experts), its first `experts` columns the router's: each token's top k and the pairs
    grouped by expert."""
    tokens = logits.shape[0]
    device = logits.device
    pairs = tokens * top_k
    blocks = max_blocks(tokens, experts, top_k, tiles.block_m)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    counts = torch.empty((experts,), dtype=torch.int32, device=device)
    sorted_pairs = torch.empty((blocks * tiles.block_m,), dtype=torch.int32, device=device)
    block_expert = torch.empty((blocks,), dtype=torch.int32, device=device)
    total = torch.empty((1,), dtype=torch.int32, device=device)
    opts = launch_options(logits)
    block_e = triton.next_power_of_2(experts)
    _route_kernel[(tokens,)](logits, ids, weights, logits.stride(0), experts, TOP_K=top_k, BLOCK_E=block_e,
                             BLOCK_K=triton.next_power_of_2(top_k), num_warps=4 if experts >= 256 else 1, **STRICT,
                             **opts)
    _count_kernel[(experts,)](ids, counts, pairs, BLOCK=SCAN_BLOCK, num_warps=4, **opts)
    _place_kernel[(experts,)](ids, counts, sorted_pairs, block_expert, total, pairs, experts, BLOCK_M=tiles.block_m,
                              BLOCK_E=block_e, BLOCK=SCAN_BLOCK, num_warps=4, **opts)
    return Routing(ids, weights, sorted_pairs, block_expert, total)


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: Routing,
                    tiles: MoeTiles) -> torch.Tensor:
    """Each pair's weighted expert output (tokens * k, dim) in x's dtype: gate_up (experts, 2 * ffn, dim), down
    (experts, dim, ffn), both contiguous."""
    tokens, dim = x.shape
    experts, ffn = down.shape[0], down.shape[2]
    top_k = routing.ids.shape[1]
    pairs = tokens * top_k
    if gate_up.shape != (experts, 2 * ffn, dim) or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError(f"gate_up must be ({experts}, {2 * ffn}, {dim}) and down ({experts}, {dim}, {ffn}), contiguous")
    if x.stride(1) != 1 or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError("x must have contiguous rows and share the weights' dtype")
    act = torch.empty((pairs, ffn), dtype=x.dtype, device=x.device)
    out = torch.empty((pairs, dim), dtype=x.dtype, device=x.device)
    blocks = routing.block_expert.shape[0]
    common = dict(LIBDEVICE_EXP=not _interpreted(), DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps,
                  num_stages=tiles.stages, **STRICT, **launch_options(x))
    _expert_kernel[(blocks, triton.cdiv(ffn, tiles.block_n))](
        x, gate_up, act, routing.sorted_pairs, routing.block_expert, routing.total, routing.weights,
        pairs, ffn, dim, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=top_k, GATED=True, **common)
    _expert_kernel[(blocks, triton.cdiv(dim, tiles.block_n))](
        act, down, out, routing.sorted_pairs, routing.block_expert, routing.total, routing.weights,
        pairs, dim, ffn, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        TOP_K=top_k, GATED=False, **common)
    return out


COMBINE_BLOCK = 512


def moe_block(h: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, shared: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, top_k: int, prefill: bool = False) -> torch.Tensor:
    """h + the mixture of experts' output for the normed rows x (tokens, dim): `logits` (tokens, experts + 1) the
    router's then the shared expert's gate logit, `shared` (tokens, dim) the shared expert's output; the routed
    experts' weights gate_up (experts, 2 * ffn, dim) and down (experts, dim, ffn). `prefill`: the prefill steps'
    tiles (else the decode steps'). A new (tokens, dim) tensor in h's dtype."""
    tokens, dim = x.shape
    experts = gate_up.shape[0]
    if logits.shape != (tokens, experts + 1) or logits.stride(1) != 1:
        raise ValueError(f"logits must be ({tokens}, {experts + 1}) with contiguous rows")
    for name, t in (("h", h), ("shared", shared)):
        if t.shape != (tokens, dim) or t.stride(1) != 1 or t.dtype != x.dtype:
            raise ValueError(f"{name} must be ({tokens}, {dim}) in {x.dtype} with contiguous rows")
    out = torch.empty_like(h)
    if tokens == 0:
        return out
    tiles = PREFILL_TILES if prefill else DECODE_TILES
    routing = route_and_sort(logits, experts, top_k, tiles)
    pair_out = experts_forward(x, gate_up, down, routing, tiles)
    _combine_kernel[(tokens, triton.cdiv(dim, COMBINE_BLOCK))](
        h, pair_out, logits, shared, out, dim, experts, h.stride(0), pair_out.stride(0), logits.stride(0),
        shared.stride(0), out.stride(0), TOP_K=top_k, BLOCK=COMBINE_BLOCK, num_warps=4, **STRICT,
        **launch_options(h))
    return out
