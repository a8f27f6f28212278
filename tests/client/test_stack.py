"""client/stack.py: the daemons it starts, the settings it gives them, and how it reports one that did not start."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.stack import FAST, Heartbeats, LocalStack, StackError


def test_fast_heartbeats_are_the_flags_each_daemon_takes() -> None:
    assert FAST.broker_args() == ["--heartbeat-ms", "100", "--liveness", "3", "--recovery-ms", "1000"]
    assert FAST.worker_args() == ["--reconnect-max-ms", "200"]
    assert FAST.loss_limit_s == 0.4
    assert Heartbeats(heartbeat_ms=250, liveness=2).loss_limit_s == 0.75


def test_a_worker_that_exits_is_reported_with_its_log_and_every_daemon_is_stopped(tmp_path: Path) -> None:
    with LocalStack(tmp_path, env={"OMP_NUM_THREADS": "1", "WORKER_THREADS": "1"}) as stack:
        broker = stack.start_broker()
        stack.start_worker("bad", model="/no/such/model.gguf", device="cpu")
        with pytest.raises(StackError, match=rf"^worker bad exited with code 3 \(log {tmp_path}/worker-bad.log\):\n"):
            stack.wait_for_workers({"bad"})
        assert stack.clients.startswith("tcp://127.0.0.1:") and stack.clients != stack.workers_address
        assert stack.stop() == {"bad": 3, "broker": 0}
    assert not broker.alive and '"event": "broker_stopped"' in broker.log_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broker-1.log", "worker-bad.log"]
