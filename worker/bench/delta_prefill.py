"""The DeltaNet prefill kernel (worker.kernels.deltanet.delta_prefill) at a hybrid preset's heads, timed per layer.

    python -m worker.bench.delta_prefill [--model random:qwen3.5-35b-a3b] [--runs 16x128 64x32 1x2048] [--sweep]

For each shape RUNSxTOKENS (that many sessions' prompts of that many tokens in one step, each from position 0):
the two launches' time (captured in a CUDA graph, best of 5) and the largest error of the output and of the state
left against the chunked delta rule in float64 (worker.model.delta_rule.chunked). With --sweep, the launch shapes
(the blocks kernel's warps, the walk's value dims and warps) over a small grid, each with its time and whether it
gives the default's bits (every shape should), to choose worker.kernels.deltanet's BLOCKS_WARPS, PREFILL_BLOCK_V
and PREFILL_WARPS. Prints microseconds.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from worker.bench.matmul import graph_us
from worker.kernels import deltanet
from worker.model import delta_rule
from worker.model.batch import Run
from worker.model.config import PRESETS, LinearAttention
from worker.model.qwen3_5 import run_tiles

SWEEP_BLOCKS_WARPS = (4, 8)
SWEEP_WALK = ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8))  # (value dims, warps) a walk program


class Case:
    """One step's inputs: `runs` prompts of `tokens` tokens each, seeded, at the heads of `lin`."""

    def __init__(self, lin: LinearAttention, runs: int, tokens: int, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        rows = runs * tokens
        self.lin, self.runs, self.tokens = lin, runs, tokens
        self.qkv = torch.randn(rows, lin.conv_dim, generator=gen, device=device).to(torch.bfloat16)
        self.a = torch.randn(rows, lin.value_heads, generator=gen, device=device).to(torch.bfloat16)
        self.b = torch.randn(rows, lin.value_heads, generator=gen, device=device).to(torch.bfloat16)
        self.a_log = torch.randn(lin.value_heads, generator=gen, device=device) * 0.5
        self.dt_bias = torch.randn(lin.value_heads, generator=gen, device=device) * 0.5
        self.state = torch.zeros(runs + 1, lin.value_heads, lin.key_dim, lin.value_dim, device=device)
        self.slots = torch.arange(runs, device=device).repeat_interleave(tokens)
        self.positions = torch.arange(tokens, device=device).repeat(runs)
        self.tiles = run_tiles([Run(r, r * tokens, tokens, 0) for r in range(runs)], device)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = deltanet.delta_prefill(self.qkv, self.a, self.b, self.a_log, self.dt_bias, self.state, self.slots,
                                     self.positions, self.tiles, self.lin.key_heads, self.lin.key_dim)
        return out, self.state[: self.runs]

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        lin, runs, n = self.lin, self.runs, self.tokens
        q, k, v = self.qkv.double().split([lin.key_heads * lin.key_dim] * 2 + [lin.value_heads * lin.value_dim], -1)
        g = -torch.exp(self.a_log.double()) * F.softplus(self.a.double() + self.dt_bias.double())
        beta = torch.sigmoid(self.b.double())
        out, state = delta_rule.chunked(
            q.view(runs, n, lin.key_heads, lin.key_dim), k.view(runs, n, lin.key_heads, lin.key_dim),
            v.view(runs, n, lin.value_heads, lin.value_dim), g.view(runs, n, lin.value_heads),
            beta.view(runs, n, lin.value_heads))
        return out.reshape(runs * n, lin.value_heads, lin.value_dim), state


def shape(text: str) -> tuple[int, int]:
    runs, _, tokens = text.partition("x")
    return int(runs), int(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3.5-35b-a3b")
    ap.add_argument("--runs", type=shape, nargs="*", default=[(16, 128), (64, 32), (1, 2048)])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    lin = PRESETS[args.model.removeprefix("random:")].linear
    if lin is None:
        raise SystemExit(f"{args.model} has no DeltaNet layers")
    dev = torch.device("cuda")
    default = (deltanet.BLOCKS_WARPS, deltanet.PREFILL_BLOCK_V, deltanet.PREFILL_WARPS)
    print(f"{args.model}: {lin.key_heads} key heads of {lin.key_dim}, {lin.value_heads} value heads of "
          f"{lin.value_dim}; blocks warps {default[0]}, walk value dims {default[1]}, walk warps {default[2]}")
    for runs, tokens in args.runs:
        case = Case(lin, runs, tokens, dev)

        def step(i: int, case: Case = case) -> object:
            return case.run()

        out, state = (t.clone() for t in case.run())
        ref_out, ref_state = case.reference()
        us = graph_us(step, reps=10)
        out_error = (out.double() - ref_out).abs().max().item()
        state_error = (state.double() - ref_state).abs().max().item()
        print(f"{runs:4d} runs x {tokens:5d} tokens: {us:9.1f} us a layer; max error out {out_error:.2e}, "
              f"state {state_error:.2e}", flush=True)
        if not args.sweep:
            continue
        for blocks_warps, (block_v, warps) in itertools.product(SWEEP_BLOCKS_WARPS, SWEEP_WALK):
            deltanet.BLOCKS_WARPS, deltanet.PREFILL_BLOCK_V, deltanet.PREFILL_WARPS = blocks_warps, block_v, warps
            try:
                o, s = case.run()
                same = torch.equal(o, out) and torch.equal(s, state)
                us = graph_us(step, rounds=3, reps=10)
                print(f"    blocks warps {blocks_warps:2d}, walk value dims {block_v:3d}, walk warps {warps}: "
                      f"{us:9.1f} us{'' if same else '  (other bits)'}", flush=True)
            except Exception as e:  # a shape that does not fit (shared memory) is reported, not fatal
                print(f"    blocks warps {blocks_warps:2d}, walk value dims {block_v:3d}, walk warps {warps}: "
                      f"{type(e).__name__}", flush=True)
        deltanet.BLOCKS_WARPS, deltanet.PREFILL_BLOCK_V, deltanet.PREFILL_WARPS = default


if __name__ == "__main__":
    main()
