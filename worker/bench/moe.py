"""The mixture-of-experts block's kernels (worker.kernels.moe) at the published Qwen3.5-35B-A3B shape, timed by launch.

    python -m worker.bench.moe [--tokens 1 16 64] [--prefill-tokens 128 2048] [--layers 8] [--sweep]

For each token count: the block's time (routing and placing, gate|up, down, combining; the shared expert run as one
more expert) with the decode tiles (or the prefill tiles for --prefill-tokens), each launch's own time, and the
bytes of the experts the tokens chose at that time. Each is timed as launches captured in a CUDA graph, one layer's
weights after another's (--layers copies: they stream from device memory, as in a step, rather than sit in the L2),
best of 5. With --sweep, the gate|up and the down kernels' tiles over a small grid each (the other kernel's kept),
and the route kernel's warps, to choose worker.kernels.moe.DECODE_TILES and PREFILL_TILES. Prints microseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F

from worker.bench.matmul import copy_bandwidth, graph_us
from worker.kernels.moe import DECODE_TILES, PREFILL_TILES, ExpertTiles, MoeTiles, moe_block, moe_scratch
from worker.model.config import PRESETS

REPS = 16  # launches a graph replays (fewer than worker.bench.matmul's: each holds a block's buffers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[128, 2048])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    ex = PRESETS["qwen3.5-35b-a3b"].experts
    assert ex is not None
    dim, ffn, stored = PRESETS["qwen3.5-35b-a3b"].dim, ex.ffn_dim, ex.count + 1
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dt)

    gate_up = [rand(stored, 2 * ffn, dim) for _ in range(args.layers)]
    down = [rand(stored, dim, ffn) for _ in range(args.layers)]
    router = rand(ex.count + 1, dim, scale=0.05)
    scratch = moe_scratch(stored, dev)
    expert_bytes = 3 * ffn * dim * 2
    print(f"device-to-device copy: {copy_bandwidth() / 1e12:.2f} TB/s (bytes read + written)")
    cases = [(t, False) for t in args.tokens] + [(t, True) for t in args.prefill_tokens]
    for tokens, prefill in cases:
        x, h = rand(tokens, dim, scale=1.0), rand(tokens, dim, scale=1.0)
        logits = F.linear(x, router)
        chosen = torch.topk(logits[:, : ex.count].float(), ex.top_k, dim=-1).indices.unique().numel() + 1
        base = PREFILL_TILES if prefill else DECODE_TILES

        def run(tiles: MoeTiles, i: int, x: torch.Tensor = x, h: torch.Tensor = h,
                logits: torch.Tensor = logits, prefill: bool = prefill) -> object:
            layer = i % args.layers
            return moe_block(h, x, logits, gate_up[layer], down[layer], ex.top_k, scratch, prefill=prefill,
                             tiles=tiles)

        us = graph_us(functools.partial(run, base), reps=REPS)
        floor = chosen * expert_bytes
        print(f"{'prefill' if prefill else 'decode'} {tokens:5d} tokens: {us:8.2f} us, {chosen} experts "
              f"({floor / 2**20:.1f} MiB: {floor / us / 1e6:.2f} TB/s)  {base}", flush=True)
        if not args.sweep:
            continue
        block_ms = [16, 64] if prefill else [base.block_m]
        for block_m in block_ms:
            at_m = dataclasses.replace(base, block_m=block_m)
            grids = (("gate_up", PREFILL_GRID), ("down", PREFILL_GRID)) if prefill else (("gate_up", GATE_UP_GRID),
                                                                                        ("down", DOWN_GRID))
            for part, grid in grids:
                results = []
                for tiles in grid:
                    trial = (dataclasses.replace(at_m, gate_up=tiles) if part == "gate_up"
                             else dataclasses.replace(at_m, down=tiles))
                    try:
                        results.append((graph_us(functools.partial(run, trial), rounds=3, reps=REPS), tiles))
                    except Exception:  # noqa: BLE001  # a configuration the compiler refuses (shared memory)
                        continue
                results.sort(key=lambda r: r[0])
                print(f"    block_m {block_m} {part:>7} best: "
                      + "; ".join(f"{t:.2f} {c.block_n}x{c.block_k}w{c.warps}s{c.stages}" for t, c in results[:4]),
                      flush=True)
        for warps in (1, 2, 4, 8):
            trial = dataclasses.replace(base, route_warps=warps)
            print(f"    route warps {warps}: {graph_us(functools.partial(run, trial), rounds=3, reps=REPS):.2f}", flush=True)


GATE_UP_GRID = [ExpertTiles(*c) for c in itertools.product([16, 32, 64], [64, 128, 256], [2, 4], [2, 3, 4])]
DOWN_GRID = [ExpertTiles(*c) for c in itertools.product([16, 32, 64, 128], [64, 128, 256], [2, 4], [2, 3, 4])]
PREFILL_GRID = [ExpertTiles(*c) for c in itertools.product([32, 64, 128], [64, 128], [4, 8], [3])]


if __name__ == "__main__":
    main()
