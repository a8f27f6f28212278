"""Device memory the GPU engine keeps free beside the weights and the session slab, and cuBLAS's share of it."""

from __future__ import annotations

import os

import torch

from worker.engine.budget import GPU_STEP_TOKENS
from worker.engine.graphs import BUCKETS, PREFILL_LOGITS
from worker.model.llama import Llama

# Fixed slack in the workspace: cuBLAS workspaces (one per stream, the capture stream included),
# lazily loaded kernel modules of torch and Triton, and caching-allocator fragmentation.
FIXED_WORKSPACE_BYTES = 768 << 20
# cuBLAS workspace per (handle, stream), as CUBLAS_WORKSPACE_CONFIG spells it: 8 buffers of 16 KiB. Torch's default
# on Hopper is 32 MiB for every stream that runs a product, held for the life of the process (the capture stream's
# stays referenced by the graphs). Measured on the H100: the same decode-graph times and the same row-invariant
# buckets at 128 KiB as at 32 MiB, and 32 MiB less device memory with 64 sessions (ratio 1.057 -> 1.046).
CUBLAS_WORKSPACE_CONFIG = ":16:8"


def limit_cublas_workspace() -> str:
    """Set CUBLAS_WORKSPACE_CONFIG to CUBLAS_WORKSPACE_CONFIG unless the environment sets it; returns the value
    it now holds. Torch reads it once, at the process's first cuBLAS product: where one ran before (a caller's
    own products), the setting does not apply. The worker process calls this (Engine.load) before any."""
    return os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


def workspace_bytes(llama: Llama) -> int:
    """Device memory to keep free beside the weights and the slab when sizing the session table.

    Generous on purpose: a session refused at create is cheap, an out-of-memory in a step is not.
    - activations of one eager step of up to GPU_STEP_TOKENS tokens (one layer live at a time, x2
      for the allocator holding the previous layer's blocks; a mixture of experts' per-pair buffers included);
    - the attention of a prefill chunk: the model's masked SDPA with GQA takes the math path, which
      materialises fp32 scores, probabilities and the mask, (H, chunk, max_context) each;
    - logits: fp32 and model dtype for the largest eager decode, and the graphs' static outputs
      (one per bucket and the prefill graph's, kept alive in the shared pool);
    - FIXED_WORKSPACE_BYTES for cuBLAS workspaces, kernel modules and fragmentation.
    """
    c = llama.config
    item = torch.empty((), dtype=llama.dtype).element_size()
    context = llama.max_context
    chunk = min(GPU_STEP_TOKENS, context)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    per_token = item * (4 * c.dim + qkv + c.n_heads * c.head_dim + 3 * c.ffn_dim)
    ex = c.experts
    if ex is not None:  # a mixture of experts: each token's k pairs' activations and outputs, router and shared expert
        per_token += item * (ex.top_k * (ex.ffn_dim + c.dim) + ex.count + 1 + 3 * ex.shared_ffn_dim) + 8 * ex.top_k
    activations = 2 * GPU_STEP_TOKENS * per_token
    attention = 3 * c.n_heads * chunk * context * 4
    logits = 2 * BUCKETS[-1] * c.vocab_size * (4 + item) + (sum(BUCKETS) + PREFILL_LOGITS) * c.vocab_size * 4
    return activations + attention + logits + FIXED_WORKSPACE_BYTES
