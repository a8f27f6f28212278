"""`broker drain WORKER`: move every session off a worker (to the other workers of its model with room) and place
nothing more on it; `broker rebalance`: move idle sessions from the fullest workers of each model to the emptiest.

Both ask a running broker as any client does (broker.status_cmd.ask: DRAIN or REBALANCE, answered MovesDone once the
moves have ended) and print what moved. With keys, only a key in the broker's admins/ may. Exit codes: 0 when every
planned move succeeded (sessions that had nowhere to go are reported as kept), 1 when the broker does not answer
within --timeout, refuses, or a move failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any, TextIO

from broker.common import protocol as p
from broker.status_cmd import add_connection, ask, ask_or_explain

DEFAULT_TIMEOUT_S = 300.0  # moves take as long as the generations running on the sessions, then their copies


def add_parsers(subparsers: Any) -> None:
    """Add `drain` and `rebalance` to the `broker` command's subparsers."""
    drain: argparse.ArgumentParser = subparsers.add_parser(
        "drain", help="move every session off a worker and place nothing more on it (then stop it at leisure)")
    drain.add_argument("worker", type=worker_name, help="the worker's name (as `broker status` lists it)")
    add_connection(drain)
    drain.set_defaults(timeout=DEFAULT_TIMEOUT_S)
    rebalance: argparse.ArgumentParser = subparsers.add_parser(
        "rebalance", help="move idle sessions from the fullest workers of each model to the emptiest")
    add_connection(rebalance)
    rebalance.set_defaults(timeout=DEFAULT_TIMEOUT_S)


def worker_name(value: str) -> str:
    """Argument type: a name a worker can have (checked as the DRAIN message checks it)."""
    try:
        p.DrainWorker(request_id="x", worker=value)
    except p.ProtocolError as e:
        raise argparse.ArgumentTypeError(e.message) from None
    return value


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    request: p.DrainWorker | p.Rebalance
    if args.command == "drain":
        request = p.DrainWorker(request_id=uuid.uuid4().hex, worker=args.worker)
    else:
        request = p.Rebalance(request_id=uuid.uuid4().hex)
    done = ask_or_explain(args.command, args, lambda: ask(args, request, p.MovesDone), err or sys.stderr)
    if done is None:
        return 1
    print(f"moved {done.moved}, failed {done.failed}, kept {done.kept}", file=out)
    return 1 if done.failed else 0
