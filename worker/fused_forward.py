"""The GPU layer stack of Llama.forward with fused kernels: ~9 launches per layer instead of ~45.

The same steps as the Python loop in worker.model.Llama.forward, in the same order and with the
same roundings (see worker.triton_fused), around the same cuBLAS GEMMs and the same attention:

    x = rms_norm(h)                                    first layer only; later ones fuse the add
    q = rope_and_store(wqkv(x))                        RoPE on q, k; k and v into the cache
    x, h = add_rms_norm(wo(attention(q)), h)           h += attention; x = post_norm(h)
    x, h = add_rms_norm(w_down(silu_mul(w_gate_up(x))), h)  h += mlp; x = next input_norm(h)
    h = h + mlp                                        the last layer: Llama.forward norms it

Set as `Llama.fused_layers` by worker.gpu.attach_gpu_kernels; used for graph-captured decode steps
and eager prefill chunks alike. Every kernel works row by row, so batch invariance is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .triton_fused import add_rms_norm, rms_norm, rope_and_store, silu_mul

if TYPE_CHECKING:
    from .model import Batch, Layer, Llama


def fused_layers(
    model: Llama,
    h: torch.Tensor,  # (T, dim): the token embeddings
    cos: torch.Tensor,  # (T, hd) fp32: rope rows at each token's position
    sin: torch.Tensor,  # (T, hd) fp32
    positions: torch.Tensor,  # int64 (T,)
    slots: torch.Tensor,  # int64 (T,)
    state: dict[str, torch.Tensor],  # "k", "v": (num_slots, layers, kv_heads, max_context, head_dim)
    batch: Batch,
) -> torch.Tensor:
    """The residual stream after the last layer (T, dim), before the final norm; K/V written to `state`."""
    eps = model.config.norm_eps
    layers = model.layers
    h = h.contiguous()  # a no-op on the GPU; the CPU's transposed embedding (interpreter tests) gives strided rows
    x = rms_norm(h, layers[0].input_norm, eps)
    for li, layer in enumerate(layers):
        k_cache, v_cache = state["k"][:, li], state["v"][:, li]  # (num_slots, kv_heads, max_context, hd)
        attn = _attention(model, layer, x, cos, sin, positions, slots, k_cache, v_cache, batch)
        x, h = add_rms_norm(attn, h, layer.post_norm, eps)
        mlp = layer.w_down(silu_mul(layer.w_gate_up(x)))  # (T, dim)
        if li + 1 < len(layers):
            x, h = add_rms_norm(mlp, h, layers[li + 1].input_norm, eps)
        else:
            h = h + mlp
    return h


def _attention(
    model: Llama,
    layer: Layer,
    x: torch.Tensor,  # (T, dim): the normed input
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,  # (num_slots, kv_heads, max_context, hd): this layer's slab view
    v_cache: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    """The attention block's output projection (T, dim); this layer's K/V of the batch stored first."""
    c = model.config
    q = rope_and_store(layer.wqkv(x), cos, sin, k_cache, v_cache, slots, positions, c.n_heads, c.n_kv_heads, c.head_dim)
    attn = model.attention(q, k_cache, v_cache, slots, batch)  # (T, H, hd)
    return layer.wo(attn.reshape(-1, c.n_heads * c.head_dim))
