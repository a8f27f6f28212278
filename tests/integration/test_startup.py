"""Starting the daemons: an address that is not tcp://HOST:PORT is refused before anything loads (exit code 2, a
message that says what was meant); the worker sets torch's threads (--threads, WORKER_THREADS, default its cores)
and says so while no broker answers it."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from broker import cli as broker_cli
from client.stack import child_env, free_address
from worker import cli as worker_cli

from .cluster import TEST_ENV, Daemon

TINY = ["--model", "random:tiny", "--device", "cpu"]


def wait_for_line(daemon: Daemon, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while text not in daemon.log_text():
        assert daemon.alive, daemon.log_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{daemon.log_text()[-3000:]}"
        time.sleep(0.1)
    return daemon.log_text()


def start_help(parser: argparse.ArgumentParser) -> str:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return str(sub.choices["start"].format_help())


@pytest.mark.parametrize(
    ("module", "args", "env", "complaint"),
    [
        ("worker.cli", ["--broker", "localhost:15555", *TINY], {}, "argument --broker: expected tcp://HOST:PORT"),
        ("worker.cli", TINY, {"WORKER_BROKER": "broker.internal:5556"}, "did you mean tcp://broker.internal:5556?"),
        ("worker.cli", ["--broker", "tcp://127.0.0.1:99999", *TINY], {}, "(PORT 1-65535)"),
        ("broker.cli", ["--clients", "127.0.0.1:5555"], {}, "did you mean tcp://127.0.0.1:5555?"),
        ("broker.cli", [], {"BROKER_WORKERS": "tcp//127.0.0.1:5556"}, "argument --workers: expected tcp://HOST:PORT"),
    ],
)
def test_an_address_that_is_not_tcp_host_port_exits_2_before_anything_loads(
    tmp_path: Path, module: str, args: list[str], env: dict[str, str], complaint: str
) -> None:
    daemon = Daemon(module, args, tmp_path / "daemon.log", env=child_env({**TEST_ENV, **env}))
    try:
        assert daemon.proc.wait(timeout=30) == 2
    finally:
        daemon.close()
    text = daemon.log_text()
    assert complaint in text
    assert "Traceback" not in text and "engine_ready" not in text  # refused before the model loads


def test_a_worker_with_no_broker_says_it_is_waiting_and_runs_the_threads_it_was_given(tmp_path: Path) -> None:
    worker = Daemon("worker.cli", ["--broker", free_address(), "--name", "lonely", "--threads", "1", *TINY],
                    tmp_path / "worker.log", env=child_env({**TEST_ENV, "WORKER_THREADS": "2"}))  # the flag wins
    try:
        text = wait_for_line(worker, '"event": "waiting_for_broker"', timeout=60)
    finally:
        worker.close()
    assert '"threads": 1' in text and '"waited_s": 5.0' in text
    assert "is this its worker address (broker start --workers)?" in text


def test_the_worker_s_threads_default_to_the_cores_it_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_THREADS", raising=False)
    assert worker_cli.parser().parse_args(["start"]).threads == len(os.sched_getaffinity(0))
    monkeypatch.setenv("WORKER_THREADS", "3")
    assert worker_cli.parser().parse_args(["start"]).threads == 3
    assert worker_cli.parser().parse_args(["start", "--threads", "1"]).threads == 1


def test_the_start_help_shows_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_DRAIN_TIMEOUT", raising=False)
    worker_help = " ".join(start_help(worker_cli.parser()).split())
    assert "after SIGTERM [env WORKER_DRAIN_TIMEOUT] (default 60.0)" in worker_help
    assert "[env WORKER_THREADS] (default: the cores this process may run on, now" in worker_help
    assert "(default tcp://127.0.0.1:5555)" in " ".join(start_help(broker_cli.parser()).split())
