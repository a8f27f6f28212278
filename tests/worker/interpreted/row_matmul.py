"""Row products (worker.kernels.matmul) against torch, in fp32 and fp16, for every flag: plain, silu of a gate|up
pair, a residual added with the squares of the output's tiles, normed rows (the norm's weight folded into the
product, the row scale from row_squares), and fp32 out; and each of those with the inner dimension split over 2 and 3
programs (Tiles.split), whose rows come out the same alone and in a batch, leaving the tickets at zero. Run by
tests/worker/test_row_matmul.py."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from worker.model import llama as M

NAN = float("nan")


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, float(b.float().abs().max())))


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    # These import triton: after the check above.
    import triton

    from tests.worker.interpreted.moe_kernels import rows_apart
    from worker.kernels.matmul import Tiles, row_matmul, row_squares, split_tickets, squares_tiles, tiles_for

    rows_apart()  # tl.dot row by row, as on a GPU, so that a row alone and in a batch can be compared bit for bit

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for rows in (1, 5, 17, 40):
            for n, k in ((24, 40), (64, 96), (40, 1100)):
                x = (torch.randn(rows, k) * 2).to(dtype)
                w = (torch.randn(2 * n, k) * 0.1).to(dtype)
                g = (1 + 0.3 * torch.randn(k)).to(dtype)
                r = torch.randn(rows, n).to(dtype)

                out = torch.full((rows, n), NAN, dtype=dtype)
                assert row_matmul(x, w[:n].contiguous(), out=out) is out
                close(out, F.linear(x, w[:n]), tol)

                gate, up = F.linear(x, w).chunk(2, dim=-1)
                close(row_matmul(x, w, silu=True), F.silu(gate) * up, tol)

                out = r.clone()
                tiles = squares_tiles(n, k)
                squares = torch.full((tiles, rows), NAN)
                assert row_matmul(x, w[:n].contiguous(), residual=out, out=out, squares_out=squares) is out
                close(out, r + F.linear(x, w[:n]), tol)
                block = tiles_for(n, k).block_n
                expected = torch.stack([(out[:, i:i + block].float() ** 2).sum(1) for i in range(0, n, block)])
                close(squares, expected, tol)

                # normed rows: the norm's weight folded into the product, the row scale from row_squares
                squares = row_squares(x, torch.full((triton.cdiv(k, 16), rows), NAN))
                folded = (w.float() * g.float()).to(dtype)
                got = row_matmul(x, folded[:n].contiguous(), norm_squares=squares, eps=1e-5)
                close(got, F.linear(M.rms_norm(x, g, 1e-5), w[:n]), tol)
                gate, up = F.linear(M.rms_norm(x, g, 1e-5), w).chunk(2, dim=-1)
                close(row_matmul(x, folded, norm_squares=squares, eps=1e-5, silu=True), F.silu(gate) * up, tol)

                wide = torch.full((rows, n), NAN, dtype=torch.float32)
                assert row_matmul(x, w[:n].contiguous(), out=wide) is wide
                close(wide, F.linear(x, w[:n]).float(), tol)

                # the inner dimension over several programs, every flag (in fp32: the indexing is the dtype's alike)
                for split in (2, 3) if dtype == torch.float32 else ():
                    def tiles_of(silu: bool, n: int = n, k: int = k, split: int = split) -> Tiles:
                        return dataclasses.replace(tiles_for(n, k, silu), split=split)

                    plain = row_matmul(x, w[:n].contiguous(), tiles=tiles_of(False))
                    close(plain, F.linear(x, w[:n]), tol)
                    alone = row_matmul(x[-1:], w[:n].contiguous(), tiles=tiles_of(False))
                    assert torch.equal(alone[0], plain[-1])  # a row's numbers are its own
                    gate, up = F.linear(x, w).chunk(2, dim=-1)
                    close(row_matmul(x, w, silu=True, tiles=tiles_of(True)), F.silu(gate) * up, tol)
                    out = r.clone()
                    squares = torch.full((tiles, rows), NAN)
                    row_matmul(x, w[:n].contiguous(), residual=out, out=out, squares_out=squares, tiles=tiles_of(False))
                    close(out, r + F.linear(x, w[:n]), tol)
                    expected = torch.stack([(out[:, i:i + block].float() ** 2).sum(1) for i in range(0, n, block)])
                    close(squares, expected, tol)
                    norm_sq = row_squares(x, torch.full((triton.cdiv(k, 16), rows), NAN))
                    got = row_matmul(x, folded[:n].contiguous(), norm_squares=norm_sq, eps=1e-5, tiles=tiles_of(False))
                    close(got, F.linear(M.rms_norm(x, g, 1e-5), w[:n]), tol)
                    assert not split_tickets(x.device, 1).any()  # every ticket back at zero
    print("ok")


if __name__ == "__main__":
    main()
