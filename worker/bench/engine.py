"""CPU/GPU speed of the engine in-process: load time and decode tokens/s for 1 and N sessions.

    python -m worker.bench.engine [--model PATH|random:PRESET] [--device cpu] [--sessions 1 8] [--tokens 64]

Decode is timed after the prompts are prefilled, so the numbers are steady-state generation. The load time is
split by the engine's own log lines (--log-level info: weights_loaded, cuda_graphs_captured, buckets_checked);
the process's peak host memory (max RSS) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import time

import structlog
import torch

from worker.engine import Engine

TARGETS_CPU = {1: 15.0, 8: 60.0}  # tokens/s on a 2-core machine (issue: one model, many sessions)


def decode_rate(engine: Engine, sessions: int, tokens: int, prompt_tokens: int) -> float:
    sids = [engine.create_session() for _ in range(sessions)]
    for i, sid in enumerate(sids):
        engine.append(sid, token_ids=[((17 * i + 31 * j) % 1000 + 100) % engine.model.config.vocab_size
                                      for j in range(prompt_tokens)])
    engine.generate_many([(sid, {"max_tokens": 1, "ignore_eos": True}) for sid in sids])  # prefill
    start = time.perf_counter()
    results = engine.generate_many([(sid, {"max_tokens": tokens, "ignore_eos": True}) for sid in sids])
    elapsed = time.perf_counter() - start
    for sid in sids:
        engine.close(sid)
    produced = sum(len(r.token_ids) for r in results)
    assert produced == sessions * tokens
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or random:PRESET (default: bundled SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--log-level", default="warning", choices=("debug", "info", "warning"))
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, args.log_level.upper())))

    start = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, max_sessions=max(args.sessions), max_context=args.max_context)
    load_s = time.perf_counter() - start
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    decode_rate(engine, 1, 4, 8)  # warm-up
    rates = {n: decode_rate(engine, n, args.tokens, args.prompt_tokens) for n in args.sessions}

    print(f"model {engine.model_name} on {engine.device}, torch threads {torch.get_num_threads()}")
    print(f"load time            {load_s:8.2f} s   (peak host memory {peak_rss_gib:.2f} GiB; weights "
          f"{engine.model.weight_bytes() / 2**30:.2f} GiB)")
    for n, rate in rates.items():
        target = TARGETS_CPU.get(n) if args.device == "cpu" else None
        verdict = "" if target is None else f"   target >= {target:.0f}: {'met' if rate >= target else 'MISSED'}"
        print(f"decode {n:3d} session(s) {rate:8.1f} tokens/s total  ({rate / n:6.1f} per session){verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_s": load_s, "peak_rss_gib": peak_rss_gib, "decode_tokens_per_s": rates,
                       "device": engine.device, "model": engine.model_name}, f, indent=2)


if __name__ == "__main__":
    main()
