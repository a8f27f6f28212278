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

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from cuda_state import BufferSpec, StateSpec, store_positions
from cuda_state import positions as positions_of
from worker.model.batch import NO_KERNELS, Batch, Kernels, Run, runs_of
from worker.model.config import ModelConfig, ModelLoadError
from worker.model.draw import Draw
from worker.model.hf_config import read_common, refuse, refuse_unknown
from worker.model.layers import Linear, apply_rope, rms_norm
from worker.model.packing import PACK_ALIGN, Pack, Place
from worker.model.rope import rope_tables

__all__ = ["PACK_ALIGN", "Batch", "Layer", "Llama", "Run", "apply_rope", "rms_norm", "rope_tables", "runs_of"]

class Layer:
    """One transformer block's weights, fused for fewer launches: qkv and gate|up (views of the model's pack).

    With fold_norms, each RMSNorm's weight is multiplied into the columns of the product after it
    (in fp32, before the cast) and the norm keeps a weight of ones: w @ (g * n) = (w * g) @ n. The
    norm is then a per-row scale, which a product can apply after summing (worker.kernels.matmul).
    A bias on the q/k/v products (Qwen2) is added after the product, so the fold leaves it as it is;
    the per-head norms of q and k (Qwen3) come after the product and are not folded.
    """

    def __init__(self, views: Mapping[str, torch.Tensor], i: int, qkv_bias: bool = False, qk_norm: bool = False) -> None:
        def view(name: str) -> torch.Tensor:
            return views[f"layers.{i}.{name}"]

        self.input_norm = view("input_norm")  # (dim,)
        self.wqkv = Linear(view("wqkv"), bias=view("wqkv_bias") if qkv_bias else None)  # ((H+2KV)*hd, dim)
        self.wo = Linear(view("wo"))  # (dim, H * hd)
        self.post_norm = view("post_norm")  # (dim,)
        self.w_gate_up = Linear(view("w_gate_up"))  # (2 * ffn, dim)
        self.w_down = Linear(view("w_down"))  # (dim, ffn)
        self.q_norm = view("q_norm") if qk_norm else None  # (hd,)
        self.k_norm = view("k_norm") if qk_norm else None  # (hd,)

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, i: int, dtype: torch.dtype, fold_norms: bool, qkv_bias: bool,
                qk_norm: bool) -> None:
        """Layer i's packed tensors and where each source tensor ("layers.i.q_proj", ...) goes."""
        hd, q, kv, f = c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.ffn_dim
        p = f"layers.{i}."
        for name, shape in (("input_norm", (c.dim,)), ("post_norm", (c.dim,)), ("wqkv", (q + 2 * kv, c.dim)),
                            ("wo", (c.dim, q)), ("w_gate_up", (2 * f, c.dim)), ("w_down", (c.dim, f))):
            pack.add(p + name, shape, dtype)
        before_qkv = p + "input_norm" if fold_norms else None
        before_mlp = p + "post_norm" if fold_norms else None
        for name, start, stop in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
            pack.route(p + name, Place(p + "wqkv", start, stop, fold=before_qkv))
        pack.route(p + "gate_proj", Place(p + "w_gate_up", 0, f, fold=before_mlp))
        pack.route(p + "up_proj", Place(p + "w_gate_up", f, 2 * f, fold=before_mlp))
        pack.route(p + "o_proj", Place(p + "wo"))
        pack.route(p + "down_proj", Place(p + "w_down"))
        if fold_norms:
            pack.folded(p + "input_norm")
            pack.folded(p + "post_norm")
        else:
            pack.route(p + "input_norm", Place(p + "input_norm"))
            pack.route(p + "post_norm", Place(p + "post_norm"))
        if qkv_bias:
            pack.add(p + "wqkv_bias", (q + 2 * kv,), dtype)
            for name, start, stop in (("q_bias", 0, q), ("k_bias", q, q + kv), ("v_bias", q + kv, q + 2 * kv)):
                pack.route(p + name, Place(p + "wqkv_bias", start, stop))
        if qk_norm:
            for name in ("q_norm", "k_norm"):
                pack.add(p + name, (hd,), dtype)
                pack.route(p + name, Place(p + name))

    def linears(self) -> list[Linear]:
        return [self.wqkv, self.wo, self.w_gate_up, self.w_down]

    def tensors(self) -> list[torch.Tensor]:
        held = [self.input_norm, self.post_norm] + [linear.weight for linear in self.linears()]
        held += [self.wqkv.bias] if self.wqkv.bias is not None else []
        held += [self.q_norm, self.k_norm] if self.q_norm is not None and self.k_norm is not None else []
        return held


class Llama:
    """The decoder every supported family shares; a family subclass sets its traits and overrides the hooks."""

    qkv_bias = False  # the q/k/v products carry a bias (weights "layers.N.q_bias", ...)
    qk_norm = False  # each head of q and k is RMS-normed before RoPE (weights "layers.N.q_norm", "layers.N.k_norm")

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],  # source tensors, our names
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
        c = config
        cpu = device.type == "cpu"
        pack = Pack()
        pack.add("lm_head", (c.dim, c.vocab_size) if cpu else (c.vocab_size, c.dim), dtype)
        pack.route("embed" if c.tie_embeddings else "lm_head", Place("lm_head", transposed=cpu))
        if not c.tie_embeddings:
            pack.add("embed", (c.vocab_size, c.dim), dtype)
            pack.route("embed", Place("embed"))
        pack.add("norm", (c.dim,), dtype)
        pack.route("norm", Place("norm"))
        for i in range(c.n_layers):
            Layer.declare(pack, c, i, dtype, fold_norms, self.qkv_bias, self.qk_norm)
        pack.add("cos", (max_context, c.head_dim), torch.float32)
        pack.add("sin", (max_context, c.head_dim), torch.float32)
        views = pack.allocate(device)
        items = weights.items() if isinstance(weights, Mapping) else weights
        extra = pack.fill(items, where=c.name)
        unknown = sorted(set(extra) - {"rope_freqs"})
        if unknown:
            raise ModelLoadError(f"{c.name}: tensors that are not part of a {c.family} model: {', '.join(unknown[:8])}")
        self.lm_head = Linear(views["lm_head"], transposed=cpu)  # (vocab, dim)
        # With tied weights the head is the embedding, stored once.
        self.embed = self.lm_head if c.tie_embeddings else Linear(views["embed"])
        self.norm = views["norm"]
        self.layers = [Layer(views, i, self.qkv_bias, self.qk_norm) for i in range(c.n_layers)]
        cos, sin = rope_tables(c, max_context, device, extra.get("rope_freqs"))
        self.cos, self.sin = views["cos"].copy_(cos), views["sin"].copy_(sin)

    def state_spec(self) -> StateSpec:
        """Per session: K and V for every layer, (layers, kv_heads, max_context, head_dim)."""
        c = self.config
        shape = (c.n_layers, c.n_kv_heads, self.max_context, c.head_dim)
        return StateSpec((BufferSpec("k", shape, self.dtype, seq_axis=2), BufferSpec("v", shape, self.dtype, seq_axis=2)))

    @property
    def takes_row_products(self) -> bool:
        """Decode steps may run the products in worker.kernels.matmul's row-invariant kernels: with the fused layer
        stack, its norms folded into the products (see Layer)."""
        return self.kernels.fused_layers is not None and self.norms_folded

    def weight_bytes(self) -> int:
        """Bytes of every weight (not the RoPE tables)."""
        tensors = [self.lm_head.weight, self.norm] + [t for layer in self.layers for t in layer.tensors()]
        if self.embed is not self.lm_head:
            tensors.append(self.embed.weight)
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
        state: dict[str, torch.Tensor],  # "k", "v": (num_slots, layers, kv_heads, blocks, block, head_dim)
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
            k_cache, v_cache = k_all[:, li], v_all[:, li]  # (num_slots, kv_heads, blocks, block, hd)
            store_positions(k_cache, slots, positions, k)
            store_positions(v_cache, slots, positions, v)
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
        k_cache: torch.Tensor,  # (num_slots, KV, blocks, block, hd)
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
        k = positions_of(k_cache, run.slot, end)  # (KV, end, hd)
        v = positions_of(v_cache, run.slot, end)
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
    """Llama 1/2/3.x and Mistral: no biases (attention_bias, mlp_bias refused when set); a sliding window caps the
    context (worker.model.hf_config). pretraining_tp changes nothing: transformers 5 does not read it, and 4.x only
    cut each product into that many slices and summed the same terms."""
    refuse_unknown(cfg, ("attention_bias", "mlp_bias", "pretraining_tp"), where)
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise refuse(where, field, cfg[field], "Llama without biases only")
    return ModelConfig(**read_common(cfg, name, "llama", where))


def random_layer(c: ModelConfig, i: int, draw: Draw) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer i's tensors for a random preset (worker.model.loader): products normal(0, 0.02), norms of ones, biases
    normal (Qwen2), per-head q/k norms of ones (Qwen3)."""
    p, d, hd, f = f"layers.{i}.", c.dim, c.head_dim, c.ffn_dim
    q, kv = c.n_heads * hd, c.n_kv_heads * hd
    if c.qkv_bias:
        yield from ((p + "q_bias", draw.normal(q)), (p + "k_bias", draw.normal(kv)), (p + "v_bias", draw.normal(kv)))
    if c.qk_norm:
        yield from ((p + "q_norm", draw.ones(hd)), (p + "k_norm", draw.ones(hd)))
    yield p + "input_norm", draw.ones(d)
    yield p + "q_proj", draw.normal(q, d)
    yield p + "k_proj", draw.normal(kv, d)
    yield p + "v_proj", draw.normal(kv, d)
    yield p + "o_proj", draw.normal(d, q)
    yield p + "post_norm", draw.ones(d)
    yield p + "gate_proj", draw.normal(f, d)
    yield p + "up_proj", draw.normal(f, d)
    yield p + "down_proj", draw.normal(d, f)
