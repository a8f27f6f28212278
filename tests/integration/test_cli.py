"""The daemons' command lines: clean shutdown on signals, their own exit code when they cannot start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .cluster import Cluster, Daemon


def test_broker_stops_cleanly_on_sigterm_and_sigint(cluster: Cluster) -> None:
    broker = cluster.start_broker()
    cluster.start_worker("w1")
    cluster.wait_for_workers({"w1"})
    broker.proc.send_signal(signal.SIGINT)
    assert broker.proc.wait(timeout=10) == 0
    cluster.start_broker()  # the same addresses are free again
    cluster.wait_for_workers({"w1"})  # and the worker finds the new broker
    assert cluster.broker is not None and cluster.broker.terminate() == 0
    assert '"event": "broker_stopped"' in cluster.broker.log_text()


def test_a_broker_that_cannot_bind_exits_with_code_3(cluster: Cluster) -> None:
    cluster.start_broker()
    with cluster.client() as c:
        assert c.status() == []  # the first broker is up and holds both addresses
    second = Daemon("broker.cli", ["--clients", cluster.clients, "--workers", cluster.workers_address],
                    cluster.tmp / "second.log")
    try:
        assert second.proc.wait(timeout=20) == 3
        assert "broker_start_failed" in second.log_text()
    finally:
        second.close()


def test_a_worker_that_cannot_load_its_model_exits_with_code_3(cluster: Cluster) -> None:
    worker = cluster.start_worker("bad", model="/no/such/model.gguf")
    assert worker.proc.wait(timeout=60) == 3
    assert "worker_start_failed" in worker.log_text()


def test_a_flag_s_environment_variable_is_checked_as_the_flag_is(tmp_path: Path) -> None:
    """Exit 2 (a bad argument: systemd's units do not restart on it) naming the flag, before anything starts."""
    cases = [("broker.cli", {"BROKER_HEARTBEAT_MS": "0"}, "argument --heartbeat-ms: must be >= 1"),
             ("broker.cli", {"BROKER_LOG_LEVEL": "loud"}, "argument --log-level: expected one of"),
             ("broker.cli", {"BROKER_MIN_WORKERS": "-1"}, "argument --min-workers: must be >= 0"),
             ("worker.cli", {"WORKER_SESSION_IDLE_TIMEOUT": "abc"}, "argument --session-idle-timeout"),
             ("worker.cli", {"WORKER_THREADS": "0"}, "argument --threads: must be >= 1"),
             ("client.gateway.cli", {"GATEWAY_TIMEOUT": "soon"}, "argument --timeout"),
             ("client.gateway.cli", {"GATEWAY_BROKER": "127.0.0.1:5555"}, "did you mean tcp://127.0.0.1:5555?")]
    for module, env, named in cases:
        out = subprocess.run([sys.executable, "-m", module, "start"], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert (out.returncode, named in out.stderr) == (2, True), (module, env, out.stderr[-500:])
