"""The daemons' command lines: clean shutdown on signals, their own exit code when they cannot start."""

from __future__ import annotations

import signal

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
