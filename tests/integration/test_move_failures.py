"""A move that fails at each of its steps, the named process killed there (the worker held at that step by
WORKER_TEST_MOVE_PAUSE): the session ends on exactly one worker, which serves it on, or answers session_lost; never on
two. random:tiny workers (the tokens are checked byte for byte with SmolLM2 in test_moves.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from broker import moves_cmd
from broker.common import protocol as p
from client import Client, Session, SessionLost
from client.stack import Daemon

from .cluster import Cluster

PROMPT = list(range(1, 40))
PAUSE_S = 30  # how long the paused worker sleeps at its step: far longer than the test takes to kill it


def start_worker(cluster: Cluster, name: str, **env: str) -> Daemon:
    """A random:tiny worker with these variables set (WORKER_TEST_MOVE_PAUSE, WORKER_TEST_CORRUPT_MOVES)."""
    before = cluster.env
    cluster.env = {**before, **env}
    try:
        return cluster.start_worker(name)
    finally:
        cluster.env = before


def wait_in_log(daemon: Daemon, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.log_text():
        assert daemon.alive, f"{daemon.log} ended without {text!r}"
        assert time.monotonic() < deadline, f"{text!r} not in {daemon.log} within {timeout} s"
        time.sleep(0.05)


class Drain:
    """`broker drain WORKER` on a thread (it answers once the moves have ended)."""

    def __init__(self, cluster: Cluster, worker: str, timeout: float = 60.0) -> None:
        args = argparse.Namespace(command="drain", worker=worker, clients=cluster.clients, broker_key=None, key=None,
                                  timeout=timeout)
        self.out = Path(cluster.tmp) / f"drain-{worker}.out"
        self.code: int | None = None
        self._thread = threading.Thread(target=self._run, args=(args,))
        self._thread.start()

    def _run(self, args: argparse.Namespace) -> None:
        with open(self.out, "w") as out, open(self.out.with_suffix(".err"), "w") as err:
            self.code = moves_cmd.run(args, out, err)

    def result(self) -> tuple[int | None, str]:
        self._thread.join(timeout=90)
        return self.code, self.out.read_text().strip()


def conversation(client: Client) -> tuple[Session, list[int]]:
    """A session on w1 with a turn behind it: the session and its first turn's tokens."""
    s = client.session()
    assert s.worker == "w1"
    s.append(token_ids=PROMPT)
    return s, s.generate(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True).token_ids


def next_turn(s: Session) -> list[int]:
    return s.generate(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True).token_ids


def two_workers(cluster: Cluster, w1_env: dict[str, str], w2_env: dict[str, str]) -> tuple[Daemon, Daemon]:
    cluster.start_broker()
    w1 = start_worker(cluster, "w1", **w1_env)
    cluster.wait_for_workers({"w1"})
    return w1, start_worker(cluster, "w2", **w2_env)


def drain_killing(cluster: Cluster, client: Client, victim: Daemon) -> tuple[Session, Drain]:
    """A conversation on w1, then `broker drain w1` while both workers run; `victim` is killed once its move has
    paused at the step its WORKER_TEST_MOVE_PAUSE names. The session and the drain (still running)."""
    s, _ = conversation(client)
    cluster.wait_for_workers({"w1", "w2"})
    drain = Drain(cluster, "w1")
    wait_in_log(victim, "move_paused_for_test")
    victim.kill()
    return s, drain


def test_target_killed_while_importing_leaves_the_session_on_its_source(cluster: Cluster) -> None:
    w1, w2 = two_workers(cluster, {}, {"WORKER_TEST_MOVE_PAUSE": f"import:{PAUSE_S}"})
    with cluster.client(timeout=30) as c:
        s, drain = drain_killing(cluster, c, w2)
        assert drain.result() == (1, "moved 0, failed 1, kept 1")
        assert len(next_turn(s)) == 6 and s.info().worker == "w1" and s.info().length == len(PROMPT) + 12


def test_source_killed_after_the_release_was_sent_leaves_the_session_on_its_target(cluster: Cluster) -> None:
    w1, w2 = two_workers(cluster, {"WORKER_TEST_MOVE_PAUSE": f"release:{PAUSE_S}"}, {})
    with cluster.client(timeout=30) as c:
        s, drain = drain_killing(cluster, c, w1)
        assert drain.result() == (0, "moved 1, failed 0, kept 0")
        assert len(next_turn(s)) == 6 and s.info().worker == "w2" and s.info().length == len(PROMPT) + 12


def test_source_killed_before_it_sent_the_state_loses_the_session(cluster: Cluster) -> None:
    w1, w2 = two_workers(cluster, {"WORKER_TEST_MOVE_PAUSE": f"export:{PAUSE_S}"}, {})
    with cluster.client(timeout=30) as c:
        s, drain = drain_killing(cluster, c, w1)
        assert drain.result() == (1, "moved 0, failed 1, kept 0")
        with pytest.raises(SessionLost):
            next_turn(s)
        assert "session_received" not in w2.log_text() and w2.alive


def test_a_state_that_arrives_corrupt_is_refused_and_stays_on_its_source(cluster: Cluster) -> None:
    w1, w2 = two_workers(cluster, {"WORKER_TEST_CORRUPT_MOVES": "1"}, {})
    with cluster.client(timeout=30) as c:
        s, _ = conversation(c)
        cluster.wait_for_workers({"w1", "w2"})
        assert Drain(cluster, "w1").result() == (1, "moved 0, failed 1, kept 1")
        assert "checksum mismatch" in w2.log_text()
        assert len(next_turn(s)) == 6 and s.info().worker == "w1" and s.info().length == len(PROMPT) + 12


def test_broker_killed_mid_move_leaves_the_session_on_one_worker(cluster: Cluster) -> None:
    """The broker dies while the target holds the state unimported; a new broker knows no move: the source keeps the
    session, the target drops what it got (it registered with another broker meanwhile)."""
    w1, w2 = two_workers(cluster, {}, {"WORKER_TEST_MOVE_PAUSE": "import:3"})
    with cluster.client(timeout=30) as c:
        s, _ = conversation(c)
        cluster.wait_for_workers({"w1", "w2"})
        drain = Drain(cluster, "w1", timeout=2)
        wait_in_log(w2, "move_paused_for_test")
        assert cluster.broker is not None
        cluster.broker.kill()
        cluster.start_broker()
        assert drain.result()[0] == 1  # its broker is gone: no answer
        wait_in_log(w2, "moves_forgotten")
        assert len(next_turn(s)) == 6 and s.info().worker == "w1" and s.info().length == len(PROMPT) + 12
        assert "session_received" not in w2.log_text()
        cluster.wait_for_workers({"w1", "w2"})
        listed = c._call(p.Sessions(request_id="list-1"), p.SessionList, 5).sessions
        assert [(e.session_id, e.worker) for e in listed] == [(s.id, "w1")]


def broker_command(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args, "--clients", cluster.clients], capture_output=True,
                          text=True, timeout=120)


def test_broker_rebalance_and_drain_as_commands_move_sessions_and_say_what_moved(cluster: Cluster) -> None:
    """The CLI processes: `broker rebalance` evens four sessions out over two workers (2 and 2), `broker drain w1`
    moves w1's off; every conversation goes on where it went, with its whole history."""
    two_workers(cluster, {}, {})
    with cluster.client(timeout=30) as c:
        talks = [conversation(c)[0] for _ in range(4)]
        cluster.wait_for_workers({"w1", "w2"})
        rebalanced = broker_command(cluster, "rebalance")
        assert (rebalanced.returncode, rebalanced.stdout.strip()) == (0, "moved 2, failed 0, kept 0"), rebalanced.stderr
        assert sorted(s.info().worker for s in talks) == ["w1", "w1", "w2", "w2"]
        drained = broker_command(cluster, "drain", "w1")
        assert (drained.returncode, drained.stdout.strip()) == (0, "moved 2, failed 0, kept 0"), drained.stderr
        for s in talks:
            assert len(next_turn(s)) == 6 and s.info().worker == "w2" and s.info().length == len(PROMPT) + 12
