"""Where a decode step's time goes: GPU time of the step alone against the whole engine step.

    python -m worker.bench.step_profile [--model random:smollm2-135m] [--sessions 1 64] [--steps 200]
        [--prompt-tokens 128] [--max-context 1024] [--kernels]

For each batch size: the graph replay timed with CUDA events (GPU time), the engine's step() timed
on the host (everything: scheduling, input copy, replay, sampling, detokenizing, bookkeeping), and
the top Python functions of the step by cumulative time (cProfile). With --kernels, the GPU kernels
of a decode step (the graph's kernels, run eagerly) and of a full prefill forward, by total time.
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

from worker.engine import Engine
from worker.engine.sampling import SamplingParams


def _sessions(engine: Engine, n: int, prompt: int, steps: int) -> list[str]:
    sids = []
    for i in range(n):
        sid = engine.create_session()
        engine.append(sid, token_ids=[((13 * i + 7 * j) % 40000 + 300) % engine.model.config.vocab_size for j in range(prompt)])
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
        from worker.bench.matmul import gpu_us
        from worker.engine.graphs import pick_bucket

        bucket = pick_bucket(executor.buckets, n)  # type: ignore[attr-defined]
        graph, _ = graphs[bucket]
        long_from = getattr(executor, "long_rows_from", None)  # the split attention's graph from this length on
        lengths = executor._decode_in.host[3, :n]  # type: ignore[attr-defined]  # the last step's, which replays
        if long_from is not None and int(lengths.max()) >= long_from:
            graph = executor._long_graphs[bucket]  # type: ignore[attr-defined]
        graph_ms = gpu_us(graph.replay, calls=steps) / 1000
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


def kernel_table(engine: Engine, n: int, steps: int = 20) -> None:
    """The kernels of one decode step of `n` rows and of one prefill forward, from torch's profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from worker.engine.graphs import GraphExecutor, pick_bucket

    executor = engine.executor
    if not isinstance(executor, GraphExecutor):
        return
    bucket = pick_bucket(executor.buckets, n)
    sids = _sessions(engine, n, 128, steps)
    for _ in range(3):
        engine.step()
    executor._decode_forward(bucket)  # warm
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            executor._decode_forward(bucket)
        torch.cuda.synchronize()
    print(f"--- kernels of one eager decode step, bucket {bucket} (mean of {steps}) ---")
    _print_kernels(prof, steps)
    for sid in sids:
        engine.close(sid)
    # A prefill forward: as many 128-token prompts as fit in one step (and in the table).
    prompts = min(engine.step_tokens // 128, engine.capacity)
    sids = []
    for i in range(prompts):
        sid = engine.create_session()
        engine.append(sid, token_ids=[(11 * i + 5 * j) % 40000 + 300 for j in range(128)])
        sids.append(sid)
    for rounds in range(2):
        rids = [engine.start_generate(sid, SamplingParams(max_tokens=1, ignore_eos=True)) for sid in sids]
        torch.cuda.synchronize()
        if rounds == 0:  # warm-up
            while engine.has_work():
                engine.step()
            for sid in sids:  # roll back: the same prompts are prefilled again
                session = engine._sessions[sid]
                del session.tokens[128:]
                session.computed = 0
            continue
        t0 = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) * 1000
        del rids
    print(f"--- kernels of one prefill step: {prompts} prompts x 128 tokens, {host_ms:.2f} ms on the host clock ---")
    _print_kernels(prof, 1)
    while engine.has_work():
        engine.step()
    for sid in sids:
        engine.close(sid)


def _print_kernels(prof: object, steps: int) -> None:
    events = [e for e in prof.key_averages() if e.device_time_total > 0]  # type: ignore[attr-defined]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    print(f"{count:.0f} kernels, {total / 1000:.3f} ms of GPU time per step")
    print(f"{'us/step':>9} {'share':>6} {'calls':>6} {'us/call':>8}  kernel")
    for e in events[:22]:
        per = e.device_time_total / steps
        print(f"{per:9.1f} {per / total:6.1%} {e.count / steps:6.0f} {e.device_time_total / e.count:8.2f}  {e.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-context", type=int, default=1024, help="the engine's context (each session's slot)")
    ap.add_argument("--kernels", action="store_true", help="also print the kernels of a decode step and a prefill")
    args = ap.parse_args()
    # A session generates 10 + steps + steps // 2 tokens after its prompt, in a request of 3 x steps + 10.
    if args.prompt_tokens + 11 + args.steps * 3 // 2 > args.max_context or 3 * args.steps + 10 > args.max_context:
        ap.error(f"a session's prompt and {args.steps} steps do not fit --max-context {args.max_context}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    engine = Engine.load(args.model, device="cuda", max_sessions=max(args.sessions),
                         max_context=args.max_context)
    rows = {n: profile(engine, n, args.steps, args.prompt_tokens) for n in args.sessions}
    print(f"{'batch':>5} {'graph GPU ms':>13} {'engine step ms':>15} {'host share':>11} {'tokens/s':>10}")
    for n, r in rows.items():
        share = 1 - r["graph_gpu_ms"] / r["engine_step_ms"]
        print(f"{n:5d} {r['graph_gpu_ms']:13.3f} {r['engine_step_ms']:15.3f} {share:11.0%} {r['tokens_per_s']:10.0f}")
    if args.kernels:
        kernel_table(engine, max(args.sessions))


if __name__ == "__main__":
    main()
