"""Qwen3.5-MoE (transformers' `qwen3_5_moe_text`, and the text part of `qwen3_5_moe` folders): Qwen3.5's hybrid layers
(worker.model.qwen3_5: gated DeltaNet and gated attention, the same per-session state) with a sparse mixture of
experts as every layer's MLP.

The MoE block, as transformers' modeling_qwen3_5_moe computes it (Qwen3_5MoeSparseMoeBlock, and its experts in the
default `grouped_mm` implementation):

- the shared expert: down(silu(gate(x)) * up(x)), an MLP of shared_expert_intermediate_size;
- the router: logits = x @ router.T in x's dtype; softmax over all experts in fp32; the top num_experts_per_tok
  probabilities (torch.topk: largest first), divided by their sum (always: this model has no norm_topk_prob switch),
  then cast to x's dtype;
- each routed expert: down_e(silu(g) * u) with g | u = x @ gate_up_e.T (one product of 2 * moe_intermediate_size
  rows), times the token's weight for it, in x's dtype;
- the token's routed outputs summed over its top-k in topk's order (`.sum(dim=1)` of (tokens, k, dim)), plus
  sigmoid(x @ shared_expert_gate.T) * the shared expert's output.

Folders store the experts either one by one (`mlp.experts.E.gate_proj.weight`, up_proj, down_proj: what transformers
5 writes and the published checkpoints hold) or fused (`mlp.experts.gate_up_proj` (experts, 2 * ffn, dim) and
`mlp.experts.down_proj` (experts, dim, ffn): transformers' in-memory layout); both are read into one packed tensor per
layer, (experts * 2 * ffn, dim) for gate|up and (experts * dim, ffn) for down (a fused source is split into each
expert's tensors as it streams).

A shared expert as wide as the routed ones (the published shape's) is stored after them as one more expert.

On the GPU the experts run in worker.kernels.moe's fused kernels (the tokens grouped by expert, each expert's weights
read once a step), the shared expert with them as every token's last pair (or, of another width, apart in the
products); the router's product in the row-invariant kernel in decode and prefill steps alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from worker.model import qwen3_5
from worker.model.batch import Batch, HybridKernels
from worker.model.config import Experts, ModelConfig, ModelLoadError
from worker.model.draw import Draw
from worker.model.hf_config import refuse
from worker.model.packing import Pack, Place

# transformers' Qwen3_5MoeTextConfig defaults (the Qwen3.5-35B-A3B shape), for the fields a folder's config leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    **qwen3_5.TEXT_DEFAULTS, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8, "num_experts": 256,
}
del TEXT_DEFAULTS["intermediate_size"]  # no dense MLP: a config's intermediate_size, if any, is not read
TEXT_FIELDS = (*qwen3_5.TEXT_FIELDS, "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
               "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
               # training only: the router's auxiliary loss
               "output_router_logits", "router_aux_loss_coef")

# A layer's MoE tensors in a folder -> ours (the experts' own names come from hf_layer_names, per config).
HF_MOE_NAMES = {
    "mlp.gate.weight": "router",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
    "mlp.shared_expert.gate_proj.weight": "shared_gate_proj",
    "mlp.shared_expert.up_proj.weight": "shared_up_proj",
    "mlp.shared_expert.down_proj.weight": "shared_down_proj",
    "mlp.experts.gate_up_proj": "experts_gate_up",  # fused: (experts, 2 * ffn, dim)
    "mlp.experts.down_proj": "experts_down",  # fused: (experts, dim, ffn)
}
BASE_NAMES = {k: v for k, v in qwen3_5.HF_LAYER_NAMES.items() if not k.startswith("mlp.")}
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def hf_layer_names(c: ModelConfig) -> dict[str, str]:
    """A layer's tensor names in a folder -> ours, the experts one by one included."""
    names = {**BASE_NAMES, **HF_MOE_NAMES}
    for e in range(_experts(c).count):
        names |= {f"mlp.experts.{e}.{part}.weight": f"experts.{e}.{part}" for part in EXPERT_PARTS}
    return names


class SparseMoe(qwen3_5.Mlp):
    """A layer's mixture of experts: the router and the shared expert's gate in one product (router rows, then the
    gate's), every expert's gate|up and down in one tensor each, and the shared expert's gate|up and down: when it is
    as wide as the routed experts, as one more expert after them (the GPU kernels run it with the routed ones, as every
    token's last pair), else in tensors of its own."""

    def __init__(self, views: Mapping[str, torch.Tensor], p: str, c: ModelConfig) -> None:
        ex = _experts(c)
        self.count, self.top_k, self.ffn = ex.count, ex.top_k, ex.ffn_dim
        self.shared_in_experts = _shared_in_experts(ex)
        stored = ex.count + int(self.shared_in_experts)
        self.w_route = qwen3_5.Products(views[p + "w_route"], [ex.count, 1])  # (experts + 1, dim)
        self.gate_up = views[p + "w_experts_gate_up"].view(stored, 2 * ex.ffn_dim, c.dim)
        self.down = views[p + "w_experts_down"].view(stored, c.dim, ex.ffn_dim)
        if self.shared_in_experts:
            self.shared_gate_up, self.shared_down = self.gate_up[ex.count], self.down[ex.count]
        else:
            self.shared_gate_up, self.shared_down = views[p + "w_shared_gate_up"], views[p + "w_shared_down"]
        # What the GPU routing keeps between steps: worker.kernels.moe.moe_scratch(stored), zero between steps.
        self.scratch = torch.zeros((2 * stored + 1,), dtype=torch.int32, device=self.gate_up.device)

    @staticmethod
    def declare(pack: Pack, c: ModelConfig, p: str, dtype: torch.dtype) -> None:
        ex = _experts(c)
        d, f, s, n = c.dim, ex.ffn_dim, ex.shared_ffn_dim, ex.count
        pack.add(p + "w_route", (n + 1, d), dtype)
        pack.route(p + "router", Place(p + "w_route", 0, n))
        pack.route(p + "shared_expert_gate", Place(p + "w_route", n, n + 1))
        stored = n + int(_shared_in_experts(ex))
        pack.add(p + "w_experts_gate_up", (stored * 2 * f, d), dtype)
        pack.add(p + "w_experts_down", (stored * d, f), dtype)
        for e in range(n):  # expert e's gate then up rows, and its down rows (fused sources come split: _split)
            pack.route(f"{p}experts.{e}.gate_proj", Place(p + "w_experts_gate_up", 2 * e * f, (2 * e + 1) * f))
            pack.route(f"{p}experts.{e}.up_proj", Place(p + "w_experts_gate_up", (2 * e + 1) * f, (2 * e + 2) * f))
            pack.route(f"{p}experts.{e}.down_proj", Place(p + "w_experts_down", e * d, (e + 1) * d))
        if stored > n:  # the shared expert as expert n
            pack.route(p + "shared_gate_proj", Place(p + "w_experts_gate_up", 2 * n * f, (2 * n + 1) * f))
            pack.route(p + "shared_up_proj", Place(p + "w_experts_gate_up", (2 * n + 1) * f, (2 * n + 2) * f))
            pack.route(p + "shared_down_proj", Place(p + "w_experts_down", n * d, (n + 1) * d))
        else:
            pack.add(p + "w_shared_gate_up", (2 * s, d), dtype)
            pack.add(p + "w_shared_down", (d, s), dtype)
            pack.route(p + "shared_gate_proj", Place(p + "w_shared_gate_up", 0, s))
            pack.route(p + "shared_up_proj", Place(p + "w_shared_gate_up", s, 2 * s))
            pack.route(p + "shared_down_proj", Place(p + "w_shared_down"))

    def tensors(self) -> list[torch.Tensor]:
        own = [] if self.shared_in_experts else [self.shared_gate_up, self.shared_down]
        return [self.w_route.fused.weight, self.gate_up, self.down, *own]

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (T, experts) -> each token's experts (T, k) int64, largest probability first, and their
        weights (T, k) in the logits' dtype: softmax in fp32, top k, divided by their sum."""
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return ids, top.to(logits.dtype)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's MLP (ungated): its gate and up products apart, as transformers computes them."""
        gate, up = (F.linear(x, w) for w in self.shared_gate_up.chunk(2))
        return F.linear(F.silu(gate) * up, self.shared_down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape
        shared = self.shared(x)
        logits, shared_gate = self.w_route(x)
        ids, weights = self.route(logits)
        flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
        weighted = x.new_empty((rows * self.top_k, dim))  # each (token, choice) pair's weighted output
        for e in torch.unique(flat_ids).tolist():
            pairs = (flat_ids == e).nonzero().squeeze(1)
            g, u = F.linear(x[pairs // self.top_k], self.gate_up[e]).chunk(2, dim=-1)
            weighted[pairs] = F.linear(F.silu(g) * u, self.down[e]) * flat_weights[pairs, None]
        routed = weighted.view(rows, self.top_k, dim).sum(dim=1)
        return routed + torch.sigmoid(shared_gate) * shared

    def add_kernels(self, k: HybridKernels, h: torch.Tensor, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self._moe_kernels(k, h, x, batch)

    def add_kernels_normed(self, k: HybridKernels, h: torch.Tensor, x: torch.Tensor, batch: Batch,
                           norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The combining kernel norms the rows it writes (no launch for the norm)."""
        normed = torch.empty_like(h)
        return self._moe_kernels(k, h, x, batch, norm, eps, normed), normed

    def _moe_kernels(self, k: HybridKernels, h: torch.Tensor, x: torch.Tensor, batch: Batch,
                     norm: torch.Tensor | None = None, eps: float = 0.0,
                     normed: torch.Tensor | None = None) -> torch.Tensor:
        if k.moe is None:
            raise ModelLoadError("the mixture-of-experts kernels are not built")
        # The router's product in the row-invariant kernel in prefill steps too: cuBLAS sums its few columns in
        # another order at another row count (so a prompt's routing would depend on its step's size).
        logits = k.row_matmul(x, self.w_route.fused.weight)  # (T, experts + 1): the router's, then the shared gate's
        shared = None
        if not self.shared_in_experts:
            if batch.row_products:
                shared = k.row_matmul(k.row_matmul(x, self.shared_gate_up, silu=True), self.shared_down)
            else:
                gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
                shared = F.linear(F.silu(gate) * up, self.shared_down)
        return k.moe(h, x, logits, self.gate_up, self.down, self.top_k, self.scratch, shared=shared,
                     prefill=not batch.row_products, norm=norm, eps=eps, normed=normed)


class Qwen3_5Moe(qwen3_5.Qwen3_5):
    """Qwen3.5's hybrid decoder with a SparseMoe in every layer."""

    mlp_class = SparseMoe

    def _sources(self, pack: Pack, c: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterable[tuple[str, torch.Tensor]]:
        return _split(c, weights)


def _split(c: ModelConfig, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors as each expert's (views of them, copied into the pack one by one); any other as it is."""
    ex = _experts(c)
    f = ex.ffn_dim
    shapes = {"experts_gate_up": (ex.count, 2 * f, c.dim), "experts_down": (ex.count, c.dim, f)}
    for name, tensor in items:
        layer, _, last = name.rpartition(".")
        expected = shapes.get(last)
        if expected is None:
            yield name, tensor
            continue
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{c.name}: tensor {name} has shape {tuple(tensor.shape)}, expected {expected}")
        for e in range(ex.count):
            if last == "experts_gate_up":
                yield f"{layer}.experts.{e}.gate_proj", tensor[e, :f]
                yield f"{layer}.experts.{e}.up_proj", tensor[e, f:]
            else:
                yield f"{layer}.experts.{e}.down_proj", tensor[e]


def _shared_in_experts(ex: Experts) -> bool:
    """The shared expert is stored (and run) as one more expert when it is as wide as the routed ones."""
    return ex.shared_ffn_dim == ex.ffn_dim


def _experts(c: ModelConfig) -> Experts:
    if c.experts is None:
        raise ModelLoadError(f"{c.name}: no mixture-of-experts shape")
    return c.experts


# -- reading a Hugging Face config.json --------------------------------------------------------------------------


def read_hf_config(cfg: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    """`qwen3_5_moe_text`, or `qwen3_5_moe` whose text_config is read (the folder's vision tower is not served)."""
    text, where = qwen3_5.text_config(cfg, "qwen3_5_moe", where)
    merged = {**TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if merged.get("norm_topk_prob", True) is not True:
        raise refuse(where, "norm_topk_prob", merged["norm_topk_prob"],
                     "Qwen3.5-MoE renormalises the top-k weights always")
    if int(merged.get("decoder_sparse_step", 1)) != 1:
        raise refuse(where, "decoder_sparse_step", merged["decoder_sparse_step"], "every layer sparse")
    experts = Experts(count=int(merged["num_experts"]), top_k=int(merged["num_experts_per_tok"]),
                      ffn_dim=int(merged["moe_intermediate_size"]),
                      shared_ffn_dim=int(merged["shared_expert_intermediate_size"]))
    if not 0 < experts.top_k <= experts.count:
        raise refuse(where, "num_experts_per_tok", experts.top_k, f"between 1 and num_experts ({experts.count})")
    if experts.ffn_dim <= 0 or experts.shared_ffn_dim <= 0:
        raise refuse(where, "moe_intermediate_size", (experts.ffn_dim, experts.shared_ffn_dim),
                     "experts and a shared expert of positive width")
    # The dense reader's intermediate_size is the experts' width here (ModelConfig.ffn_dim; no layer is dense).
    dense = {k: v for k, v in merged.items() if k != "intermediate_size"}
    config = qwen3_5.read_text_config({**dense, "intermediate_size": experts.ffn_dim}, name, where,
                                      defaults={}, fields=TEXT_FIELDS, family="qwen3_5_moe")
    return dataclasses.replace(config, experts=experts)


def random_layer(c: ModelConfig, i: int, draw: Draw) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer i's tensors for a random preset: the hybrid layer's mixer and norms as qwen3_5 draws them, then the router,
    the shared expert and its gate, and each expert's gate, up and down, normal(0, 0.02) as transformers initialises
    them, one tensor at a time (an expert is 3 x ffn x dim: on the device, never the whole layer at once)."""
    ex = _experts(c)
    p, d, f, s = f"layers.{i}.", c.dim, ex.ffn_dim, ex.shared_ffn_dim
    yield from qwen3_5.random_mixer(c, i, draw)
    yield p + "router", draw.normal(ex.count, d)
    yield p + "shared_expert_gate", draw.normal(1, d)
    yield p + "shared_gate_proj", draw.normal(s, d)
    yield p + "shared_up_proj", draw.normal(s, d)
    yield p + "shared_down_proj", draw.normal(d, s)
    for e in range(ex.count):
        yield f"{p}experts.{e}.gate_proj", draw.normal(f, d)
        yield f"{p}experts.{e}.up_proj", draw.normal(f, d)
        yield f"{p}experts.{e}.down_proj", draw.normal(d, f)
