"""Whether a prompt's last token gives the same bits computed in a prefill chunk and in a decode step.

    python -m worker.bench.prompt_paths [--device cuda] [--models random:tiny random:llama3-8b ...]

A plain generation computes the whole prompt in prefill chunks and samples its first token from the last chunk's
last row. A prefill-only GENERATE (max_tokens 0: what the gateway's `n` > 1 and a fork of a prompt take) leaves the
prompt's last token pending, and the next generation computes it in a decode step, through the decode kernels. For
each model: greedy tokens and their log-probabilities (compared exactly) of the plain path, of prefill-then-generate,
and of a fork after the prefill, as JSON on stdout. Batch invariance does not cover this (it is one row's path, not
what shares its step): a difference here means "n choices from one prefill" is not bit-identical to n = 1.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import structlog

from worker.engine import Engine, SamplingParams

PROMPT_TOKENS = 97
NEW_TOKENS = 12


def paths(engine: Engine) -> dict[str, Any]:
    prompt = [(i * 37 + 11) % 200 + 3 for i in range(PROMPT_TOKENS)]
    runs: dict[str, tuple[list[int], list[float]]] = {}
    for path in ("plain", "prefill_then", "prefill_fork"):
        sid = engine.create_session()
        engine.append(sid, token_ids=prompt)
        target = sid
        if path != "plain":
            engine.start_generate(sid, SamplingParams(max_tokens=0))
            while engine.has_work():
                engine.step()
            if path == "prefill_fork":
                target = engine.fork(sid)
        result = engine.generate(target, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
        runs[path] = (result.token_ids, [lp[0] for lp in result.logprobs or []])
        for session in {sid, target}:
            engine.close(session)
    plain = runs["plain"]
    return {
        "same_tokens": all(r[0] == plain[0] for r in runs.values()),
        "same_logprob_bits": all(r[1] == plain[1] for r in runs.values()),
        "max_logprob_difference": max(abs(a - b) for r in runs.values() for a, b in zip(r[1], plain[1], strict=True)),
        "tokens": {path: r[0] for path, r in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["random:tiny", "random:tiny-qwen3.5-moe", "random:llama3-8b"])
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out = {}
    for model in args.models:
        engine = Engine.load(model=model, device=args.device, max_sessions=4, max_context=512)
        try:
            out[model] = paths(engine)
        finally:
            engine.table.close()
    print(json.dumps(out, indent=1))  # the tool's output


if __name__ == "__main__":
    main()
