"""The worker's per-step cost of its streamed answers, in process: a step's engine chunks -> one FANOUT -> bytes.

    python -m worker.bench.fanout [--streams 1 8 64] [--clients-per-stream 1] [--steps 2000] [--repeat 5]

For each count of streaming requests it times `Dispatch.step_answers` (the FANOUT with a CHUNKS part per client
route, one chunk of one token per request) plus `protocol.encode` of what it returns, as the compute loop does
every step, and prints the best mean over `--repeat` runs in microseconds per step (and per streamed token), in
the process's CPU time (time.process_time: another process taking the core does not count, on a shared host).
No engine runs: the chunks are made up, one token and one character per request per step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from broker.common import protocol as p
from worker.engine.session import Chunk
from worker.serve.config import WorkerConfig
from worker.serve.dispatch import Active, Dispatch
from worker.serve.metrics import NoMetrics


def dispatch_with(streams: int, routes: int) -> Dispatch:
    """A Dispatch with `streams` streaming generations in flight over `routes` client routes (no engine: the
    answers of generations that do not finish never ask it anything)."""
    dispatch = Dispatch(engine=None, config=WorkerConfig(), sampling=lambda s: s, metrics=NoMetrics())  # type: ignore[arg-type]
    for i in range(streams):
        dispatch.active[f"e{i}"] = Active(f"r{i:08d}", f"{i:032x}", b"c%07d" % (i % routes), True)
    return dispatch


def time_steps(streams: int, routes: int, steps: int) -> float:
    """Seconds per step of step_answers + encode, `steps` steps of one token per stream."""
    dispatch = dispatch_with(streams, routes)
    encode = p.encode
    chunks: list[Any] = []
    start = time.process_time()
    for step in range(steps):
        chunks = [Chunk(f"e{i}", "", [step % 500], "x") for i in range(streams)]
        messages, _ = dispatch.step_answers(chunks, 0.0)
        for message in messages:
            encode(message)
    return (time.process_time() - start) / steps


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker.bench.fanout", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--clients-per-stream", type=float, default=1.0,
                        help="client routes per stream (1: each stream its own client)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args(argv)
    print("streams  us/step  us/token")
    for streams in args.streams:
        routes = max(1, round(streams * args.clients_per_stream))
        best = min(time_steps(streams, routes, args.steps) for _ in range(args.repeat))
        print(f"{streams:7d}  {best * 1e6:7.2f}  {best * 1e6 / streams:8.3f}")


if __name__ == "__main__":
    main()
