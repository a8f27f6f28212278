"""The gated delta rule (gated DeltaNet's token mixer) in plain torch: the CPU path, and the reference the GPU
kernels are checked against.

Per value head, a state S (key_dim x value_dim) is carried through the tokens: S is decayed by exp(g_t), corrected
toward v_t along k_t with the rate beta_t (the delta rule: S += k_t (beta_t (v_t - S^T k_t))^T), then read by q_t.
q and k are L2-normed (transformers' `use_qk_l2norm_in_kernel`) and q scaled by key_dim^-1/2.

Two schedules of the same arithmetic, as transformers' Qwen3.5 computes them (modeling_qwen3_5's
torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule), step for step and in the same dtypes, so that a
CPU model in fp32 gives transformers' numbers: `chunked` for prompt chunks (blocks of CHUNK tokens solved with a
triangular system, the state carried from block to block; a prompt's last block padded with tokens that change
nothing), `recurrent` for one token at a time (decode). A prompt cut into pieces that are multiples of CHUNK, each
continuing from the state the last one left, computes the same blocks as the whole prompt at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked schedule (transformers' and flash-linear-attention's chunk_size)
L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Key heads repeated for their value heads, everything fp32 as (batch, heads, tokens, ...)."""
    key_heads, value_heads = k.shape[2], v.shape[2]
    if key_heads != value_heads:  # each key head serves value_heads / key_heads consecutive value heads
        q = q.repeat_interleave(value_heads // key_heads, dim=2)
        k = k.repeat_interleave(value_heads // key_heads, dim=2)
    return tuple(x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g))


def chunked(
    q: torch.Tensor,  # (batch, tokens, key_heads, key_dim)
    k: torch.Tensor,  # (batch, tokens, key_heads, key_dim)
    v: torch.Tensor,  # (batch, tokens, value_heads, value_dim)
    g: torch.Tensor,  # (batch, tokens, value_heads): the log of each token's decay (<= 0)
    beta: torch.Tensor,  # (batch, tokens, value_heads)
    state: torch.Tensor | None = None,  # (batch, value_heads, key_dim, value_dim) before the tokens; None: zeros
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, tokens, value_heads, value_dim) in q's dtype, the state after the tokens (fp32))."""
    dtype = q.dtype
    batch, tokens = k.shape[:2]
    value_dim = v.shape[-1]
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - tokens % CHUNK) % CHUNK  # zero k, v, beta and g: the padding tokens change no state
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, CHUNK)
    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)  # the log of the decay from a block's start to each token
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(above, float("-inf")).exp()  # decay from token j to i
    system = (k_beta @ k.transpose(-1, -2)) * pair
    within = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    # The block's delta-rule updates condensed (the UT transform): the values to write, and the keys that read the
    # state the block starts from.
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = (torch.zeros((batch, v.shape[1], k.shape[-1], value_dim), dtype=new_values.dtype, device=q.device)
         if state is None else state.to(new_values))
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + within[:, :, i] @ v_new
        s = s * block_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, out.shape[1], -1, value_dim)[:, :, :tokens]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `chunked`, one token after the other (what a decode step computes for each row)."""
    dtype = q.dtype
    batch, tokens = k.shape[:2]
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    q, k = l2norm(q), l2norm(k)
    q = q / q.shape[-1] ** 0.5
    s = (torch.zeros((batch, v.shape[1], k.shape[-1], v.shape[-1]), dtype=v.dtype, device=v.device)
         if state is None else state.to(v))
    out = torch.zeros_like(v)
    for i in range(tokens):
        q_t, k_t, v_t = q[:, :, i], k[:, :, i], v[:, :, i]
        s = s * g[:, :, i].exp()[..., None, None]
        delta = (v_t - (s * k_t.unsqueeze(-1)).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
        s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s
