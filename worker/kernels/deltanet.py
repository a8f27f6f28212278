"""Gated DeltaNet in Triton (Qwen3.5's linear-attention layers): the causal convolution and the gated delta rule,
reading and writing each session's state in its slot.

A step's rows are tokens; row r belongs to the session in slot `slots[r]` at position `positions[r]`, and a
session's rows in a step are consecutive with consecutive positions (a run). A run from position 0 starts from
zero state whatever its slot holds; any other run continues from the state its slot holds and leaves the state
after its last token. No kernel here needs the runs from the host: decode steps have one row per session, and prefill
steps pass the prompt attention's tiles (worker.kernels.tiles: up to 64 consecutive rows of one chunk, cut from the
chunk's first row), whose boundaries are the gated delta rule's 64-token blocks. So every launch has a grid fixed by
the step's shape and reads its work from static inputs: it is captured once in a CUDA graph.

- `conv_decode`: one token per row: y = silu(w . [held inputs, x]), and the held inputs move by one.
- `conv_prefill`: a prompt chunk's rows: each row's window takes the rows before it in its run and, before the run,
  the inputs its slot holds (zeros before position 0); then the last row of each run writes the held inputs
  (a second launch: every row's window must read the slot's inputs before any is replaced).
- `delta_decode`: one token per row, per (value head, block of value dims): the recurrent update, as transformers'
  torch_recurrent_gated_delta_rule and flash-linear-attention's fused_recurrent kernel compute it.
- `delta_prefill`: the chunked form of transformers' torch_chunk_gated_delta_rule in two launches. First a
  program per tile (a block of up to 64 tokens) and value head computes what does not depend on the state, every
  block at once: the block's reach (q k^T times the decays, lower triangle) and the inverse of its unit
  lower-triangular system (the UT transform, inverted as flash-linear-attention's solve_tril does, by forward
  substitution in 16 x 16 blocks and two block merges), into an fp32 scratch. Then one program per run, value head
  and block of value dims walks the run's blocks in order, the state in registers, reading them. The same bits as
  computing both in the walk (each block's numbers are the same products in the same order).

Decays come in as transformers computes them: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); q and k
are L2-normed per head in fp32 (eps 1e-6) and q scaled by key_dim^-1/2. The recurrent state is fp32.

Batch invariance: every program reads one session's rows and state and writes only them; a row's numbers depend on
its own run only (its block boundaries are counted from the run's first row), never on the other rows of the step.

Slab pointers: Triton checks every pointer argument, and parts of a reserved slab may be unmapped; the state is
passed as a view of the spare slot (always mapped) and slots are addressed relative to it, as the attention
kernels do (worker.kernels.attention.spare_views).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.fused import STRICT, _interpreted
from worker.kernels.pdl import launch_options, wait_then_release
from worker.kernels.tiles import TILE_ROWS

CONV_BLOCK = 256  # channels per convolution program (prefill)
# Decode launch shapes. Swept in the 35B-A3B's decode graphs on the H100 (2026-11-27; the graphs captured again per
# shape, replays timed at 1 and 64 rows): the delta rule at 16 / 32 / 64 value dims x 1 / 2 / 4 warps, the
# convolution at 256 / 512 / 1,024 channels x 2 / 4 warps. None beat these (3,229 us at one row, 25,041 at 64): 16
# value dims matched them at one row and lost 6-7% at 64 rows; the rest were within 0.5% or slower (64 value dims in
# one warp 7% slower at one row, 20% at 64).
CONV_DECODE_BLOCK = 256  # channels per decode convolution program
CONV_DECODE_WARPS = 4
DELTA_BLOCK_V = 32  # value dims per decode delta-rule program
DELTA_WARPS = 4
# Prefill launch shapes, from a sweep on the H200 (Qwen3.5-35B-A3B's DeltaNet: 32 value heads of 128 dims; blocks
# kernel warps 4 / 8 / 16 x value dims per walk program 16-128 x walk warps 4 / 8): 16 runs of 128 tokens 676 us a
# layer at 4 / 32 / 4 against 945 at 8 / 64 / 8; 64 runs of 32 tokens 1,331 against 1,986; one run of 2,048 873
# against 1,088 (834 at 16 value dims, the only shape where narrower wins). One launch computing the blocks' reach and
# inverse again in each walk program took 2,565, 5,520 and 3,934 us. Every choice gives the same bits (a value
# column's sums do not depend on the others'; each block's products are the same).
PREFILL_BLOCK_V = 32
PREFILL_WARPS = 4
BLOCKS_WARPS = 4  # the blocks' reach and inverse (_delta_blocks_kernel)
# The prefill kernel's products, all fp32: "tf32x3" (three TF32 passes on the tensor cores, about fp32's precision).
# When the prefill was one launch (8 warps), in plain fp32 FMAs ("ieee") it compiled for Qwen3.5-9B's heads to 32
# registers and a 10 KB stack of spills (ptxas for sm_90, Triton 3.9); with the tensor cores to 255 registers and 3 KB.
# The interpreter computes in fp32.
PREFILL_DOT = "tf32x3"
L2_EPS = 1e-6


@triton.jit
def _when(cond, mask):  # type: ignore[no-untyped-def]
    """mask where a scalar cond holds, else all false (Triton's interpreter mishandles `block & scalar` masks)."""
    return tl.where(cond, mask, False)


@triton.jit
def _softplus(x):  # type: ignore[no-untyped-def]  # torch's: x past the threshold 20 passes as it is
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _sigmoid(x):  # type: ignore[no-untyped-def]
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _silu_rounded(acc, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """silu of the convolution rounded to the model dtype first, as torch computes silu(conv(x))."""
    y = acc.to(dtype).to(tl.float32)
    return (y / (1.0 + tl.exp(-y))).to(dtype)


# -- the causal convolution ---------------------------------------------------------------------------------------


@triton.jit
def _run_before(Slots, Positions, r, slot, p, LIMIT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Rows of row r's run before it (its session's consecutive tokens just before it in the step), up to LIMIT."""
    m = p * 0
    for e in tl.static_range(1, LIMIT + 1):
        prev = tl.maximum(r - e, 0)
        same = (r - e >= 0) & (tl.load(Slots + prev) == slot) & (tl.load(Positions + prev) == p - e)
        m = tl.where(same & (m == e - 1), e, m)
    return m


@triton.jit
def _conv_input(X, held, r, p, m, d, stride_x, cols, ok):  # type: ignore[no-untyped-def]
    """The convolution's input at position p - d for row r at position p with m rows of its run before it: that row
    of X, or before the run the slot's held input (column TAPS - 1 - d + m of held), zero for a run from position 0."""
    in_run = d <= m
    from_rows = tl.load(X + tl.maximum(r - d, 0) * stride_x + cols, mask=_when(in_run, ok), other=0.0)
    from_held = tl.load(held + (m - d), mask=_when(~in_run & (p - m > 0), ok), other=0.0)
    return tl.where(in_run, from_rows, from_held.to(from_rows.dtype))


@triton.jit
def _conv_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, W, Out, State, Slots, Positions, anchor,
    stride_x, stride_w, stride_out, stride_ss, stride_sc,
    C,
    TAPS: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, cdiv(C, BLOCK_C)). Out[r] = silu(sum_j W[:, j] * input at position p - (TAPS-1) + j) for row r at
    position p of its slot. SINGLE (decode: every row its own run): the program also moves the slot's held inputs
    (column c holds the input at position p - (TAPS - 1) + c, c < TAPS - 1)."""
    wait_then_release(PDL)
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    slot = tl.load(Slots + r)
    p = tl.load(Positions + r)
    held = State + (slot - anchor) * stride_ss + cols * stride_sc + (TAPS - 1)  # past this slot's last column
    if SINGLE:
        m = p * 0
    else:
        m = _run_before(Slots, Positions, r, slot, p, TAPS - 1)
    x = tl.load(X + r * stride_x + cols, mask=ok, other=0.0)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(TAPS - 1):  # the oldest input first, as the convolution sums them
        value = _conv_input(X, held, r, p, m, TAPS - 1 - j, stride_x, cols, ok)
        acc += tl.load(W + cols * stride_w + j, mask=ok, other=0.0).to(tl.float32) * value.to(tl.float32)
        if SINGLE:
            if j > 0:  # columns move down in order: column j was read above, before this store to j - 1
                tl.store(held - (TAPS - 1) + (j - 1), value.to(State.dtype.element_ty), mask=ok)
    acc += tl.load(W + cols * stride_w + (TAPS - 1), mask=ok, other=0.0).to(tl.float32) * x.to(tl.float32)
    if SINGLE:
        tl.store(held - 1, x.to(State.dtype.element_ty), mask=ok)
    tl.store(Out + r * stride_out + cols, _silu_rounded(acc, Out.dtype.element_ty), mask=ok)


@triton.jit
def _conv_hold_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    X, State, Slots, Positions, anchor, rows,
    stride_x, stride_ss, stride_sc,
    C,
    TAPS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, cdiv(C, BLOCK_C)): the last row of each run writes its slot's held inputs, the TAPS - 1 inputs up
    to and including its own (from the run's rows, or the slot's older held inputs for a short run)."""
    wait_then_release(PDL)
    r = tl.program_id(0)
    slot = tl.load(Slots + r)
    p = tl.load(Positions + r)
    nxt = tl.minimum(r + 1, rows - 1)
    last = (r + 1 >= rows) | (tl.load(Slots + nxt) != slot) | (tl.load(Positions + nxt) != p + 1)
    if last:
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < C
        held = State + (slot - anchor) * stride_ss + cols * stride_sc + (TAPS - 1)
        m = _run_before(Slots, Positions, r, slot, p, TAPS - 2)
        # Column c takes the input at position p - (TAPS - 2 - c): a row of the run, or the held column c + m + 1.
        # In increasing c, each column is read before it is written.
        for c in tl.static_range(TAPS - 1):
            value = _conv_input(X, held, r, p, m, TAPS - 2 - c, stride_x, cols, ok)
            tl.store(held - (TAPS - 1) + c, value.to(State.dtype.element_ty), mask=ok)


def _conv_checks(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor) -> tuple[int, int, int]:
    rows, channels = x.shape
    taps = weight.shape[-1]
    if weight.shape != (channels, 1, taps) or weight.stride(-1) != 1 or taps < 2:
        raise ValueError(f"weight must be ({channels}, 1, taps >= 2) with contiguous taps, got {tuple(weight.shape)}")
    if state.dim() != 3 or state.shape[1:] != (channels, taps - 1) or state.stride(-1) != 1:
        raise ValueError(f"state must be (slots, {channels}, {taps - 1}) with a contiguous last dim")
    if x.stride(-1) != 1 or slots.shape != (rows,) or positions.shape != (rows,):
        raise ValueError("x must have contiguous rows, and slots and positions one entry per row")
    return rows, channels, taps


def conv_decode(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row (distinct slots): silu(causal depthwise conv) of x (R, C) after each slot's held inputs
    (state: (num_slots, C, taps - 1), the last slot mapped), and the held inputs moved on. (R, C) in x's dtype."""
    rows, channels, taps = _conv_checks(x, weight, state, slots, positions)
    out = torch.empty_like(x) if out is None else out
    if rows:
        anchor = state.shape[0] - 1
        _conv_kernel[(rows, triton.cdiv(channels, CONV_DECODE_BLOCK))](
            x, weight, out, state[anchor], slots, positions, anchor,
            x.stride(0), weight.stride(0), out.stride(0), state.stride(0), state.stride(1), channels,
            TAPS=taps, SINGLE=True, BLOCK_C=CONV_DECODE_BLOCK, num_warps=CONV_DECODE_WARPS, **STRICT,
            **launch_options(x))
    return out


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Runs of consecutive tokens (a prefill step's rows): the same as conv_decode token by token, each run reading
    its slot's held inputs before its first token (none from position 0) and leaving them after its last."""
    rows, channels, taps = _conv_checks(x, weight, state, slots, positions)
    out = torch.empty_like(x) if out is None else out
    if rows:
        anchor = state.shape[0] - 1
        grid = (rows, triton.cdiv(channels, CONV_BLOCK))
        _conv_kernel[grid](
            x, weight, out, state[anchor], slots, positions, anchor,
            x.stride(0), weight.stride(0), out.stride(0), state.stride(0), state.stride(1), channels,
            TAPS=taps, SINGLE=False, BLOCK_C=CONV_BLOCK, num_warps=4, **STRICT, **launch_options(x))
        _conv_hold_kernel[grid](
            x, state[anchor], slots, positions, anchor, rows, x.stride(0), state.stride(0), state.stride(1), channels,
            TAPS=taps, BLOCK_C=CONV_BLOCK, num_warps=4, **STRICT, **launch_options(x))
    return out


# -- the gated delta rule -----------------------------------------------------------------------------------------


@triton.jit
def _load_row_head(Base, row, col0, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    cols = tl.arange(0, BLOCK)
    return tl.load(Base + row + col0 + cols, mask=cols < n, other=0.0).to(tl.float32)


@triton.jit
def _delta_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, A, B, ALog, DtBias, Out, State, Slots, Positions, anchor,
    stride_qkv, stride_ab, stride_out, stride_ss, stride_sh, stride_sk,
    key_dim, value_dim, scale,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, value heads, cdiv(value_dim, BLOCK_V)): one token's recurrent update of one head's state columns.

    The state, the slots and positions and the decay parameters are read before the wait (PDL): no kernel of the step
    writes them before this one (the state: this kernel, a step earlier; the rest: the host, before the step; and the
    kernel before it waited for all before that), so their loads overlap the kernel before instead of adding a round
    trip to memory after it. H100, 35B-A3B engine: one session 306.1 -> 307.7 tokens/s, 64 sessions 2,544.5 / 2,545.0
    -> 2,539.5 / 2,539.9 (64 states read under the kernel before take its bandwidth). The convolution's held inputs
    and weights read the same way gained nothing at one session (307.6) and lost 0.4% at 64: not kept."""
    r = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (VALUE_HEADS // KEY_HEADS)
    slot = tl.load(Slots + r)
    fresh = tl.load(Positions + r) == 0
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < key_dim
    v_ok = vs < value_dim
    h_ptr = State + (slot - anchor) * stride_ss + hv * stride_sh + ks[:, None] * stride_sk + vs[None, :]
    h_ok = k_ok[:, None] & v_ok[None, :]
    h = tl.load(h_ptr, mask=_when(~fresh, h_ok), other=0.0)
    a_log = tl.load(ALog + hv).to(tl.float32)
    dt_bias = tl.load(DtBias + hv).to(tl.float32)
    wait_then_release(PDL)
    row = QKV + r * stride_qkv
    q = tl.load(row + hk * key_dim + ks, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(row + (KEY_HEADS + hk) * key_dim + ks, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * KEY_HEADS * key_dim + hv * value_dim + vs, mask=v_ok, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6))  # l2norm
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
    q = q / scale
    a = tl.load(A + r * stride_ab + hv).to(tl.float32)
    b = tl.load(B + r * stride_ab + hv).to(tl.float32)
    g = -tl.exp(a_log) * _softplus(a + dt_bias)
    beta = _sigmoid(b)
    h = h * tl.exp(g)
    delta = (v - tl.sum(h * k[:, None], 0)) * beta
    h = h + k[:, None] * delta[None, :]
    o = tl.sum(h * q[:, None], 0)
    tl.store(Out + r * stride_out + hv * value_dim + vs, o.to(Out.dtype.element_ty), mask=v_ok)
    tl.store(h_ptr, h, mask=h_ok)


@triton.jit
def _unit_lower_inverse(system, ts, eye, BLOCK_T: tl.constexpr, DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    """(I + L)^-1 for L strictly lower triangular (BLOCK_T = 64), as flash-linear-attention's solve_tril computes it:
    forward substitution inside the four 16 x 16 diagonal blocks (all four at once, a row of each per step), then two
    merges, [A 0; C B]^-1 = [A^-1 0; -B^-1 C A^-1 B^-1], of 16-blocks into 32-blocks and of those into the whole.
    Stable where a series in L is not: keys alike make L's powers huge and their sum cancel (measured: the product
    (I - L)(I + L^2)(I + L^4)... off by 5e4 where the inverse's entries are at most 1)."""
    tl.static_assert(BLOCK_T == 64)
    same16 = (ts[:, None] // 16) == (ts[None, :] // 16)
    within16 = tl.where(same16, system, 0.0)
    inverse = eye
    for i in range(1, 16):  # row i of each 16-block, from the rows above it, final already
        rows = (ts % 16) == i
        step = tl.dot(tl.where(rows[:, None], within16, 0.0), inverse, input_precision=DOT)
        inverse = tl.where(rows[:, None], eye - step, inverse)
    lower16 = ((ts[:, None] // 32) == (ts[None, :] // 32)) & (ts[:, None] % 32 >= 16) & (ts[None, :] % 32 < 16)
    c = tl.dot(tl.dot(inverse, tl.where(lower16, system, 0.0), input_precision=DOT), inverse,
               input_precision=DOT)
    inverse = inverse - c
    lower32 = (ts[:, None] >= 32) & (ts[None, :] < 32)
    c = tl.dot(tl.dot(inverse, tl.where(lower32, system, 0.0), input_precision=DOT), inverse,
               input_precision=DOT)
    return inverse - c


@triton.jit
def _block_keys(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, A, B, rows, rows_ok, hk, hv, ks, k_ok, a_log, dt_bias, stride_qkv, stride_ab, key_dim, scale,
    KEY_HEADS: tl.constexpr,
):
    """A block's queries (L2-normed, scaled) and keys (L2-normed) of key head hk, and value head hv's beta and
    cumulated decays: the same code in both prefill kernels, so both see the same bits."""
    base = QKV + rows[:, None] * stride_qkv
    q = tl.load(base + hk * key_dim + ks[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
    k = tl.load(base + (KEY_HEADS + hk) * key_dim + ks[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None] * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 1) + 1e-6))[:, None]
    a = tl.load(A + rows * stride_ab + hv, mask=rows_ok, other=0.0).to(tl.float32)
    b = tl.load(B + rows * stride_ab + hv, mask=rows_ok, other=0.0).to(tl.float32)
    g = tl.where(rows_ok, -tl.exp(a_log) * _softplus(a + dt_bias), 0.0)  # padding rows decay nothing
    beta = tl.where(rows_ok, _sigmoid(b), 0.0)  # and write nothing
    return q, k, beta, tl.cumsum(g, 0)


@triton.jit
def _block_parts_at(Blocks, t, hv, stride_bt, stride_bh, ts, BLOCK_T: tl.constexpr):  # type: ignore[no-untyped-def]
    """Where tile t's parts for value head hv lie in the scratch (both prefill kernels read this one layout): the
    reach within the block, then the inverse of its system (BLOCK_T x BLOCK_T fp32 each)."""
    at = Blocks + t.to(tl.int64) * stride_bt + hv * stride_bh + ts[:, None] * BLOCK_T + ts[None, :]
    return at, at + BLOCK_T * BLOCK_T


@triton.jit
def _delta_blocks_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, A, B, ALog, DtBias, Blocks, TileFirst, TileRows,
    stride_qkv, stride_ab, stride_bt, stride_bh,
    key_dim, scale,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tiles, value heads). What of tile t's block does not depend on the state, for value head hv (fp32,
    BLOCK_T x BLOCK_T each): Blocks[t, hv, 0] = the queries' reach within the block, (q k^T * decay) on and below
    the diagonal; Blocks[t, hv, 1] = the inverse of its unit lower-triangular system (I + beta k k^T * decay, below
    the diagonal). Every block at once: the walk over a run's blocks (_delta_prefill_kernel) then only reads them."""
    wait_then_release(PDL)
    t = tl.program_id(0)
    hv = tl.program_id(1)
    count = tl.load(TileRows + t)
    if count > 0:
        hk = hv // (VALUE_HEADS // KEY_HEADS)
        ts = tl.arange(0, BLOCK_T)
        ks = tl.arange(0, BLOCK_K)
        rows_ok = ts < count
        rows = tl.load(TileFirst + t) + ts
        lower = ts[:, None] >= ts[None, :]
        strictly = ts[:, None] > ts[None, :]
        eye = (ts[:, None] == ts[None, :]).to(tl.float32)
        q, k, beta, cum = _block_keys(QKV, A, B, rows, rows_ok, hk, hv, ks, ks < key_dim,
                                      tl.load(ALog + hv).to(tl.float32), tl.load(DtBias + hv).to(tl.float32),
                                      stride_qkv, stride_ab, key_dim, scale, KEY_HEADS)
        decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))  # from token j to i
        within = tl.where(lower, tl.dot(q, tl.trans(k), input_precision=DOT) * decay, 0.0)
        within_at, inverse_at = _block_parts_at(Blocks, t, hv, stride_bt, stride_bh, ts, BLOCK_T)
        tl.store(within_at, within)
        kk = tl.dot(k, tl.trans(k), input_precision=DOT)
        system = tl.where(strictly, kk * beta[:, None] * decay, 0.0)  # L: (I + L) solved for
        tl.store(inverse_at, _unit_lower_inverse(system, ts, eye, BLOCK_T, DOT))


@triton.jit
def _delta_prefill_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, A, B, ALog, DtBias, Out, State, Slots, Positions, TileFirst, TileRows, Blocks, anchor, n_tiles,
    stride_qkv, stride_ab, stride_out, stride_ss, stride_sh, stride_sk, stride_bt, stride_bh,
    key_dim, value_dim, scale,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (tiles, value heads, cdiv(value_dim, BLOCK_V)). The program of a run's first tile walks the run's tiles in
    order (blocks of up to BLOCK_T tokens), the state's columns in registers, each block's reach and inverse from
    Blocks (_delta_blocks_kernel); the others exit."""
    wait_then_release(PDL)
    t = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (VALUE_HEADS // KEY_HEADS)
    count = tl.load(TileRows + t)
    first = tl.load(TileFirst + t)
    slot = tl.load(Slots + first)
    start = tl.load(Positions + first)
    before = tl.maximum(t - 1, 0)
    prev_count = tl.load(TileRows + before)
    prev_first = tl.load(TileFirst + before)
    continues = (t > 0) & (prev_count > 0) & (tl.load(Slots + prev_first) == slot) & (
        tl.load(Positions + prev_first) + prev_count == start)
    if (count > 0) & ~continues:
        ts = tl.arange(0, BLOCK_T)
        ks = tl.arange(0, BLOCK_K)
        vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok = ks < key_dim
        v_ok = vs < value_dim
        a_log = tl.load(ALog + hv).to(tl.float32)
        dt_bias = tl.load(DtBias + hv).to(tl.float32)
        h_ptr = State + (slot - anchor) * stride_ss + hv * stride_sh + ks[:, None] * stride_sk + vs[None, :]
        h_ok = k_ok[:, None] & v_ok[None, :]
        h = tl.load(h_ptr, mask=_when(start > 0, h_ok), other=0.0)
        tile = t
        going = count > 0
        while going:
            rows_ok = ts < count
            rows = tl.load(TileFirst + tile) + ts
            q, k, beta, cum = _block_keys(QKV, A, B, rows, rows_ok, hk, hv, ks, k_ok, a_log, dt_bias, stride_qkv,
                                          stride_ab, key_dim, scale, KEY_HEADS)
            v = tl.load(QKV + rows[:, None] * stride_qkv + 2 * KEY_HEADS * key_dim + hv * value_dim + vs[None, :],
                        mask=rows_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            within_at, inverse_at = _block_parts_at(Blocks, tile, hv, stride_bt, stride_bh, ts, BLOCK_T)
            # q's part first (what it reads of the state before the block), then the block's own
            o = tl.dot(q * tl.exp(cum)[:, None], h, input_precision=DOT)
            # transformers' new_values - k_cumdecay @ S = T (v beta) - T (k beta e^cum) S = T (v beta - (k beta e^cum) S)
            k_read = tl.dot(k * (beta * tl.exp(cum))[:, None], h, input_precision=DOT)
            v_new = tl.dot(tl.load(inverse_at), v * beta[:, None] - k_read, input_precision=DOT)
            o += tl.dot(tl.load(within_at), v_new, input_precision=DOT)
            tl.store(Out + rows[:, None] * stride_out + hv * value_dim + vs[None, :], o.to(Out.dtype.element_ty),
                     mask=rows_ok[:, None] & v_ok[None, :])
            last = tl.sum(tl.where(ts == count - 1, cum, 0.0), 0)
            h = h * tl.exp(last) + tl.dot(tl.trans(k * tl.exp(last - cum)[:, None]), v_new, input_precision=DOT)
            end = tl.load(Positions + tl.load(TileFirst + tile)) + count
            tile += 1
            nxt = tl.minimum(tile, n_tiles - 1)
            count = tl.load(TileRows + nxt)
            nxt_first = tl.load(TileFirst + nxt)
            going = (tile < n_tiles) & (count > 0) & (tl.load(Slots + nxt_first) == slot) & (
                tl.load(Positions + nxt_first) == end)
        tl.store(h_ptr, h, mask=h_ok)


def _delta_checks(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state: torch.Tensor, key_heads: int,
                  key_dim: int) -> tuple[int, int, int]:
    rows = qkv.shape[0]
    _, value_heads, k_dim, value_dim = state.shape
    if k_dim != key_dim or value_heads % key_heads:
        raise ValueError(f"state {tuple(state.shape)} does not fit {key_heads} key heads of {key_dim}")
    if qkv.shape[1] != 2 * key_heads * key_dim + value_heads * value_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold q, k and v of these heads with contiguous rows")
    if a.shape != (rows, value_heads) or b.shape != a.shape or a.stride() != b.stride() or a.stride(-1) != 1:
        raise ValueError("a and b must be (rows, value_heads) alike")
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("the recurrent state is float32 with contiguous value dims")
    return rows, value_heads, value_dim


def delta_decode(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                 state: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, key_heads: int, key_dim: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row (distinct slots): the gated delta rule's recurrent step. qkv (R, 2*HK*dk + HV*dv) after the
    convolution; a, b (R, HV); state (num_slots, HV, dk, dv) fp32 (the last slot mapped). (R, HV, dv) in qkv's dtype."""
    rows, value_heads, value_dim = _delta_checks(qkv, a, b, state, key_heads, key_dim)
    out = torch.empty((rows, value_heads, value_dim), dtype=qkv.dtype, device=qkv.device) if out is None else out
    if rows:
        anchor = state.shape[0] - 1
        block_v = min(DELTA_BLOCK_V, triton.next_power_of_2(value_dim))
        _delta_decode_kernel[(rows, value_heads, triton.cdiv(value_dim, block_v))](
            qkv, a, b, a_log, dt_bias, out, state[anchor], slots, positions, anchor,
            qkv.stride(0), a.stride(0), out.stride(0), state.stride(0), state.stride(1), state.stride(2),
            key_dim, value_dim, key_dim ** 0.5,
            KEY_HEADS=key_heads, VALUE_HEADS=value_heads, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v,
            num_warps=DELTA_WARPS, **STRICT, **launch_options(qkv))
    return out


def delta_prefill(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  state: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor,
                  key_heads: int, key_dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Runs of consecutive tokens in `tiles` ((2, n): each tile's first row and row count, at most TILE_ROWS, a run's
    tiles consecutive from its first row; unused tiles count 0): the chunked gated delta rule over each run from its
    slot's state (zeros for a run from position 0), leaving the state after its last token."""
    rows, value_heads, value_dim = _delta_checks(qkv, a, b, state, key_heads, key_dim)
    out = torch.empty((rows, value_heads, value_dim), dtype=qkv.dtype, device=qkv.device) if out is None else out
    if tiles.dim() != 2 or tiles.shape[0] != 2 or tiles.stride(1) != 1:
        raise ValueError("tiles must be (2, n) with contiguous rows")
    n_tiles = tiles.shape[1]
    if rows and n_tiles:
        anchor = state.shape[0] - 1
        block_k = max(16, triton.next_power_of_2(key_dim))
        dot = "ieee" if _interpreted() else PREFILL_DOT
        blocks = torch.empty((n_tiles, value_heads, 2, TILE_ROWS, TILE_ROWS), dtype=torch.float32, device=qkv.device)
        _delta_blocks_kernel[(n_tiles, value_heads)](
            qkv, a, b, a_log, dt_bias, blocks, tiles[0], tiles[1],
            qkv.stride(0), a.stride(0), blocks.stride(0), blocks.stride(1), key_dim, key_dim ** -0.5,
            KEY_HEADS=key_heads, VALUE_HEADS=value_heads, BLOCK_T=TILE_ROWS, BLOCK_K=block_k, DOT=dot,
            num_warps=BLOCKS_WARPS, **STRICT, **launch_options(qkv))
        block_v = max(16, min(PREFILL_BLOCK_V, triton.next_power_of_2(value_dim)))
        _delta_prefill_kernel[(n_tiles, value_heads, triton.cdiv(value_dim, block_v))](
            qkv, a, b, a_log, dt_bias, out, state[anchor], slots, positions, tiles[0], tiles[1], blocks, anchor,
            n_tiles, qkv.stride(0), a.stride(0), out.stride(0), state.stride(0), state.stride(1), state.stride(2),
            blocks.stride(0), blocks.stride(1), key_dim, value_dim, key_dim ** -0.5,
            KEY_HEADS=key_heads, VALUE_HEADS=value_heads, BLOCK_T=TILE_ROWS, BLOCK_K=block_k, BLOCK_V=block_v,
            DOT=dot, num_warps=PREFILL_WARPS, **STRICT, **launch_options(qkv))
    return out
