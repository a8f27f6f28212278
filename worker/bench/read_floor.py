"""The read floor of a model's decode step: the bytes a step must read at least, and the time that takes at the
device's copy bandwidth.

Per decode step of n sessions at a context of L tokens:

- every weight but the routed experts' and the embedding table's (the embedding reads n rows), once: the layers (for
  a mixture of experts: the router, the shared experts, the attention and DeltaNet layers), the norms and the head;
- for a mixture of experts, the routed experts the step's tokens chose, once each: per layer, the distinct experts of
  the n tokens' top-k (measured: one eager decode step of n tokens through the model, the router's choices counted per
  layer), times an expert's gate, up and down bytes;
- each session's state: the fixed-size buffers (convolution and recurrent state) read and written, the K/V of its L
  tokens read.

`floor_s / step_s` is the share of the floor a measured step reaches (1.0: every byte read once at copy speed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from worker.engine import Engine
from worker.model.batch import HybridKernels
from worker.model.config import Experts


def touched_experts(engine: Engine, sessions: int) -> list[int]:
    """Per layer, the distinct experts one decode step of `sessions` tokens (random ids, fresh slots) routes to."""
    model: Any = engine.model
    ex: Experts = model.config.experts
    hybrid: HybridKernels = model.kernels.hybrid
    real = hybrid.moe
    assert real is not None
    seen: list[int] = []

    def counting(h: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        ids = torch.topk(logits[:, : ex.count].float(), ex.top_k, dim=-1).indices
        seen.append(int(torch.unique(ids).numel()))
        return real(h, x, logits, *args, **kw)

    model.kernels = dataclasses.replace(model.kernels, hybrid=dataclasses.replace(hybrid, moe=counting))
    slots = [engine.table.create() for _ in range(sessions)]
    try:
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(100, model.config.vocab_size, (sessions,), generator=gen).to(model.device)
        zeros = torch.zeros(sessions, dtype=torch.long, device=model.device)
        model.forward(tokens, zeros, torch.tensor(slots, device=model.device), engine.table.views())
        torch.cuda.synchronize()
    finally:
        for slot in slots:
            engine.table.free(slot)
        model.kernels = dataclasses.replace(model.kernels, hybrid=hybrid)
    return seen


def floor_bytes(engine: Engine, sessions: int, context: int) -> dict[str, float]:
    """The step's floor in bytes, by part (weights, experts touched, state), and the experts touched per layer."""
    model: Any = engine.model
    c = model.config
    ex: Experts | None = c.experts
    item = torch.empty((), dtype=model.dtype).element_size()
    expert = 0 if ex is None else 3 * ex.ffn_dim * c.dim * item
    all_experts = 0 if ex is None else c.n_layers * ex.count * expert
    embed = 0 if c.tie_embeddings else c.vocab_size * c.dim * item
    weights = model.weight_bytes() - all_experts - embed + sessions * c.dim * item
    touched = [] if ex is None else touched_experts(engine, sessions)
    spec = model.state_spec()
    fixed = sum(b.nbytes for b in spec.buffers if b.seq_axis is None)
    per_token = sum(b.nbytes // b.shape[b.seq_axis] for b in spec.buffers if b.seq_axis is not None)
    state = sessions * (2 * fixed + per_token * context)
    return {"weights": weights, "experts": sum(touched) * expert, "state": state,
            "experts_per_layer": sum(touched) / len(touched) if touched else 0.0, "total": weights + sum(touched) * expert + state}
