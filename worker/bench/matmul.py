"""The decode step's products: cuBLAS plus the separate fused kernels against worker.kernels.matmul.

    python -m worker.bench.matmul [--model random:smollm2-135m] [--rows 1 4 16 64] [--sweep]

For each of a layer's products (a Llama-family layer's four; a hybrid layer's DeltaNet in and out, attention q|k|v
and o, and its MLP's or its mixture of experts' router and shared expert, as worker.model.qwen3_5 runs them), at each
row count: the time of what the decode step runs without row products (cuBLAS's GEMM and, for a Llama layer, the
fused kernel after it: add_rms_norm or silu_mul) and with them (one row_matmul launch: normed rows, silu, residual add
and squares as the step uses them; the norms need no kernel of their own), each timed as 50 launches captured in a CUDA graph
(so launch gaps count as they do in a decode step) with one weight per layer used in turn (so they
stream from device memory, as in a step, rather than sit in the L2), best of 5. With --sweep, every tile
configuration of a small grid too, to choose worker.kernels.matmul.tiles_for. Prints microseconds.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from worker.kernels.fused import add_rms_norm, silu_mul
from worker.kernels.matmul import Tiles, row_matmul, squares_tiles, tiles_for
from worker.model.config import ModelConfig

REPS = 50


def gpu_us(fn: Callable[[], object], calls: int = 1, rounds: int = 1) -> float:
    """Microseconds of GPU time per call of fn(), timed with CUDA events over `calls` calls, best of `rounds`."""
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def graph_us(fn: Callable[[int], object], rounds: int = 5, reps: int = REPS) -> float:
    """Microseconds per call of fn(i), `reps` calls (i = 0..reps-1) replayed from one CUDA graph, best of `rounds`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
        fn(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(reps):
            fn(i)
    return gpu_us(graph.replay, rounds=rounds) / reps


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (best of 5)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / (gpu_us(lambda: dst.copy_(src), rounds=5) / 1e6)


@dataclass(frozen=True)
class Product:
    """One product of a decode layer: out (rows, n) from x (rows, k)."""

    name: str
    n: int  # output columns (with silu: the gate's; the weight has 2n rows)
    k: int
    silu: bool = False
    residual: bool = False  # h + x @ w.T, in place (a Llama layer's also leaves the squares its next product reads)
    normed: bool = False  # rms_norm(x) @ w.T from the squares a producer left (a Llama layer's q|k|v and gate|up)


def layer_products(c: ModelConfig) -> list[Product]:
    """The products of one decode layer, as the model's decode step runs them."""
    hd = c.head_dim
    if c.linear is None:  # a Llama-family layer (worker.model.llama.Layer): norms folded in, squares passed on
        return [Product("qkv", (c.n_heads + 2 * c.n_kv_heads) * hd, c.dim, normed=True),
                Product("o", c.dim, c.n_heads * hd, residual=True),
                Product("gate_up", c.ffn_dim, c.dim, silu=True, normed=True),
                Product("down", c.dim, c.ffn_dim, residual=True)]
    lin = c.linear  # a hybrid layer (worker.model.qwen3_5): its norms are kernels of their own
    values = lin.value_heads * lin.value_dim
    found = [Product("in", lin.conv_dim + values + 2 * lin.value_heads, c.dim),
             Product("out", c.dim, values, residual=True),
             Product("qkv", 2 * c.n_heads * hd + 2 * c.n_kv_heads * hd, c.dim),
             Product("o", c.dim, c.n_heads * hd, residual=True)]
    ex = c.experts
    if ex is None:
        return [*found, Product("gate_up", c.ffn_dim, c.dim, silu=True), Product("down", c.dim, c.ffn_dim, residual=True)]
    found.append(Product("router", ex.count + 1, c.dim))
    if ex.shared_ffn_dim != ex.ffn_dim:  # else the shared expert runs with the routed ones (worker.kernels.moe)
        found += [Product("shared_gate_up", ex.shared_ffn_dim, c.dim, silu=True),
                  Product("shared_down", c.dim, ex.shared_ffn_dim)]
    return found


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
    grid.add_argument("--split", type=int, nargs="+", default=[1], help="programs a tile's inner dimension is split over")
    args = ap.parse_args()
    sweep_grid = [Tiles(*combo) for combo in itertools.product(args.block_m, args.block_n, args.block_k, args.warps,
                                                                args.stages, args.split)]
    from worker.model.loader import load_model

    c = load_model(args.model).config
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dt)

    found = layer_products(c)
    # One weight per layer, used in turn as a decode step does: they stream from device memory, not the L2.
    weights = {p.name: rand(c.n_layers, 2 * p.n if p.silu else p.n, p.k, scale=0.05) for p in found}
    print(f"device-to-device copy: {copy_bandwidth() / 1e12:.2f} TB/s (bytes read + written); the products' TB/s below "
          "count their weight's bytes")
    print(f"{'product':>14} {'rows':>4} {'before us':>10} {'row_matmul us':>14} {'ratio':>6} {'TB/s':>5}")
    swept: dict[tuple[str, Tiles], list[float]] = {}
    for rows in args.rows:
        bench_rows(rows, c, found, weights, rand, swept if args.sweep else None, sweep_grid)
    if swept:
        print(f"tile configurations by their time summed over {args.rows} rows:")
        for p in found:
            ranked = sorted(((sum(times), tiles) for (name, tiles), times in swept.items()
                             if name == p.name and len(times) == len(args.rows)), key=lambda r: r[0])
            print(f"{p.name:>14}: " + "; ".join(f"{total:.2f} {tiles}" for total, tiles in ranked[:3]), flush=True)


def bench_rows(rows: int, c: ModelConfig, found: list[Product], weights: dict[str, torch.Tensor],
               rand: Callable[..., torch.Tensor], swept: dict[tuple[str, Tiles], list[float]] | None,
               grid: list[Tiles]) -> None:
    """One row count: every product, before and fused (see the module docstring)."""
    eps = c.norm_eps
    layers = c.n_layers
    norm_w = 1 + rand(c.dim, scale=0.1)
    llama = c.linear is None
    # the partial sums of squares a producer leaves: as many tiles as in a step
    squares = torch.rand((squares_tiles(c.dim, c.ffn_dim), rows), device=norm_w.device)
    for p in found:
        w_all = weights[p.name]
        x, h = rand(rows, p.k), rand(rows, p.n)

        def w(i: int, w_all: torch.Tensor = w_all) -> torch.Tensor:
            return w_all[i % layers]

        def before(i: int, p: Product = p, x: torch.Tensor = x, h: torch.Tensor = h) -> object:
            y = F.linear(x, w(i))
            if p.silu:
                return silu_mul(y) if llama else F.silu(y[:, : p.n]) * y[:, p.n:]
            if p.residual:
                return add_rms_norm(y, h, norm_w, eps) if llama else h + y
            return y

        def fused(t: Tiles | None, i: int, p: Product = p, x: torch.Tensor = x, h: torch.Tensor = h) -> object:
            squares_out = None
            if p.residual and llama:
                squares_out = torch.empty((triton.cdiv(p.n, (t or tiles_for(p.n, p.k)).block_n), rows), device=h.device)
            return row_matmul(x, w(i), silu=p.silu, residual=h if p.residual else None, out=h if p.residual else None,
                              norm_squares=squares if p.normed else None, eps=eps, squares_out=squares_out, tiles=t)

        b, f = graph_us(before), graph_us(functools.partial(fused, None))
        width = 2 * p.n if p.silu else p.n
        tbs = width * p.k * 2 / (f * 1e-6) / 1e12
        print(f"{p.name:>14} {rows:4d} {b:10.2f} {f:14.2f} {f / b:6.2f} {tbs:5.2f}   default {tiles_for(p.n, p.k, p.silu)}",
              flush=True)
        if swept is not None:
            results = []
            for tiles in grid:
                try:
                    us = graph_us(functools.partial(fused, tiles), rounds=3)
                except Exception:  # a configuration the compiler refuses (shared memory): skip it
                    continue
                results.append((us, tiles))
                swept.setdefault((p.name, tiles), []).append(us)
            results.sort(key=lambda r: r[0])
            print("          best: " + "; ".join(f"{us:.2f} {t}" for us, t in results[:4]), flush=True)


if __name__ == "__main__":
    main()
