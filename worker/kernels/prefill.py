"""Prompt-chunk attention in Triton: tiles of a chunk's consecutive rows share each K/V block they read.

A prefill step packs several sessions' prompt chunks into rows; row r is a query of the session in
slot `slots[r]` attending to positions 0..lengths[r]-1 of that slot (its prefix, and the chunk up to
itself: the step stored the chunk's K/V first). The decode kernel (worker.kernels.attention) serves such
rows one program per (row, KV head), each walking all of its row's keys: a chunk of n rows at the end
of a long prefix reads that prefix n times. Here a program serves a tile of up to TILE_ROWS consecutive
rows of one chunk and one query head, loading each K/V block once for the tile (once per query head:
SmolLM2's KV heads serve three each, so a long chunk's rows read ~21x fewer K/V bytes).

The loop over key blocks is the decode kernels' (triton_attention.attend), each row masked at its own
length. The tiles come from the host (worker.kernels.tiles): (first row, rows) pairs, a chunk's rows cut from
its first row on, every tile inside one slot. The grid is fixed per row count (max_tiles), so the
launch is captured once in a CUDA graph; unused tiles have 0 rows and exit.

Batch invariance: a row's numbers never depend on its tile. The key blocks start at position 0 in
steps of BLOCK_N whatever the tile, each row masks the keys from its own length on, and a block
wholly past a row's length leaves that row's running max, sum and accumulator exactly as they were
(scale 2^0 = 1, weights 2^-inf = 0, times the later rows' V, which is finite: a non-finite V would
make those rows themselves non-finite): the tile's longer rows add blocks that change nothing for
the shorter ones. So a chunk's rows give the same bits however the chunk is tiled or packed, and
whichever chunks share its step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from worker.kernels.attention import BLOCK_N, LOG2E, attend, check_shapes, slab_strides, spare_views
from worker.kernels.pdl import launch_options, wait_then_release
from worker.kernels.tiles import TILE_ROWS

NUM_WARPS = 4


@triton.jit
def _prefill_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
    Q, K, V, Out, Slots, Lengths, TileStart, TileRows, anchor,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kb, stride_kt,
    stride_vs, stride_vh, stride_vb, stride_vt,
    stride_ob, stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (heads, tiles): query head `head` of the tile's rows, all in one slot.

    K and V point at slot `anchor` (see triton_attention.spare_views); the tile's slot is its first row's."""
    wait_then_release(PDL)
    head = tl.program_id(0)
    tile = tl.program_id(1)
    n_rows = tl.load(TileRows + tile).to(tl.int32)
    if n_rows > 0:
        first = tl.load(TileStart + tile)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        m_mask = offs_m < n_rows
        rows = first + offs_m
        slot = tl.load(Slots + first).to(tl.int64) - anchor  # relative to the slot K and V point at
        lengths = tl.load(Lengths + rows, mask=m_mask, other=1).to(tl.int32)  # (BLOCK_M,)
        hi = tl.max(lengths, 0)  # the tile's longest row
        kvh = head // GROUP
        q_mask = m_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + rows[:, None] * stride_qb + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        k_ptr = K + slot * stride_ks + kvh * stride_kh
        v_ptr = V + slot * stride_vs + kvh * stride_vh
        acc, m_i, l_i = attend(q, k_ptr, v_ptr, stride_kb, stride_kt, stride_vb, stride_vt, 0, hi, lengths[:, None],
                               qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK, BLOCK_T)
        out = acc / l_i[:, None]
        tl.store(Out + rows[:, None] * stride_ob + head * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=q_mask)


def prefill_attention(
    q: torch.Tensor,  # (T, H, hd)
    k_cache: torch.Tensor,  # (num_slots, KV, blocks, block, hd), any strides with a contiguous hd; last slot mapped
    v_cache: torch.Tensor,  # same
    slots: torch.Tensor,  # (T,) int64: the slot each row reads
    lengths: torch.Tensor,  # (T,) int32 or int64, >= 1: positions 0..length-1 are attended to
    tiles: torch.Tensor,  # (2, n) int64: each tile's first row and row count (0: unused), worker.kernels.tiles
    out: torch.Tensor | None = None,  # (T, H, hd) preallocated output (else allocated here)
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v per row over that row's slot and length, rows read in tiles; (T, H, hd).

    Rows in no tile are not written (the GPU executor's tiles cover every row, padding included)."""
    if out is None:
        out = torch.empty_like(q)
    check_shapes(q, k_cache, v_cache, slots, lengths, out)
    if tiles.dim() != 2 or tiles.shape[0] != 2 or tiles.dtype != torch.int64 or tiles.stride(1) != 1:
        raise ValueError(f"tiles {tuple(tiles.shape)} {tiles.dtype} must be (2, n) int64 rows of contiguous "
                         "first rows and row counts")
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if rows == 0 or tiles.shape[1] == 0:
        return out
    anchor, k_anchor, v_anchor = spare_views(k_cache, v_cache)
    _prefill_kernel[(heads, tiles.shape[1])](
        q, k_anchor, v_anchor, out, slots, lengths, tiles[0], tiles[1], anchor,
        *slab_strides(q, k_cache, v_cache), out.stride(0), out.stride(1), LOG2E / math.sqrt(head_dim),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=TILE_ROWS, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK=BLOCK_N, BLOCK_T=k_cache.shape[3], num_warps=NUM_WARPS, **launch_options(q),
    )
    return out
