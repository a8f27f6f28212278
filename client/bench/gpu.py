"""The GPU benchmark: our full stack, our engine in-process, and Hugging Face transformers, one run.

    python -m client.bench.gpu [--model random:PRESET] [--sessions 1 64] [--prompt-tokens 128] [--new-tokens 256]
        [--repeats 3] [--json FILE]

All three run the same architecture (default `random:smollm2-135m`, the SmolLM2-135M shape; also
`random:llama3-8b`, `random:qwen2.5-7b`, `random:qwen3-8b`) in bf16 on the same GPU:
  (a) stack:     a broker and one worker as processes on loopback, driven by `loadtest`
  (b) engine:    the same workload through `worker.engine.Engine` in-process (no broker), with the
                 worker's configuration (capacity max(--sessions), so the same decode graph)
  (c) hf:        transformers' model of the same family and shape (its own random init: speed does not depend on
                 the values) and `generate` with a static cache, greedy, one batch of all sessions, in a child
                 process with torch's defaults (the engine's process sets a small cuBLAS workspace)
Each session appends a prompt of --prompt-tokens random ids and generates --new-tokens (EOS ignored,
so every system makes exactly the same number of tokens). Prints output tokens/s, the ratios, and the
issue's targets against the measured values. For session counts below the largest, the stack is also
run with a worker sized for that count (`--max-sessions N`): a smaller table has a smaller decode graph.
Every measurement is repeated --repeats times (default 3) and the median run is reported, with all of
the runs' values beside it: single runs of the 64-session load spread by several percent. Each measurement is also
printed to stderr as soon as it is made (engine, then stack, then transformers, whose compilation is the slowest),
so that a run cut short by a time limit still shows what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from broker.common import logs
from client.bench.loadtest import LoadConfig, run
from client.bench.loadtest.report import Report
from client.stack import LocalStack

MODEL = "random:smollm2-135m"
TARGET_STACK_64 = 40_000.0  # output tokens/s, full stack, 64 sessions
TARGET_VS_HF = 4.0  # full stack over transformers' static-cache generate, 64 sessions
TARGET_STACK_1 = 1_000.0  # output tokens/s, full stack, one session
TARGET_STACK_VS_ENGINE = 0.90  # full stack over the engine in-process, 64 sessions
TARGET_MEMORY_SLACK = 0.05  # GPU memory with 64 sessions <= weights + 64 x bytes per session + 5%
# The engine sets a small cuBLAS workspace for its process (worker.engine.graphs.limit_cublas_workspace); transformers
# runs in a child process with the environment this one started with, so it gets torch's defaults.
_STARTING_ENV = dict(os.environ)
HF_RESULT = "hf-rates: "  # the child's result line
HF_TIMEOUT_S = 1800
WORKER = "bench-gpu"
START_TIMEOUT_S = 300.0  # model load and CUDA graph capture
STOP_TIMEOUT_S = 60.0


def progress(what: str, rates: list[float]) -> None:
    """One measurement as soon as it is made (stderr), so that a run cut short still shows what it measured."""
    sys.stderr.write(f"measured: {what}: {' / '.join(f'{r:.0f}' for r in rates)} output tokens/s\n")
    sys.stderr.flush()


def median_run(measure: Callable[[], Report], repeats: int, show: bool = False) -> dict[str, Any]:
    """The report (as a dict) of the median of `repeats` runs by output tokens/s, with every run's value;
    `show` prints the median run's table."""
    runs = [(report.to_dict(), report) for report in (measure() for _ in range(max(1, repeats)))]
    runs.sort(key=lambda pair: pair[0]["output_tokens_per_s"])
    median, report = runs[len(runs) // 2]
    if show:
        print(report.table())
    median["runs_output_tokens_per_s"] = [d["output_tokens_per_s"] for d, _ in runs]
    return median


def bench_hf(model_name: str, batch: int, prompt_tokens: int, new_tokens: int, seed: int, repeats: int = 1,
             cache: str = "static") -> list[float]:
    """transformers' greedy generate with a static cache (or its default dynamic one: `cache`): output tokens/s for one
    batch, per timed run."""
    from transformers import AutoModelForCausalLM

    from worker.bench.hf_generate import hf_config
    from worker.model.loader import load_model

    c = load_model(model_name).config
    with torch.device("cuda"):
        model: Any = AutoModelForCausalLM.from_config(hf_config(c), dtype=torch.bfloat16)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(300, min(49000, c.vocab_size), (batch, prompt_tokens), generator=gen).cuda()
    kwargs: dict[str, Any] = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        # Warm-up with the timed shapes: with a static cache, transformers compiles the forward
        # (torch.compile) on first use for each shape; compilation stays out of the timing.
        for _ in range(2 if cache == "static" else 1):
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        rates = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out: Any = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            torch.cuda.synchronize()
            rates.append((out.shape[1] - prompt_tokens) * batch / (time.perf_counter() - start))
    del model
    torch.cuda.empty_cache()
    return sorted(rates)


def bench_hf_apart(model: str, batch: int, prompt_tokens: int, new_tokens: int, seed: int, repeats: int,
                   cache: str = "static", timeout_s: float = HF_TIMEOUT_S) -> list[float]:
    """bench_hf in a child process started with this process's starting environment."""
    args = ["--model", model, "--hf-batch", str(batch), "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens),
            "--seed", str(seed), "--repeats", str(repeats), "--hf-cache", cache]
    done = subprocess.run([sys.executable, "-m", "client.bench.gpu", *args], env=_STARTING_ENV, capture_output=True,
                          text=True, check=False, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith(HF_RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the transformers run failed ({done.returncode}): {done.stderr[-2000:]}")
    rates: list[float] = json.loads(lines[-1][len(HF_RESULT):])
    return rates


def workload(sessions: int, prompt_tokens: int, new_tokens: int, seed: int, rounds: int, vocab_size: int,
             max_context: int, **kw: Any) -> LoadConfig:
    """Each session makes `rounds` generations of new_tokens (SmolLM2 at 64 sessions, 8 rounds: ~3 s a run)."""
    return LoadConfig(
        sessions=sessions, prompt_tokens=prompt_tokens, max_tokens=new_tokens, turns=1, requests=sessions * rounds,
        ignore_eos=True, temperature=0.0, seed=seed, progress=False, max_context=max_context,
        warmup=sessions, vocab_size=min(vocab_size, 49152), **kw,
    )


def memory_check(model: str, sessions: int, max_context: int = 2048) -> dict[str, float]:
    """Device memory used by an engine with `sessions` live sessions against weights + sessions x bytes.

    At the default 2048-token context a session is 45 MiB, its slot 46 MiB (2 MiB granularity).
    Counted: everything the engine allocates (weights, slab, graphs and their pool, workspaces). Not
    counted: the kernels' code, which the CUDA context loads on first use in any process (cuBLAS, torch
    and Triton modules: about 240 MiB on the H100): a first engine of the same shape runs a generation
    and is freed before the baseline is read, so the result does not depend on what ran before.
    """
    from worker.engine import Engine

    warm = Engine.load(model, device="cuda", max_sessions=sessions, max_context=max_context)
    sid = warm.create_session()
    warm.append(sid, token_ids=list(range(1000, 1300)))
    warm.generate(sid, max_tokens=4, ignore_eos=True)
    warm.unload()
    gc.collect()  # the graphs and their pool go now, not during the measurement
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    engine = Engine.load(model, device="cuda", max_sessions=sessions, max_context=max_context)
    for _ in range(sessions):
        engine.create_session()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    used = free0 - free1
    budget = engine.model.weight_bytes() + sessions * engine.bytes_per_session
    result = {"used_bytes": used, "weights_plus_sessions_bytes": budget, "ratio": used / budget, "max_context": max_context,
              "slot_bytes": engine.table.slot_bytes, "bytes_per_session": engine.bytes_per_session}
    engine.unload()
    return result


def gpu_stack(model: str, max_sessions: int, max_context: int) -> LocalStack:
    """A broker and one GPU worker as processes on loopback (the daemons' own heartbeats), the worker registered.
    Stop it with `stop(STOP_TIMEOUT_S)`."""
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="bench-gpu-")), heartbeats=None)
    try:
        stack.start_broker()
        stack.start_worker(WORKER, model=model, device="cuda", max_sessions=max_sessions, max_context=max_context)
        stack.wait_for_workers({WORKER}, timeout=START_TIMEOUT_S)
    except BaseException:
        stack.stop(STOP_TIMEOUT_S)
        raise
    return stack


# The real-size models' targets (Llama-3-8B's shape on the H100): the engine near the bandwidth floor at 64 sessions,
# the stack close to the engine, one session near its floor, both well ahead of transformers.
TARGET_8B_ENGINE_64 = 9_000.0
TARGET_8B_STACK_VS_ENGINE = 0.95
TARGET_8B_STACK_1 = 170.0
TARGET_8B_VS_HF = 2.5
# The Qwen3.5-MoE's (35B-A3B shape, one H200); its 64-session target against the read floor is worker.bench.engine's.
MOE_MODEL = "random:qwen3.5-35b-a3b"
TARGET_MOE_STACK_1 = 400.0
TARGET_MOE_VS_HF = 5.0


def targets(model: str, runs: dict[int, Any]) -> list[tuple[str, float | None, float]]:
    """(what, measured or None, target at least) for the runs made: SmolLM2's targets for it, the MoE's for it, the
    8B ones else."""
    checks: list[tuple[str, float | None, float]] = []
    small, moe = model == MODEL, model == MOE_MODEL
    if 64 in runs:
        r = runs[64]
        if small:
            checks += [("64 sessions, stack output tokens/s", r["stack"]["output_tokens_per_s"], TARGET_STACK_64),
                       ("64 sessions, stack / transformers", r["ratios"]["stack_over_hf"], TARGET_VS_HF),
                       ("64 sessions, stack / engine in-process", r["ratios"]["stack_over_engine"], TARGET_STACK_VS_ENGINE)]
        elif moe:
            checks += [("64 sessions, stack / engine in-process", r["ratios"]["stack_over_engine"], TARGET_8B_STACK_VS_ENGINE),
                       ("64 sessions, stack / transformers", r["ratios"]["stack_over_hf"], TARGET_MOE_VS_HF)]
        else:
            checks += [("64 sessions, engine output tokens/s", r["engine"]["output_tokens_per_s"], TARGET_8B_ENGINE_64),
                       ("64 sessions, stack / engine in-process", r["ratios"]["stack_over_engine"], TARGET_8B_STACK_VS_ENGINE),
                       ("64 sessions, stack / transformers", r["ratios"]["stack_over_hf"], TARGET_8B_VS_HF)]
    if 1 in runs:
        r = runs[1]
        one = TARGET_STACK_1 if small else TARGET_MOE_STACK_1 if moe else TARGET_8B_STACK_1
        checks.append(("1 session, stack output tokens/s", r["stack"]["output_tokens_per_s"], one))
        if "stack_sized" in r:
            checks.append(("1 session, stack, worker --max-sessions 1", r["stack_sized"]["output_tokens_per_s"], one))
        if not small:
            checks.append(("1 session, stack / transformers", r["ratios"]["stack_over_hf"],
                           TARGET_MOE_VS_HF if moe else TARGET_8B_VS_HF))
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="random:PRESET (default %(default)s)")
    ap.add_argument("--max-context", type=int, default=1024, help="the worker's and the engine's context")
    ap.add_argument("--rounds", type=int, default=8, help="generations per session in a run")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--processes", type=int, default=4, help="loadtest client processes for the full stack")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is reported")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hf-cache", choices=("static", "dynamic", "skip"), default="static",
                    help="transformers' KV cache: static (compiled; its fastest), dynamic (no compile: for shapes whose "
                         "compile takes too long), or skip transformers (default %(default)s)")
    ap.add_argument("--hf-timeout", type=float, default=HF_TIMEOUT_S,
                    help="seconds for each transformers run, compile included; past it the run is reported as not "
                         "finished (default %(default)s)")
    ap.add_argument("--hf-batch", type=int, default=None, help=argparse.SUPPRESS)  # the transformers child
    args = ap.parse_args()
    logs.configure("warning")
    if args.hf_batch is not None:
        rates = bench_hf(args.model, args.hf_batch, args.prompt_tokens, args.new_tokens, args.seed, args.repeats,
                         args.hf_cache)
        sys.stdout.write(HF_RESULT + json.dumps(rates) + "\n")
        return
    model, context = args.model, args.max_context
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "model": model, "runs": {}}

    from worker.engine import Engine

    capacity = max(args.sessions)
    engine = Engine.load(model, device="cuda", max_sessions=capacity, max_context=context)  # as the stack's worker
    shape = dict(rounds=args.rounds, vocab_size=engine.model.config.vocab_size, max_context=context)
    reps = args.repeats

    def on_stack(n: int, clients: str) -> Callable[[], Report]:
        return lambda: run(workload(n, args.prompt_tokens, args.new_tokens, args.seed, broker=clients, model=None,
                                    processes=min(args.processes, n), **shape))

    def in_process(n: int, engine: Engine) -> Callable[[], Report]:
        return lambda: run(workload(n, args.prompt_tokens, args.new_tokens, args.seed, in_process=True, device="cuda",
                                    model=model, **shape), engine=engine)

    for n in args.sessions:
        results["runs"][n] = {"engine": median_run(in_process(n, engine), reps)}
        progress(f"engine, {n} sessions", results["runs"][n]["engine"]["runs_output_tokens_per_s"])
    engine.unload()
    for n in sorted(set(args.sessions) - {capacity}):
        sized = gpu_stack(model, n, context)
        try:
            results["runs"][n]["stack_sized"] = median_run(on_stack(n, sized.clients), reps)
            progress(f"stack (--max-sessions {n}), {n} sessions", results["runs"][n]["stack_sized"]["runs_output_tokens_per_s"])
        finally:
            sized.stop(STOP_TIMEOUT_S)
    stack = gpu_stack(model, capacity, context)
    try:
        for n in args.sessions:
            results["runs"][n]["stack"] = median_run(on_stack(n, stack.clients), reps, show=True)
            progress(f"stack, {n} sessions", results["runs"][n]["stack"]["runs_output_tokens_per_s"])
    finally:
        stack.stop(STOP_TIMEOUT_S)
    results["hf_cache"] = args.hf_cache
    for n in args.sessions:
        rates = []
        if args.hf_cache != "skip":
            try:
                rates = bench_hf_apart(model, n, args.prompt_tokens, args.new_tokens, args.seed, reps, args.hf_cache,
                                       args.hf_timeout)
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"transformers, {n} sessions: not finished in {args.hf_timeout:g} s\n")
        results["runs"][n]["hf_tokens_per_s"] = rates[len(rates) // 2] if rates else None
        results["runs"][n]["hf_runs_tokens_per_s"] = rates
        if rates:
            progress(f"transformers ({args.hf_cache} cache), {n} sessions", rates)
    results["memory_64"] = memory_check(model, 64, max(context, 2048) if model == MODEL else context)

    print(f"\n{results['device']}, {model} (bf16), prompts of {args.prompt_tokens}, {args.new_tokens} new tokens each")
    print(f"worker and in-process engine: capacity {capacity} sessions, context {context}")
    print(f"transformers: {args.hf_cache} cache" + (" (compiled)" if args.hf_cache == "static" else ""))
    print(f"{'sessions':>8} {'stack tok/s':>12} {'engine tok/s':>13} {'hf tok/s':>10} {'stack/engine':>13} {'stack/hf':>9}")
    for n, r in results["runs"].items():
        s, e, h = r["stack"]["output_tokens_per_s"], r["engine"]["output_tokens_per_s"], r["hf_tokens_per_s"]
        print(f"{n:8d} {s:12.0f} {e:13.0f} {_rate(h):>10} {s / e:13.2f} {_rate(s / h if h else None, 2):>9}")
        r["ratios"] = {"stack_over_engine": s / e, "stack_over_hf": s / h if h else None}
        if "stack_sized" in r:
            sized = r["stack_sized"]["output_tokens_per_s"]
            print(f"{'':8s} {sized:12.0f}  (stack, worker sized for {n}: --max-sessions {n})")
    print(f"\nmedians of {reps} runs each; every run's output tokens/s:")
    for n, r in results["runs"].items():
        runs = {name: r[name]["runs_output_tokens_per_s"] for name in ("stack", "stack_sized", "engine") if name in r}
        runs["hf"] = r["hf_runs_tokens_per_s"]
        print(f"{n:8d} " + "  ".join(f"{name} {' / '.join(f'{v:.0f}' for v in values)}" for name, values in runs.items()))
    mem = results["memory_64"]
    print("\ntargets:")
    checks = targets(model, results["runs"])
    for name, value, target in checks:
        if value is None:
            print(f"  {name:42s} {'n/a':>10}  target >= {target:<8g} not measured")
            continue
        print(f"  {name:42s} {value:10.2f}  target >= {target:<8g} {'met' if value >= target else 'MISSED'}")
    limit = 1 + TARGET_MEMORY_SLACK
    print(f"  {'GPU memory, 64 sessions / (weights + 64 x bytes)':42s} {mem['ratio']:10.3f}  target <= {limit:<8g} "
          f"{'met' if mem['ratio'] <= limit else 'MISSED'}  ({mem['used_bytes'] / 2**30:.2f} GiB used)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


def _rate(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
