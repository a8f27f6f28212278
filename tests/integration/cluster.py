"""Start the real `broker` and `worker` daemons as processes on 127.0.0.1 (client/stack.py), and always clean them up.

The tests' settings: fast heartbeats, debug logs, one torch thread per daemon (two cores are shared by every
daemon and the test itself), and random:tiny CPU workers of 4 sessions unless a test asks otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from client import Client, Session, SessionLost, Stream
from client.stack import PYTHON, Heartbeats, LocalStack, child_env, free_port
from client.stack import Daemon as StackDaemon

__all__ = ["ROOT", "Cluster", "Daemon", "Measure", "free_port", "one_session_on_each", "seconds_until_lost"]

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_MS = 100
LIVENESS = 3
TEST_ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WORKER_THREADS": os.environ.get("WORKER_THREADS", "1")}
Measure = Callable[[str, float], None]  # the `measure` fixture (conftest.py): records a measured value


def one_session_on_each(client: Client, prompt: list[int]) -> tuple[Session, Session]:
    """Two sessions, each holding `prompt`, which the broker spreads over two workers: (on w1, on w2)."""
    a, b = client.session(), client.session()
    on_w1, on_w2 = (a, b) if a.worker == "w1" else (b, a)
    assert (on_w1.worker, on_w2.worker) == ("w1", "w2")
    on_w1.append(token_ids=prompt)
    on_w2.append(token_ids=prompt)
    return on_w1, on_w2


def seconds_until_lost(stream: Stream, since: float) -> float:
    """Read `stream` to its end, which must be SessionLost: the seconds from `since` (monotonic) until then."""
    with pytest.raises(SessionLost):
        for _ in stream:
            pass
    return time.monotonic() - since


class Daemon(StackDaemon):
    """One daemon process with the tests' environment, its log in a file (read it when a test fails)."""

    def __init__(self, module: str, args: Sequence[str], log: Path, *, python: Sequence[str] = PYTHON,
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(module, args, log, python=python, env=env if env is not None else child_env(TEST_ENV))


class Cluster(LocalStack):
    """A broker and any number of workers; `close()` stops them all whatever state they are in."""

    def __init__(self, tmp: Path, heartbeat_ms: int = HEARTBEAT_MS, liveness: int = LIVENESS,
                 recovery_ms: int = 1000) -> None:
        super().__init__(tmp, heartbeats=Heartbeats(heartbeat_ms, liveness, recovery_ms), log_level="debug",
                         env=TEST_ENV)
        self.tmp = tmp
        self.heartbeat_ms = heartbeat_ms
        self.liveness = liveness
        self.recovery_ms = recovery_ms

    def start_worker(self, name: str, *, model: str | None = "random:tiny", device: str | None = "cpu",
                     max_sessions: int | None = 4, max_context: int | None = 2048, extra: Sequence[str] = (),
                     python: Sequence[str] = PYTHON) -> StackDaemon:
        """A random:tiny CPU worker of 4 sessions unless told otherwise (model=None: the bundled model)."""
        return super().start_worker(name, model=model, device=device, max_sessions=max_sessions,
                                    max_context=max_context, extra=extra, python=python)

    @property
    def loss_limit_s(self) -> float:
        """How soon the broker must declare a silent worker lost: (liveness + 1) heartbeats."""
        return (self.liveness + 1) * self.heartbeat_ms / 1000

    def start_two_workers(self, **worker: Any) -> tuple[StackDaemon, StackDaemon]:
        """A broker and workers w1 and w2 (same `start_worker` options), both registered."""
        self.start_broker()
        pair = (self.start_worker("w1", **worker), self.start_worker("w2", **worker))
        self.wait_for_workers({"w1", "w2"})
        return pair
