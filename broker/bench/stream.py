"""Streaming throughput: output tokens/s through broker + worker + client vs the same engine in-process.

    python -m broker.bench.stream [--sessions 64] [--tokens 256] [--repeat 3] [--client async|sync]

One run, two measurements of the same workload (`--sessions` sessions, each generating `--tokens`
tokens with ignore_eos, all at once):

- in-process: `Engine.load(model, device)` and `generate_many` (in a child process, so that this one
  stays a plain client);
- the stack: one broker (`python -m broker.cli start`), one worker (`python -m worker.cli start --model
  random:tiny --device cpu --max-sessions N`), both started by client/stack.py with their logs in a
  temporary folder, and the client here: one AsyncClient running every stream
  concurrently (`--client async`), or one Client reading every stream round-robin on one thread
  (`--client sync`).

Besides tokens/s it reports the CPU each process spent per output token while streaming (broker,
worker, client; the engine's own in-process), which says where the time goes whatever else the machine
is doing, and from it how many tokens/s one core of broker or client could carry. torch runs with
`--torch-threads` threads in both measurements (default 1: the stack's three processes share the
machine's cores). `--profile DIR` runs the broker and the worker under cProfile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from client import AsyncClient, AsyncSession, Client
from client.stack import PYTHON, LocalStack, child_env

PROMPT = [7, 8, 9, 10]
WORKER = "bench"  # the worker's name
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def prompt(i: int) -> list[int]:
    return [*PROMPT, 11 + i % 200]


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU of a process (this one when pid is None), Linux /proc."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- in-process -------------------------------------------------------------------------------------------


def engine_only(
    model: str, device: str, sessions: int, tokens: int, repeat: int, threads: int
) -> list[tuple[float, float]]:
    """(tokens/s, CPU us per token) of `generate_many` on the engine itself (runs in the child process)."""
    import torch

    from worker.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.load(model, device=device, max_sessions=sessions, max_context=2048)
    rates = []
    for r in range(repeat + 1):  # the first run warms up
        ids = [engine.create_session() for _ in range(sessions)]
        for i, sid in enumerate(ids):
            engine.append(sid, token_ids=prompt(i))
        start, cpu = time.perf_counter(), cpu_seconds()
        results = engine.generate_many([(sid, {"max_tokens": tokens, "ignore_eos": True}) for sid in ids])
        elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        assert all(len(g.token_ids) == tokens for g in results)
        if r:
            rates.append((sessions * tokens / elapsed, cpu / (sessions * tokens) * 1e6))
        for sid in ids:
            engine.close(sid)
    return rates


def in_process(args: argparse.Namespace) -> list[tuple[float, float]]:
    out = subprocess.run(
        [sys.executable, "-m", "broker.bench.stream", "--engine-only", "--model", args.model, "--device", args.device,
         "--sessions", str(args.sessions), "--tokens", str(args.tokens), "--repeat", str(args.repeat),
         "--torch-threads", str(args.torch_threads)],
        env=child_env({"OMP_NUM_THREADS": str(args.torch_threads)}), check=True, capture_output=True, text=True,
    )
    return [(rate, cpu) for rate, cpu in json.loads(out.stdout.strip().splitlines()[-1])]


# -- through the stack --------------------------------------------------------------------------------------


@dataclass
class Run:
    tokens_per_s: float
    ttft_p50_ms: float
    cpu_us_per_token: dict[str, float]


Probe = Callable[[], dict[str, float]]  # CPU seconds so far, by process
Result = tuple[int, float, list[float], dict[str, float]]  # tokens, seconds, TTFTs, CPU seconds by process


def cpu_used(probe: Probe, before: dict[str, float]) -> dict[str, float]:
    after = probe()
    return {k: after[k] - before[k] for k in before}


async def async_run(address: str, sessions: int, tokens: int, probe: Probe) -> Result:
    """Every stream at once on one AsyncClient; tokens/s and CPU are taken over the streaming alone."""
    async with AsyncClient(address, timeout=120) as c:
        handles = list(await asyncio.gather(*(c.session() for _ in range(sessions))))
        await asyncio.gather(*(s.append(token_ids=prompt(i)) for i, s in enumerate(handles)))
        ttfts: list[float] = []
        cpu = probe()
        start = time.perf_counter()

        async def one(s: AsyncSession) -> int:
            stream = await s.generate(max_tokens=tokens, ignore_eos=True, stream=True)
            n = 0
            first = True
            async for chunk in stream:
                if first and chunk.token_ids:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                n += len(chunk.token_ids)
            return n

        counts = await asyncio.gather(*(one(s) for s in handles))
        elapsed = time.perf_counter() - start
        used = cpu_used(probe, cpu)
        await asyncio.gather(*(s.close() for s in handles))
    return sum(counts), elapsed, ttfts, used


def sync_run(address: str, sessions: int, tokens: int, probe: Probe) -> Result:
    """Every stream on one Client, read round-robin on this thread."""
    with Client(address, timeout=120) as c:
        handles = [c.session() for _ in range(sessions)]
        for i, s in enumerate(handles):
            s.append(token_ids=prompt(i))
        ttfts: list[float] = []
        cpu = probe()
        start = time.perf_counter()
        streams = [s.generate(max_tokens=tokens, ignore_eos=True, stream=True) for s in handles]
        total = 0
        started: set[int] = set()
        live = list(range(sessions))
        while live:
            still = []
            for i in live:
                chunk = next(streams[i], None)
                if chunk is None:
                    continue
                if chunk.token_ids and i not in started:
                    started.add(i)
                    ttfts.append(time.perf_counter() - start)
                total += len(chunk.token_ids)
                if chunk.finish_reason is None:
                    still.append(i)
            live = still
        elapsed = time.perf_counter() - start
        used = cpu_used(probe, cpu)
        for s in handles:
            s.close()
    return total, elapsed, ttfts, used


def through_stack(args: argparse.Namespace) -> list[Run]:
    def python(name: str) -> tuple[str, ...]:
        if args.profile is None:
            return PYTHON
        return (sys.executable, "-m", "cProfile", "-o", str(Path(args.profile) / f"{name}.prof"))

    stack = LocalStack(heartbeats=None, log_level="warning", env={"OMP_NUM_THREADS": str(args.torch_threads),
                        "WORKER_THREADS": str(args.torch_threads)})
    clients = stack.clients
    runs: list[Run] = []
    try:
        broker = stack.start_broker(python=python("broker"))
        worker = stack.start_worker(WORKER, model=args.model, device=args.device, max_sessions=args.sessions,
                                    python=python("worker"))
        stack.wait_for_workers({WORKER}, timeout=START_TIMEOUT_S)

        def probe() -> dict[str, float]:
            return {"broker": cpu_seconds(broker.pid), "worker": cpu_seconds(worker.pid), "client": cpu_seconds()}

        for r in range(args.repeat + 1):  # the first run warms up
            if args.client == "async":
                total, elapsed, ttfts, used = asyncio.run(async_run(clients, args.sessions, args.tokens, probe))
            else:
                total, elapsed, ttfts, used = sync_run(clients, args.sessions, args.tokens, probe)
            assert total == args.sessions * args.tokens, (total, args.sessions * args.tokens)
            if r:
                runs.append(Run(
                    total / elapsed,
                    statistics.median(ttfts) * 1000 if ttfts else float("nan"),
                    {k: v / total * 1e6 for k, v in used.items()},
                ))
    finally:
        stack.stop(STOP_TIMEOUT_S)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="measured runs of each (after one warm-up)")
    parser.add_argument("--client", choices=("async", "sync"), default="async")
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--profile", metavar="DIR", help="run the broker and the worker under cProfile, stats into DIR")
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_only:
        rates = engine_only(args.model, args.device, args.sessions, args.tokens, args.repeat, args.torch_threads)
        print(json.dumps(rates))
        return

    engine_runs = in_process(args)
    runs = through_stack(args)
    engine = [rate for rate, _ in engine_runs]
    stack = [r.tokens_per_s for r in runs]
    print(f"{args.sessions} streams x {args.tokens} tokens, {args.model} on {args.device}, "
          f"torch threads {args.torch_threads}, {args.client} client, {args.repeat} runs each")
    print(f"{'output tokens/s':<24}{'best':>12}{'median':>12}")
    print(f"{'engine in-process':<24}{max(engine):>12,.0f}{statistics.median(engine):>12,.0f}")
    print(f"{'through the stack':<24}{max(stack):>12,.0f}{statistics.median(stack):>12,.0f}")
    print(f"{'stack / engine':<24}{max(stack) / max(engine):>12.2f}{statistics.median(stack) / statistics.median(engine):>12.2f}")
    cpu = {"engine in-process": statistics.median(c for _, c in engine_runs)}
    cpu |= {k: statistics.median(r.cpu_us_per_token[k] for r in runs) for k in runs[0].cpu_us_per_token}
    print("CPU us per output token (median): " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
    print(f"one core would carry: broker {1e6 / cpu['broker']:,.0f} tokens/s, client {1e6 / cpu['client']:,.0f} tokens/s; "
          f"worker overhead over the engine {cpu['worker'] - cpu['engine in-process']:+.1f} us/token; "
          f"TTFT p50 {statistics.median(r.ttft_p50_ms for r in runs):.1f} ms")


if __name__ == "__main__":
    main()
