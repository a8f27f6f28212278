"""The mixture-of-experts kernels (worker.kernels.moe) in Triton's interpreter, in fp32, against the torch code the CPU
model runs (worker.model.qwen3_5_moe.SparseMoe), at tiny sizes:

- routing: each token's experts are torch.topk's of the softmax, its weights theirs renormalised; the sorted pairs
  hold every pair once, grouped by expert in pair order, each expert's range padded with the sentinel to a multiple
  of BLOCK_M, each block's expert recorded, the padded total right;
- the block: h + routed + gated shared expert, as the torch MLP (decode tiles and prefill tiles, with experts that no
  token chooses, and a token count where one expert takes more than one block), the shared expert computed apart (the
  tiny preset's is wider than its routed experts) and run as one more expert (the same config with equal widths, as
  the published shape has them);
- the combining launch's norm of the rows it writes (the next layer's input norm): the norm kernel's bits;
- batch invariance: a token's output rows are the same bits alone (routed by the one-token path), with others, and
  moved to another place of the batch (its pairs land elsewhere in the sorted order).
The interpreter computes tl.dot with numpy's matmul, whose BLAS sums a row in an order that depends on the row's place
in the tile (its micro-kernels take rows in groups): the check computes each row of a tl.dot by itself instead, as a
GPU's tensor cores do (a row's sums do not depend on its place in the tile), so that the bits compare the kernels'
indexing. Run by tests/worker/test_moe_kernels.py."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from worker.model.config import PRESETS, ModelConfig
from worker.model.qwen3_5_moe import SparseMoe

TOKENS = (1, 40)  # one (the route kernel's one-program path), and enough for an expert to take several decode blocks


def rows_apart() -> None:
    """tl.dot in the interpreter row by row (see the module docstring)."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        out = np.stack([np.matmul(row[None, :], b.data, dtype=d.data.dtype)[0] for row in a.data])
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def rows_of(mlp: SparseMoe, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor, prefill: bool) -> torch.Tensor:
    """The block's output for some rows of (h, x, logits, shared) only."""
    from worker.kernels.moe import moe_block

    h, x, logits, shared = (t[rows] for t in inputs)
    return moe_block(h, x, logits, mlp.gate_up, mlp.down, mlp.top_k, mlp.scratch,
                     shared=None if mlp.shared_in_experts else shared, prefill=prefill)


def check(c: ModelConfig) -> None:
    from worker.kernels.moe import DECODE_TILES, PREFILL_TILES, moe_block, route_and_sort
    from worker.kernels.norms import offset_rms_norm

    ex = c.experts
    assert ex is not None
    gen = torch.Generator().manual_seed(7)
    d, f, s, n = c.dim, ex.ffn_dim, ex.shared_ffn_dim, ex.count
    merged = s == f
    stored = n + int(merged)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    views = {"l.w_route": rand(n + 1, d), "l.w_experts_gate_up": rand(stored * 2 * f, d),
             "l.w_experts_down": rand(stored * d, f)}
    if not merged:
        views |= {"l.w_shared_gate_up": rand(2 * s, d), "l.w_shared_down": rand(d, s)}
    views["l.w_route"][2] = -1.0  # with positive inputs expert 2's logit is far down: no token chooses it
    mlp = SparseMoe(views, "l.", c)
    assert mlp.shared_in_experts == merged
    pairs_per_token = ex.top_k + int(merged)

    for tiles in (DECODE_TILES, PREFILL_TILES):
        for tokens in TOKENS:
            x, h = rand(tokens, d, scale=1.0).abs(), rand(tokens, d, scale=1.0)
            logits = torch.nn.functional.linear(x, mlp.w_route.fused.weight)
            routing = route_and_sort(logits, n, ex.top_k, tiles, mlp.scratch, shared=merged)
            # the counts and the ticket are back to zero for the next step (the starts between are rewritten each step)
            assert not mlp.scratch[:stored].any() and int(mlp.scratch[-1]) == 0
            ids, weights = mlp.route(logits[:, :n])
            assert torch.equal(routing.ids[:, : ex.top_k].long(), ids), (routing.ids, ids)
            torch.testing.assert_close(routing.weights[:, : ex.top_k], weights, rtol=1e-6, atol=1e-7)
            if merged:  # the shared expert: expert n, every token's last pair, weight 1
                assert bool((routing.ids[:, -1] == n).all()) and bool((routing.weights[:, -1] == 1).all())
            pairs = tokens * pairs_per_token
            flat = routing.ids.reshape(-1).long()
            counts = torch.bincount(flat, minlength=stored)
            assert counts[2] == 0
            padded = (counts + tiles.block_m - 1) // tiles.block_m * tiles.block_m
            total = int(padded.sum())
            assert int(routing.total[0]) == total
            start = 0
            for e in range(stored):
                mine = routing.sorted_pairs[start : start + int(padded[e])]
                want = (flat == e).nonzero().squeeze(1).int()
                # the interpreter runs the programs in order, so the ranks are in pair order
                assert torch.equal(mine[: int(counts[e])], want), (e, mine, want)
                assert bool((mine[int(counts[e]) :] == pairs).all())
                blocks = routing.block_expert[start // tiles.block_m : (start + int(padded[e])) // tiles.block_m]
                assert bool((blocks == e).all())
                start += int(padded[e])
            expected = h + mlp(x)
            shared = mlp.shared(x)
            got = moe_block(h, x, logits, mlp.gate_up, mlp.down, ex.top_k, mlp.scratch,
                            shared=None if merged else shared, prefill=tiles is PREFILL_TILES)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            # the next layer's input norm in the combining launch: the same rows, and them normed as the norm kernel
            norm = 1.0 + rand(d, scale=0.1)
            normed = torch.empty_like(h)
            also = moe_block(h, x, logits, mlp.gate_up, mlp.down, ex.top_k, mlp.scratch,
                             shared=None if merged else shared, prefill=tiles is PREFILL_TILES, norm=norm, eps=1e-6,
                             normed=normed)
            assert torch.equal(also, got)
            assert torch.equal(normed, offset_rms_norm(got, norm, 1e-6))

            if tokens > 1:  # the last token alone, and the batch reversed: the same bits for every token
                inputs = (h, x, logits, shared)
                whole = rows_of(mlp, inputs, torch.arange(tokens), tiles is PREFILL_TILES)
                alone = rows_of(mlp, inputs, torch.tensor([tokens - 1]), tiles is PREFILL_TILES)
                backwards = rows_of(mlp, inputs, torch.arange(tokens).flip(0), tiles is PREFILL_TILES)
                assert torch.equal(alone[0], whole[-1])
                assert torch.equal(backwards.flip(0), whole)


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    rows_apart()
    c: ModelConfig = PRESETS["tiny-qwen3.5-moe"]
    assert c.experts is not None and c.experts.shared_ffn_dim != c.experts.ffn_dim
    check(c)  # the shared expert apart (wider than the routed ones)
    check(dataclasses.replace(c, experts=dataclasses.replace(c.experts, shared_ffn_dim=c.experts.ffn_dim)))
    print("ok")


if __name__ == "__main__":
    main()
