"""Micro-benchmark of the GPU session table and decode: `python -m cuda_state.bench.table [--json PATH]`.

Prints session create, fork (of a 2,000-token session) and close latency in ms (median and p99), through
the driver (a slot mapped per create, unmapped per close) and with closed slots kept mapped for reuse,
and decode tokens/s at batch 1 and 64 for the SmolLM2-135M architecture with seeded random weights
in bf16, eager against CUDA graphs, both through the engine (scheduling and sampling included).
Latencies stop the clock after a device synchronize, so they include the GPU work the call
queued (the memset of a create, the copy of a fork): what a client waits for, not the host call.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

MODEL = "random:smollm2-135m"
FORK_TOKENS = 2000
BATCHES = (1, 64)
MAX_CONTEXT = 2048


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[max(0, math.ceil(0.99 * len(ms)) - 1)]
    return {"median": round(statistics.median(ms), 4), "p99": round(p99, 4), "samples": len(ms)}


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def random_tokens(engine: Any, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.model.config.vocab_size) for _ in range(n)]


def session_latencies(engine: Any, samples: int, rng: random.Random) -> dict[str, dict[str, float]]:
    """Create, fork and close through the driver (every create maps a new slot, every close unmaps it), then
    the same with closed slots kept mapped and reused (the engine's default: see cuda_state.table)."""
    out: dict[str, dict[str, float]] = {}
    keep = engine.table.keep_mapped
    parent = engine.create_session()
    engine.append(parent, token_ids=random_tokens(engine, FORK_TOKENS, rng))
    engine.generate(parent, max_tokens=1, ignore_eos=True)  # the 2,000 prompt tokens' K/V are computed
    try:
        for suffix, kept in (("", 0), ("_reused", keep)):
            engine.table.keep_mapped = kept
            engine.release_idle_slots(0.0)
            create: list[float] = []
            fork: list[float] = []
            close: list[float] = []
            for _ in range(samples):
                sid, seconds = timed(engine.create_session)
                create.append(seconds)
                close.append(timed(engine.close, sid)[1])
            for _ in range(samples):
                child, seconds = timed(engine.fork, parent)
                fork.append(seconds)
                close.append(timed(engine.close, child)[1])
            out |= {f"create{suffix}": summarize(create), f"fork_{FORK_TOKENS}{suffix}": summarize(fork),
                    f"close{'_kept' if kept else ''}": summarize(close)}
    finally:
        engine.table.keep_mapped = keep
        engine.close(parent)
    return out


def decode_rate(engine: Any, batch: int, tokens: int, rng: random.Random) -> float:
    """Output tokens/s of `batch` sessions decoding `tokens` tokens together (prompts prefilled first)."""
    sids = [engine.create_session() for _ in range(batch)]
    try:
        for sid in sids:
            engine.append(sid, token_ids=random_tokens(engine, 32, rng))
        engine.generate_many([(sid, {"max_tokens": 8, "ignore_eos": True}) for sid in sids])  # prefill + warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate_many([(sid, {"max_tokens": tokens, "ignore_eos": True}) for sid in sids])
        torch.cuda.synchronize()
        return batch * tokens / (time.perf_counter() - start)
    finally:
        for sid in sids:
            engine.close(sid)


def decode_rates(engine: Any, tokens: int, rng: random.Random) -> dict[str, dict[str, float]]:
    from worker.engine.executor import EagerExecutor

    graphs = engine.executor
    eager = EagerExecutor(engine.model, engine.table)
    out: dict[str, dict[str, float]] = {}
    try:
        for batch in BATCHES:
            row: dict[str, float] = {}
            for name, executor in (("eager", eager), ("graph", graphs)):
                engine.executor = executor
                # Best of two runs: the first of a shape can pay one-off costs (kernel selection, caches).
                row[name] = round(max(decode_rate(engine, batch, tokens, rng) for _ in range(2)), 1)
            out[str(batch)] = row
    finally:
        engine.executor = graphs
    return out


def report(results: dict[str, Any]) -> str:
    lines = [
        f"device: {results['device']}   model: {results['model']} (bf16)   "
        f"slot: {results['slot_bytes'] / 2**20:.1f} MiB   capacity: {results['capacity']}",
        "",
        f"{'session op':<22}{'median ms':>12}{'p99 ms':>12}",
    ]
    for op, stats in results["latency_ms"].items():
        lines.append(f"{op:<22}{stats['median']:>12.3f}{stats['p99']:>12.3f}")
    lines += ["", f"{'decode tokens/s':<22}{'eager':>12}{'graph':>12}{'graph/eager':>14}"]
    for batch, row in results["decode_tokens_per_s"].items():
        lines.append(f"{'batch ' + batch:<22}{row['eager']:>12.1f}{row['graph']:>12.1f}{row['graph'] / row['eager']:>14.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.add_argument("--model", default=MODEL, help=f"model to load (default {MODEL})")
    parser.add_argument("--samples", type=int, default=200, help="create/fork/close repetitions")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens per session in a decode run")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if not torch.cuda.is_available():
        print("cuda_state.bench.table needs a CUDA device", file=sys.stderr)
        return 2

    from worker.engine import Engine

    engine = Engine.load(model=args.model, device="cuda", max_sessions=max(BATCHES) + 8, max_context=MAX_CONTEXT)
    rng = random.Random(0)
    try:
        results = {
            "device": torch.cuda.get_device_name(engine.model.device),
            "model": engine.model_name,
            "slot_bytes": engine.table.slot_bytes,
            "bytes_per_session": engine.bytes_per_session,
            "capacity": engine.capacity,
            "max_context": engine.max_context,
            "latency_ms": session_latencies(engine, args.samples, rng),
            "decode_tokens_per_s": decode_rates(engine, args.decode_tokens, rng),
        }
    finally:
        engine.table.close()
    print(report(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
