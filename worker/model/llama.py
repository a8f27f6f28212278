"""A stateless Llama (Llama 1/2/3.x and Mistral): weights live here once; every session's K/V lives in the
session table. The other families of this shape (worker.model.qwen2, worker.model.qwen3) are subclasses that say
what they add: a bias on the q/k/v products, a norm over each head of q and k.

`forward` takes a flat batch of tokens. Token t belongs to the session in slot `slots[t]` and sits at
position `positions[t]` of it; its K/V are written to the state there, and it attends to positions
0..positions[t] of that same slot. Tokens of one session are contiguous in the batch and in order,
so a batch is a list of runs: prefill chunks (many tokens of one session) and decode rows (one
token each), mixed freely. Nothing here knows about sessions, sampling or scheduling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from cuda_state import BufferSpec, StateSpec
from worker.model.batch import NO_KERNELS, Batch, Kernels, Run, runs_of
from worker.model.config import ModelConfig
from worker.model.hf_config import read_common, refuse, refuse_unknown
from worker.model.layers import Linear, apply_rope, rms_norm
from worker.model.rope import rope_tables

__all__ = ["PACK_ALIGN", "Batch", "Layer", "Llama", "Run", "apply_rope", "rms_norm", "rope_tables", "runs_of"]

PACK_ALIGN = 512  # bytes: every packed weight starts at a multiple (cuBLAS and Triton want 16 at least)


class Layer:
    """One transformer block's weights, fused for fewer launches: qkv and gate|up.

    With fold_norms, each RMSNorm's weight is multiplied into the columns of the product after it
    (in fp32, before the cast) and the norm keeps a weight of ones: w @ (g * n) = (w * g) @ n. The
    norm is then a per-row scale, which a product can apply after summing (worker.kernels.matmul).
    A bias on the q/k/v products (Qwen2) is added after the product, so the fold leaves it as it is;
    the per-head norms of q and k (Qwen3) come after the product and are not folded.
    """

    def __init__(self, w: dict[str, torch.Tensor], i: int, device: torch.device, dtype: torch.dtype,
                 fold_norms: bool = False, qkv_bias: bool = False, qk_norm: bool = False) -> None:
        def get(name: str) -> torch.Tensor:
            return w[f"layers.{i}.{name}"]

        input_norm, post_norm = get("input_norm").float(), get("post_norm").float()
        qkv = torch.cat([get("q_proj"), get("k_proj"), get("v_proj")]).float()
        gate_up = torch.cat([get("gate_proj"), get("up_proj")]).float()
        if fold_norms:
            qkv, gate_up = qkv * input_norm, gate_up * post_norm
            input_norm, post_norm = torch.ones_like(input_norm), torch.ones_like(post_norm)
        bias = torch.cat([get("q_bias"), get("k_bias"), get("v_bias")]) if qkv_bias else None
        self.input_norm = input_norm.to(device=device, dtype=dtype)  # (dim,)
        self.wqkv = Linear(qkv, device, dtype, bias=bias)  # ((H+2KV)*hd, dim), bias ((H+2KV)*hd,)
        self.wo = Linear(get("o_proj"), device, dtype)  # (dim, H * hd)
        self.post_norm = post_norm.to(device=device, dtype=dtype)  # (dim,)
        self.w_gate_up = Linear(gate_up, device, dtype)  # (2 * ffn, dim)
        self.w_down = Linear(get("down_proj"), device, dtype)  # (dim, ffn)
        self.q_norm = get("q_norm").to(device=device, dtype=dtype) if qk_norm else None  # (hd,)
        self.k_norm = get("k_norm").to(device=device, dtype=dtype) if qk_norm else None  # (hd,)

    def linears(self) -> list[Linear]:
        return [self.wqkv, self.wo, self.w_gate_up, self.w_down]

    def tensors(self) -> list[tuple[object, str]]:
        """(owner, attribute) of every tensor of the layer: what pack_weights moves."""
        held: list[tuple[object, str]] = [(self, "input_norm"), (self, "post_norm")]
        held += [(linear, "weight") for linear in self.linears()]
        held += [(self.wqkv, "bias")] if self.wqkv.bias is not None else []
        held += [(self, "q_norm"), (self, "k_norm")] if self.q_norm is not None else []
        return held


class Llama:
    """The decoder every supported family shares; a family subclass sets its traits and overrides the hooks."""

    qkv_bias = False  # the q/k/v products carry a bias (weights "layers.N.q_bias", ...)
    qk_norm = False  # each head of q and k is RMS-normed before RoPE (weights "layers.N.q_norm", "layers.N.k_norm")

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        fold_norms: bool = False,  # the layers' norm weights multiplied into the products (see Layer)
        kernels: Kernels = NO_KERNELS,  # the GPU kernels the forward takes in place of plain torch
    ) -> None:
        self.config = config
        self.kernels = kernels
        self.norms_folded = fold_norms
        self.device = device
        self.dtype = dtype
        self.max_context = max_context
        # On the GPU the tensors are built in host memory, then moved in one block (pack_weights): the device holds
        # the weights once, never twice.
        build = torch.device("cpu") if device.type == "cuda" else device
        head = weights["embed"] if config.tie_embeddings else weights["lm_head"]
        self.lm_head = Linear(head, build, dtype, transposed=device.type == "cpu")  # (vocab, dim)
        # With tied weights the head is the embedding, stored once.
        self.embed = self.lm_head if config.tie_embeddings else Linear(weights["embed"], build, dtype)
        self.norm = weights["norm"].to(device=build, dtype=dtype)
        self.layers = [Layer(weights, i, build, dtype, fold_norms, self.qkv_bias, self.qk_norm)
                       for i in range(config.n_layers)]
        self.cos, self.sin = rope_tables(config, max_context, build, weights.get("rope_freqs"))
        if device.type == "cuda":
            self.pack_weights(device)

    def pack_weights(self, device: torch.device | None = None) -> None:
        """Move every weight and table into one allocation on `device` (default: where they are), as views at
        PACK_ALIGN-aligned offsets.

        Allocated one by one on the GPU, the ~200 tensors of a small model leave the caching allocator's 20 MiB
        segments part empty: on SmolLM2-135M 280 MiB reserved for 257 MiB of weights. One block costs its size
        rounded to 2 MiB."""
        holders: list[tuple[object, str]] = [(self.lm_head, "weight"), (self, "norm"), (self, "cos"), (self, "sin")]
        if self.embed is not self.lm_head:
            holders.append((self.embed, "weight"))
        for layer in self.layers:
            holders += layer.tensors()
        tensors = [getattr(owner, name) for owner, name in holders]
        places: list[tuple[int, int, torch.dtype, torch.Size]] = []  # (offset, bytes, dtype, shape) of each
        total = 0
        for t in tensors:
            places.append((total, t.numel() * t.element_size(), t.dtype, t.shape))
            total += -(-places[-1][1] // PACK_ALIGN) * PACK_ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
        for t, (offset, nbytes, dtype, shape) in zip(tensors, places, strict=True):
            flat[offset : offset + nbytes].view(dtype).view(shape).copy_(t)
        if device is not None:
            flat = flat.to(device)
        for (owner, name), (offset, nbytes, dtype, shape) in zip(holders, places, strict=True):
            setattr(owner, name, flat[offset : offset + nbytes].view(dtype).view(shape))

    def state_spec(self) -> StateSpec:
        """Per session: K and V for every layer, (layers, kv_heads, max_context, head_dim)."""
        c = self.config
        shape = (c.n_layers, c.n_kv_heads, self.max_context, c.head_dim)
        return StateSpec((BufferSpec("k", shape, self.dtype, seq_axis=2), BufferSpec("v", shape, self.dtype, seq_axis=2)))

    def weight_bytes(self) -> int:
        """Bytes of every weight (not the RoPE tables)."""
        held = [(self.lm_head, "weight"), (self, "norm")] + [t for layer in self.layers for t in layer.tensors()]
        if self.embed is not self.lm_head:
            held.append((self.embed, "weight"))
        tensors = [getattr(owner, name) for owner, name in held]
        return sum(t.numel() * t.element_size() for t in tensors)

    def before_rope(self, layer: Layer, qkv: torch.Tensor) -> torch.Tensor:
        """Hook between the q/k/v product (its bias added) and RoPE: qkv (T, (H+2KV)*hd). Llama: nothing."""
        return qkv

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # int64 (T,)
        positions: torch.Tensor,  # int64 (T,)
        slots: torch.Tensor,  # int64 (T,)
        state: dict[str, torch.Tensor],  # "k", "v": (num_slots, layers, kv_heads, max_context, head_dim)
        batch: Batch | None = None,
        logits_at: torch.Tensor | None = None,  # int64 (R,): rows whose logits are wanted; None = all
    ) -> torch.Tensor:
        """Logits (R, vocab) in float32 for the rows in `logits_at`."""
        if batch is None:
            batch = self.plan(slots.tolist(), positions.tolist())
        c = self.config
        h = self.embed.rows(token_ids)  # (T, dim)
        cos, sin = self.cos[positions], self.sin[positions]  # (T, hd)
        kernels = self.kernels
        if kernels.fused_layers is not None:
            h = kernels.fused_layers(self, h, cos, sin, positions, slots, state, batch)
        else:
            h = self._layers(h, cos, sin, positions, slots, state, batch)
        if logits_at is not None:
            h = h[logits_at]
        if batch.row_products and kernels.fused_layers is not None and kernels.fused_head is not None:
            return kernels.fused_head(self, h)
        return self.lm_head(rms_norm(h, self.norm, c.norm_eps)).float()

    def _layers(
        self,
        h: torch.Tensor,  # (T, dim)
        cos: torch.Tensor,  # (T, hd)
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        state: dict[str, torch.Tensor],
        batch: Batch,
    ) -> torch.Tensor:
        """The layer stack in plain torch: the residual stream after the last layer (T, dim)."""
        c = self.config
        k_all, v_all = state["k"], state["v"]
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.norm_eps)
            q, k, v = self.before_rope(layer, layer.wqkv(x)).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(-1, c.n_heads, c.head_dim), cos, sin)
            k = apply_rope(k.view(-1, c.n_kv_heads, c.head_dim), cos, sin)
            v = v.view(-1, c.n_kv_heads, c.head_dim)
            k_cache, v_cache = k_all[:, li], v_all[:, li]  # (num_slots, kv_heads, max_context, hd)
            k_cache[slots, :, positions] = k
            v_cache[slots, :, positions] = v
            attn = self.attention(q, k_cache, v_cache, slots, batch)  # (T, H, hd)
            h = h + layer.wo(attn.reshape(-1, q_size))
            x = rms_norm(h, layer.post_norm, c.norm_eps)
            gate, up = layer.w_gate_up(x).chunk(2, dim=-1)
            h = h + layer.w_down(F.silu(gate) * up)
        return h

    def plan(self, slots: list[int], positions: list[int], lengths_on_device: bool = False) -> Batch:
        runs = runs_of(slots, positions)
        decode_only = all(r.n == 1 for r in runs)
        lengths = None
        if decode_only and lengths_on_device:
            lengths = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=self.device)
        return Batch(runs, decode_only, lengths)

    def attention(
        self,
        q: torch.Tensor,  # (T, H, hd)
        k_cache: torch.Tensor,  # (num_slots, KV, max_context, hd)
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # (T,)
        batch: Batch,
    ) -> torch.Tensor:
        kernels = self.kernels
        if batch.tiles is not None and kernels.prefill_attention is not None:
            if batch.lengths is None:
                raise ValueError("a batch with attention tiles needs its rows' lengths")
            tiled: torch.Tensor = kernels.prefill_attention(q, k_cache, v_cache, slots, batch.lengths, batch.tiles)
            return tiled
        if batch.decode_only and kernels.decode_attention is not None and batch.lengths is not None:
            out: torch.Tensor = kernels.decode_attention(q, k_cache, v_cache, slots, batch.lengths,
                                                      splits=batch.attention_splits)
            return out
        outs = [self._run_attention(q, k_cache, v_cache, batch, i) for i in range(len(batch.runs))]
        if not batch.padded:
            return torch.cat(outs, dim=0)
        out = q.new_zeros(q.shape)
        for run, o in zip(batch.runs, outs, strict=True):
            out[run.start : run.start + run.n] = o
        return out

    def _run_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, i: int) -> torch.Tensor:
        """Causal attention of one session's run over its cached prefix, read in place from the slab."""
        run = batch.runs[i]
        end = run.pos + run.n
        qs = q[run.start : run.start + run.n].transpose(0, 1)  # (H, n, hd)
        k = k_cache[run.slot, :, :end]  # (KV, end, hd), a view of the slab
        v = v_cache[run.slot, :, :end]
        mask = None
        if run.n > 1 and run.pos > 0:
            mask = batch.masks.get(i)
            if mask is None:
                key_pos = torch.arange(end, device=q.device)
                query_pos = torch.arange(run.pos, end, device=q.device)
                mask = batch.masks[i] = key_pos[None, :] <= query_pos[:, None]  # (n, end)
        # A run from position 0 is plain causal attention: no mask tensor, the fused kernels apply.
        causal = run.n > 1 and run.pos == 0
        out = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask, is_causal=causal, enable_gqa=True)[0]
        return out.transpose(0, 1)  # (n, H, hd)


# -- reading a Hugging Face config.json (transformers' `llama` and `mistral`) -----------------------------------

# Hugging Face tensor names of one layer -> ours ("layers.N.<ours>"); the families add theirs.
HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}


def read_hf_config(cfg: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    """Llama 1/2/3.x and Mistral: no biases (attention_bias, mlp_bias refused when set), one tensor-parallel rank's
    arithmetic (pretraining_tp > 1 refused); a sliding window caps the context (worker.model.hf_config)."""
    refuse_unknown(cfg, ("attention_bias", "mlp_bias", "pretraining_tp"), where)
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise refuse(where, field, cfg[field], "Llama without biases only")
    if int(cfg.get("pretraining_tp") or 1) != 1:
        raise refuse(where, "pretraining_tp", cfg["pretraining_tp"], "the products are not split")
    return ModelConfig(**read_common(cfg, name, "llama", where))
