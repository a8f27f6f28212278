"""Where a decode step's time goes: GPU time of the step alone against the whole engine step.

    python -m worker.step_profile [--model random:smollm2-135m] [--sessions 1 64] [--steps 200]

For each batch size: the graph replay timed with CUDA events (GPU time), the engine's step() timed
on the host (everything: scheduling, input copy, replay, sampling, detokenizing, bookkeeping), and
the top Python functions of the step by cumulative time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import time

import structlog
import torch

from .engine import Engine
from .sampling import SamplingParams


def _sessions(engine: Engine, n: int, prompt: int, steps: int) -> list[str]:
    sids = []
    for i in range(n):
        sid = engine.create_session()
        engine.append(sid, token_ids=[(13 * i + 7 * j) % 40000 + 300 for j in range(prompt)])
        engine.start_generate(sid, SamplingParams(max_tokens=steps * 3 + 10, ignore_eos=True))
        sids.append(sid)
    while any(engine._sessions[s].pending > 1 for s in sids):
        engine.step()  # prefill
    return sids


def profile(engine: Engine, n: int, steps: int, prompt: int) -> dict[str, float]:
    sids = _sessions(engine, n, prompt, steps)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    # GPU time of the decode step alone: replay the bucket's graph with the current inputs.
    executor = engine.executor
    graph_ms = float("nan")
    graphs = getattr(executor, "_graphs", {})
    if graphs:
        from .gpu import pick_bucket

        graph, _ = graphs[pick_bucket(executor.buckets, n)]  # type: ignore[attr-defined]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1000 / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps // 2):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"--- batch {n}: top functions by own time over {steps // 2} steps ---")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-2400:])
    for sid in sids:
        engine.close(sid)
    return {"graph_gpu_ms": graph_ms, "engine_step_ms": step_ms, "tokens_per_s": n * 1000 / step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    engine = Engine.load(args.model, device="cuda", max_sessions=max(args.sessions), max_context=1024)
    rows = {n: profile(engine, n, args.steps, args.prompt_tokens) for n in args.sessions}
    print(f"{'batch':>5} {'graph GPU ms':>13} {'engine step ms':>15} {'host share':>11} {'tokens/s':>10}")
    for n, r in rows.items():
        share = 1 - r["graph_gpu_ms"] / r["engine_step_ms"]
        print(f"{n:5d} {r['graph_gpu_ms']:13.3f} {r['engine_step_ms']:15.3f} {share:11.0%} {r['tokens_per_s']:10.0f}")


if __name__ == "__main__":
    main()
