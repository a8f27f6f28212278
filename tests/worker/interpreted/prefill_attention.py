"""The tiled prompt-chunk attention (worker.kernels.prefill) against a float64 reference (the decode check's), in fp32
and fp16: chunks of 1 to 3 tiles at offsets, padding rows in the spare slot, K/V past each chunk poisoned, rows
outside every tile untouched. Run by tests/worker/gpu/test_attention.py (see this package)."""

from __future__ import annotations

import os

import torch

from tests.worker.interpreted.decode_attention import reference
from tests.worker.tensors import blocked

CHUNKS = [(2, 100, 130), (0, 0, 70), (1, 298, 2)]  # (slot, first position, rows)
CONTEXT = 300
SPARE = 4  # the slab's last slot: padding rows read position 0 of it
PADDING = 10  # padding rows after the chunks
LOOSE = 3  # rows in no tile: left as they are


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    # These import triton: after the check above.
    from worker.kernels.prefill import prefill_attention
    from worker.kernels.tiles import prefill_tiles

    torch.manual_seed(1)
    for dtype, tol, heads, kv, hd in ((torch.float32, 1e-5, 9, 3, 64), (torch.float16, 3e-3, 4, 4, 80)):
        k, v = torch.randn(SPARE + 1, kv, CONTEXT, hd).to(dtype), torch.randn(SPARE + 1, kv, CONTEXT, hd).to(dtype)
        row_slots: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        for slot, pos, n in CHUNKS:
            starts.append(len(row_slots))
            row_slots += [slot] * n
            positions += range(pos, pos + n)
            k[slot, :, pos + n:] = float("nan")  # poison what no row of the chunk may read
            v[slot, :, pos + n:] = float("nan")
        starts.append(len(row_slots))
        row_slots += [SPARE] * PADDING
        positions += [0] * PADDING
        slots, lengths = torch.tensor(row_slots), torch.tensor(positions, dtype=torch.int32) + 1
        q = torch.randn(len(slots) + LOOSE, heads, hd).to(dtype)
        firsts, counts = prefill_tiles(starts, [n for _, _, n in CHUNKS] + [PADDING])
        tiles = torch.zeros(2, len(firsts) + 4, dtype=torch.long)  # unused tiles: 0 rows
        tiles[0, : len(firsts)], tiles[1, : len(firsts)] = torch.from_numpy(firsts), torch.from_numpy(counts)
        out = torch.full_like(q, 7.0)
        rows = len(slots)
        pad_slots, pad_lengths = torch.cat([slots, slots[:LOOSE]]), torch.cat([lengths, lengths[:LOOSE]])
        kb, vb = blocked(k, v)  # the table's layout of one layer
        assert prefill_attention(q, kb, vb, pad_slots, pad_lengths, tiles, out=out) is out
        expected = reference(q[:rows], k, v, slots, lengths)  # by position, in float64
        err = (out[:rows].double() - expected).abs().max().item()
        assert err < tol, (dtype, err)
        assert (out[rows:] == 7.0).all()
    print("ok")


if __name__ == "__main__":
    main()
