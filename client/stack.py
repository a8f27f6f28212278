"""Start the daemons on this host: a broker and workers as child processes on loopback, for the tests, the
benchmarks and the demo.

    with LocalStack() as stack:
        stack.start_broker()
        stack.start_worker("w1", model="random:tiny", device="cpu")
        stack.wait_for_workers({"w1"})
        with Client(stack.clients) as client:
            ...

Each daemon is `python -m broker.cli start ...` or `python -m worker.cli start ...` (this module imports
neither), on free 127.0.0.1 ports, its stdout and stderr in a log file of `log_dir`. By default the broker
runs with fast heartbeats (`FAST`), so that a lost worker is noticed within half a second; `heartbeats=None`
leaves the daemons' own settings. `stop()` (and leaving the `with` block) sends the workers SIGTERM first (a
worker drains and says DISCONNECT), then the broker, and kills whatever has not exited in time; `close()`
does the same with a short wait (tests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from client.errors import ClientError
from client.sync import Client

ROOT = Path(__file__).resolve().parents[1]  # holds broker/ and worker/: the children import from here
PYTHON: tuple[str, ...] = (sys.executable,)  # what runs `-m MODULE`; e.g. (sys.executable, "-m", "cProfile", "-o", F)
STOP_TIMEOUT_S = 30.0  # for a daemon to exit after SIGTERM (a worker drains its generations first)
POLL_S = 0.05  # between two looks at the broker's worker list
LOG_TAIL_CHARS = 3000  # of a dead daemon's log, in the error that reports it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class StackError(RuntimeError):
    """A daemon exited, or the workers did not register in time. The message says which and where the logs are."""


@dataclass(frozen=True)
class Heartbeats:
    """How fast the daemons notice each other. The broker gets the first three; the worker takes the broker's
    heartbeat from its WELCOME, and retries a lost broker at most every `reconnect_max_ms`."""

    heartbeat_ms: int = 100
    liveness: int = 3  # heartbeats a worker may miss before the broker declares it lost
    recovery_ms: int = 1000  # a new broker holds requests for unknown sessions this long (workers re-register)
    reconnect_max_ms: int = 200

    @property
    def loss_limit_s(self) -> float:
        """How soon the broker must declare a silent worker lost: (liveness + 1) heartbeats."""
        return (self.liveness + 1) * self.heartbeat_ms / 1000

    def broker_args(self) -> list[str]:
        return ["--heartbeat-ms", str(self.heartbeat_ms), "--liveness", str(self.liveness),
                "--recovery-ms", str(self.recovery_ms)]

    def worker_args(self) -> list[str]:
        return ["--reconnect-max-ms", str(self.reconnect_max_ms)]


FAST = Heartbeats()


class Daemon:
    """One daemon process, `[*python, "-m", module, "start", *args]`, its output appended to `log`."""

    def __init__(self, module: str, args: Sequence[str], log: Path, *, python: Sequence[str] = PYTHON,
                 env: Mapping[str, str] | None = None) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            [*python, "-m", module, "start", *args], env=dict(env) if env is not None else child_env(),
            stdout=self._log_file, stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """kill -9, and wait for it."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log_file.close()

    def terminate(self, timeout: float = 10) -> int:
        """SIGTERM; its exit code. subprocess.TimeoutExpired (after a kill -9) when it takes longer than `timeout`."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then kill -9 after `timeout`: its exit code, or None when it had to be killed."""
        try:
            code: int | None = self.terminate(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self._log_file.close()
        return code

    def close(self) -> None:
        """Stop it whatever state it is in (5 s for SIGTERM)."""
        self.stop(timeout=5)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def child_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a daemon: the packages importable from ROOT, output unbuffered."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(overrides or {})}


class LocalStack:
    """A broker and any number of workers on this host; `stop()` ends them all whatever state they are in.

    `log_dir`: where the daemons' logs go (default: a new temporary folder, kept). `heartbeats`: FAST, or
    None for the daemons' own settings. `log_level`: the daemons' --log-level (None: theirs). `env`: set in
    the daemons' environment, over this process's.
    """

    def __init__(self, log_dir: Path | None = None, *, heartbeats: Heartbeats | None = FAST,
                 log_level: str | None = None, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="sessionserve-"))
        self.heartbeats = heartbeats
        self.log_level = log_level
        self.env = child_env(env)
        self.client_port = free_port()
        self.worker_port = free_port()
        self.clients = f"tcp://127.0.0.1:{self.client_port}"  # the broker's client address
        self.workers_address = f"tcp://127.0.0.1:{self.worker_port}"  # the broker's worker address
        self.broker: Daemon | None = None
        self.workers: dict[str, Daemon] = {}
        self._broker_starts = 0

    def start_broker(self, extra: Sequence[str] = (), *, python: Sequence[str] = PYTHON) -> Daemon:
        """A broker on this stack's two addresses (a running one is stopped first: a restart)."""
        if self.broker is not None:
            self.broker.close()
        self._broker_starts += 1
        args = ["--clients", self.clients, "--workers", self.workers_address,
                *(self.heartbeats.broker_args() if self.heartbeats else []), *self._log_args(), *extra]
        self.broker = Daemon("broker.cli", args, self.log_dir / f"broker-{self._broker_starts}.log", python=python,
                             env=self.env)
        return self.broker

    def start_worker(self, name: str, *, model: str | None = None, device: str | None = None,
                     max_sessions: int | None = None, max_context: int | None = None, extra: Sequence[str] = (),
                     python: Sequence[str] = PYTHON) -> Daemon:
        """A worker named `name` for this stack's broker. None: the worker's default (`--model`: the bundled one)."""
        options = {"--model": model, "--device": device, "--max-sessions": max_sessions, "--max-context": max_context}
        args = ["--broker", self.workers_address, "--name", name,
                *(word for flag, value in options.items() if value is not None for word in (flag, str(value))),
                *(self.heartbeats.worker_args() if self.heartbeats else []), *self._log_args(), *extra]
        daemon = Daemon("worker.cli", args, self.log_dir / f"worker-{name}.log", python=python, env=self.env)
        self.workers[name] = daemon
        return daemon

    def client(self, timeout: float = 20.0, *, broker_key: str | os.PathLike[str] | None = None,
               key: str | os.PathLike[str] | None = None) -> Client:
        """A Client of this stack's broker (`broker_key`, `key`: for a broker started with --keys)."""
        return Client(self.clients, timeout=timeout, broker_key=broker_key, key=key)

    def wait_for_workers(self, names: Collection[str], timeout: float = 60.0, *,
                         broker_key: str | os.PathLike[str] | None = None,
                         key: str | os.PathLike[str] | None = None) -> None:
        """Until the broker lists exactly these workers. StackError when one of them exited, or at the timeout."""
        wanted = set(names)
        deadline = time.monotonic() + timeout
        seen: set[str] = set()
        with self.client(timeout=2.0, broker_key=broker_key, key=key) as c:
            while True:
                try:
                    seen = {w.name for w in c.status()}
                except ClientError:
                    seen = set()  # the broker is not up yet
                if seen == wanted:
                    return
                self._check_started(wanted)
                if time.monotonic() > deadline:
                    raise StackError(f"workers {sorted(wanted)} not registered within {timeout:g} s "
                                     f"(seen {sorted(seen)}; logs in {self.log_dir})")
                time.sleep(POLL_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, int | None]:
        """Stop every daemon, the workers first: each one's exit code by name ("broker" for the broker), None
        for one that had to be killed."""
        codes = {name: daemon.stop(timeout) for name, daemon in self.workers.items()}
        if self.broker is not None:
            codes["broker"] = self.broker.stop(timeout)
        return codes

    def close(self) -> None:
        """Stop every daemon whatever state it is in (5 s each for SIGTERM)."""
        self.stop(timeout=5)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def _log_args(self) -> list[str]:
        return ["--log-level", self.log_level] if self.log_level else []

    def _check_started(self, names: set[str]) -> None:
        for name in sorted(names):
            daemon = self.workers.get(name)
            if daemon is not None and not daemon.alive:
                raise StackError(f"worker {name} exited with code {daemon.proc.returncode} (log {daemon.log}):\n"
                                 f"{daemon.log_text()[-LOG_TAIL_CHARS:]}")
        if self.broker is not None and not self.broker.alive:
            raise StackError(f"the broker exited with code {self.broker.proc.returncode} (log {self.broker.log}):\n"
                             f"{self.broker.log_text()[-LOG_TAIL_CHARS:]}")
