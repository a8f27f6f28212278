"""Decode attention in Triton: one query token per row, K/V read in place from the session slab.

Row r of the batch belongs to the session in slot `slots[r]` and attends to positions
0..lengths[r]-1 of that slot. Each program serves one (row, kv_head) pair and the H/KV query heads
that share it (GQA), so a K/V block is loaded once for the whole group. Softmax is online, in fp32,
in the log2 domain (exp2 with log2(e) folded into the scale).

For few rows the (row, kv_head) grid cannot fill the GPU, so the keys of each row are split across
programs (flash-decoding): each split writes an unnormalised partial (acc, max, sum) and a second
kernel merges them. The grid depends only on shapes; inside it a row takes as many of the splits as
its own length gives MIN_SPLIT_KEYS keys each (a short row: one, bitwise the one-program kernel's
result), so a row's numbers never depend on the other rows. Nothing here reads device values on the
host: both paths are safe to capture in a CUDA graph once compiled.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.kernels.pdl import launch_options, wait_then_release

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner-loop block
MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16: the query-head group is padded up to this
MIN_SPLIT_KEYS = 256  # a split covers at least this many positions of max_context, and of a row's length
MAX_SPLITS = 32
NUM_WARPS = 4


@triton.jit
def attend(  # type: ignore[no-untyped-def]  # Triton reads the signature
    q,  # (ROWS, BLOCK_D) query rows (padding rows zero)
    k_ptr,  # K at (slot, kv_head), position 0
    v_ptr,
    stride_kb,  # a block of BLOCK_T positions (cuda_state.spec)
    stride_kt,  # a position within its block
    stride_vb,
    stride_vt,
    lo,  # first position to attend to
    hi,  # one past the last position read
    limit,  # one past the last position each row attends to: hi, or (ROWS, 1) row lengths <= hi (worker.kernels.prefill)
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,  # positions per block of the slot layout
):
    """Online-softmax attention over positions [lo, limit) of each row, in blocks of BLOCK from lo: unnormalised acc,
    running max (log2), sum. A block wholly past a row's limit leaves that row's three exactly as they were.

    Position n is row n % BLOCK_T of layout block n // BLOCK_T: BLOCK_T consecutive keys are contiguous."""
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK):
        n = start + offs_n
        block = (n // BLOCK_T).to(tl.int64)  # 64-bit: a slot's blocks may span more than 2^31 elements
        row = n % BLOCK_T
        kv_mask = (n < hi)[:, None] & d_mask[None, :]
        k_off = block * stride_kb + row * stride_kt
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK, BLOCK_D)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (ROWS, BLOCK) fp32
        s = tl.where(n[None, :] < limit, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a row's first block holds one of its keys
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + row * stride_vt
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _load_group(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Q, row, kvh, stride_qb, stride_qh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The query heads of kv head `kvh` for batch row `row`: (GROUP_PAD, BLOCK_D), zero-padded."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    return tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _store_group(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Out, out, row, kvh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """_load_group's converse: `out` (GROUP_PAD, BLOCK_D), the query heads of kv head `kvh`, to row `row` of Out."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mask)


@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Q, K, V, Out, Slots, Lengths, anchor,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kb, stride_kt,
    stride_vs, stride_vh, stride_vb, stride_vt,
    stride_ob, stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, kv_heads): the whole key range of one row in one program.

    K and V point at slot `anchor` (see decode_attention); row r reads slot slots[r].
    """
    wait_then_release(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(Slots + row).to(tl.int64) - anchor  # relative to the slot K and V point at
    length = tl.load(Lengths + row).to(tl.int32)
    q = _load_group(Q, row, kvh, stride_qb, stride_qh, GROUP, HEAD_DIM, GROUP_PAD, BLOCK_D)
    k_ptr = K + slot * stride_ks + kvh * stride_kh
    v_ptr = V + slot * stride_vs + kvh * stride_vh
    acc, m_i, l_i = attend(q, k_ptr, v_ptr, stride_kb, stride_kt, stride_vb, stride_vt, 0, length, length,
                           qk_scale, HEAD_DIM, GROUP_PAD, BLOCK_D, BLOCK, BLOCK_T)
    _store_group(Out, acc / l_i[:, None], row, kvh, stride_ob, stride_oh, GROUP, HEAD_DIM, GROUP_PAD, BLOCK_D)


@triton.jit
def _rotated(  # type: ignore[no-untyped-def]  # Triton reads the signature
    ptrs, partner, mask, first, cos, sin, EXACT: tl.constexpr,
):
    """RoPE (rotate half) of vectors at `ptrs` whose other half is at `partner`, in fp32, rounded as
    worker.kernels.fused's RoPE (compiled without FMA contraction): x * cos + (-x2 or x1) * sin, each product and
    the sum rounded on its own (mul_rn / add_rn on the GPU; the interpreter's numpy does not contract)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(partner, mask=mask, other=0.0).to(tl.float32)
    p = tl.where(first, -p, p)
    if EXACT:
        return libdevice.add_rn(libdevice.mul_rn(x, cos), libdevice.mul_rn(p, sin))
    return x * cos + p * sin


@triton.jit
def _rope_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    QKV, Cos, Sin, K, V, Out, Slots, Lengths, anchor,
    stride_qkv, stride_cos, stride_sin,
    stride_ks, stride_kh, stride_kb, stride_kt,
    stride_vs, stride_vh, stride_vb, stride_vt,
    stride_ob, stride_oh,
    qk_scale,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, kv_heads): worker.kernels.fused's RoPE + K/V store and _decode_kernel in one launch, for rows
    that are each a different session's one token (position length - 1).

    The program rotates its KV head's k and stores it and v at the row's position, rotates its group of query heads
    in registers (rounded to the model dtype, as the stored q would be), then attends as _decode_kernel, reading the
    position it wrote back from the slab after a barrier: the same bits as the two launches."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(Slots + row).to(tl.int64) - anchor
    length = tl.load(Lengths + row).to(tl.int32)
    pos = (length - 1).to(tl.int64)
    half = HEAD_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    first = offs_d < half
    other = tl.where(first, offs_d + half, offs_d - half)  # the rotation's partner of each dimension
    cos = tl.load(Cos + row * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + row * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    src = QKV + row.to(tl.int64) * stride_qkv

    k_src = src + (HEADS + kvh) * HEAD_DIM
    k = _rotated(k_src + offs_d, k_src + other, d_mask, first, cos, sin, EXACT)
    k_ptr = K + slot * stride_ks + kvh * stride_kh
    v_ptr = V + slot * stride_vs + kvh * stride_vh
    tl.store(k_ptr + (pos // BLOCK_T) * stride_kb + (pos % BLOCK_T) * stride_kt + offs_d, k.to(K.dtype.element_ty),
             mask=d_mask)
    v = tl.load(src + (HEADS + KV_HEADS + kvh) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
    tl.store(v_ptr + (pos // BLOCK_T) * stride_vb + (pos % BLOCK_T) * stride_vt + offs_d, v.to(V.dtype.element_ty),
             mask=d_mask)

    offs_g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    q_src = src + heads[:, None] * HEAD_DIM
    q = _rotated(q_src + offs_d[None, :], q_src + other[None, :], mask, first[None, :], cos[None, :], sin[None, :],
                 EXACT).to(QKV.dtype.element_ty)
    tl.debug_barrier()  # this position's K/V, stored above by the program's threads, are read below
    acc, m_i, l_i = attend(q, k_ptr, v_ptr, stride_kb, stride_kt, stride_vb, stride_vt, 0, length, length,
                           qk_scale, HEAD_DIM, GROUP_PAD, BLOCK_D, BLOCK, BLOCK_T)
    _store_group(Out, acc / l_i[:, None], row, kvh, stride_ob, stride_oh, GROUP, HEAD_DIM, GROUP_PAD, BLOCK_D)


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Q, K, V, Slots, Lengths, anchor, PartAcc, PartMax, PartSum,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kb, stride_kt,
    stride_vs, stride_vh, stride_vb, stride_vt,
    qk_scale,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, kv_heads, SPLITS): split `s` covers its share of [0, length), in whole blocks.

    Partials are contiguous: PartAcc (rows, HEADS, SPLITS, HEAD_DIM), PartMax/PartSum (rows, HEADS, SPLITS).
    """
    wait_then_release(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(Slots + row).to(tl.int64) - anchor  # relative to the slot K and V point at
    length = tl.load(Lengths + row).to(tl.int32)
    # The row's own split count: length // MIN_KEYS, from 1 to SPLITS (a short row takes one; the splits past a row's
    # count are empty, as rounding to whole blocks may leave its last one). A function of the row's length alone,
    # so a row sums in the same order in any batch; a row of one split gives the bits of _decode_kernel (the merge
    # weighs empty splits 0).
    row_splits = tl.minimum(tl.maximum(length // MIN_KEYS, 1), SPLITS)
    per_split = tl.cdiv(tl.cdiv(length, row_splits), BLOCK) * BLOCK
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)  # lo >= hi: an empty split (max -inf, sum 0)
    q = _load_group(Q, row, kvh, stride_qb, stride_qh, GROUP, HEAD_DIM, GROUP_PAD, BLOCK_D)
    k_ptr = K + slot * stride_ks + kvh * stride_kh
    v_ptr = V + slot * stride_vs + kvh * stride_vh
    acc, m_i, l_i = attend(q, k_ptr, v_ptr, stride_kb, stride_kt, stride_vb, stride_vt, lo, hi, hi, qk_scale,
                           HEAD_DIM, GROUP_PAD, BLOCK_D, BLOCK, BLOCK_T)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    part = (row * HEADS + kvh * GROUP + offs_g) * SPLITS + split  # (GROUP_PAD,) index of (row, head, split)
    tl.store(PartMax + part, m_i, mask=g_mask)
    tl.store(PartSum + part, l_i, mask=g_mask)
    mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)


@triton.jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    PartAcc, PartMax, PartSum, Out,
    stride_ob, stride_oh,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (rows, heads): out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < SPLITS
    d_mask = offs_d < HEAD_DIM
    base = (row * HEADS + head) * SPLITS
    m = tl.load(PartMax + base + offs_s, mask=s_mask, other=float("-inf"))
    sums = tl.load(PartSum + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always holds position 0
    w = tl.exp2(m - m_max)  # empty and padded splits weigh 0
    acc = tl.load(PartAcc + (base + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(sums * w, 0)
    tl.store(Out + row * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def num_splits(rows: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """How many programs share one row's keys: enough to fill about two waves of the GPU.

    1 when rows x kv_heads already fills the SMs or the context is short. Shapes only, so a graph
    captured for a batch size always launches the same grid.
    """
    programs = rows * kv_heads
    if programs >= sm_count:
        return 1
    wanted = math.ceil(2 * sm_count / programs)
    return max(1, min(wanted, max_context // MIN_SPLIT_KEYS, MAX_SPLITS))


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, out: torch.Tensor) -> None:
    rows, heads, head_dim = q.shape
    if k_cache.dim() != 5:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} is not (slots, kv_heads, blocks, block, head_dim)")
    _, kv_heads, _, _, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if kv_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the head dimension of q, k_cache, v_cache and out must be contiguous")
    if slots.shape != (rows,) or lengths.shape != (rows,):
        raise ValueError(f"slots {tuple(slots.shape)} and lengths {tuple(lengths.shape)} must be ({rows},)")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")


def spare_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The spare (last) slot's index and K and V as views of it: the pointers a slab kernel takes.

    Triton checks every pointer argument with cuPointerGetAttribute, which fails on the unmapped parts of a
    reserved slab (slot 0 may be free). So K and V are passed as views of the last slot, the spare that is
    always mapped, and the kernels offset from there (negative offsets)."""
    anchor = k_cache.shape[0] - 1
    return anchor, k_cache[anchor], v_cache[anchor]


def slab_strides(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """A slab kernel's strides after its pointers: q's (row, head), then K's and V's (slot, KV head, block, position
    in the block)."""
    return (q.stride(0), q.stride(1), *k_cache.stride()[:4], *v_cache.stride()[:4])


def context(k_cache: torch.Tensor) -> int:
    """Positions a (slots, kv_heads, blocks, block, head_dim) cache holds: blocks x block."""
    return int(k_cache.shape[2] * k_cache.shape[3])


def decode_attention(
    q: torch.Tensor,  # (B, H, hd)
    k_cache: torch.Tensor,  # (num_slots, KV, blocks, block, hd), any strides with a contiguous hd; last slot mapped
    v_cache: torch.Tensor,  # same
    slots: torch.Tensor,  # (B,) int64: the slot each row reads
    lengths: torch.Tensor,  # (B,) int32 or int64, >= 1: positions 0..length-1 are attended to
    out: torch.Tensor | None = None,  # (B, H, hd) preallocated output (else allocated here)
    splits: int | None = None,  # None: chosen from the shapes (see num_splits)
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v per row over that row's slot and length; (B, H, hd) in q's dtype."""
    if out is None:
        out = torch.empty_like(q)
    check_shapes(q, k_cache, v_cache, slots, lengths, out)
    rows, heads, head_dim = q.shape
    kv_heads, max_context = k_cache.shape[1], context(k_cache)
    if rows == 0:
        return out
    anchor, k_anchor, v_anchor = spare_views(k_cache, v_cache)
    strides = slab_strides(q, k_cache, v_cache)
    group = heads // kv_heads
    if splits is None:
        splits = num_splits(rows, kv_heads, max_context, sm_count(q.device))
    shape = dict(
        HEAD_DIM=head_dim,
        GROUP_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK=BLOCK_N,
        BLOCK_T=k_cache.shape[3],
    )
    qk_scale = LOG2E / math.sqrt(head_dim)
    pdl = launch_options(q)
    if splits <= 1:
        _decode_kernel[(rows, kv_heads)](
            q, k_anchor, v_anchor, out, slots, lengths, anchor, *strides, out.stride(0), out.stride(1),
            qk_scale, GROUP=group, num_warps=NUM_WARPS, **shape, **pdl,
        )
        return out
    part_acc = torch.empty((rows, heads, splits, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(rows, kv_heads, splits)](
        q, k_anchor, v_anchor, slots, lengths, anchor, part_acc, part_max, part_sum, *strides, qk_scale,
        HEADS=heads, GROUP=group, SPLITS=splits, MIN_KEYS=MIN_SPLIT_KEYS, num_warps=NUM_WARPS, **shape, **pdl,
    )
    _merge_splits_kernel[(rows, heads)](
        part_acc, part_max, part_sum, out,
        out.stride(0), out.stride(1),
        HEADS=heads, HEAD_DIM=head_dim, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
        BLOCK_D=shape["BLOCK_D"], num_warps=NUM_WARPS, **pdl,
    )
    return out


def rope_decode_attention(
    qkv: torch.Tensor,  # (B, (H + 2 KV) * hd): the fused projection, [q | k | v]
    cos: torch.Tensor,  # (B, hd) fp32: the rope table's rows at each row's position
    sin: torch.Tensor,  # (B, hd) fp32
    k_cache: torch.Tensor,  # (num_slots, KV, blocks, block, hd), any strides with a contiguous hd; last slot mapped
    v_cache: torch.Tensor,  # same
    slots: torch.Tensor,  # (B,) int64: each row's slot, a different one per row (padding rows: the spare)
    lengths: torch.Tensor,  # (B,) int32 or int64, >= 1: each row's token is at position length - 1
    n_heads: int,
    out: torch.Tensor | None = None,  # (B, H, hd)
) -> torch.Tensor:
    """worker.kernels.fused.rope_and_store, then decode_attention unsplit, in one launch, with the same bits:
    (B, H, hd) in qkv's dtype. Each row must be a different session's single token (a decode step's rows)."""
    rows = qkv.shape[0]
    if k_cache.dim() != 5:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} is not (slots, kv_heads, blocks, block, head_dim)")
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[4]
    if head_dim % 2 or n_heads % kv_heads:
        raise ValueError(f"{n_heads} heads and a cache of {tuple(k_cache.shape)}: an even head_dim and whole groups")
    if qkv.shape[1] != (n_heads + 2 * kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not ({rows}, {(n_heads + 2 * kv_heads) * head_dim}) contiguous")
    if cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim) or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be ({rows}, {head_dim})")
    if out is None:
        out = torch.empty((rows, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    check_shapes(out, k_cache, v_cache, slots, lengths, out)
    if rows == 0:
        return out
    anchor, k_anchor, v_anchor = spare_views(k_cache, v_cache)
    group = n_heads // kv_heads
    _rope_decode_kernel[(rows, kv_heads)](
        qkv, cos, sin, k_anchor, v_anchor, out, slots, lengths, anchor,
        qkv.stride(0), cos.stride(0), sin.stride(0), *k_cache.stride()[:4], *v_cache.stride()[:4],
        out.stride(0), out.stride(1), LOG2E / math.sqrt(head_dim),
        HEADS=n_heads, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim,
        GROUP_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK=BLOCK_N, BLOCK_T=k_cache.shape[3], EXACT=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=NUM_WARPS, **launch_options(qkv),
    )
    return out
