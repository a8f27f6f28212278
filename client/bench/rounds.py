"""Where a round of the GPU benchmark's workload goes: client.bench.gpu's engine run with every `engine.step()` timed.

    python -m client.bench.rounds [--model random:qwen3.5-35b-a3b] [--sessions 64] [--rounds 2]

The engine in process runs the benchmark's workload (every session appends a --prompt-tokens prompt (128) and
generates --new-tokens (256), `--rounds` times) once to warm up, then once measured. Each `step()` call is timed on the host; a call
launches one step and reads the one before (the GPU runs one step ahead), so a launched prompt step's time shows in
the call after it. Prints the measured run's tokens/s, its time split into the calls that launched prompt tokens
(with the call after each), the full decode calls and the rest, and the host's idle time between calls.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from client.bench.gpu import workload
from client.bench.loadtest.cli import run
from worker.engine import Chunk, Engine


@dataclass
class Call:
    start: float  # seconds since the run's start
    ms: float
    rows: int  # requests in the step it launched
    prompt_tokens: int  # prompt tokens that step computes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3.5-35b-a3b")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    engine = Engine.load(args.model, device=args.device, max_sessions=args.sessions, max_context=args.max_context)
    calls: list[Call] = []
    origin = [time.perf_counter()]
    step = engine.step

    def timed_step(wait: bool = True) -> list[Chunk]:
        t0 = time.perf_counter()
        out = step(wait)
        calls.append(Call(t0 - origin[0], (time.perf_counter() - t0) * 1000, engine.last_rows,
                          engine.last_prefill_tokens))
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    config = workload(args.sessions, args.prompt_tokens, args.new_tokens, 0, rounds=args.rounds,
                      vocab_size=engine.model.config.vocab_size, max_context=args.max_context, in_process=True,
                      device=args.device, model=args.model)
    try:
        run(config, engine=engine)  # warm-up
        calls.clear()
        origin[0] = time.perf_counter()
        report = run(config, engine=engine)
    finally:
        engine.unload()
    span = (calls[-1].start - calls[0].start) * 1000 + calls[-1].ms
    prompt = [i for i, c in enumerate(calls) if c.prompt_tokens]
    after = {i + 1 for i in prompt if i + 1 < len(calls)}
    prompt_ms = sum(calls[i].ms for i in prompt) + sum(calls[i].ms for i in after)
    full = [c.ms for i, c in enumerate(calls) if i not in after and not c.prompt_tokens and c.rows == args.sessions]
    rest = sum(c.ms for c in calls) - prompt_ms - sum(full)
    print(f"{args.model}, {args.sessions} sessions, {args.rounds} rounds: {report.output_tokens_per_s:.0f} tokens/s; "
          f"{len(calls)} step calls over {span:.0f} ms")
    print(f"  prompt steps: {len(prompt)} launching {sum(calls[i].prompt_tokens for i in prompt)} prompt tokens, "
          f"{prompt_ms:.0f} ms with the calls after them ("
          + ", ".join(f"{calls[i].prompt_tokens}+{calls[i].rows}: {calls[i].ms + (calls[i + 1].ms if i + 1 in after else 0):.1f}"
                      for i in prompt) + " ms)")
    print(f"  full decode steps: {len(full)}, {sum(full):.0f} ms ({sum(full) / max(len(full), 1):.2f} ms each)")
    print(f"  other calls: {rest:.0f} ms; the host between calls: {span - sum(c.ms for c in calls):.0f} ms")


if __name__ == "__main__":
    main()
