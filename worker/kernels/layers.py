"""The GPU layer stack of Llama.forward with fused kernels: ~9 launches per layer instead of ~45.

The same steps as the Python loop in worker.model.llama.Llama.forward, in the same order and with the
same roundings (see worker.kernels.fused), around the same cuBLAS GEMMs and the same attention:

    x = rms_norm(h)                                    first layer only; later ones fuse the add
    q = rope_and_store(wqkv(x))                        RoPE on q, k; k and v into the cache
    x, h = add_rms_norm(wo(attention(q)), h)           h += attention; x = post_norm(h)
    x, h = add_rms_norm(w_down(silu_mul(w_gate_up(x))), h)  h += mlp; x = next input_norm(h)
    h = h + mlp                                        the last layer: Llama.forward norms it

Set as `Llama.fused_layers` by worker.engine.graphs.attach_gpu_kernels; used for graph-captured decode steps
and eager prefill chunks alike. Every kernel works row by row, so batch invariance is kept.

Batches marked `row_products` (the GPU executor's decode steps) go further, with the norms' weights
folded into the products (worker.model.llama.Layer): worker.kernels.matmul's kernels do each product with
what surrounds it, 6 launches per layer (7 when attention splits the keys):

    qkv = wqkv(rms_norm(h))                  the norm: a row scale from the squares the last product left
    q = rope_and_store(qkv)
    h = h + wo(attention(q))                 and the partial sums of squares of the new h
    act = silu(gate(rms_norm(h))) * up(...)  the norm as above, silu and the gated product
    h = h + w_down(act)                      and its squares, for the next layer's qkv

`fused_head` does the final norm in one kernel instead of torch's seven.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.kernels.fused import add_rms_norm, rms_norm, rope_and_store, silu_mul
from worker.kernels.matmul import row_matmul, row_squares, squares_tiles, tiles_for

if TYPE_CHECKING:
    from worker.model.llama import Batch, Layer, Llama


def fused_layers(
    model: Llama,
    h: torch.Tensor,  # (T, dim): the token embeddings
    cos: torch.Tensor,  # (T, hd) fp32: rope rows at each token's position
    sin: torch.Tensor,  # (T, hd) fp32
    positions: torch.Tensor,  # int64 (T,)
    slots: torch.Tensor,  # int64 (T,)
    state: dict[str, torch.Tensor],  # "k", "v": (num_slots, layers, kv_heads, blocks, block, head_dim)
    batch: Batch,
) -> torch.Tensor:
    """The residual stream after the last layer (T, dim), before the final norm; K/V written to `state`."""
    if batch.row_products:
        return _row_layers(model, h, cos, sin, positions, slots, state, batch)
    eps = model.config.norm_eps
    layers = model.layers
    h = h.contiguous()  # a no-op on the GPU; the CPU's transposed embedding (interpreter tests) gives strided rows
    x = rms_norm(h, layers[0].input_norm, eps)
    for li, layer in enumerate(layers):
        k_cache, v_cache = state["k"][:, li], state["v"][:, li]  # (num_slots, kv_heads, blocks, block, hd)
        attn = layer.wo(_attend(model, layer, layer.wqkv(x), cos, sin, positions, slots, k_cache, v_cache, batch))
        x, h = add_rms_norm(attn, h, layer.post_norm, eps)
        mlp = layer.w_down(silu_mul(layer.w_gate_up(x)))  # (T, dim)
        if li + 1 < len(layers):
            x, h = add_rms_norm(mlp, h, layers[li + 1].input_norm, eps)
        else:
            h = h + mlp
    return h


def _attend(
    model: Llama,
    layer: Layer,
    qkv: torch.Tensor,  # (T, (H + 2 KV) * hd): the qkv product
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    """The family's step before RoPE (worker.model.llama.Llama.before_rope), RoPE, this layer's K/V of the batch
    stored, then attention: (T, H * hd), the o product's input."""
    c = model.config
    qkv = model.before_rope(layer, qkv)
    fused = model.kernels.rope_decode_attention
    if batch.rope_in_attention and fused is not None and batch.lengths is not None:
        out: torch.Tensor = fused(qkv, cos, sin, k_cache, v_cache, slots, batch.lengths, c.n_heads)
        return out.reshape(-1, c.n_heads * c.head_dim)
    q = rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, positions, c.n_heads, c.n_kv_heads, c.head_dim)
    attn = model.attention(q, k_cache, v_cache, slots, batch)  # (T, H, hd)
    return attn.reshape(-1, c.n_heads * c.head_dim)


def _row_layers(
    model: Llama,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    state: dict[str, torch.Tensor],
    batch: Batch,
) -> torch.Tensor:
    """fused_layers for a row_products batch: the residual stream (T, dim), updated in place.

    The norms' weights are in the products (model.norms_folded), and a norm is a per-row scale that the
    next product applies from partial sums of squares the previous one left (worker.kernels.matmul)."""
    if not model.norms_folded:
        raise ValueError("row products need the norms folded into the products (Llama(fold_norms=True))")
    c = model.config
    eps = c.norm_eps
    rows = h.shape[0]
    h = h.contiguous()  # the embedding rows: a gathered copy, ours to update
    after_attention = h.new_empty((squares_tiles(c.dim, c.n_heads * c.head_dim), rows), dtype=torch.float32)
    after_mlp = h.new_empty((squares_tiles(c.dim, c.ffn_dim), rows), dtype=torch.float32)
    row_squares(h, after_mlp, block_n=tiles_for(c.dim, c.ffn_dim).block_n)  # the first layer's input: the embeddings
    for li, layer in enumerate(model.layers):
        k_cache, v_cache = state["k"][:, li], state["v"][:, li]
        qkv = layer.wqkv.add_bias(row_matmul(h, layer.wqkv.weight, norm_squares=after_mlp, eps=eps))
        attn = _attend(model, layer, qkv, cos, sin, positions, slots, k_cache, v_cache, batch)
        row_matmul(attn, layer.wo.weight, residual=h, out=h, squares_out=after_attention)
        act = row_matmul(h, layer.w_gate_up.weight, norm_squares=after_attention, eps=eps, silu=True)
        row_matmul(act, layer.w_down.weight, residual=h, out=h, squares_out=after_mlp)
    return h


def fused_head(model: Llama, h: torch.Tensor) -> torch.Tensor:
    """Llama.forward's last step, logits (T, vocab) fp32, with the norm in one kernel (cuBLAS's product:
    at 64 rows the head's 56 MB weight wants wide tiles that a row-invariant kernel does not have)."""
    return model.lm_head(rms_norm(h.contiguous(), model.norm, model.config.norm_eps)).float()
