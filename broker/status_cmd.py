"""`broker status`: ask a running broker for its workers and print them as a table (or JSON).

Exit codes: 0 with the table, 1 when the broker does not answer within --timeout or refuses the
request (the message says which), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import zmq
from rich import box
from rich.console import Console
from rich.table import Table

from client import Client, ClientError, Timeout, WorkerInfo

DEFAULT_CLIENTS = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT_S = 5.0
WIDTH = 120  # columns of the plain-text table


def _env(*names: str) -> str | None:
    """The first of these environment variables that is set and not empty."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return seconds


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `status` to the `broker` command's subparsers (argparse's _SubParsersAction)."""
    status: argparse.ArgumentParser = subparsers.add_parser("status", help="show the workers a running broker knows")
    status.add_argument("--clients", default=_env("BROKER_CLIENTS") or DEFAULT_CLIENTS,
                        help="the broker's client address [env BROKER_CLIENTS] (default %(default)s)")
    status.add_argument("--broker-key", default=_env("BROKER_STATUS_BROKER_KEY", "CLIENT_BROKER_KEY"), metavar="FILE",
                        help="the broker's public key file, for CURVE [env BROKER_STATUS_BROKER_KEY, CLIENT_BROKER_KEY]")
    status.add_argument("--key", default=_env("BROKER_STATUS_KEY", "CLIENT_KEY"), metavar="FILE",
                        help="this client's secret key file (.key_secret) [env BROKER_STATUS_KEY, CLIENT_KEY]")
    status.add_argument("--json", action="store_true", help="print the workers as JSON instead of a table")
    status.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds to wait for the broker (default %(default)s)")
    return status


def as_dict(worker: WorkerInfo) -> dict[str, Any]:
    return dataclasses.asdict(worker)


def table(workers: Sequence[WorkerInfo]) -> Table:
    t = Table(title=f"{len(workers)} worker{'' if len(workers) == 1 else 's'}", title_justify="left", box=box.SIMPLE)
    t.add_column("worker", no_wrap=True)
    t.add_column("model")
    t.add_column("device")
    for name in ("capacity", "sessions", "free", "draining", "last seen"):
        t.add_column(name, justify="right")
    for w in sorted(workers, key=lambda w: (w.model, w.name)):
        t.add_row(w.name, w.model, w.device or "-", str(w.capacity), str(w.sessions), str(w.free_slots),
                  "yes" if w.draining else "no", f"{w.last_seen_s:.1f}s")
    t.add_section()
    draining = sum(1 for w in workers if w.draining)
    t.add_row("total", "", "", str(sum(w.capacity for w in workers)), str(sum(w.sessions for w in workers)),
              str(sum(w.free_slots for w in workers)), str(draining), "")
    return t


def render(workers: Sequence[WorkerInfo], width: int = WIDTH) -> str:
    """The table as plain text (no colour), as `broker status` prints it."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(table(workers))
    return "".join(line.rstrip() + "\n" for line in out.getvalue().splitlines())


def fetch(args: argparse.Namespace) -> list[WorkerInfo]:
    """The broker's workers. Raises ClientError (Timeout when it does not answer), OSError, ValueError."""
    try:
        client = Client(args.clients, timeout=args.timeout, broker_key=args.broker_key or None, key=args.key or None)
    except ClientError as e:  # a malformed address: nothing was asked of a broker
        raise ValueError(str(e)) from e
    with client:
        return client.status(timeout=args.timeout)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        workers = fetch(args)
    except Timeout:
        print(f"broker status: no answer from the broker at {args.clients} within {args.timeout:g} s "
              "(is it running, and is this its client address?)", file=err)
        return 1
    except ClientError as e:
        print(f"broker status: the broker at {args.clients} answered {e.code}: {e.message}", file=err)
        return 1
    except (OSError, ValueError) as e:  # a key file that cannot be read, keys this client cannot use
        print(f"broker status: {e}", file=err)
        return 1
    except zmq.ZMQError as e:  # a malformed address
        print(f"broker status: cannot connect to {args.clients!r}: {e}", file=err)
        return 1
    if args.json:
        print(json.dumps([as_dict(w) for w in workers], indent=2), file=out)
    else:
        print(render(workers), end="", file=out)
    return 0
