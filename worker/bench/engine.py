"""CPU/GPU speed of the engine in-process: load time and decode tokens/s for 1 and N sessions.

    python -m worker.bench.engine [--model PATH|random:PRESET] [--device cpu] [--sessions 1 8] [--tokens 64]
        [--prompt-tokens 32] [--penalties] [--hf] [--json FILE]

Decode is timed after the prompts are prefilled, so the numbers are steady-state generation. The load time is
split by the engine's own log lines (--log-level info: weights_loaded, cuda_graphs_captured, buckets_checked);
the process's peak host memory (max RSS) is printed beside it.

On the GPU each session count also gets the read floor of its decode steps (worker.bench.read_floor: the weights,
for a mixture-of-experts model only the experts its tokens touch, and the sessions' state, at the device's copy
bandwidth) and the share of it the measured step reaches. With --hf, transformers' static-cache
generate of the same shape (worker.bench.hf_generate, Qwen3.5 families) runs for each session count in a child
process after the engine is unloaded; "oom" where it does not fit. With --penalties every session count is measured
again with every generation asking for a logit bias and the three penalties (worker.engine.penalties), beside the
plain rate of the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import time
from typing import Any

import structlog
import torch

from worker.engine import Engine

TARGETS_CPU = {1: 15.0, 8: 60.0}  # tokens/s on a 2-core machine (issue: one model, many sessions)
# --penalties: what each generation asks for (a bias on 10 tokens, all three penalties)
PENALTIES: dict[str, object] = {"logit_bias": tuple((t, 0.5) for t in range(100, 110)), "repetition_penalty": 1.1,
                                "frequency_penalty": 0.5, "presence_penalty": 0.5}


def decode_rate(engine: Engine, sessions: int, tokens: int, prompt_tokens: int,
                extra: dict[str, object] | None = None) -> float:
    sids = [engine.create_session() for _ in range(sessions)]
    for i, sid in enumerate(sids):
        engine.append(sid, token_ids=[((17 * i + 31 * j) % 1000 + 100) % engine.model.config.vocab_size
                                      for j in range(prompt_tokens)])
    engine.generate_many([(sid, {"max_tokens": 1, "ignore_eos": True}) for sid in sids])  # prefill
    start = time.perf_counter()
    results = engine.generate_many([(sid, {"max_tokens": tokens, "ignore_eos": True, **(extra or {})}) for sid in sids])
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
    ap.add_argument("--hf", action="store_true", help="transformers' generate beside it (Qwen3.5 families, GPU)")
    ap.add_argument("--penalties", action="store_true", help="each count again with logit bias and penalties")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, args.log_level.upper())))

    start = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, max_sessions=max(args.sessions), max_context=args.max_context)
    load_s = time.perf_counter() - start
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    decode_rate(engine, 1, 4, 8)  # warm-up
    rates = {n: decode_rate(engine, n, args.tokens, args.prompt_tokens) for n in args.sessions}
    penalized = {n: decode_rate(engine, n, args.tokens, args.prompt_tokens, PENALTIES) for n in args.sessions} \
        if args.penalties else {}
    floors: dict[int, dict[str, float]] = {}
    if engine.device.startswith("cuda"):
        from worker.bench.matmul import copy_bandwidth
        from worker.bench.read_floor import floor_bytes

        bandwidth = copy_bandwidth()
        context = args.prompt_tokens + args.tokens // 2  # the decode steps' mean context
        for n in args.sessions:
            floor = floor_bytes(engine, n, context)
            floor["seconds"] = floor["total"] / bandwidth
            floor["share"] = floor["seconds"] / (n / rates[n])  # the floor's time over the measured step's
            floors[n] = floor

    print(f"model {engine.model_name} on {engine.device}, torch threads {torch.get_num_threads()}")
    print(f"load time            {load_s:8.2f} s   (peak host memory {peak_rss_gib:.2f} GiB; weights "
          f"{engine.model.weight_bytes() / 2**30:.2f} GiB)")
    for n, rate in rates.items():
        target = TARGETS_CPU.get(n) if args.device == "cpu" else None
        verdict = "" if target is None else f"   target >= {target:.0f}: {'met' if rate >= target else 'MISSED'}"
        print(f"decode {n:3d} session(s) {rate:8.1f} tokens/s total  ({rate / n:6.1f} per session){verdict}")
        if n in floors:
            fl = floors[n]
            experts = (f", experts {fl['experts'] / 2**30:.2f} ({fl['experts_per_layer']:.0f} a layer)"
                       if fl["experts_per_layer"] else "")
            print(f"    read floor {fl['total'] / 2**30:6.2f} GiB a step (weights {fl['weights'] / 2**30:.2f}{experts}, "
                  f"state {fl['state'] / 2**30:.2f}): {fl['seconds'] * 1e3:.2f} ms, {n / fl['seconds']:.0f} tokens/s; "
                  f"measured step {n / rate * 1e3:.2f} ms, {fl['share']:.2f} of the floor")
        if n in penalized:
            print(f"    with logit bias and penalties {penalized[n]:8.1f} tokens/s, {penalized[n] / rate:.3f} of the plain "
                  f"rate (step {n / penalized[n] * 1e3:.2f} ms)")
    result: dict[str, Any] = {"load_s": load_s, "peak_rss_gib": peak_rss_gib, "decode_tokens_per_s": rates,
                              "device": engine.device, "model": engine.model_name, "read_floor": floors,
                              "weight_bytes": engine.model.weight_bytes(),
                              "bytes_per_session": engine.bytes_per_session, "penalized_tokens_per_s": penalized}
    if args.hf:
        model = args.model
        engine.unload()
        del engine
        torch.cuda.empty_cache()
        result["hf_tokens_per_s"] = {n: hf_rate(model, n, args.prompt_tokens, args.tokens) for n in args.sessions}
        for n, hf in result["hf_tokens_per_s"].items():
            ratio = "" if isinstance(hf, str) else f"   engine / transformers {rates[n] / hf:.2f}"
            print(f"transformers {n:3d} session(s) {hf if isinstance(hf, str) else f'{hf:8.1f}'} tokens/s{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def hf_rate(model: str, batch: int, prompt_tokens: int, new_tokens: int) -> float | str:
    """worker.bench.hf_generate in a child process: output tokens/s, "oom", or "failed"."""
    from worker.bench.hf_generate import RESULT

    done = subprocess.run([sys.executable, "-m", "worker.bench.hf_generate", "--model", model, "--batch", str(batch),
                           "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens)],
                          capture_output=True, text=True, check=False, timeout=3600)
    lines = [line[len(RESULT):] for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        sys.stderr.write(done.stderr[-3000:])
        return "failed"
    return lines[-1] if lines[-1] == "oom" else float(lines[-1])


if __name__ == "__main__":
    main()
