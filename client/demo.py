"""The multi-session demo through the whole stack: `python -m client.demo`.

Starts a broker and one worker (the bundled SmolLM2 unless --model says otherwise) on free loopback
ports, runs two chat sessions interleaved and streamed, forks one, prints the text, closes everything
and stops both daemons with SIGTERM. Daemon logs go to files in a temporary folder (printed on failure).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from broker.common import logs
from client import Client, ClientError, Stream
from client.stack import LocalStack, StackError

QUESTIONS = ("What is the capital of France?", "Give me one tip for learning to cook.")
WORKER = "demo-worker"
START_TIMEOUT_S = 300.0  # for the worker to load the model and register
STOP_TIMEOUT_S = 30.0


def interleave(streams: dict[str, Stream]) -> dict[str, str]:
    """Read the streams turn about, as a server sees them, printing each chunk labelled by its session."""
    texts = {name: "" for name in streams}
    live = dict(streams)
    while live:
        for name, stream in list(live.items()):
            chunk = next(stream)
            texts[name] += chunk.text
            if chunk.text.strip():
                print(f"  [{name}] {chunk.text!r}")
            if chunk.finish_reason is not None:
                del live[name]
    return texts


def run_demo(client: Client, max_tokens: int) -> None:
    workers = client.status()
    print(f"worker {workers[0].name}: model {workers[0].model!r}, {workers[0].capacity} session slots")
    with client.session() as a, client.session() as b:
        print(f"\nTwo sessions ({a.id[:8]}, {b.id[:8]}), streamed and interleaved:")
        streams = {"A": a.chat(QUESTIONS[0], max_tokens=max_tokens, stream=True),
                   "B": b.chat(QUESTIONS[1], max_tokens=max_tokens, stream=True)}
        texts = interleave(streams)
        for name, question in zip(("A", "B"), QUESTIONS, strict=True):
            print(f"\n{name}: {question}\n   -> {texts[name].strip()}")
        with a.fork() as fork:
            print(f"\nFork of A ({fork.id[:8]}) and A itself get different follow-ups; each keeps A's history:")
            print(f"  A:    And of Italy?   -> {a.chat('And of Italy?', max_tokens=max_tokens).text.strip()}")
            print(f"  fork: And of Spain?   -> {fork.chat('And of Spain?', max_tokens=max_tokens).text.strip()}")
            print(f"  lengths: A {a.info().length} tokens, fork {fork.info().length} tokens")
    print(f"\nall sessions closed; worker holds {client.status()[0].sessions}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="worker --model (default: the bundled SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    logs.configure("warning")

    stack = LocalStack(Path(tempfile.mkdtemp(prefix="sessionserve-demo-")), heartbeats=None)  # the daemons' defaults
    broker = stack.start_broker()
    worker = stack.start_worker(WORKER, model=args.model, device=args.device, max_sessions=4)
    code = 0
    try:
        with Client(stack.clients, timeout=120) as client:
            print("starting a broker and a worker (loading the model)...")
            stack.wait_for_workers({WORKER}, timeout=START_TIMEOUT_S)
            run_demo(client, args.max_tokens)
    except (ClientError, StackError) as e:
        print(f"demo failed: {e} (daemon logs in {stack.log_dir})", file=sys.stderr)
        code = 1
    finally:
        if None in stack.stop(timeout=STOP_TIMEOUT_S).values():  # the worker first: it drains, says DISCONNECT, exits
            code = 1  # one had to be killed
    print(f"broker and worker stopped (exit codes {broker.proc.returncode}, {worker.proc.returncode})")
    return code or broker.proc.returncode or worker.proc.returncode


if __name__ == "__main__":
    sys.exit(main())
