"""The Triton kernels of the GPU path, and the one place that picks them for a model (gpu_kernels).

- attention.py: decode attention, one program per (row, KV head), K/V read from the slab by slot and length
- prefill.py, tiles.py: prompt chunks' attention in tiles of consecutive rows (tiles planned on the host)
- matmul.py: row-invariant products with the norm, SiLU and residual add fused in (decode steps)
- fused.py: RMSNorm, residual add + norm, RoPE + K/V store, SiLU-and-multiply
- layers.py: the layer stack and the head built from them (what Llama.forward runs on the GPU)
- pdl.py: programmatic dependent launch on Hopper and later
"""

from __future__ import annotations

from worker.model.batch import Kernels


def gpu_kernels(prefill_tiles: bool = True, fused: bool = True) -> Kernels:
    """The GPU model's kernels: decode attention always, the tiled prompt attention unless `prefill_tiles` is off
    (prompt rows then take the decode kernel, one program per row), the fused layer stack and head unless `fused`
    is off (plain torch around cuBLAS). Imports Triton: call it only where CUDA is."""
    from worker.kernels.attention import decode_attention
    from worker.kernels.layers import fused_head, fused_layers
    from worker.kernels.prefill import prefill_attention

    return Kernels(decode_attention=decode_attention,
                   prefill_attention=prefill_attention if prefill_tiles else None,
                   fused_layers=fused_layers if fused else None,
                   fused_head=fused_head if fused else None)
