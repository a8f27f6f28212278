"""`broker sessions`: the sessions a running broker routes to, as a table (or JSON): id, worker, owner, length, idle
time, and whether the client holding it is connected. `broker close-session ID`: close one.

Both speak the protocol as any client does (broker.status_cmd.ask): SESSIONS, answered by the broker, and a plain
CLOSE. With keys, a client key sees and closes its own sessions only; a key in the broker's admins/ sees and closes
any. Exit codes: 0 done, 1 when the broker does not answer within --timeout or refuses (the message says which; a
session already gone is `session_lost`, `session_expired` or `session_not_found`), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from broker.common import protocol as p
from broker.status_cmd import WIDTH, add_connection, ask, ask_or_explain


def session_id(value: str) -> str:
    if not p.is_session_id(value):
        raise argparse.ArgumentTypeError(f"not a session id (32 hexadecimal digits): {value!r}")
    return value


def add_parsers(subparsers: Any) -> None:
    """Add `sessions` and `close-session` to the `broker` command's subparsers."""
    listing: argparse.ArgumentParser = subparsers.add_parser(
        "sessions", help="list the sessions a running broker routes to (owner, worker, length, idle, client)")
    add_connection(listing)
    listing.add_argument("--json", action="store_true", help="print the sessions as JSON instead of a table")
    close: argparse.ArgumentParser = subparsers.add_parser(
        "close-session", help="close one session (its owner's key, or a key in the broker's admins/)")
    close.add_argument("session", type=session_id, help="the session's id")
    add_connection(close)


def as_dict(s: p.SessionEntry) -> dict[str, Any]:
    """A session as `--json` prints it (times in seconds)."""
    return {"session": s.session_id, "worker": s.worker, "owner": s.owner or None, "length": s.length,
            "idle_s": s.idle_ms / 1000, "client": s.client, "client_gone_s": s.gone_ms / 1000 if s.client == "gone" else None}


def table(sessions: Sequence[p.SessionEntry], total: int) -> Table:
    title = f"{total} session{'' if total == 1 else 's'}" + (f" ({len(sessions)} listed)" if total > len(sessions) else "")
    t = Table(title=title, title_justify="left", box=box.SIMPLE)
    t.add_column("session", no_wrap=True)
    t.add_column("worker")
    t.add_column("owner")
    for name in ("length", "idle"):
        t.add_column(name, justify="right")
    t.add_column("client")
    for s in sessions:
        client = "connected" if s.client == "connected" else f"gone {s.gone_ms / 1000:.1f}s"
        t.add_row(s.session_id, s.worker, s.owner[:12] or "-", "?" if s.length is None else str(s.length),
                  f"{s.idle_ms / 1000:.1f}s", client)
    return t


def render(sessions: Sequence[p.SessionEntry], total: int, width: int = WIDTH) -> str:
    """The table as plain text (no colour), as `broker sessions` prints it."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(table(sessions, total))
    return "".join(line.rstrip() + "\n" for line in out.getvalue().splitlines())


def run_sessions(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    listing = ask_or_explain("sessions", args, lambda: ask(args, p.Sessions(request_id=uuid.uuid4().hex), p.SessionList),
                             err or sys.stderr)
    if listing is None:
        return 1
    if args.json:
        print(json.dumps([as_dict(s) for s in listing.sessions], indent=2), file=out)
    else:
        print(render(listing.sessions, listing.total), end="", file=out)
    return 0


def run_close(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    close = p.Close(request_id=uuid.uuid4().hex, session_id=args.session)
    if ask_or_explain("close-session", args, lambda: ask(args, close, p.Closed), err or sys.stderr) is None:
        return 1
    print(f"closed {args.session}", file=out)
    return 0
