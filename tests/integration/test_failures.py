"""The failures a deployment sees: a worker killed, the broker killed and restarted, a worker drained."""

from __future__ import annotations

import time

import pytest

from client import SessionLost, WorkerDraining

from .cluster import Cluster, one_session_on_each, seconds_until_lost

PROMPT = [7, 8, 9, 10]
LONG = dict(max_tokens=3000, ignore_eos=True)  # long enough to be running when something is killed


def test_killed_worker_fails_its_stream_with_session_lost_and_the_other_worker_carries_on(cluster: Cluster) -> None:
    cluster.start_two_workers(max_sessions=2, max_context=4096)
    with cluster.client() as c:
        doomed, survivor = one_session_on_each(c, PROMPT)
        stream = doomed.generate(**LONG, stream=True)  # type: ignore[call-overload]
        assert next(stream).finish_reason is None

        cluster.workers["w1"].kill()
        elapsed = seconds_until_lost(stream, since=time.monotonic())
        limit = cluster.loss_limit_s
        assert elapsed <= limit + 0.2, f"SessionLost after {elapsed:.3f} s, limit {limit} s"  # 0.2 s: scheduling

        assert len(survivor.generate(max_tokens=8, ignore_eos=True).token_ids) == 8
        with pytest.raises(SessionLost):  # later requests: lost, not "not found"
            doomed.generate(max_tokens=2)
        assert [w.name for w in c.status()] == ["w2"]
        doomed.close()  # closing a lost session is not an error
        survivor.close()


@pytest.mark.parametrize("cluster", [{"recovery_ms": 3000}], indirect=True)  # room for a slow re-registration
def test_broker_restart_keeps_sessions(cluster: Cluster) -> None:
    cluster.start_broker()
    cluster.start_worker("w1", max_sessions=4)
    cluster.wait_for_workers({"w1"})
    with cluster.client() as c:
        s = c.session()
        s.append(token_ids=PROMPT)
        before = s.generate(max_tokens=6, ignore_eos=True)
        with s.fork() as twin:
            expected = twin.generate(max_tokens=6, ignore_eos=True)

        assert cluster.broker is not None
        cluster.broker.kill()
        cluster.start_broker()  # same addresses, new broker id, empty tables

        again = s.generate(max_tokens=6, ignore_eos=True)  # held until w1 re-registers with its sessions
        assert again == expected
        assert again.session_length == before.session_length + 6
        status = c.status()
        assert [(w.name, w.sessions) for w in status] == [("w1", 1)]  # nothing new was created
        s.close()


@pytest.mark.parametrize("cluster", [{"recovery_ms": 3000}], indirect=True)
def test_a_stream_survives_a_broker_restart_in_the_middle(cluster: Cluster) -> None:
    cluster.start_broker()
    cluster.start_worker("w1", max_sessions=2, max_context=4096)
    cluster.wait_for_workers({"w1"})
    with cluster.client() as c:
        s = c.session()
        s.append(token_ids=PROMPT)
        stream = s.generate(max_tokens=1500, ignore_eos=True, stream=True)
        tokens: list[int] = []
        for i, chunk in enumerate(stream):
            tokens += chunk.token_ids
            if i == 3:
                assert cluster.broker is not None
                cluster.broker.kill()
                cluster.start_broker()
        # Chunks sent while no broker was up are missing; the final answer carries them and the client fills in.
        assert stream.result is not None and stream.result.finish_reason == "length"
        assert tokens == stream.result.token_ids and len(tokens) == 1500
        assert s.info().length == len(PROMPT) + 1500


def test_sigterm_drains_the_worker(cluster: Cluster) -> None:
    cluster.start_broker()
    worker = cluster.start_worker("w1", max_sessions=4, max_context=4096)
    cluster.wait_for_workers({"w1"})
    with cluster.client() as c:
        s = c.session()
        s.append(token_ids=PROMPT)
        stream = s.generate(max_tokens=400, ignore_eos=True, stream=True)
        first = next(stream)
        assert first.finish_reason is None
        worker.proc.terminate()  # SIGTERM
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                c.session().close()
            except WorkerDraining:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the draining worker kept taking sessions")
        tokens = first.token_ids + [t for chunk in stream for t in chunk.token_ids]
        assert stream.result is not None and stream.result.finish_reason == "length"
        assert tokens == stream.result.token_ids and len(tokens) == 400  # the in-flight generation finished
        assert worker.proc.wait(timeout=10) == 0
        with pytest.raises(SessionLost):
            s.generate(max_tokens=2)
