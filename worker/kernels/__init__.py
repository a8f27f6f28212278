"""The Triton kernels of the GPU path, and the one place that picks them for a model (gpu_kernels).

- attention.py: decode attention, one program per (row, KV head), K/V read from the slab by slot and length
  (with RoPE and the K/V store in the same launch for a decode step's rows)
- prefill.py, tiles.py: prompt chunks' attention in tiles of consecutive rows (tiles planned on the host)
- matmul.py: row-invariant products with the norm, SiLU and residual add fused in (decode steps)
- fused.py: RMSNorm, residual add + norm, per-head q/k norm (Qwen3), RoPE + K/V store, SiLU-and-multiply
- layers.py: the layer stack and the head built from them (what Llama.forward runs on the GPU)
- pdl.py: programmatic dependent launch on Hopper and later
- deltanet.py, norms.py: the hybrid model's gated DeltaNet (causal convolution, gated delta rule) and its norms
- gated_attention.py: the hybrid model's gated attention around the attention kernels (per-head norms, partial RoPE
  and the K/V store in one launch; the output gate)
- moe.py: the mixture-of-experts block's routing and routed experts (tokens grouped by expert), for Qwen3.5-MoE
"""

from __future__ import annotations

from worker.model.batch import HybridKernels, Kernels


def gpu_kernels(prefill_tiles: bool = True, fused: bool = True) -> Kernels:
    """The GPU model's kernels: decode attention always, the tiled prompt attention unless `prefill_tiles` is off
    (prompt rows then take the decode kernel, one program per row), the fused layer stack and head unless `fused`
    is off (plain torch around cuBLAS). Imports Triton: call it only where CUDA is."""
    from worker.kernels.attention import decode_attention, rope_decode_attention
    from worker.kernels.fused import head_rms_norm
    from worker.kernels.layers import fused_head, fused_layers
    from worker.kernels.prefill import prefill_attention

    return Kernels(decode_attention=decode_attention, rope_decode_attention=rope_decode_attention,
                   prefill_attention=prefill_attention if prefill_tiles else None,
                   fused_layers=fused_layers if fused else None,
                   fused_head=fused_head if fused else None,
                   head_norm=head_rms_norm if fused else None,
                   hybrid=hybrid_kernels())


def hybrid_kernels() -> HybridKernels:
    """The hybrid model's kernels (worker.model.qwen3_5 takes them on the GPU, and in Triton's interpreter for tests)."""
    from worker.kernels.deltanet import conv_decode, conv_prefill, delta_decode, delta_prefill
    from worker.kernels.gated_attention import norm_rope_store, sigmoid_gate
    from worker.kernels.matmul import row_matmul
    from worker.kernels.moe import moe_block
    from worker.kernels.norms import gated_rms_norm, offset_rms_norm

    return HybridKernels(conv_decode=conv_decode, conv_prefill=conv_prefill, delta_decode=delta_decode,
                         delta_prefill=delta_prefill, offset_rms_norm=offset_rms_norm, gated_rms_norm=gated_rms_norm,
                         row_matmul=row_matmul, norm_rope_store=norm_rope_store, sigmoid_gate=sigmoid_gate,
                         moe=moe_block)
