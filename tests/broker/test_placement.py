"""Placement and the registry's bookkeeping, with exact values."""

from __future__ import annotations

import pytest

from broker.common.protocol import ErrorCode, Ready
from broker.liveness import Liveness
from broker.placement import NoPlacement, place
from broker.registry import Gone, Registry, WorkerRecord

A = "a" * 32
B = "b" * 32
C = "c" * 32


def worker(name: str, capacity: int = 4, sessions: int = 0, pending: int = 0, model: str = "m",
           draining: bool = False) -> WorkerRecord:
    record = WorkerRecord(name.encode(), name, model, capacity, capacity, 64, draining=draining, pending=pending)
    record.sessions = {f"{name}{i}" for i in range(sessions)}
    return record


def test_the_worker_with_most_free_slots_wins_and_pending_creates_count() -> None:
    assert place([worker("w1", sessions=1), worker("w2", sessions=2)], None).name == "w1"
    assert place([worker("w1", sessions=1, pending=2), worker("w2", sessions=2)], None).name == "w2"
    assert place([worker("w1", capacity=8, sessions=4), worker("w2", capacity=2)], None).name == "w1"


def test_only_workers_serving_the_model_and_not_draining_are_candidates() -> None:
    workers = [worker("w1", model="Small"), worker("w2", model="big", sessions=3), worker("w3", model="small",
                                                                                          draining=True)]
    assert place(workers, "big").name == "w2"
    assert place(workers, "SMALL").name == "w1"
    with pytest.raises(NoPlacement) as e:
        place(workers, "huge")
    assert e.value.code is ErrorCode.MODEL_NOT_FOUND
    with pytest.raises(NoPlacement) as e:
        place([worker("w3", draining=True)], None)
    assert e.value.code is ErrorCode.WORKER_DRAINING
    with pytest.raises(NoPlacement) as e:
        place([], None)
    assert e.value.code is ErrorCode.MODEL_NOT_FOUND


def test_a_full_system_is_capacity_exhausted() -> None:
    with pytest.raises(NoPlacement) as e:
        place([worker("w1", capacity=2, sessions=2), worker("w2", capacity=2, sessions=1, pending=1)], None)
    assert e.value.code is ErrorCode.CAPACITY_EXHAUSTED
    assert "4 session slots" in e.value.message


def ready(name: str, sessions: tuple[str, ...] = (), capacity: int = 4) -> Ready:
    return Ready(name=name, model="m", capacity=capacity, free_slots=capacity - len(sessions), max_context=64,
                 sessions=sessions)


def test_registry_tracks_sessions_and_remembers_lost_ones() -> None:
    reg = Registry()
    reg.register(b"w1", ready("w1", (A, B)))
    reg.register(b"w2", ready("w2"))
    assert reg.worker_of(A) is reg.workers[b"w1"] and reg.session_count() == 2
    assert reg.add_session(b"w2", C)
    assert not reg.add_session(b"w2", A)  # held by w1: the claim is refused
    reg.drop_session(B)
    assert reg.worker_of(B) is None and reg.workers[b"w1"].sessions == {A}
    removed = reg.remove(b"w1")
    assert removed is not None and removed.name == "w1"
    assert reg.worker_of(A) is None and reg.gone(A) is Gone.LOST and reg.gone(B) is None
    reg.register(b"w3", ready("w3", (A,)))  # a worker that comes back with it (a network blip) un-loses it
    assert reg.gone(A) is None and reg.worker_of(A) is reg.workers[b"w3"]


def test_registering_again_replaces_the_session_list() -> None:
    reg = Registry()
    reg.register(b"w1", ready("w1", (A, B)))
    record = reg.register(b"w1", ready("w1", (B, C), capacity=8))
    assert record.sessions == {B, C} and record.capacity == 8 and reg.worker_of(A) is None
    assert record.free == 6


def test_liveness_expires_silent_peers_and_beats_once_per_interval() -> None:
    live = Liveness(interval_s=0.25, liveness=3, now=0.0)  # binary fractions: exact arithmetic
    live.seen(b"w1", 0.0)
    live.seen(b"w2", 0.5)
    assert live.expired(0.5) == []
    assert live.expired(0.75) == [b"w1"]
    assert live.expired(1.0) == []
    assert live.expired(1.25) == [b"w2"]
    assert live.expired(9.0) == []
    assert [live.heartbeat_due(t) for t in (0.125, 0.25, 0.375, 0.5)] == [False, True, False, True]
    assert live.heartbeat_due(5.0) and not live.heartbeat_due(5.125)  # missed beats are skipped, not burst
    assert live.next_heartbeat == 5.25
