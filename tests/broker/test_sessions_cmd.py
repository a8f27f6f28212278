"""`broker sessions` and `broker close-session` without a broker: the table and JSON for a fixed list, the arguments."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from broker import sessions_cmd
from broker.common import protocol as p

ALICE = "A" * 40
SESSIONS = [  # as a SessionList lists them, the longest idle first
    p.SessionEntry("a" * 32, "gpu0", owner=ALICE, length=1200, idle_ms=125_000, client="gone", gone_ms=30_500),
    p.SessionEntry("b" * 32, "gpu1", owner="", length=None, idle_ms=1_500),
]


def parse(*argv: str) -> argparse.Namespace:
    top = argparse.ArgumentParser(prog="broker")
    sessions_cmd.add_parsers(top.add_subparsers(dest="command", required=True))
    return top.parse_args(list(argv))


def test_the_table_lists_each_session_with_its_client_state() -> None:
    assert sessions_cmd.render(SESSIONS, total=2) == (
        "2 sessions\n"
        "\n"
        "  session                            worker   owner          length     idle   client\n"
        " ─────────────────────────────────────────────────────────────────────────────────────────\n"
        "  aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa   gpu0     AAAAAAAAAAAA     1200   125.0s   gone 30.5s\n"
        "  bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb   gpu1     -                   ?     1.5s   connected\n"
        "\n"
    )
    assert sessions_cmd.render(SESSIONS[:1], total=12_000).splitlines()[0] == "12000 sessions (1 listed)"


def test_json_lists_every_field_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_cmd, "ask", lambda args, request, kind: p.SessionList(
        request_id="x", sessions=tuple(SESSIONS), total=2))
    out, err = io.StringIO(), io.StringIO()
    assert sessions_cmd.run_sessions(parse("sessions", "--json"), out, err) == 0
    assert json.loads(out.getvalue()) == [
        {"session": "a" * 32, "worker": "gpu0", "owner": ALICE, "length": 1200, "idle_s": 125.0, "client": "gone",
         "client_gone_s": 30.5},
        {"session": "b" * 32, "worker": "gpu1", "owner": None, "length": None, "idle_s": 1.5, "client": "connected",
         "client_gone_s": None},
    ]


def test_close_session_takes_a_session_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("close-session", "c" * 32).session == "c" * 32
    with pytest.raises(SystemExit) as exited:
        parse("close-session", "C" * 32)
    assert exited.value.code == 2 and "not a session id (32 hexadecimal digits)" in capsys.readouterr().err
