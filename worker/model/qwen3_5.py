"""Qwen3.5 (transformers' `qwen3_5_text`, and the text part of `qwen3_5` folders): a hybrid decoder whose layers mix
tokens either by gated DeltaNet (linear attention with a recurrent state) or by gated full attention, in the order
the config's `layer_types` gives (three linear layers to one full in the published shapes).

- Gated DeltaNet layer: one product gives q|k|v (the convolution's channels), z (the output gate), b (beta) and a
  (the decay's input); q|k|v pass a depthwise causal convolution of `conv_kernel` taps and SiLU; the gated delta rule
  (worker.model.delta_rule) runs per value head with g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b),
  each key head serving value_heads / key_heads value heads; its output is RMS-normed per head, times SiLU(z), and
  projected back (out_proj).
- Full-attention layer: q_proj gives each head's query and an output gate side by side; q and k are RMS-normed per
  head, RoPE turns the first rotary_dim dims of each head (partial rotary); the attention's output is multiplied by
  sigmoid(gate) before o_proj.
- Every RMSNorm but the DeltaNet's output norm scales by (1 + weight) (the stored weights are centred on zero); the
  loader's weights keep their stored values and the model adds the one when it packs them, in fp32.

Per session (state_spec): K and V for the full-attention layers only, which grow with the context, and for each
linear layer a convolution state (the last conv_kernel - 1 inputs of its channels) and the recurrent state (value
heads x key_dim x value_dim, fp32), which do not. A run of a session's tokens from position 0 starts from zero state
whatever its slot holds; a later run continues from the state its slot holds, and leaves it after its last token.
So the state of a slot is exact only at the session's computed length: the engine never runs a token twice into it
(worker.engine.core).

The arithmetic follows transformers' modeling_qwen3_5 step by step in the same dtypes (its pure-torch paths: the
chunked delta rule for prompts, the recurrent one for decode rows), so the CPU model in fp32 gives its numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from cuda_state import BufferSpec, StateSpec, store_positions
from worker.model import delta_rule
from worker.model.batch import NO_KERNELS, Batch, HybridKernels, Kernels, Run
from worker.model.config import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttention, ModelConfig, ModelLoadError
from worker.model.draw import Draw
from worker.model.hf_config import read_common, refuse, refuse_unknown, rope_params
from worker.model.layers import Linear, apply_rope
from worker.model.llama import Llama
from worker.model.packing import Pack, Place
from worker.model.rope import rope_tables

# Hugging Face tensor names of one layer -> ours ("layers.N.<ours>"): the shared ones, then each mixer's.
HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "linear_attn.in_proj_qkv.weight": "in_proj_qkv",
    "linear_attn.in_proj_z.weight": "in_proj_z",
    "linear_attn.in_proj_b.weight": "in_proj_b",
    "linear_attn.in_proj_a.weight": "in_proj_a",
    "linear_attn.conv1d.weight": "conv",
    "linear_attn.A_log": "A_log",
    "linear_attn.dt_bias": "dt_bias",
    "linear_attn.norm.weight": "gated_norm",
    "linear_attn.out_proj.weight": "out_proj",
}
# Tensor name prefixes of a folder that are not part of text generation: the vision tower of `qwen3_5` folders and
# the multi-token-prediction head (speculative decoding). transformers leaves them out of the text model as well.
HF_SKIPPED = ("model.visual.", "mtp.")
FRESH, PROMPT, DECODE = 0, 1, 2  # where a run's convolution starts (Qwen3_5._convolve)
# Our names of the norms stored centred on zero (the model scales by 1 + weight).
UNIT_OFFSET_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm")


def offset_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNorm: normed in fp32, times (1 + weight) in fp32, then in x's dtype. The pack holds
    1 + weight already, in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNormGated: weight * norm(x), times SiLU(gate) in fp32, in x's dtype."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over the first cos.shape[-1] dims of each head of x (T, heads, hd); the rest as it is."""
    turned = cos.shape[-1]
    if turned == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)


class Products:
    """Products of one input packed as one weight's row ranges: one product on the GPU, then split; one product per
    part on the CPU, as transformers computes them (a product's rows can sum in another order when it is part of a
    wider one, and the CPU model must give transformers' bits)."""

    def __init__(self, weight: torch.Tensor, sizes: list[int]) -> None:
        self.fused = Linear(weight)
        self.sizes = sizes
        self.parts = [Linear(w) for w in weight.split(sizes)]
        self.apart = weight.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.apart:
            return tuple(part(x) for part in self.parts)
        return self.fused(x).split(self.sizes, dim=-1)


class Attention:
    """A gated full-attention layer's weights: q (with each head's gate beside it) | k | v in one product."""

    def __init__(self, views: Mapping[str, torch.Tensor], p: str, index: int, c: ModelConfig) -> None:
        self.index = index  # its place among the full-attention layers (the K/V buffers' layer axis)
        kv = c.n_kv_heads * c.head_dim
        self.wqkv = Products(views[p + "wqkv"], [2 * c.n_heads * c.head_dim, kv, kv])  # (2 * H * hd + 2 * KV * hd, dim)
        self.wo = Linear(views[p + "wo"])  # (dim, H * hd)
        self.q_norm = views[p + "q_norm"]  # (hd,) fp32, 1 + weight
        self.k_norm = views[p + "k_norm"]

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, p: str, dtype: torch.dtype) -> None:
        hd = c.head_dim
        q, kv = 2 * c.n_heads * hd, c.n_kv_heads * hd  # q_proj: each head's query then its gate
        pack.add(p + "wqkv", (q + 2 * kv, c.dim), dtype)
        pack.add(p + "wo", (c.dim, c.n_heads * hd), dtype)
        for name, start, stop in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
            pack.route(p + name, Place(p + "wqkv", start, stop))
        pack.route(p + "o_proj", Place(p + "wo"))
        for name in ("q_norm", "k_norm"):
            pack.add(p + name, (hd,), torch.float32)
            pack.route(p + name, Place(p + name))

    def tensors(self) -> list[torch.Tensor]:
        return [self.wqkv.fused.weight, self.wo.weight, self.q_norm, self.k_norm]


class DeltaNet:
    """A gated DeltaNet layer's weights: q|k|v|z|b|a in one product, the convolution, the decay's parameters, the
    output norm and out_proj."""

    def __init__(self, views: Mapping[str, torch.Tensor], p: str, index: int, c: ModelConfig) -> None:
        self.index = index  # its place among the linear layers (the conv and recurrent buffers' layer axis)
        lin = _linear(c)
        # q|k|v (conv_dim), z (value_heads * value_dim), b and a (value_heads each)
        self.w_in = Products(views[p + "w_in"], [lin.conv_dim, lin.value_heads * lin.value_dim, lin.value_heads,
                                                 lin.value_heads])
        self.conv = views[p + "conv"]  # (conv_dim, 1, conv_kernel), as F.conv1d takes it
        self.A_log = views[p + "A_log"]  # (value_heads,)
        self.dt_bias = views[p + "dt_bias"]  # (value_heads,)
        self.gated_norm = views[p + "gated_norm"]  # (value_dim,)
        self.w_out = Linear(views[p + "w_out"])  # (dim, value_heads * value_dim)

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, p: str, dtype: torch.dtype) -> None:
        lin = _linear(c)
        conv, values, heads = lin.conv_dim, lin.value_heads * lin.value_dim, lin.value_heads
        pack.add(p + "w_in", (conv + values + 2 * heads, c.dim), dtype)
        bounds = (("in_proj_qkv", 0, conv), ("in_proj_z", conv, conv + values),
                  ("in_proj_b", conv + values, conv + values + heads),
                  ("in_proj_a", conv + values + heads, conv + values + 2 * heads))
        for name, start, stop in bounds:
            pack.route(p + name, Place(p + "w_in", start, stop))
        for name, shape in (("conv", (conv, 1, lin.conv_kernel)), ("A_log", (heads,)), ("dt_bias", (heads,)),
                            ("gated_norm", (lin.value_dim,)), ("w_out", (c.dim, values))):
            pack.add(p + name, shape, dtype)
        for name in ("conv", "A_log", "dt_bias", "gated_norm"):
            pack.route(p + name, Place(p + name))
        pack.route(p + "out_proj", Place(p + "w_out"))

    def tensors(self) -> list[torch.Tensor]:
        return [self.w_in.fused.weight, self.conv, self.A_log, self.dt_bias, self.gated_norm, self.w_out.weight]


class Mlp:
    """A layer's MLP: declared in the pack, read from its views, run by the torch path (`__call__`) and by the GPU
    kernels (`add_kernels`). DenseMlp here; the sparse mixture of experts in worker.model.qwen3_5_moe."""

    def __init__(self, views: Mapping[str, torch.Tensor], p: str, c: ModelConfig) -> None:
        """The MLP of the layer whose tensors are named `p` + ... in `views`."""

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, p: str, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output for the normed rows x (T, dim), as transformers computes it."""
        raise NotImplementedError

    def add_kernels(self, k: HybridKernels, h: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """h + the MLP's output for x, in the GPU kernels (row-invariant ones for decode steps: batch.row_products)."""
        raise NotImplementedError

    def add_kernels_normed(self, k: HybridKernels, h: torch.Tensor, x: torch.Tensor, batch: Batch,
                           norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """add_kernels's rows and the same normed by `norm` (1 + weight: the next layer's input norm or the final
        norm). Here in two steps; an MLP whose last kernel can norm the rows it writes does it there."""
        out = self.add_kernels(k, h, x, batch)
        return out, k.offset_rms_norm(out, norm, eps)


class DenseMlp(Mlp):
    """gate|up fused, SiLU, down (as Llama's)."""

    def __init__(self, views: Mapping[str, torch.Tensor], p: str, c: ModelConfig) -> None:
        self.w_gate_up = Products(views[p + "w_gate_up"], [c.ffn_dim, c.ffn_dim])
        self.w_down = Linear(views[p + "w_down"])

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, p: str, dtype: torch.dtype) -> None:
        f = c.ffn_dim
        pack.add(p + "w_gate_up", (2 * f, c.dim), dtype)
        pack.add(p + "w_down", (c.dim, f), dtype)
        pack.route(p + "gate_proj", Place(p + "w_gate_up", 0, f))
        pack.route(p + "up_proj", Place(p + "w_gate_up", f, 2 * f))
        pack.route(p + "down_proj", Place(p + "w_down"))

    def tensors(self) -> list[torch.Tensor]:
        return [self.w_gate_up.fused.weight, self.w_down.weight]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x)
        return self.w_down(F.silu(gate) * up)

    def add_kernels(self, k: HybridKernels, h: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if batch.row_products:
            act = k.row_matmul(x, self.w_gate_up.fused.weight, silu=True)
            return k.row_matmul(act, self.w_down.weight, residual=h)
        gate, up = F.linear(x, self.w_gate_up.fused.weight).split(self.w_gate_up.sizes, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.w_down.weight)


class Block:
    """One layer: its norms (1 + weight, fp32), its token mixer, and its MLP."""

    def __init__(self, views: Mapping[str, torch.Tensor], i: int, mixer: Attention | DeltaNet, mlp: Mlp) -> None:
        p = f"layers.{i}."
        self.input_norm = views[p + "input_norm"]
        self.post_norm = views[p + "post_norm"]
        self.mixer = mixer
        self.mlp = mlp

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, i: int, dtype: torch.dtype, mlp: type[Mlp]) -> None:
        p = f"layers.{i}."
        for name in ("input_norm", "post_norm"):
            pack.add(p + name, (c.dim,), torch.float32)
            pack.route(p + name, Place(p + name))
        mlp.declare(pack, c, p, dtype)
        (Attention if c.mixer(i) == FULL_ATTENTION else DeltaNet).declare(pack, c, p, dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_norm, self.post_norm, *self.mlp.tensors(), *self.mixer.tensors()]


class Qwen3_5(Llama):
    """The hybrid decoder. It shares Llama's engine-facing interface (forward, plan, state_spec) and its attention
    over the slab; Llama's own layer list stays empty (its fused GPU stack does not apply): the layers are `blocks`.
    Each layer's MLP is a `mlp_class` (DenseMlp here; a subclass sets another)."""

    mlp_class: type[Mlp] = DenseMlp

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        fold_norms: bool = False,  # not taken: the norms scale by 1 + weight in fp32 (offset_rms_norm)
        kernels: Kernels = NO_KERNELS,
    ) -> None:
        c = config
        if c.linear is None and LINEAR_ATTENTION in c.layer_types:
            raise ModelLoadError(f"{c.name}: linear-attention layers without their shape")
        self.config = c
        # The Llama layer stack's fused kernels are not this model's; the attention kernels over the slab are.
        self.kernels = dataclasses.replace(kernels, fused_layers=None, fused_head=None)
        self.norms_folded = False
        self.device = device
        self.dtype = dtype
        self.max_context = max_context
        pack = Pack()
        # The head as stored, (vocab, dim), on the CPU too (Llama's CPU head is transposed, for speed): a product of
        # the same layout as transformers' gives its bits.
        pack.add("lm_head", (c.vocab_size, c.dim), dtype)
        pack.route("embed" if c.tie_embeddings else "lm_head", Place("lm_head"))
        if not c.tie_embeddings:
            pack.add("embed", (c.vocab_size, c.dim), dtype)
            pack.route("embed", Place("embed"))
        pack.add("norm", (c.dim,), torch.float32)
        pack.route("norm", Place("norm"))
        for i in range(c.n_layers):
            Block.declare(pack, c, i, dtype, self.mlp_class)
        pack.add("cos", (max_context, c.rotary_dim), torch.float32)
        pack.add("sin", (max_context, c.rotary_dim), torch.float32)
        views = pack.allocate(device)
        items = self._sources(pack, c, weights.items() if isinstance(weights, Mapping) else weights)
        extra = pack.fill(_unit_offset(items), where=c.name)
        if extra:
            raise ModelLoadError(f"{c.name}: tensors that are not part of a {c.family} model: {', '.join(sorted(extra)[:8])}")
        self.lm_head = Linear(views["lm_head"])
        self.embed = self.lm_head if c.tie_embeddings else Linear(views["embed"])
        self.norm = views["norm"]
        self.layers = []
        self.blocks: list[Block] = []
        full = linear = 0
        for i in range(c.n_layers):
            p = f"layers.{i}."
            mixer: Attention | DeltaNet
            if c.mixer(i) == FULL_ATTENTION:
                mixer, full = Attention(views, p, full, c), full + 1
            else:
                mixer, linear = DeltaNet(views, p, linear, c), linear + 1
            self.blocks.append(Block(views, i, mixer, self.mlp_class(views, p, c)))
        self.full_layers, self.linear_layers = full, linear
        cos, sin = rope_tables(c, max_context, device)
        self.cos, self.sin = views["cos"].copy_(cos), views["sin"].copy_(sin)

    def _sources(self, pack: Pack, c: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterable[tuple[str, torch.Tensor]]:
        """The source tensors as the pack takes them (a subclass may route more places by what the source holds)."""
        return weights

    def state_spec(self) -> StateSpec:
        return state_spec(self.config, self.max_context, self.dtype)

    def weight_bytes(self) -> int:
        tensors = [self.lm_head.weight, self.norm] + [t for block in self.blocks for t in block.tensors()]
        if self.embed is not self.lm_head:
            tensors.append(self.embed.weight)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def takes_row_products(self) -> bool:
        """Decode steps may run the products in the row-invariant kernels (its own norms stay apart)."""
        return self.kernels.hybrid is not None

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # int64 (T,)
        positions: torch.Tensor,  # int64 (T,)
        slots: torch.Tensor,  # int64 (T,)
        state: dict[str, torch.Tensor],  # state_spec's buffers, (num_slots, ...) each
        batch: Batch | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (R, vocab) in float32 for the rows in `logits_at` (all rows: None).

        In plain torch (the CPU) the DeltaNet layers go run by run (batch.runs, planned here when not given). With the
        GPU kernels (kernels.hybrid) nothing is read back to the host, so a step can be captured in a CUDA graph: a
        batch with prompt tiles (batch.tiles) is a prefill step whose runs the kernels find in them, any other has one
        token per row (a decode step)."""
        if batch is None:
            batch = self.plan(slots.tolist(), positions.tolist(), lengths_on_device=self.device.type == "cuda")
        c = self.config
        h = self.embed.rows(token_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        hybrid = self.kernels.hybrid
        if hybrid is not None:
            if batch.tiles is None and not batch.decode_only:  # prompt chunks planned here (an eager GPU step)
                batch = dataclasses.replace(batch, tiles=run_tiles(batch.runs, h.device),
                                            lengths=(positions + 1).to(torch.int32))
            return self._kernel_forward(hybrid, h, cos, sin, positions, slots, state, batch, logits_at)
        if not batch.runs and len(token_ids):
            raise ValueError("the torch path needs the batch's runs")
        runs = _Runs(batch.runs, h.device)
        for block in self.blocks:
            x = offset_rms_norm(h, block.input_norm, c.norm_eps)
            if isinstance(block.mixer, Attention):
                h = h + self._attend(block.mixer, x, cos, sin, positions, slots, state, batch)
            else:
                h = h + self._delta(block.mixer, x, state, runs)
            h = h + block.mlp(offset_rms_norm(h, block.post_norm, c.norm_eps))
        if logits_at is not None:
            h = h[logits_at]
        return self.lm_head(offset_rms_norm(h, self.norm, c.norm_eps)).float()

    def _kernel_forward(self, k: HybridKernels, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, slots: torch.Tensor, state: dict[str, torch.Tensor], batch: Batch,
                        logits_at: torch.Tensor | None) -> torch.Tensor:
        """The forward in the GPU kernels: the same steps and roundings as the torch path, the norms and the DeltaNet
        in Triton, the products in worker.kernels.matmul's row-invariant kernels for decode steps (batch.row_products,
        the residual adds and the MLP's silu fused into them) and cuBLAS for prefill steps."""
        c = self.config
        eps = c.norm_eps
        rowwise = batch.row_products

        def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return k.row_matmul(x, weight) if rowwise else F.linear(x, weight)

        def add_product(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # h + x @ weight.T
            return k.row_matmul(x, weight, residual=h) if rowwise else h + F.linear(x, weight)

        blocks = self.blocks
        x = k.offset_rms_norm(h, blocks[0].input_norm, eps)
        for i, block in enumerate(blocks):
            if isinstance(block.mixer, Attention):
                layer = block.mixer
                act = self._attend_kernels(k, layer, product(x, layer.wqkv.fused.weight), cos, sin, positions, slots,
                                           state, batch)
                h = add_product(h, act, layer.wo.weight)
            else:
                h = add_product(h, self._delta_kernels(k, block.mixer, product(x, block.mixer.w_in.fused.weight),
                                                       positions, slots, state, batch), block.mixer.w_out.weight)
            # the MLP's rows, and the same normed for what comes next (the next layer's input, or the head)
            then_norm = blocks[i + 1].input_norm if i + 1 < len(blocks) else self.norm
            h, x = block.mlp.add_kernels_normed(k, h, k.offset_rms_norm(h, block.post_norm, eps), batch, then_norm,
                                                eps)
        if logits_at is not None:
            x = x[logits_at]
        return product(x, self.lm_head.weight).float()

    def _attend_kernels(self, k: HybridKernels, layer: Attention, qkv: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, state: dict[str, torch.Tensor],
                        batch: Batch) -> torch.Tensor:
        """_attend's steps from the q|k|v product in the kernels (the norms, RoPE and the K/V store in one launch, the
        attention, the output gate in another): the gated attention (rows, H * hd)."""
        c = self.config
        k_cache, v_cache = state["k"][:, layer.index], state["v"][:, layer.index]
        q = k.norm_rope_store(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, slots, positions, c.n_heads,
                              c.norm_eps)
        return k.sigmoid_gate(self.attention(q, k_cache, v_cache, slots, batch), qkv, c.n_heads)

    def _delta_kernels(self, k: HybridKernels, layer: DeltaNet, proj: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, state: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        """_delta's steps from the q|k|v|z|b|a product in the kernels: the normed, gated output (rows, HV * dv)."""
        c, lin = self.config, _linear(self.config)
        rows, values = proj.shape[0], lin.value_heads * lin.value_dim
        mixed, z, b, a = proj.split(layer.w_in.sizes, dim=-1)
        conv_state, rec_state = state["conv"][:, layer.index], state["recurrent"][:, layer.index]
        if batch.tiles is not None:  # a prefill step: runs of prompt tokens, in the tiles
            qkv = k.conv_prefill(mixed, layer.conv, conv_state, slots, positions)
            out = k.delta_prefill(qkv, a, b, layer.A_log, layer.dt_bias, rec_state, slots, positions, batch.tiles,
                                  lin.key_heads, lin.key_dim)
        else:  # one token per row
            qkv = k.conv_decode(mixed, layer.conv, conv_state, slots, positions)
            out = k.delta_decode(qkv, a, b, layer.A_log, layer.dt_bias, rec_state, slots, positions, lin.key_heads,
                                 lin.key_dim)
        normed = k.gated_rms_norm(out.view(rows * lin.value_heads, lin.value_dim),
                                  z.reshape(rows * lin.value_heads, lin.value_dim), layer.gated_norm, c.norm_eps)
        return normed.view(rows, values)

    def _attend(self, layer: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, state: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        """Gated full attention of the rows over their slots' K/V (this layer's K/V written first)."""
        c = self.config
        rows, hd, heads, kv_heads = x.shape[0], c.head_dim, c.n_heads, c.n_kv_heads
        qg, k, v = layer.wqkv(x)
        q, gate = qg.view(rows, heads, 2 * hd).chunk(2, dim=-1)
        q = partial_rope(offset_rms_norm(q, layer.q_norm, c.norm_eps), cos, sin)
        k = partial_rope(offset_rms_norm(k.view(rows, kv_heads, hd), layer.k_norm, c.norm_eps), cos, sin)
        k_cache, v_cache = state["k"][:, layer.index], state["v"][:, layer.index]  # (num_slots, KV, blocks, block, hd)
        store_positions(k_cache, slots, positions, k)
        store_positions(v_cache, slots, positions, v.view(rows, kv_heads, hd))
        attn = self.attention(q, k_cache, v_cache, slots, batch)  # (T, H, hd)
        return layer.wo(attn.reshape(rows, heads * hd) * torch.sigmoid(gate.reshape(rows, heads * hd)))

    def _delta(self, layer: DeltaNet, x: torch.Tensor, state: dict[str, torch.Tensor], runs: _Runs) -> torch.Tensor:
        """Gated DeltaNet over each session's run: its convolution and recurrent state read from its slot (zeros for a
        run from position 0) and written back after the run's last token."""
        c, lin = self.config, _linear(self.config)
        rows, heads, values = x.shape[0], lin.value_heads, lin.value_heads * lin.value_dim
        keys = lin.key_heads * lin.key_dim
        mixed, z, b, a = layer.w_in(x)
        beta = b.sigmoid()
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        conv_state, rec_state = state["conv"][:, layer.index], state["recurrent"][:, layer.index]
        out = x.new_empty((rows, heads, lin.value_dim))

        def split(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:  # (B, n, conv_dim) -> q, k, v by heads
            lead = qkv.shape[:2]
            q, k, v = qkv.split([keys, keys, values], dim=-1)
            return (q.reshape(*lead, lin.key_heads, lin.key_dim), k.reshape(*lead, lin.key_heads, lin.key_dim),
                    v.reshape(*lead, heads, lin.value_dim))

        for run in runs.chunks:  # prompt chunks (and a run from position 0): the chunked schedule
            span = slice(run.start, run.start + run.n)
            window = self._convolve(layer, mixed[span].t()[None], conv_state[run.slot][None],
                                    FRESH if run.pos == 0 else PROMPT)
            conv_state[run.slot] = window.state[0]
            q, k, v = split(window.out)
            o, s = delta_rule.chunked(q, k, v, g[span][None], beta[span][None],
                                      None if run.pos == 0 else rec_state[run.slot][None])
            rec_state[run.slot] = s[0]
            out[span] = o[0]
        if runs.decode is not None:  # single tokens that continue a state: the recurrent schedule, batched
            at, slots = runs.decode
            window = self._convolve(layer, mixed[at][:, :, None], conv_state[slots], DECODE)
            conv_state[slots] = window.state
            q, k, v = split(window.out)
            o, s = delta_rule.recurrent(q, k, v, g[at][:, None], beta[at][:, None], rec_state[slots])
            rec_state[slots] = s
            out[at] = o[:, 0]
        normed = gated_rms_norm(out.reshape(-1, lin.value_dim), z.reshape(-1, lin.value_dim), layer.gated_norm,
                                c.norm_eps)
        return layer.w_out(normed.reshape(rows, values))

    @staticmethod
    def _convolve(layer: DeltaNet, new: torch.Tensor, held: torch.Tensor, start: int) -> _Window:
        """The causal depthwise convolution and SiLU of `new` (B, conv_dim, n) after the inputs `held` (B, conv_dim,
        kernel - 1) of the tokens before it; `start`: FRESH (a run from position 0: nothing before it, `held` unread),
        PROMPT (a prompt chunk after earlier tokens) or DECODE (one token). out (B, n, conv_dim), and what is held
        after it. Each case calls the convolution as transformers does (padded for prompts, not for one token, on
        inputs of the same length: zero columns stand for the inputs it pads with or keeps and never reads), so the
        sums come out the same."""
        n, taps, weight = new.shape[-1], layer.conv.shape[-1], layer.conv
        x = new.to(weight.dtype)
        if start == FRESH:  # transformers pads a first chunk shorter than the kernel to its width first
            padded = F.pad(x, (taps - n, 0)) if n < taps else x
            out = F.conv1d(padded, weight, padding=taps - 1, groups=x.shape[1])[..., : padded.shape[-1]][..., -n:]
            window = torch.cat([torch.zeros_like(held), x], dim=-1)
        else:
            window = torch.cat([held.new_zeros((*held.shape[:2], 1)), held, x], dim=-1)
            if start == PROMPT:
                out = F.conv1d(window, weight, padding=taps - 1, groups=x.shape[1])[..., : window.shape[-1]][..., -n:]
            else:
                out = F.conv1d(window, weight, groups=x.shape[1])[..., -n:]
        return _Window(F.silu(out).to(new.dtype).transpose(1, 2), window[..., window.shape[-1] - (taps - 1):])


@dataclasses.dataclass
class _Window:
    out: torch.Tensor
    state: torch.Tensor


class _Runs:
    """A batch's runs for the DeltaNet layers, sorted once per forward: runs of several tokens or from position 0
    (the chunked schedule, one by one) and single tokens continuing a state (the recurrent one, all at once)."""

    def __init__(self, runs: list[Run], device: torch.device) -> None:
        self.chunks = [r for r in runs if r.n > 1 or r.pos == 0]
        single = [r for r in runs if r.n == 1 and r.pos > 0]
        self.decode: tuple[torch.Tensor, torch.Tensor] | None = None
        if single:
            self.decode = (torch.tensor([r.start for r in single], dtype=torch.long, device=device),
                           torch.tensor([r.slot for r in single], dtype=torch.long, device=device))


def state_spec(c: ModelConfig, max_context: int, dtype: torch.dtype) -> StateSpec:
    """Per session: K and V of the full-attention layers, (full layers, kv_heads, max_context, head_dim), which grow
    with the context; the convolution state (linear layers, conv_dim, conv_kernel - 1) in the model's dtype, and the
    recurrent state (linear layers, value_heads, key_dim, value_dim) in fp32, which do not."""
    full = sum(c.mixer(i) == FULL_ATTENTION for i in range(c.n_layers))
    linear = c.n_layers - full
    buffers: list[BufferSpec] = []
    if full:
        shape = (full, c.n_kv_heads, max_context, c.head_dim)
        buffers += [BufferSpec("k", shape, dtype, seq_axis=2), BufferSpec("v", shape, dtype, seq_axis=2)]
    if linear:
        lin = _linear(c)
        buffers += [BufferSpec("conv", (linear, lin.conv_dim, lin.conv_kernel - 1), dtype),
                    BufferSpec("recurrent", (linear, lin.value_heads, lin.key_dim, lin.value_dim), torch.float32)]
    return StateSpec(tuple(buffers))


def run_tiles(runs: list[Run], device: torch.device) -> torch.Tensor:
    """(2, n) int64: the first row and row count of each block of delta_rule.CHUNK rows of each run, cut from its
    first row (the GPU executor's prompt tiles, worker.kernels.tiles, for a batch planned from its runs)."""
    firsts = [r.start + i for r in runs for i in range(0, r.n, delta_rule.CHUNK)]
    counts = [min(delta_rule.CHUNK, r.n - i) for r in runs for i in range(0, r.n, delta_rule.CHUNK)]
    return torch.tensor([firsts, counts], dtype=torch.long, device=device)


def _linear(c: ModelConfig) -> LinearAttention:
    if c.linear is None:
        raise ModelLoadError(f"{c.name}: no linear-attention shape")
    return c.linear


def _unit_offset(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as stored, the zero-centred norms turned into 1 + weight (fp32)."""
    for name, tensor in items:
        if name == "norm" or name.rsplit(".", 1)[-1] in UNIT_OFFSET_NORMS:
            yield name, tensor.float() + 1.0
        else:
            yield name, tensor


# -- reading a Hugging Face config.json --------------------------------------------------------------------------

# transformers' Qwen3_5TextConfig defaults, for the fields a folder's config leaves out (as transformers fills them).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# Fields this family reads beyond the common ones, and those that do not change the text model's arithmetic.
TEXT_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads", "attention_bias", "attn_output_gate", "full_attention_interval",
               "partial_rotary_factor", "mamba_ssm_dtype", "mlp_only_layers",
               # the multi-token-prediction head (speculative decoding; its tensors are skipped, HF_SKIPPED)
               "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")
# A `qwen3_5` folder's own fields around text_config: the vision tower and its tokens (images are not taken).
VL_FIELDS = ("text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id", "tie_word_embeddings")
# With text alone the three position axes of Qwen3.5's multimodal RoPE are equal, so its sections change nothing.
ROPE_NO_OPS = ("mrope_section", "mrope_interleaved")


def read_hf_config(cfg: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    """`qwen3_5_text`, or `qwen3_5` whose text_config is read (the folder's vision tower is not served)."""
    text, where = text_config(cfg, "qwen3_5", where)
    return read_text_config(text, name, where)


def text_config(cfg: Mapping[str, Any], wrapper: str, where: str) -> tuple[Mapping[str, Any], str]:
    """The text model's config: a vision-language folder's (model_type `wrapper`) text_config, with the folder's own
    tie_word_embeddings (False when absent), which is what transformers ties by, whatever text_config says; any other
    config as it is."""
    if cfg.get("model_type") != wrapper:
        return cfg, where
    refuse_unknown(cfg, VL_FIELDS, where)
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ModelLoadError(f"{where}: text_config must be a mapping")
    text = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    return text, f"{where} (text_config)"


def read_text_config(text: Mapping[str, Any], name: str, where: str, defaults: Mapping[str, Any] = TEXT_DEFAULTS,
                     fields: tuple[str, ...] = TEXT_FIELDS, family: str = "qwen3_5") -> ModelConfig:
    """The hybrid layers' config; `defaults` fill what `text` leaves out, `fields` are the family's beyond the common
    ones (worker.model.qwen3_5_moe reads its own with this)."""
    cfg = {**defaults, **{k: v for k, v in text.items() if v is not None}}
    refuse_unknown(cfg, fields, where)
    if cfg.get("attention_bias"):
        raise refuse(where, "attention_bias", cfg["attention_bias"], "Qwen3.5 without biases only")
    if not cfg.get("attn_output_gate", True):
        raise refuse(where, "attn_output_gate", cfg["attn_output_gate"], "Qwen3.5's gated attention only")
    if cfg.get("mlp_only_layers"):
        raise refuse(where, "mlp_only_layers", cfg["mlp_only_layers"], "every layer's MLP of one kind")
    if cfg.get("mamba_ssm_dtype", "float32") != "float32":
        raise refuse(where, "mamba_ssm_dtype", cfg["mamba_ssm_dtype"], "the recurrent state is float32")
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise refuse(where, "layer_types", types, f"one entry per layer ({n_layers})")
    bad = sorted({str(t) for t in types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
    if bad:
        raise refuse(where, "layer_types", bad, "full_attention or linear_attention")
    params = rope_params(cfg)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise refuse(where, "rope_type", kind, "Qwen3.5 with its default RoPE only")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    common = read_common({k: v for k, v in cfg.items() if k != "layer_types"}, name, family, where,
                         partial_rotary=True, rope_no_ops=ROPE_NO_OPS)
    common["explicit_head_dim"] = int(cfg["head_dim"])
    linear = LinearAttention(conv_kernel=int(cfg["linear_conv_kernel_dim"]), key_heads=int(cfg["linear_num_key_heads"]),
                             value_heads=int(cfg["linear_num_value_heads"]), key_dim=int(cfg["linear_key_head_dim"]),
                             value_dim=int(cfg["linear_value_head_dim"]))
    if linear.value_heads % linear.key_heads or linear.conv_kernel < 2:
        raise refuse(where, "linear_num_value_heads", linear.value_heads,
                     "a multiple of linear_num_key_heads, and a kernel of 2 taps or more")
    config = ModelConfig(**common, qk_norm=True, partial_rotary=partial, layer_types=tuple(types), linear=linear,
                         attention_gate=True)
    if config.rotary_dim % 2 or not 0 < config.rotary_dim <= config.head_dim:
        raise refuse(where, "partial_rotary_factor", partial, "an even number of dims within the head")
    return config


def hf_names(name: str) -> str | None:
    """A folder's tensor name as the text model's (`model.language_model.X` is `model.X`), or None for one that is
    not part of text generation (HF_SKIPPED)."""
    if name.startswith(HF_SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def random_layer(c: ModelConfig, i: int, draw: Draw) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer i's tensors for a random preset (worker.model.loader): its norms and mixer (random_mixer), then the MLP's
    products normal(0, 0.02)."""
    p, d, f = f"layers.{i}.", c.dim, c.ffn_dim
    yield from random_mixer(c, i, draw)
    yield p + "gate_proj", draw.normal(f, d)
    yield p + "up_proj", draw.normal(f, d)
    yield p + "down_proj", draw.normal(d, f)


def random_mixer(c: ModelConfig, i: int, draw: Draw) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer i's norms and token mixer for a random preset: products normal(0, 0.02), the convolution's taps
    normal(0, 0.2); the zero-centred norms zero (a scale of one), the DeltaNet's output norm one; A_log the log of a
    uniform rate in [0.01, 16) and dt_bias one, as transformers initialises them."""
    p, d, hd = f"layers.{i}.", c.dim, c.head_dim
    yield p + "input_norm", draw.zeros(d)
    yield p + "post_norm", draw.zeros(d)
    if c.mixer(i) == FULL_ATTENTION:
        yield p + "q_proj", draw.normal(2 * c.n_heads * hd, d)
        yield p + "k_proj", draw.normal(c.n_kv_heads * hd, d)
        yield p + "v_proj", draw.normal(c.n_kv_heads * hd, d)
        yield p + "o_proj", draw.normal(d, c.n_heads * hd)
        yield p + "q_norm", draw.zeros(hd)
        yield p + "k_norm", draw.zeros(hd)
    else:
        lin = _linear(c)
        values = lin.value_heads * lin.value_dim
        yield p + "in_proj_qkv", draw.normal(lin.conv_dim, d)
        yield p + "in_proj_z", draw.normal(values, d)
        yield p + "in_proj_b", draw.normal(lin.value_heads, d)
        yield p + "in_proj_a", draw.normal(lin.value_heads, d)
        yield p + "conv", draw.normal(lin.conv_dim, 1, lin.conv_kernel).mul_(10)
        yield p + "A_log", draw.uniform(0.01, 16.0, lin.value_heads).log_()
        yield p + "dt_bias", draw.ones(lin.value_heads)
        yield p + "gated_norm", draw.ones(lin.value_dim)
        yield p + "out_proj", draw.normal(d, values)
