"""Row-invariant matrix products for decode steps, with the norm and the epilogue fused in (Triton).

A decode step of a small model is a chain of tiny launches: at one row each of cuBLAS's products
takes 3-5 us on the H100, and the norm, SiLU and residual kernels beside them ~2 us each, while the
bytes they move would take well under 1 us. `row_matmul` does a product and its neighbours in one launch:

    out = epilogue(scale(x @ w.T))
    norm_squares: rows scaled by rsqrt(mean square + eps) after the product: rms_norm(x) @ w.T, with
                  the norm's weight folded into w (worker.model.llama.Layer), from partial sums of squares
                  of x that the product which wrote x left (squares_out), or row_squares
    SILU:         w = [gate | up]: silu(x @ gate.T) * (x @ up.T)     (the MLP's activation)
    RESIDUAL:     residual + x @ w.T                                 (the residual add after o and down)
    squares_out:  the partial sums of squares of out's rows, per column tile, for the next product

so a decode layer is 6 launches (qkv+norm, rope_and_store, attention, o+add+squares,
gate|up+norm+silu, down+add+squares; 7 when attention splits the keys; 5 when RoPE and the K/V store
ride in the attention's launch, worker.kernels.attention.rope_decode_attention) instead of 9. The norm is
applied after the product because elementwise work on x before tl.dot stops Triton from
prefetching x (measured: qkv with the norm applied to x in the loop 5.0-5.3 us, against 4.2 for the
norm kernel plus cuBLAS, and ~3.1 for this kernel).

Numbers: the product is accumulated in fp32 over K in BLOCK_K chunks, in order (a product split over several
programs, Tiles.split: each part's chunks in order, then the parts' sums in part order); a normed product is
scaled in fp32; then the result is rounded to the model dtype as the library's GEMM returns it, and
silu, the gated product and the residual sum are rounded where worker.model.llama's torch code rounds them
(as worker.kernels.fused does). The torch code rounds the normed x to the dtype before the product and
keeps the norm's weight apart, so the two differ by bf16 rounding (tests: within the tolerances of
bf16 against fp32).

Batch invariance: a program computes BLOCK_M rows x BLOCK_N columns; a row's numbers depend only on
that row (tl.dot's rows are independent; the squares are added tile after tile, unrolled) and on the
tile configuration (its split included), which depends on the weight's shape only, never on the row count, so a
row comes out the same in every bucket.

Capture safety: no host syncs and no allocations besides the outputs (which callers may pass) and a split product's
partial sums; a split product's tickets are made on its stream's first split launch, which must not be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.kernels.fused import STRICT, _interpreted
from worker.kernels.pdl import launch_options, wait_then_release

BLOCK_M = 16  # rows per program unless tiles_for says otherwise (tl.dot's smallest tile)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    # Programs a tile's inner dimension is split over (each a contiguous range of whole BLOCK_K steps); the last of
    # them to finish adds the partial sums in split order and runs the epilogue. 1: no split.
    split: int = 1


TICKETS = 1 << 16  # the split products' tickets (one per tile of rows x columns), zero between launches
_tickets: dict[tuple[str, int], torch.Tensor] = {}  # by device type and stream handle (one set a stream)


def split_tickets(device: torch.device, count: int) -> torch.Tensor:
    """The tickets for split products launched on the current stream of `device` (one set a stream, so that eager
    products on two streams never share one; a CUDA graph keeps the set of the stream it was captured on, so its
    replays must not overlap another user of that set): made (zeros) on the stream's first call, which must come
    before any capture on it (the engine warms up on its capture stream first); every launch leaves the tickets it
    used at zero, and products on one stream run one after another."""
    if count > TICKETS:
        raise ValueError(f"a split product of {count} tiles: more than the {TICKETS} tickets")
    # A stream's handle names its device too, so "cuda" and "cuda:0" find the same set.
    key = (device.type, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    tickets = _tickets.get(key)
    if tickets is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split products' tickets are made outside a CUDA graph capture: run a step first")
        tickets = _tickets[key] = torch.zeros((TICKETS,), dtype=torch.int32, device=device)
    return tickets


def tiles_for(n: int, k: int, silu: bool = False) -> Tiles:
    """The tile configuration of an (n, k) product: a function of the shape only (see the module docstring).

    Narrow column blocks: at a few rows the product is a stream of the weight, and more programs
    keep more of it in flight; a long k takes wider steps. Chosen with `python -m worker.bench.matmul
    --rows 1 64 --sweep` on the H100 for SmolLM2-135M's shapes: the least time summed over 1 and 64
    rows, with the weights streaming from device memory as in a step (qkv 7.02 us, o 6.22,
    gate|up 12.86, down 9.82, against 6.43, 9.82, 14.86 and 14.08 for cuBLAS with the kernels after it).
    """
    if n >= 2048 and k >= 2048:
        # Real-size models (8B: 4096-14336 wide): one program covers 64 rows, so a step of up to 64 rows reads each
        # weight once (with 16-row programs a 64-row step read it four times: 3.6x cuBLAS's time for gate|up at 64
        # rows). Then by the product's shape, from `python -m worker.bench.matmul --model random:llama3-8b --rows 1 64
        # --sweep` on the H100 (time summed over 1 and 64 rows; 1 row, us, against the single 64x32x128 4-stage tile
        # this replaced and cuBLAS): [gate | up] 3 stages (88.4 against 98.8; cuBLAS 81.6), the long inner
        # dimensions (o, down) 256-wide steps (o 14.0 against 15.2, cuBLAS 16.4; down 42.8 against 47.2, cuBLAS
        # 44.3), the wide ones (qkv) 64 columns in 5 stages (21.5 against 22.2, cuBLAS 20.2). A Llama-3-8B decode
        # step: 5.89 ms at one session against 6.74, 6.56 ms at 64 against 7.11.
        # A 2048-wide model (Qwen3.5-35B-A3B: its DeltaNet's in (12352 x 2048) and out (2048 x 4096) products, its
        # attention's q|k|v (9216 x 2048) and o) wants more, narrower programs: by `python -m worker.bench.matmul
        # --model random:qwen3.5-35b-a3b --rows 1 64 --sweep` on the H100, in 20.25 against 19.10 us at one row, out 9.97 against 9.20,
        # q|k|v 19.21 against 15.77 (64 rows: 21.56 / 20.36, 10.05 / 9.80, 19.50 / 16.32).
        if silu:
            return Tiles(block_m=64, block_n=32, block_k=128, warps=4, stages=3)
        if k >= n:
            if n <= 2048:
                return Tiles(block_m=64, block_n=16, block_k=256, warps=4, stages=5)
            return Tiles(block_m=64, block_n=32, block_k=256, warps=4, stages=4)
        if k <= 2048:
            return Tiles(block_m=64, block_n=32, block_k=128, warps=4, stages=3)
        return Tiles(block_m=64, block_n=64, block_k=128, warps=4, stages=5)
    if n < 1024 and k >= 2048 and not silu:
        # A router (Qwen3.5-35B-A3B's 257 x 2048): few columns, long rows, so each tile's inner dimension is split
        # over 4 programs (36 instead of 17 at one row). `python -m worker.bench.matmul --model random:qwen3.5-35b-a3b
        # --rows 1 64 --sweep --block-m 16 64 --block-n 32 --block-k 128 256 --stages 3 --split 1 2 4 8` on the H100:
        # 3.38 us at one row and 4.51 at 64 against 4.42 and 4.46 unsplit (16 x 16 x 512); split 8 gave 3.20 and 4.82.
        # (The 2048-wide out and o products split gained nothing over the tiles above at 64 rows.)
        return Tiles(block_m=16, block_n=32, block_k=256, warps=4, stages=3, split=4)
    if k >= 1024:
        return Tiles(block_m=16, block_n=16, block_k=256, warps=2, stages=3)
    if silu:
        return Tiles(block_m=16, block_n=32, block_k=128, warps=4, stages=3)
    return Tiles(block_m=64, block_n=16, block_k=128, warps=4, stages=3)


@triton.jit
def _row_matmul_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, W, Out, Res, SqIn, SqOut, Partial, Tickets,
    M, N, K,
    stride_xm, stride_wn, stride_om, stride_rm, stride_sq_in, stride_sq_out,
    inv_k, eps,
    SPLIT: tl.constexpr,
    NORMED: tl.constexpr,
    SQ_TILES: tl.constexpr,
    SQUARES_OUT: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N) * SPLIT, cdiv(M, BLOCK_M)). Out[m, n] for the program's rows and columns.

    W is (N, K), or (2N, K) with SILU (gate rows, then up rows). Res and Out may be the same tensor.
    NORMED: X's rows are scaled by rsqrt(sum_t SqIn[t, m] * inv_k + eps) after the product (SqIn: the
    partial sums of squares of X's rows, SQ_TILES of them). SQUARES_OUT: SqOut[tile, m] = the sum of
    squares of this program's BLOCK_N columns of Out's row m (what a NORMED product of Out reads).
    SPLIT > 1: program (tile, part) sums over part's range of K into Partial[part] (SPLIT, M, N or 2N with SILU,
    fp32) and takes a ticket (Tickets[tile], zero before); the last to take one adds the SPLIT partial sums in part
    order (so the result does not depend on which was last), sets the ticket back to zero and runs the epilogue.
    """
    wait_then_release(PDL)
    dtype = X.dtype.element_ty
    rm = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile_n = tl.program_id(0) // SPLIT
    part = tl.program_id(0) % SPLIT
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = X + rm[:, None] * stride_xm
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    if NORMED:  # the rows' rms from the partial sums the producer of X left
        # Added tile after tile, in order: a tl.sum over a loaded block would sum in an order that follows the
        # block's register layout, which the compiler picks from what it knows of the strides (here the row
        # count), and rows would come out differently in different buckets. A loop, not unrolled: an 8B model's
        # 128 tiles unrolled made every normed product's compile take seconds.
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for t in range(SQ_TILES):
            squares += tl.load(SqIn + t * stride_sq_in + rm, mask=row_ok, other=0.0)
        rstd = tl.math.rsqrt(squares * inv_k + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT > 1:
        k_part = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K  # whole steps a part
        k_first = part * k_part
        k_end = tl.minimum(k_first + k_part, K)
    else:
        k_first = 0
        k_end = K
    for k in range(k_first, k_end, BLOCK_K):
        ks = k + rk
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SILU:
            wu = tl.load(w_rows + N * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT > 1:
        width: tl.constexpr = 2 if SILU else 1
        at = Partial + (rm[:, None] * width * N + rn[None, :])
        stride_part = M * width * N
        tl.store(at + part * stride_part, acc, mask=out_mask)
        if SILU:
            tl.store(at + part * stride_part + N, acc_up, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the ticket (which releases them)
        ticket_at = Tickets + tl.program_id(1) * tl.cdiv(N, BLOCK_N) + tile_n
        if tl.atomic_add(ticket_at, 1, sem="acq_rel") != SPLIT - 1:
            return
        acc = tl.load(at, mask=out_mask, other=0.0, cache_modifier=".cg")
        if SILU:
            acc_up = tl.load(at + N, mask=out_mask, other=0.0, cache_modifier=".cg")
        for p in tl.static_range(1, SPLIT):  # in part order
            acc += tl.load(at + p * stride_part, mask=out_mask, other=0.0, cache_modifier=".cg")
            if SILU:
                acc_up += tl.load(at + p * stride_part + N, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(ticket_at, 0)
    if NORMED:  # rms_norm(x) @ w.T = rstd * (x @ w.T) per row; the norm's weight is folded into w
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    y = acc.to(dtype)  # the product in the model dtype, as the library's GEMM returns it
    if SILU:
        gate = y.to(tl.float32)
        if LIBDEVICE_EXP:
            e = libdevice.exp(-gate)  # expf, as torch's CUDA silu
        else:
            e = tl.exp(-gate)
        act = tl.math.div_rn(gate, 1.0 + e).to(dtype)
        y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    if RESIDUAL:
        r = tl.load(Res + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)  # rounded once, as h + y
    if SQUARES_OUT:
        yf = y.to(tl.float32)  # columns past N are 0
        tl.store(SqOut + tile_n * stride_sq_out + rm, tl.sum(yf * yf, 1), mask=row_ok)
    tl.store(Out + rm[:, None] * stride_om + rn[None, :], y.to(Out.dtype.element_ty), mask=out_mask)


def row_matmul(
    x: torch.Tensor,  # (M, K), contiguous last dimension
    weight: torch.Tensor,  # (N, K) contiguous; (2N, K) = [gate | up] with silu
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,  # (M, N) in x's dtype: added last; may be `out`
    out: torch.Tensor | None = None,  # (M, N), x's dtype or float32
    norm_squares: torch.Tensor | None = None,  # (T, M) fp32: x's rows' partial sums of squares; x is normed
    eps: float = 0.0,  # the norm's epsilon, with norm_squares
    squares_out: torch.Tensor | None = None,  # (squares_tiles(N, K), M) fp32: out's, for the next product
    tiles: Tiles | None = None,  # default tiles_for(N, K); benchmarks try others
) -> torch.Tensor:
    """epilogue(prologue(x) @ weight.T) in one launch (see the module docstring).

    With norm_squares the product is rms_norm(x) @ weight.T, the norm's weight folded into `weight`
    (worker.model.llama.Layer): each row is scaled after the product by rsqrt(mean square + eps), from
    the partial sums a producer left with squares_out (or row_squares)."""
    rows, k = x.shape
    width = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be (N, {k}) contiguous, got {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must have a contiguous last dimension")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight ({weight.dtype}) and x ({x.dtype}) must share a dtype")
    if silu and width % 2:
        raise ValueError(f"a [gate | up] weight has an even number of rows, got {width}")
    n = width // 2 if silu else width
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if out.shape != (rows, n) or out.stride(-1) != 1 or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out must be ({rows}, {n}) in {x.dtype} or float32 with a contiguous last dimension")
    if residual is not None and (residual.shape != (rows, n) or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be ({rows}, {n}) in {x.dtype} with a contiguous last dimension")
    if rows and out.data_ptr() == x.data_ptr():
        raise ValueError("out must not be x: other column tiles still read the rows this one writes")
    tiles = tiles or tiles_for(n, k, silu)
    if norm_squares is not None and (norm_squares.dim() != 2 or norm_squares.shape[1] != rows
                                     or norm_squares.dtype != torch.float32 or norm_squares.stride(1) != 1):
        raise ValueError(f"norm_squares must be (T, {rows}) float32 with contiguous rows")
    n_tiles = triton.cdiv(n, tiles.block_n)
    if squares_out is not None and (squares_out.shape != (n_tiles, rows) or squares_out.dtype != torch.float32
                                    or squares_out.stride(1) != 1):
        raise ValueError(f"squares_out must be ({n_tiles}, {rows}) float32 with contiguous rows")
    if rows == 0:
        return out
    res = residual if residual is not None else out  # unused pointers when the flags are off
    sq_in = norm_squares if norm_squares is not None else out
    sq_out = squares_out if squares_out is not None else out
    sq_tiles = norm_squares.shape[0] if norm_squares is not None else 1
    m_tiles = triton.cdiv(rows, tiles.block_m)
    if tiles.split > 1:  # the parts' sums (fp32) and the tiles' tickets
        partial = torch.empty((tiles.split, rows, width), dtype=torch.float32, device=x.device)
        tickets = split_tickets(x.device, n_tiles * m_tiles)
    else:
        partial, tickets = out, out  # unused
    _row_matmul_kernel[(n_tiles * tiles.split, m_tiles)](
        x, weight, out, res, sq_in, sq_out, partial, tickets,
        rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0), res.stride(0), sq_in.stride(0), sq_out.stride(0),
        1.0 / k, eps,
        SPLIT=tiles.split, NORMED=norm_squares is not None, SQ_TILES=sq_tiles,
        SQUARES_OUT=squares_out is not None, SILU=silu, RESIDUAL=residual is not None,
        LIBDEVICE_EXP=not _interpreted(), DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.warps, num_stages=tiles.stages, **STRICT, **launch_options(x),
    )
    return out


def squares_tiles(n: int, k: int, silu: bool = False) -> int:
    """Rows of the squares_out buffer of an (n, k) product: its column tiles."""
    return triton.cdiv(n, tiles_for(n, k, silu).block_n)


@triton.jit
def _row_squares_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, SqOut, M, N, stride_xm, stride_sq,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): SqOut[tile, m] = sum of X[m, tile's columns]^2."""
    wait_then_release(PDL)
    rm = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < M
    xf = tl.load(X + rm[:, None] * stride_xm + rn[None, :], mask=row_ok[:, None] & (rn < N)[None, :], other=0.0)
    xf = xf.to(tl.float32)
    tl.store(SqOut + tl.program_id(0) * stride_sq + rm, tl.sum(xf * xf, 1), mask=row_ok)


def row_squares(x: torch.Tensor, out: torch.Tensor, block_n: int = 16) -> torch.Tensor:
    """The partial sums of squares of x's rows (T, M) fp32 over column tiles of block_n: what squares_out
    leaves, for a first product with norm_squares (the embedding rows have no producer)."""
    rows, n = x.shape
    tiles = triton.cdiv(n, block_n)
    if x.stride(-1) != 1 or out.shape != (tiles, rows) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dimension and out be ({tiles}, {rows}) float32")
    if rows:
        _row_squares_kernel[(tiles, triton.cdiv(rows, BLOCK_M))](
            x, out, rows, n, x.stride(0), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, num_warps=2,
            **launch_options(x))
    return out
