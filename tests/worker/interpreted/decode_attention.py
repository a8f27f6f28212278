"""The Triton decode attention (worker.kernels.attention) against a float64 reference, in fp32 and fp16: GQA and
not, head dims that are not powers of two, one to five key splits, K/V as the table's block-strided views of a slab
(contexts that end inside a block), and the keys
past each row's length poisoned with NaN. Run by tests/worker/gpu/test_attention.py (see this package)."""

from __future__ import annotations

import math
import os

import torch

from tests.worker.tensors import blocked

CASES = [  # (rows, heads, kv_heads, head_dim, max_context, splits)
    (3, 9, 3, 64, 300, 1), (3, 9, 3, 64, 300, 4), (2, 4, 4, 32, 130, 3),
    (4, 8, 2, 80, 200, 2), (5, 9, 3, 64, 500, 5), (1, 2, 1, 16, 64, 1),
    (2, 9, 3, 64, 800, 3),  # 800 keys: 3 splits
]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              lengths: torch.Tensor) -> torch.Tensor:
    rows, heads, hd = q.shape
    group = heads // k.shape[1]
    out = torch.empty(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        n, s = int(lengths[r]), int(slots[r])
        for h in range(heads):
            kk, vv = k[s, h // group, :n].double(), v[s, h // group, :n].double()
            out[r, h] = torch.softmax(kk @ q[r, h].double() / math.sqrt(hd), 0) @ vv
    return out


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    from worker.kernels.attention import decode_attention  # imports triton: after the check above

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        for rows, heads, kv, hd, ctx, splits in CASES:
            slots_n = rows + 2
            k, v = torch.randn(slots_n, kv, ctx, hd).to(dtype), torch.randn(slots_n, kv, ctx, hd).to(dtype)
            slots = torch.randperm(slots_n)[:rows]
            lengths = torch.randint(1, ctx + 1, (rows,), dtype=torch.int32)
            lengths[0], lengths[-1] = ctx, 1
            for r in range(rows):  # poison what must not be read
                k[slots[r], :, int(lengths[r]):] = float("nan")
                v[slots[r], :, int(lengths[r]):] = float("nan")
            q = torch.randn(rows, heads, hd).to(dtype)
            out = torch.full((rows, heads, hd), float("nan"), dtype=dtype)
            kb, vb = blocked(k, v)  # strided views of a slab, block by block, as the model passes them
            got = decode_attention(q, kb, vb, slots, lengths, out=out, splits=splits)
            assert got is out
            err = (out.double() - reference(q, k, v, slots, lengths)).abs().max().item()
            assert err < tol, (dtype, rows, heads, kv, hd, ctx, splits, err)
    print("ok")


if __name__ == "__main__":
    main()
