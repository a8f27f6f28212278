"""Fuzz the whole stack for a long run: `python tests/fuzz_stack.py --cases 10000 [--seed N]`.

Starts a broker and two random:tiny CPU workers on 127.0.0.1 (one behind the broker, one driven by a fake
broker), then fires `--cases` hypothesis-drawn cases at each target in turn: the broker's client socket, its
worker socket, and the worker's message handling (see tests/fuzz/ for the cases and the checks). Prints
a summary: cases and cases per second per target, what came back (errors by code), checkpoints and good-session
rounds passed, processes alive. Exit code 0 when every check passed, 1 on the first failed one (its report: the
check, the cases of its batch, the daemons' tracebacks), 2 for bad arguments. The daemons' logs stay in --logs.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the packages import from the repository root

import structlog  # noqa: E402

from broker.common.arguments import positive_int  # noqa: E402
from tests.fuzz.checks import FuzzFailure, Report  # noqa: E402
from tests.fuzz.run import run_all  # noqa: E402
from tests.fuzz.targets import TARGETS  # noqa: E402


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(prog="fuzz_stack", description=__doc__.split("\n\n")[0])
    parse.add_argument("--cases", type=positive_int, default=10_000, help="cases per target (default %(default)s)")
    parse.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a random one, printed)")
    parse.add_argument("--batch", type=positive_int, default=100, help="cases between checkpoints (default %(default)s)")
    parse.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS), help="default: all")
    parse.add_argument("--logs", type=Path, default=None, help="where the daemons' logs go (default: a new temp dir)")
    return parse


def line(report: Report) -> str:
    errors = ", ".join(f"{code} {n}" for code, n in report.errors_by_code().items()) or "-"
    other = ", ".join(f"{k} {n}" for k, n in sorted(report.answers.items()) if not k.startswith("ERROR:")) or "-"
    return (
        f"{report.target:<22} {report.cases:>7} cases {report.seconds:7.1f} s {report.rate:7.1f} cases/s  "
        f"checkpoints {report.checkpoints}, good rounds {report.good_rounds}\n"
        f"{'':<22} errors answered: {errors}\n{'':<22} other answers: {other}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="fuzz-stack-"))
    logs.mkdir(parents=True, exist_ok=True)
    # The good client logs every garbage answer a fake worker sends it (answer_invalid): expected here, so quiet.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(f"fuzz_stack: {args.cases} cases per target, seed {seed}, batch {args.batch}, logs in {logs}", flush=True)
    started = time.monotonic()
    reports: list[Report] = []
    try:
        for report in run_all(logs, args.cases, seed, args.batch, args.targets):
            reports.append(report)
            print(line(report), flush=True)
    except FuzzFailure as e:
        print(f"\nFAILED after {time.monotonic() - started:.1f} s (seed {seed}):\n{e}", flush=True)
        return 1
    total = sum(r.cases for r in reports)
    print(f"\nall checks passed: {total} cases in {time.monotonic() - started:.1f} s, crashes 0, every process alive "
          f"(seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
