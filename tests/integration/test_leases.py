"""Session leases with the real daemons: the sessions of a client that is gone (its process killed) are closed after
the broker's grace period and their slots serve others, while an idle client that is still connected keeps its own;
`broker sessions` lists them (owner, worker, length, idle, client) and `broker close-session ID` closes one.

Before, a killed client's sessions held their slots forever by default (4 of 8 in the report), and there was no
command to list or close sessions."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from client import SessionExpired, SessionNotFound

from .cluster import ROOT, Cluster, Measure

GRACE_MS = 1000
CLIENT = """
import sys, time
from client import Client
client = Client(sys.argv[1], timeout=30)
for _ in range(2):
    s = client.session()
    s.append(token_ids=[7, 8, 9, 10])
    print(s.id, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def leased(cluster: Cluster) -> Iterator[Cluster]:
    cluster.start_broker(["--session-grace-ms", str(GRACE_MS)])
    cluster.start_worker("w1", max_sessions=3)
    cluster.wait_for_workers({"w1"})
    yield cluster


def broker_cli(cluster: Cluster, *args: str) -> tuple[int, str, str]:
    out = subprocess.run([sys.executable, "-m", "broker.cli", *args, "--clients", cluster.clients], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout, out.stderr


def listed(cluster: Cluster) -> dict[str, dict[str, object]]:
    code, out, err = broker_cli(cluster, "sessions", "--json")
    assert (code, err) == (0, "")
    return {entry["session"]: entry for entry in json.loads(out)}


def test_a_killed_client_s_sessions_are_closed_after_the_grace_period_and_a_connected_idle_one_keeps_its_own(
    leased: Cluster, measure: Measure
) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    with leased.client() as idle:
        mine = idle.session()
        mine.append(token_ids=[1, 2, 3])
        doomed = subprocess.Popen([sys.executable, "-c", CLIENT, leased.clients], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert doomed.stdout is not None
            theirs = []
            for _ in range(2):
                readable, _, _ = select.select([doomed.stdout], [], [], 30)
                assert readable, "the client process made no session"
                theirs.append(doomed.stdout.readline().decode().strip())
            assert [(w.sessions, w.free_slots) for w in idle.status()] == [(3, 0)]  # the worker is full
            table = listed(leased)
            assert {sid: (e["worker"], e["length"], e["client"]) for sid, e in table.items()} == {
                mine.id: ("w1", 3, "connected"), theirs[0]: ("w1", 4, "connected"), theirs[1]: ("w1", 4, "connected")}
            doomed.kill()
            killed = time.monotonic()
        finally:
            doomed.kill()
            doomed.wait(timeout=10)
            if doomed.stdout is not None:
                doomed.stdout.close()
        seen_gone = False
        while True:
            table = listed(leased)
            seen_gone |= any(table.get(sid, {}).get("client") == "gone" for sid in theirs)
            if set(table) == {mine.id}:
                break
            assert time.monotonic() - killed < 10, table
            time.sleep(0.1)
        closed_after = time.monotonic() - killed
        measure("client_kill_to_sessions_closed_s", round(closed_after, 3))
        assert seen_gone and GRACE_MS / 1000 <= closed_after < GRACE_MS / 1000 + 1.5
        assert [(w.sessions, w.free_slots) for w in idle.status()] == [(1, 2)]  # their slots are free again
        with pytest.raises(SessionExpired, match="its client was gone for more than 1 s"):
            idle.attach(theirs[0]).info()
        time.sleep(GRACE_MS / 1000)  # idle longer than the grace period, but connected: kept
        assert listed(leased)[mine.id]["idle_s"] >= GRACE_MS / 1000  # type: ignore[operator]
        assert mine.info().length == 3
        mine.close()


def test_broker_sessions_lists_them_and_close_session_closes_one(leased: Cluster) -> None:
    with leased.client() as c:
        a, b = c.session(), c.session()
        a.append(token_ids=[1, 2, 3, 4, 5])
        b.append(token_ids=[1, 2])
        code, out, err = broker_cli(leased, "sessions")
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0].strip() == "2 sessions"
        assert lines[2].split() == ["session", "worker", "owner", "length", "idle", "client"]
        rows = {line.split()[0]: line.split()[1:] for line in lines[4:] if line.strip()}
        assert {sid: (row[0], row[1], row[2], row[4]) for sid, row in rows.items()} == {
            a.id: ("w1", "-", "5", "connected"), b.id: ("w1", "-", "2", "connected")}
        assert broker_cli(leased, "close-session", a.id) == (0, f"closed {a.id}\n", "")
        with pytest.raises(SessionNotFound):
            a.info()
        assert set(listed(leased)) == {b.id}
        code, out, err = broker_cli(leased, "close-session", a.id)  # gone already
        assert code == 1 and out == "" and "answered session_not_found" in err
        code, _, err = broker_cli(leased, "close-session", "not-a-session")
        assert code == 2 and "not a session id" in err
        b.close()
        assert listed(leased) == {}
