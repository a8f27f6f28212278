"""RoPE, the K/V store and decode attention in one launch (worker.kernels.attention.rope_decode_attention) against
the two launches it replaces (worker.kernels.fused.rope_and_store, then decode_attention unsplit): the same bits in
the output and in both caches, GQA and not, a head_dim that is not a power of two, rows in distinct slots at
lengths from 1 to a whole context (the last position of a block and the first of the next), padding rows in the
spare slot. Run in Triton's interpreter by tests/worker/gpu/test_attention.py (fp32, fp16), and on the GPU (bf16)."""

from __future__ import annotations

import os

import torch

from tests.worker.tensors import blocked, rope_rows, same_bits

CASES = [  # (rows, heads, kv_heads, head_dim, max_context)
    (4, 8, 2, 64, 100), (3, 4, 4, 32, 70), (2, 6, 3, 48, 40),
]


def compare(device: str, dtype: torch.dtype, cases: list[tuple[int, int, int, int, int]] = CASES) -> None:
    """Assert the one launch gives the two launches' bits, for each case, on `device`."""
    from worker.kernels.attention import decode_attention, rope_decode_attention  # import triton: after the caller's
    from worker.kernels.fused import rope_and_store

    gen = torch.Generator().manual_seed(3)
    for rows, heads, kv, hd, ctx in cases:
        slots_n = rows + 3  # the last is the spare (padding rows)
        k = torch.randn((slots_n, kv, ctx, hd), generator=gen).to(dtype).to(device)
        v = torch.randn((slots_n, kv, ctx, hd), generator=gen).to(dtype).to(device)
        real = torch.randperm(slots_n - 1, generator=gen)[: rows - 1].tolist()
        slots = torch.tensor([*real, slots_n - 1], device=device)  # the last row: padding, position 0 of the spare
        lengths = torch.tensor([ctx, 1, 17, 33, 64][: rows - 1] + [1], dtype=torch.int32, device=device)
        qkv = (torch.randn((rows, (heads + 2 * kv) * hd), generator=gen) * 2).to(dtype).to(device)
        cos, sin = rope_rows(hd, 10000.0, ctx, (lengths - 1).long())
        expected = []
        for fused in (False, True):
            kb, vb = blocked(k, v)
            if fused:
                out = rope_decode_attention(qkv, cos, sin, kb, vb, slots, lengths, heads)
            else:
                q = rope_and_store(qkv, cos, sin, kb, vb, slots, (lengths - 1).long(), heads, kv, hd)
                out = decode_attention(q, kb, vb, slots, lengths, splits=1)
            expected.append((out, kb, vb))
        (a, ka, va), (b, kb_, vb_) = expected
        case = (dtype, rows, heads, kv, hd, ctx)
        assert same_bits(a, b), case
        assert same_bits(ka, kb_) and same_bits(va, vb_), case


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    for dtype in (torch.float32, torch.float16):
        compare("cpu", dtype)
    print("ok")


if __name__ == "__main__":
    main()
