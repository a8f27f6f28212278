"""`broker status`: ask a running broker for its workers and print them as a table (or JSON).

It speaks the protocol itself: one STATUS request on a DEALER (with CURVE keys when given), the
StatusReport (or ERROR) back. Exit codes: 0 with the table, 1 when the broker does not answer within
--timeout or refuses the request (the message says which), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TextIO, TypeVar

import zmq
from rich import box
from rich.console import Console
from rich.table import Table

from broker.common import protocol as p
from broker.common.arguments import zmq_address
from broker.common.keys import HANDSHAKE_FAILED, HANDSHAKE_REFUSED, CurveClient, drain_events

M = TypeVar("M", bound=p.Message)
T = TypeVar("T")

DEFAULT_CLIENTS = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT_S = 5.0
WIDTH = 120  # columns of the plain-text table


class NoAnswer(Exception):
    """The broker did not answer within the timeout: not running, or not at this address."""


class Refused(Exception):
    """The broker answered with an ERROR, or refused this client's handshake (code `unauthorized`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _env(*names: str) -> str | None:
    """The first of these environment variables that is set and not empty."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


MAX_WAIT_S = 1e6  # what a socket poll's millisecond count holds comfortably (--timeout)


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not 0 < seconds < MAX_WAIT_S:
        raise argparse.ArgumentTypeError(f"must be > 0 and < {MAX_WAIT_S:g}, got {value}")
    return seconds


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `status` to the `broker` command's subparsers (argparse's _SubParsersAction)."""
    status: argparse.ArgumentParser = subparsers.add_parser("status", help="show the workers a running broker knows")
    add_connection(status)
    status.add_argument("--json", action="store_true", help="print the workers as JSON instead of a table")
    return status


def add_connection(command: argparse.ArgumentParser) -> None:
    """The flags of a command that asks a running broker: --clients, --broker-key, --key, --timeout."""
    command.add_argument("--clients", type=zmq_address, default=_env("BROKER_CLIENTS") or DEFAULT_CLIENTS,
                         help="the broker's client address [env BROKER_CLIENTS] (default %(default)s)")
    command.add_argument("--broker-key", default=_env("BROKER_STATUS_BROKER_KEY", "CLIENT_BROKER_KEY"), metavar="FILE",
                         help="the broker's public key file, for CURVE [env BROKER_STATUS_BROKER_KEY, CLIENT_BROKER_KEY]")
    command.add_argument("--key", default=_env("BROKER_STATUS_KEY", "CLIENT_KEY"), metavar="FILE",
                         help="this client's secret key file (.key_secret) [env BROKER_STATUS_KEY, CLIENT_KEY]")
    command.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                         help="seconds to wait for the broker (default %(default)s)")


def as_dict(worker: p.WorkerStatus) -> dict[str, Any]:
    """A worker as `--json` prints it (the heartbeat age in seconds)."""
    return {"name": worker.name, "model": worker.model, "capacity": worker.capacity, "free_slots": worker.free_slots,
            "sessions": worker.sessions, "draining": worker.draining, "device": worker.device,
            "max_context": worker.max_context, "last_seen_s": worker.last_seen_ms / 1000,
            "sampling_defaults": worker.sampling_defaults.given(), "tools": worker.tools}


def table(workers: Sequence[p.WorkerStatus]) -> Table:
    t = Table(title=f"{len(workers)} worker{'' if len(workers) == 1 else 's'}", title_justify="left", box=box.SIMPLE)
    t.add_column("worker", no_wrap=True)
    t.add_column("model")
    t.add_column("device")
    for name in ("context", "capacity", "sessions", "free", "draining", "last seen"):
        t.add_column(name, justify="right")
    for w in sorted(workers, key=lambda w: (w.model, w.name)):
        t.add_row(w.name, w.model, w.device or "-", str(w.max_context or "-"), str(w.capacity), str(w.sessions),
                  str(w.free_slots), "yes" if w.draining else "no", f"{w.last_seen_ms / 1000:.1f}s")
    t.add_section()
    draining = sum(1 for w in workers if w.draining)
    t.add_row("total", "", "", "", str(sum(w.capacity for w in workers)), str(sum(w.sessions for w in workers)),
              str(sum(w.free_slots for w in workers)), str(draining), "")
    return t


def render(workers: Sequence[p.WorkerStatus], width: int = WIDTH) -> str:
    """The table as plain text (no colour), as `broker status` prints it."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(table(workers))
    return "".join(line.rstrip() + "\n" for line in out.getvalue().splitlines())


def fetch(args: argparse.Namespace) -> list[p.WorkerStatus]:
    """The broker's workers. Raises NoAnswer, Refused, OSError or ValueError (key files), zmq.ZMQError (address)."""
    return list(ask(args, p.Status(request_id=uuid.uuid4().hex), p.StatusReport).workers)


def ask(args: argparse.Namespace, request: p.Message, kind: type[M]) -> M:
    """Send one request to the broker at args.clients (with args.broker_key and args.key when given) and wait up to
    args.timeout for its answer of type `kind`. Raises NoAnswer, Refused (an ERROR, or a refused handshake), OSError or
    ValueError (key files), zmq.ZMQError (address)."""
    curve = CurveClient.from_files(args.broker_key or None, args.key or None)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)  # ZeroMQ retries a refused handshake silently
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        if curve is not None:
            curve.apply(sock)
        sock.connect(args.clients)
        sock.send_multipart(p.encode(request))
        request_id: str = getattr(request, "request_id", "")
        answer = _answer(sock, monitor, request_id, kind, time.monotonic() + args.timeout)
        if answer is None:
            raise NoAnswer(f"no answer within {args.timeout:g} s")
        return answer
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        context.term()


def _answer(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], request_id: str, kind: type[M],
            deadline: float) -> M | None:
    """The answer of type `kind` for `request_id`, None at the deadline; an ERROR for it, or a refused handshake
    (which ZeroMQ would retry until the deadline), raises Refused at once."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while (left_ms := round((deadline - time.monotonic()) * 1000)) > 0:
        ready = dict(poller.poll(left_ms))
        if monitor in ready and drain_events(monitor):
            raise Refused(p.ErrorCode.UNAUTHORIZED.value, HANDSHAKE_REFUSED)
        if sock not in ready:
            continue
        try:
            answer = p.decode(sock.recv_multipart())
        except p.ProtocolError:
            continue  # not an answer to our request: wait on for one that is
        if isinstance(answer, kind) and getattr(answer, "request_id", None) == request_id:
            return answer
        if isinstance(answer, p.Error) and answer.request_id == request_id:
            raise Refused(answer.code.value, answer.message)
    return None


def ask_or_explain(command: str, args: argparse.Namespace, call: Callable[[], T], err: TextIO) -> T | None:
    """`call()` (which asks the broker), with every failure explained on `err` as `broker COMMAND: ...` (None then:
    exit 1)."""
    try:
        return call()
    except NoAnswer:
        print(f"broker {command}: no answer from the broker at {args.clients} within {args.timeout:g} s "
              "(is it running, and is this its client address?)", file=err)
    except Refused as e:
        print(f"broker {command}: the broker at {args.clients} answered {e.code}: {e.message}", file=err)
    except (OSError, ValueError) as e:  # a key file that cannot be read, keys this client cannot use
        print(f"broker {command}: {e}", file=err)
    except zmq.ZMQError as e:  # a malformed address
        print(f"broker {command}: cannot connect to {args.clients!r}: {e}", file=err)
    return None


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    workers = ask_or_explain("status", args, lambda: fetch(args), err or sys.stderr)
    if workers is None:
        return 1
    if args.json:
        print(json.dumps([as_dict(w) for w in workers], indent=2), file=out)
    else:
        print(render(workers), end="", file=out)
    return 0
