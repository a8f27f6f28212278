"""What a recurrent state's checkpoint saves a turn sent whole from its start (worker.engine.checkpoints).

    python -m worker.bench.resume [--model random:qwen3.5-35b-a3b] [--device cuda] [--context 2048] [--repeats 3]

A session holds a `--context`-token conversation and a 16-token answer. Its next request is sent from its start, as the
gateway sends a Qwen3.5 chat turn (the template renders the answer without the reasoning its assistant prompt opened,
so the session keeps its tokens up to that prompt less "<think>\\n": here its last `--tail` tokens, the checkpoint
placed before them by the first generation's turn_tail). Timed from start_generate to the first token (the engine in
process, nothing else running), for:

- regenerate: the conversation again (its answer asked again; the checkpoint before the prompt's last token, from a
  first generation without a tail);
- next turn: the conversation less its tail, then `--turn` new tokens (the next user turn);
- edited last question: after such a next turn and its answer, that turn's question replaced (`--turn` other tokens):
  it cuts inside the latest checkpoint and starts from the first turn's;
- next turn after hibernation: the next turn of a session hibernated (to host memory) after its answer, its restore
  (and its checkpoint's) included;

each from the session's checkpoint and with the checkpoint dropped first (the state computed from the start: what
every such turn cost before checkpoints). JSON on stdout: the milliseconds (median of the repeats), the tokens each
computed, and the bytes a checkpoint holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from typing import Any

import structlog

from worker.engine import Engine, SamplingParams

ANSWER_TOKENS = 16


def first_token_ms(engine: Engine, sid: str, ids: list[int]) -> tuple[float, int]:
    """Milliseconds from a from_start GENERATE of `ids` to its first token, and the tokens it found computed."""
    start = time.perf_counter()
    rid = engine.start_generate(sid, SamplingParams(max_tokens=1, ignore_eos=True), prompt_ids=ids, from_start=True)
    computed = engine.session_computed(sid)
    while True:
        chunks = [c for c in engine.step() if c.request_id == rid]
        if any(c.token_ids for c in chunks):
            ms = (time.perf_counter() - start) * 1e3
            break
    while engine.has_work():
        engine.step()
    return ms, computed


CASES = ("regenerate", "next turn", "edited last question", "next turn after hibernation")


def one_case(engine: Engine, case: str, checkpoint: bool, context: int, tail: int, turn: int,
             rng: random.Random, vocab: int) -> tuple[float, int]:
    def new_ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def generate(ids: list[int], turn_tail: int, from_start: bool) -> None:
        engine.start_generate(sid, SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True), prompt_ids=ids,
                              turn_tail=turn_tail, from_start=from_start)
        while engine.has_work():
            engine.step()

    prompt = new_ids(context)
    sid = engine.create_session()
    try:
        generate(prompt, 0 if case == "regenerate" else tail, False)
        kept = prompt[:-tail]
        if case == "edited last question":  # a second turn, then its question edited: the first turn's checkpoint
            generate(kept + new_ids(turn) + prompt[-tail:], tail, True)
        if not checkpoint and engine.checkpoints is not None:
            engine.checkpoints.drop(sid)
        if case == "next turn after hibernation":
            assert engine.hibernate(sid), "the session did not hibernate"
        ids = prompt if case == "regenerate" else kept + new_ids(turn)
        return first_token_ms(engine, sid, ids)
    finally:
        engine.close(sid)


def measure(engine: Engine, context: int, tail: int, turn: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    one_case(engine, "regenerate", True, min(context, 64), tail, turn, rng, vocab)  # warm-up
    out: dict[str, Any] = {}
    for case in CASES:
        for checkpoint in (True, False):
            runs = [one_case(engine, case, checkpoint, context, tail, turn, rng, vocab) for _ in range(repeats)]
            ms = statistics.median(r[0] for r in runs)
            out[f"{case}, {'from the checkpoint' if checkpoint else 'from the start'}"] = {
                "first_token_ms": round(ms, 2), "computed_before": runs[0][1]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3.5-35b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=2048, help="tokens of the conversation before the answer")
    parser.add_argument("--tail", type=int, default=2, help="the prompt's last tokens the next turn renders otherwise")
    parser.add_argument("--turn", type=int, default=32, help="tokens the next turn adds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-context", type=int, default=4096)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    engine = Engine.load(args.model, device=args.device, max_sessions=4, max_context=args.max_context)
    engine.enable_hibernation(host_cache_bytes=8 * engine.table.spec.bytes_for(args.max_context), session_store=None)
    try:
        if engine.checkpoints is None:
            parser.error(f"{args.model} has no recurrent state: a from_start turn cuts its K/V, no checkpoint needed")
        result = {"model": args.model, "device": engine.device, "context": args.context, "tail": args.tail,
                  "turn": args.turn, "checkpoint_bytes": engine.table.spec.token_offset,
                  "cases": measure(engine, args.context, args.tail, args.turn, args.repeats)}
    finally:
        engine.unload()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
