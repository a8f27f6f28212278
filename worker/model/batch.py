"""What one forward pass takes besides the token tensors: its runs, its batch facts, and the kernels it uses.

A batch is flat: token t belongs to the session in slot `slots[t]` at position `positions[t]`. Tokens of one
session are contiguous and in order, so a batch is a list of runs (prompt chunks of many tokens, decode rows of
one). The executors build a Batch outside graphs; the model only reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch


class Run(NamedTuple):
    """One session's tokens in a batch: batch rows [start, start+n) at positions [pos, pos+n).

    A named tuple: a decode step builds one per row, and a tuple is built several times faster than a
    frozen dataclass."""

    slot: int
    start: int
    n: int
    pos: int


@dataclass
class Batch:
    """What one forward needs besides the token tensors. Built by the engine, outside graphs."""

    runs: list[Run]
    decode_only: bool  # every run is a single token: the batched decode-attention path applies
    lengths: torch.Tensor | None = None  # int32 [rows]: positions + 1, on the model's device (decode)
    # Rows outside every run (padding to a fixed shape): their attention output is zero and they
    # write K/V only where the caller pointed them (the spare slot).
    padded: bool = False
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # run index -> causal mask, built once per forward
    # Decode attention: programs per row's keys (None: chosen from the shapes). The GPU executor pins one
    # count for every batch size, so a row's attention sums in the same order in any bucket.
    attention_splits: int | None = None
    # Prompt-chunk attention in tiles of a chunk's rows (worker.kernels.prefill): (2, n) int64, each tile's first row
    # and row count, for the GPU executor's prefill steps. None: every row by itself (the decode kernel).
    tiles: torch.Tensor | None = None
    # The products (and the norms, activation and residual adds beside them) in worker.kernels.matmul's
    # row-invariant kernels instead of cuBLAS: the GPU executor's decode steps, through fused_layers.
    row_products: bool = False
    # Every row a different session's single token and the attention unsplit (the GPU executor's decode steps, short
    # rows): RoPE, the K/V store and the attention in one kernel (Kernels.rope_decode_attention), the same bits.
    rope_in_attention: bool = False


def runs_of(slots: list[int], positions: list[int]) -> list[Run]:
    """Split a flat batch into per-session runs (a run breaks where the slot changes or a position skips).

    Vectorised: a prefill step holds thousands of tokens, and a Python pass over them cost ~2 ms a step."""
    if len(slots) != len(positions):
        raise ValueError(f"{len(slots)} slots for {len(positions)} positions")
    if not slots:
        return []
    s = np.array(slots, dtype=np.int64)
    p = np.array(positions, dtype=np.int64)
    breaks = (np.flatnonzero((s[1:] != s[:-1]) | (p[1:] != p[:-1] + 1)) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(slots)]
    return [Run(slots[a], a, b - a, positions[a]) for a, b in zip(starts, ends, strict=True)]


@dataclass(frozen=True)
class HybridKernels:
    """The GPU kernels of the hybrid model's layers (worker.model.qwen3_5): the causal convolution and the gated delta
    rule over the slab's conv and recurrent states (worker.kernels.deltanet), its norms (worker.kernels.norms), the
    row-invariant product of decode steps (worker.kernels.matmul.row_matmul), and the gated attention's own
    (worker.kernels.gated_attention)."""

    conv_decode: Callable[..., torch.Tensor]
    conv_prefill: Callable[..., torch.Tensor]
    delta_decode: Callable[..., torch.Tensor]
    delta_prefill: Callable[..., torch.Tensor]
    offset_rms_norm: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]
    row_matmul: Callable[..., torch.Tensor]
    # The gated attention's norms, RoPE and K/V store, and its output gate (worker.kernels.gated_attention).
    norm_rope_store: Callable[..., torch.Tensor]
    sigmoid_gate: Callable[..., torch.Tensor]
    # The mixture-of-experts block's routed experts and its sums (worker.kernels.moe.moe_block), for Qwen3.5-MoE.
    moe: Callable[..., torch.Tensor] | None = None


@dataclass(frozen=True)
class Kernels:
    """The GPU kernels a model's forward takes in place of plain torch, fixed when the model is built
    (worker.kernels.gpu_kernels; the CPU builds a model with none).

    - decode_attention: a batch of single-token rows reads K/V from the slab by slot and length
      (worker.kernels.attention); rope_decode_attention: the same after RoPE and the K/V store, in one kernel
      (Batch.rope_in_attention);
    - prefill_attention: prompt chunks' rows in tiles that share K/V loads (worker.kernels.prefill);
    - fused_layers, fused_head: the layer stack and the final norm + head in fused kernels
      (worker.kernels.layers); head_norm: Qwen3's per-head q/k norms in one kernel (worker.kernels.fused);
    - hybrid: the hybrid model's own (HybridKernels)."""

    decode_attention: Callable[..., torch.Tensor] | None = None
    rope_decode_attention: Callable[..., torch.Tensor] | None = None
    prefill_attention: Callable[..., torch.Tensor] | None = None
    fused_layers: Callable[..., torch.Tensor] | None = None
    fused_head: Callable[..., torch.Tensor] | None = None
    head_norm: Callable[..., torch.Tensor] | None = None
    hybrid: HybridKernels | None = None


NO_KERNELS = Kernels()
