"""The fused kernels (worker.kernels.fused) against worker.model.llama's torch code, in fp32 and fp16: rms_norm and
add_rms_norm (rows that are column slices of wider tensors too), silu_mul, Qwen3's per-head q/k norms, and
rope_and_store writing K/V into the strided slab views the model passes, outputs and caches poisoned with NaN.
Run by tests/worker/test_fused.py."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from cuda_state import store_positions
from tests.worker.tensors import rope_rows, same_bits, slab_caches, ulps
from worker.model import llama as M

NAN = float("nan")


def rows(t: int, dim: int, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    """t x dim, optionally a column slice of a wider tensor (row stride dim + pad)."""
    return (torch.randn(t, dim + pad) * 3).to(dtype)[:, :dim]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # fp16: a rare last-bit flip of the normed or silu value (sum order, exp) moves the output <= 2 ulps
    if a.dtype == torch.float16:
        return bool((ulps(a, b) <= 2).all())
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def check_norms(dtype: torch.dtype) -> None:
    from worker.kernels.fused import add_rms_norm, rms_norm

    for t, dim, pad in ((5, 576, 0), (3, 64, 16), (4, 80, 0), (1, 1000, 24)):
        x, r = rows(t, dim, dtype, pad), rows(t, dim, dtype)
        w = torch.randn(dim).to(dtype)
        out = torch.full((t, dim), NAN, dtype=dtype)
        assert rms_norm(x, w, 1e-5, out=out) is out
        assert close(out, M.rms_norm(x, w, 1e-5)), ("rms_norm", dtype, t, dim)

        out, res = torch.full((t, dim), NAN, dtype=dtype), torch.full((t, dim), NAN, dtype=dtype)
        got, new_res = add_rms_norm(x, r, w, 1e-5, out=out, residual_out=res)
        assert got is out and new_res is res
        assert same_bits(res, r + x), ("residual", dtype, t, dim)  # h + y, rounded once
        assert close(out, M.rms_norm(r + x, w, 1e-5)), ("add_rms_norm", dtype, t, dim)
        r_in_place = r.clone()
        _, again = add_rms_norm(x, r_in_place, w, 1e-5, residual_out=r_in_place)  # row by row: in place is safe
        assert again is r_in_place and same_bits(again, res)


def check_head_norm(dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k norms in place against its torch code, v untouched; a row alone gives its bits in a batch."""
    from worker.kernels.fused import head_rms_norm
    from worker.model.layers import rms_norm

    for t, heads, kv, hd in ((3, 4, 2, 64), (2, 6, 3, 48), (1, 2, 1, 128)):
        qkv = rows(t, (heads + 2 * kv) * hd, dtype)
        qw, kw = (1 + 0.3 * torch.randn(hd)).to(dtype), (1 + 0.3 * torch.randn(hd)).to(dtype)
        q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
        want_q = rms_norm(q.reshape(t, heads, hd), qw, 1e-6).reshape(t, -1)
        want_k = rms_norm(k.reshape(t, kv, hd), kw, 1e-6).reshape(t, -1)
        got = qkv.clone()
        assert head_rms_norm(got, qw, kw, heads, kv, 1e-6) is got
        assert close(got[:, : heads * hd], want_q) and close(got[:, heads * hd : (heads + kv) * hd], want_k), (dtype, t)
        assert same_bits(got[:, (heads + kv) * hd :], v)
        alone = qkv[-1:].clone()
        assert same_bits(head_rms_norm(alone, qw, kw, heads, kv, 1e-6), got[-1:])


def check_silu_mul(dtype: torch.dtype) -> None:
    from worker.kernels.fused import silu_mul

    for t, ffn, pad in ((3, 1536, 0), (2, 40, 8), (1, 1030, 0)):
        gate_up = (torch.randn(t, 2 * ffn + pad) * 4).to(dtype)[:, : 2 * ffn]
        out = torch.full((t, ffn), NAN, dtype=dtype)
        assert silu_mul(gate_up, out=out) is out
        gate, up = gate_up.chunk(2, dim=-1)
        assert close(out, F.silu(gate) * up), ("silu_mul", dtype, t, ffn)


def check_rope_and_store(dtype: torch.dtype) -> None:
    from worker.kernels.fused import rope_and_store

    for heads, kv, hd in ((9, 3, 64), (4, 4, 80), (4, 2, 16)):
        n_slots, layers, ctx = 5, 3, 40
        spare = n_slots - 1
        k_all, v_all = slab_caches(n_slots, layers, kv, ctx, hd, dtype, "cpu")
        k_all.fill_(NAN)  # poison: only the written places may change
        v_all.fill_(NAN)
        k_cache, v_cache = k_all[:, 1], v_all[:, 1]  # layer 1, as the model passes it
        # a prefill run of slot 2, decode rows of slots 0 and 3, a padding row of the spare
        slots = torch.tensor([2, 2, 2, 0, 3, spare])
        positions = torch.tensor([5, 6, 7, 0, ctx - 1, 0])
        t = len(slots)
        qkv = torch.randn(t, (heads + 2 * kv) * hd).to(dtype)
        cos, sin = rope_rows(hd, 10000.0, ctx, positions)
        expect_k, expect_v = k_all.clone(), v_all.clone()
        q_ref, k_ref, v_ref = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
        store_positions(expect_k[:, 1], slots, positions, M.apply_rope(k_ref.view(t, kv, hd), cos, sin))
        store_positions(expect_v[:, 1], slots, positions, v_ref.view(t, kv, hd))
        q_out = torch.full((t, heads, hd), NAN, dtype=dtype)
        q = rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, positions, heads, kv, hd, out=q_out)
        assert q is q_out
        assert same_bits(q, M.apply_rope(q_ref.view(t, heads, hd), cos, sin)), ("rope q", dtype, heads, kv, hd)
        assert same_bits(k_all, expect_k), ("k cache", dtype, heads, kv, hd)  # every slot, every layer
        assert same_bits(v_all, expect_v), ("v cache", dtype, heads, kv, hd)


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"  # the kernels import triton: only after this check
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        check_norms(dtype)
        check_silu_mul(dtype)
        check_head_norm(dtype)
        check_rope_and_store(dtype)
    print("ok")


if __name__ == "__main__":
    main()
