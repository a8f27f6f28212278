"""The decode step's products: cuBLAS plus the separate fused kernels against worker.kernels.matmul.

    python -m worker.bench.matmul [--model random:smollm2-135m] [--rows 1 4 16 64] [--sweep]

For each of a layer's four products, at each row count: the time of what the decode step runs
without row products (cuBLAS's GEMM and the fused kernel after it: add_rms_norm or silu_mul) and
with them (one row_matmul launch: normed rows, silu, residual add and squares as the step uses
them; the norms need no kernel of their own), each timed as 50 launches captured in a CUDA graph
(so launch gaps count as they do in a decode step) with one weight per layer used in turn (so they
stream from device memory, as in a step, rather than sit in the L2), best of 5. With --sweep, every tile
configuration of a small grid too, to choose worker.kernels.matmul.tiles_for. Prints microseconds.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from worker.kernels.fused import add_rms_norm, silu_mul
from worker.kernels.matmul import Tiles, row_matmul, squares_tiles, tiles_for
from worker.model.config import ModelConfig

REPS = 50


def graph_us(fn: Callable[[int], object], rounds: int = 5) -> float:
    """Microseconds per call of fn(i), REPS calls (i = 0..REPS-1) replayed from one CUDA graph, best of `rounds`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
        fn(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(REPS):
            fn(i)
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / REPS)
    return best


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (best of 5)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--sweep", action="store_true")
    grid = ap.add_argument_group("the sweep's grid (every combination)")
    grid.add_argument("--block-m", type=int, nargs="+", default=[16, 64])
    grid.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    grid.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    grid.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    grid.add_argument("--stages", type=int, nargs="+", default=[3])
    args = ap.parse_args()
    sweep_grid = [Tiles(*combo) for combo in itertools.product(args.block_m, args.block_n, args.block_k, args.warps,
                                                                args.stages)]
    from worker.model.loader import load_model

    c = load_model(args.model).config
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dt)

    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    # One weight per layer, used in turn as a decode step does: they stream from device memory, not the L2.
    layers = c.n_layers
    weights = {"qkv": rand(layers, qkv, c.dim, scale=0.05), "o": rand(layers, c.dim, c.n_heads * c.head_dim, scale=0.05),
               "gate_up": rand(layers, 2 * c.ffn_dim, c.dim, scale=0.05), "down": rand(layers, c.dim, c.ffn_dim, scale=0.05)}
    norm_w = 1 + rand(c.dim, scale=0.1)
    print(f"device-to-device copy: {copy_bandwidth() / 1e12:.2f} TB/s (bytes read + written); the products' TB/s below "
          "count their weight's bytes")
    print(f"{'product':>8} {'rows':>4} {'before us':>10} {'row_matmul us':>14} {'ratio':>6} {'TB/s':>5}")
    swept: dict[tuple[str, Tiles], list[float]] = {}
    for rows in args.rows:
        bench_rows(rows, c, weights, norm_w, rand, swept if args.sweep else None, sweep_grid)
    if swept:
        print(f"tile configurations by their time summed over {args.rows} rows:")
        for name in ("qkv", "o", "gate_up", "down"):
            ranked = sorted((sum(times), tiles) for (product, tiles), times in swept.items()
                            if product == name and len(times) == len(args.rows))
            print(f"{name:>8}: " + "; ".join(f"{total:.2f} {tiles}" for total, tiles in ranked[:3]), flush=True)


def bench_rows(rows: int, c: ModelConfig, weights: dict[str, torch.Tensor], norm_w: torch.Tensor,
               rand: Callable[..., torch.Tensor], swept: dict[tuple[str, Tiles], list[float]] | None,
               grid: list[Tiles]) -> None:
    """One row count: every product, before and fused (see the module docstring)."""
    eps = c.norm_eps
    h = rand(rows, c.dim)
    attn, act = rand(rows, c.n_heads * c.head_dim), rand(rows, c.ffn_dim)
    layers = weights["qkv"].shape[0]

    def w(name: str, i: int) -> torch.Tensor:
        return weights[name][i % layers]

    # the partial sums of squares a producer (down, o) leaves: as many tiles as in a step
    squares = torch.rand((squares_tiles(c.dim, c.ffn_dim), rows), device=h.device)

    def squares_out(n: int, k: int, t: Tiles | None) -> torch.Tensor:
        block_n = (t or tiles_for(n, k)).block_n
        return torch.empty((triton.cdiv(n, block_n), rows), device=h.device)

    cases: dict[str, tuple[Callable[[int], object], Callable[[Tiles | None, int], object]]] = {
        "qkv": (lambda i: F.linear(h, w("qkv", i)),
                lambda t, i: row_matmul(h, w("qkv", i), norm_squares=squares, eps=eps, tiles=t)),
        "o": (lambda i: add_rms_norm(F.linear(attn, w("o", i)), h, norm_w, eps),
              lambda t, i: row_matmul(attn, w("o", i), residual=h, out=h, squares_out=squares_out(c.dim, c.n_heads * c.head_dim, t),
                                       tiles=t)),
        "gate_up": (lambda i: silu_mul(F.linear(h, w("gate_up", i))),
                    lambda t, i: row_matmul(h, w("gate_up", i), norm_squares=squares, eps=eps, silu=True, tiles=t)),
        "down": (lambda i: add_rms_norm(F.linear(act, w("down", i)), h, norm_w, eps),
                 lambda t, i: row_matmul(act, w("down", i), residual=h, out=h, squares_out=squares_out(c.dim, c.ffn_dim, t),
                                         tiles=t)),
    }
    for name, (before, fused) in cases.items():
        b, f = graph_us(before), graph_us(functools.partial(fused, None))
        _, width, k = weights[name].shape
        n = width // 2 if name == "gate_up" else width
        tbs = width * k * 2 / (f * 1e-6) / 1e12
        print(f"{name:>8} {rows:4d} {b:10.2f} {f:14.2f} {f / b:6.2f} {tbs:5.2f}   default {tiles_for(n, k, name == 'gate_up')}",
              flush=True)
        if swept is not None:
            results = []
            for tiles in grid:
                try:
                    us = graph_us(functools.partial(fused, tiles), rounds=3)
                except Exception:  # a configuration the compiler refuses (shared memory): skip it
                    continue
                results.append((us, tiles))
                swept.setdefault((name, tiles), []).append(us)
            results.sort(key=lambda r: r[0])
            print("          best: " + "; ".join(f"{us:.2f} {t}" for us, t in results[:4]), flush=True)


if __name__ == "__main__":
    main()
