"""In-process multi-session demo: two conversations interleaved and batched, then a fork.

    python -m worker.demo [--model PATH] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

from worker.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out = sys.stdout

    engine = Engine.load(args.model, device=args.device, max_sessions=4, max_context=2048)
    out.write(f"model {engine.model_name} on {engine.device}: {engine.capacity} session slots of "
              f"{engine.bytes_per_session / 2**20:.0f} MiB\n\n")
    alice, bob = engine.create_session(), engine.create_session()
    engine.chat(alice, "What is the capital of France?")
    engine.chat(bob, "Give me a fun fact about octopuses.")
    answers = engine.generate_many([(alice, {"max_tokens": 48}), (bob, {"max_tokens": 48})])
    out.write(f"[alice] What is the capital of France?\n  -> {answers[0].text}\n")
    out.write(f"[bob]   Give me a fun fact about octopuses.\n  -> {answers[1].text}\n\n")

    engine.chat(alice, "And what is it famous for?")
    carol = engine.fork(alice)  # same history, own state from here on
    engine.chat(bob, "How many hearts do they have?")
    answers = engine.generate_many(
        [(alice, {"max_tokens": 48}), (carol, {"max_tokens": 48, "temperature": 0.8, "seed": 7}), (bob, {"max_tokens": 48})]
    )
    out.write(f"[alice] And what is it famous for?\n  -> {answers[0].text}\n")
    out.write(f"[carol, forked from alice, sampled]\n  -> {answers[1].text}\n")
    out.write(f"[bob]   How many hearts do they have?\n  -> {answers[2].text}\n")
    for sid in (alice, bob, carol):
        engine.close(sid)


if __name__ == "__main__":
    main()
