"""Prefill steps on the GPU: tiled prompt attention against one program per prompt row, in one run.

    python -m worker.bench.prefill [--model random:smollm2-135m] [--max-context 4096] [--replays 50]

Both executors share the model and the session table: one replays prefill graphs captured with the tiled
kernel (worker.kernels.prefill), the other graphs captured with prompt rows in the decode kernel (what
WORKER_PREFILL_TILES=0 gives). For each scenario (prompts of a given length starting at a given position of
their sessions), the prefill graph's replay is timed with CUDA events over the same static inputs, and so is
the attention alone: each layer's launch on the same rows in turn, from a CUDA graph (worker.bench.matmul.graph_us;
launched from Python one by one, these kernels would be timed by their launches), as ms per step of all layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from collections.abc import Callable

import structlog
import torch

from worker.bench.matmul import gpu_us, graph_us
from worker.engine import Engine
from worker.engine.graphs import GraphExecutor, pick_bucket
from worker.kernels.attention import decode_attention
from worker.kernels.prefill import prefill_attention
from worker.kernels.tiles import max_tiles
from worker.model.llama import Run

SCENARIOS = (  # (prompts, tokens each, first position): one prefill replay each
    (16, 128, 0),  # a turn's new 128-token prompts (bench_gpu)
    (16, 128, 1000),  # the same at a later turn of the conversations
    (1, 128, 1800),
    (1, 2048, 0),  # one long prompt
    (1, 2048, 2048),  # its second half
    (4, 512, 0),
)


def _gpu_ms(fn: Callable[[], object], replays: int) -> float:
    """GPU time of one call of fn, the mean of `replays` after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return gpu_us(fn, calls=replays) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sessions = max(n for n, _, _ in SCENARIOS)
    engine = Engine.load(args.model, device="cuda", max_sessions=sessions, max_context=args.max_context)
    tiled = engine.executor
    kernels = engine.model.kernels
    assert isinstance(tiled, GraphExecutor) and kernels.prefill_attention is not None
    engine.model.kernels = dataclasses.replace(kernels, prefill_attention=None)  # graphs captured now: the decode kernel
    rows = GraphExecutor(engine.model, engine.table)
    engine.model.kernels = kernels
    slots = [engine.table.create(args.max_context) for _ in range(sessions)]  # backed whole: the runs reach anywhere
    gen = torch.Generator().manual_seed(0)
    c = engine.model.config
    print(f"{'prompts':>7} {'tokens':>6} {'from':>5} {'bucket':>6} {'step, rows ms':>14} {'step, tiled ms':>15} "
          f"{'x':>5} {'attention, rows':>16} {'attention, tiled':>17} {'x':>5}")
    for prompts, n, first in SCENARIOS:
        if first + n > engine.model.max_context:
            continue
        tokens = torch.randint(300, c.vocab_size, (prompts * n,), generator=gen).tolist()
        positions = [first + j for _ in range(prompts) for j in range(n)]
        runs = [Run(slot=slots[i], start=i * n, n=n, pos=first) for i in range(prompts)]
        ends = {run.start + n - 1 for run in runs}
        bucket = pick_bucket(tiled.prefill_buckets, prompts * n)
        step_ms = {}
        for name, executor in (("rows", rows), ("tiled", tiled)):
            executor.replay_prefill(runs, tokens, positions, ends)  # loads the static inputs (and writes the K/V)
            step_ms[name] = _gpu_ms(executor._prefill_graphs[bucket].replay, args.replays)
        # The attention alone: every layer's, on the rows the tiled executor loaded.
        inputs = tiled._prefill_in.device[:, :bucket]
        q = torch.randn((bucket, c.n_heads, c.head_dim), generator=gen).to(engine.model.device, engine.model.dtype)
        lengths = inputs[3].to(torch.int32)
        tiles = tiled._prefill_in.device[5:, : max_tiles(bucket, tiled.prefill_logits)]
        out = torch.empty_like(q)
        k, v = engine.table.views()["k"], engine.table.views()["v"]
        layers = range(c.n_layers)
        by_rows = [functools.partial(decode_attention, q, k[:, i], v[:, i], inputs[2], lengths, out=out,
                                     splits=rows.prefill_splits) for i in layers]
        by_tiles = [functools.partial(prefill_attention, q, k[:, i], v[:, i], inputs[2], lengths, tiles, out=out)
                    for i in layers]
        attn_rows = graph_us(lambda i: by_rows[i % c.n_layers]()) * c.n_layers / 1000  # noqa: B023 (called at once)
        attn_tiled = graph_us(lambda i: by_tiles[i % c.n_layers]()) * c.n_layers / 1000  # noqa: B023
        print(f"{prompts:7d} {n:6d} {first:5d} {bucket:6d} {step_ms['rows']:14.3f} {step_ms['tiled']:15.3f} "
              f"{step_ms['rows'] / step_ms['tiled']:5.2f} {attn_rows:16.3f} {attn_tiled:17.3f} {attn_rows / attn_tiled:5.2f}")


if __name__ == "__main__":
    main()
