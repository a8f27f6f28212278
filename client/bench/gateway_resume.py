"""What a chat turn that does not simply continue a session costs through the HTTP gateway, against a new session.

    python -m client.bench.gateway_resume [--model MODEL] [--device cpu] [--turns 6] [--words 120] [--rounds 5]

Starts a broker, one worker (the bundled SmolLM2 by default: it has a chat template) and a gateway on loopback, plays a
conversation of --turns turns (user messages of --words words, answers of 16 tokens, greedy), then times, --rounds
times each, alternating, a one-token answer (a non-streamed request of max_tokens 1: the prompt's computation and one
token) for:

    regenerate   the conversation less its last answer, without a name: a fork of the session that gave that
                 answer, sent the whole conversation from its start (it keeps all but the answer)
    edit         a named conversation whose last question the client replaced by another: the session is sent the
                 whole conversation from its start and keeps everything before that question
    branch       the same without a name: a fork of the session that holds the conversation, sent it from its start
    new          the same request under a name never used: a new session computes the whole prompt

Prints JSON: each case's p50 time and the prompt and cached tokens its answer reports.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
import urllib.request
from typing import Any

from client.bench.gateway_overhead import start_gateway
from client.stack import LocalStack

WORDS = ("river", "stone", "garden", "window", "letter", "music", "silver", "market", "winter", "island", "candle",
         "forest", "bridge", "harbor", "lantern", "meadow", "journey", "thunder", "velvet", "orchard")


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int, name: str | None = None) -> tuple[
        float, dict[str, Any]]:
    """One non-streamed chat completion: (seconds, the answer's JSON)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if name is not None:
        body["session_id"] = name
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return time.perf_counter() - start, answer


def conversation(url: str, model: str, turns: int, words: int, rng: random.Random,
                 name: str | None = None) -> list[dict[str, str]]:
    """`turns` turns played (the last one answered too)."""
    messages: list[dict[str, str]] = []
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words)) + "?"})
        _, answer = chat(url, model, messages, 16, name)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the worker's model (default: the bundled SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    names = (f"bench-{i}" for i in itertools.count())
    times: dict[str, list[float]] = {"regenerate": [], "edit": [], "branch": [], "new": []}
    usage: dict[str, dict[str, int]] = {}
    with LocalStack(heartbeats=None) as stack:
        stack.start_broker()
        stack.start_worker("w1", model=args.model, device=args.device, max_sessions=16, max_context=8192)
        stack.wait_for_workers({"w1"}, timeout=300)
        gw, url, model = start_gateway(stack)
        anonymous = conversation(url, model, args.turns, args.words, rng)
        named = next(names)
        edited = conversation(url, model, args.turns, args.words, random.Random(0), named)
        for round_ in range(args.rounds):
            cases = ["regenerate", "edit", "branch", "new"]
            for case in cases if round_ % 2 == 0 else reversed(cases):
                words = " ".join(rng.choice(WORDS) for _ in range(args.words))
                question = {"role": "user", "content": f"{round_}: {words}?"}  # another question altogether
                if case == "regenerate":
                    seconds, answer = chat(url, model, anonymous[:-1], 1)
                elif case == "edit":
                    seconds, answer = chat(url, model, [*edited[:-2], question], 1, named)
                elif case == "branch":
                    seconds, answer = chat(url, model, [*anonymous[:-2], question], 1)
                else:
                    seconds, answer = chat(url, model, anonymous[:-1], 1, next(names))
                times[case].append(seconds)
                u = answer["usage"]
                usage[case] = {"prompt_tokens": u["prompt_tokens"],
                               "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
        gw.stop()
    print(json.dumps({case: {"ms_p50": round(statistics.median(t) * 1e3, 1), **usage[case]}
                      for case, t in times.items()}, indent=2))


if __name__ == "__main__":
    main()
