"""Start the real `broker` and `worker` daemons as processes on 127.0.0.1, and always clean them up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client import Client, Session, SessionLost, Stream

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_MS = 100
LIVENESS = 3


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


class Daemon:
    """One daemon process, its log in a file (read it when a test fails)."""

    def __init__(self, module: str, args: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.setdefault("OMP_NUM_THREADS", "1")  # two cores shared by every daemon and the test itself
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "start", *args], cwd=ROOT, env=env,
            stdout=self._log_file, stderr=subprocess.STDOUT,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """kill -9."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log_file.close()

    def terminate(self, timeout: float = 10) -> int:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def close(self) -> None:
        try:
            if self.alive:
                self.terminate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.alive:
                self.kill()
            self._log_file.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class Cluster:
    """A broker and any number of workers; `close()` stops them all whatever state they are in."""

    def __init__(self, tmp: Path, heartbeat_ms: int = HEARTBEAT_MS, liveness: int = LIVENESS,
                 recovery_ms: int = 1000) -> None:
        self.tmp = tmp
        self.heartbeat_ms = heartbeat_ms
        self.liveness = liveness
        self.recovery_ms = recovery_ms
        self.client_port = free_port()
        self.worker_port = free_port()
        self.clients = f"tcp://127.0.0.1:{self.client_port}"
        self.workers_address = f"tcp://127.0.0.1:{self.worker_port}"
        self.broker: Daemon | None = None
        self.workers: dict[str, Daemon] = {}
        self._broker_starts = 0

    def start_broker(self, extra: list[str] | None = None) -> Daemon:
        if self.broker is not None:
            self.broker.close()
        self._broker_starts += 1
        self.broker = Daemon(
            "broker.cli",
            ["--clients", self.clients, "--workers", self.workers_address, "--heartbeat-ms", str(self.heartbeat_ms),
             "--liveness", str(self.liveness), "--recovery-ms", str(self.recovery_ms), "--log-level", "debug",
             *(extra or [])],
            self.tmp / f"broker-{self._broker_starts}.log",
        )
        return self.broker

    def start_worker(self, name: str, model: str | None = "random:tiny", max_sessions: int = 4,
                     max_context: int = 2048, extra: list[str] | None = None) -> Daemon:
        daemon = Daemon(
            "worker.cli",
            ["--broker", self.workers_address, *(["--model", model] if model else []), "--device", "cpu", "--name", name,
             "--max-sessions", str(max_sessions), "--max-context", str(max_context), "--reconnect-max-ms", "200",
             *(extra or [])],
            self.tmp / f"worker-{name}.log",
        )
        self.workers[name] = daemon
        return daemon

    @property
    def loss_limit_s(self) -> float:
        """How soon the broker must declare a silent worker lost: (liveness + 1) heartbeats."""
        return (self.liveness + 1) * self.heartbeat_ms / 1000

    def start_two_workers(self, **worker: Any) -> tuple[Daemon, Daemon]:
        """A broker and workers w1 and w2 (same `start_worker` options), both registered."""
        self.start_broker()
        pair = (self.start_worker("w1", **worker), self.start_worker("w2", **worker))
        self.wait_for_workers({"w1", "w2"})
        return pair

    def client(self, timeout: float = 20.0, **keys: Any) -> Client:
        """`keys`: broker_key=..., key=... for a broker started with --keys."""
        return Client(self.clients, timeout=timeout, **keys)

    def wait_for_workers(self, names: set[str], timeout: float = 60.0, **keys: Any) -> None:
        """Until the broker lists exactly these workers."""
        deadline = time.monotonic() + timeout
        with self.client(timeout=2.0, **keys) as c:
            while True:
                try:
                    seen = {w.name for w in c.status()}
                except Exception:
                    seen = set()
                if seen == names:
                    return
                for name in names:
                    daemon = self.workers.get(name)
                    if daemon is not None and not daemon.alive:
                        raise RuntimeError(f"worker {name} exited:\n{daemon.log_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {names} not registered (seen {seen})")
                time.sleep(0.05)

    def close(self) -> None:
        for daemon in self.workers.values():
            daemon.close()
        if self.broker is not None:
            self.broker.close()
