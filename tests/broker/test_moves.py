"""The broker's half of moving sessions (broker.moves through the router), without sockets: the order of a move's
messages, requests held and sent on, the route switched only after the source released the session, a dead target
giving the session back, a session two workers claim dropped on the second, rebalance's plan and the metrics."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

from broker.common import protocol as p
from broker.counters import RouterCounters
from broker.metrics import BrokerMetrics
from broker.router import Peer, Router, Send

from .test_router import C1, W1, W2, decoded, ready, running

W3 = b"w3-id"
A, B, C = "a" * 32, "b" * 32, "c" * 32


def to(sends: list[Send], identity: bytes) -> list[p.Message]:
    return [m for peer, i, m in decoded(sends) if i == identity]


def report(router: Router, worker: bytes, move: p.Move, status: str, now: float = 3.0) -> list[Send]:
    return router.worker_message(worker, p.encode(p.MoveReport(migration=move.migration, session_id=move.session_id,
                                                               status=status)), now)


def drain_w1(router: Router) -> p.Move:
    sends = router.client_message(C1, p.encode(p.DrainWorker(request_id="d1", worker="w1")), 2.5)
    (move,) = to(sends, W1)
    assert isinstance(move, p.Move) and move.session_id == A and move.target == "w2"
    return move


def test_a_move_holds_requests_relays_the_state_and_switches_only_after_the_release() -> None:
    router = running((W1, ready("w1", 2, (A,))), (W2, ready("w2", 2)))
    move = drain_w1(router)
    assert router.client_message(C1, p.encode(p.Append(request_id="r1", session_id=A, token_ids=(1,))), 2.6) == []
    state = p.MoveState(migration=move.migration, session_id=A, tokens=(1, 2), computed=2, nbytes=3, chunks=1,
                        model="m", layout="x", digest=bytes(p.DIGEST_BYTES))
    chunk = p.MoveChunk(migration=move.migration, index=0, data=b"abc")
    relayed = router.worker_message(W1, p.encode(state), 2.7) + router.worker_message(W1, p.encode(chunk), 2.7)
    assert [(s.identity, s.frames) for s in relayed] == [(W2, p.encode(state)), (W2, p.encode(chunk))]
    assert router.worker_message(W2, p.encode(chunk), 2.7) == []  # from the wrong side: dropped
    released = to(report(router, W2, move, "imported"), W1)
    assert released == [p.MoveEnd(migration=move.migration, session_id=A, outcome="release")]
    assert router.registry.worker_of(A) is router.registry.workers[W1]  # not switched before the source closed it
    out = decoded(report(router, W1, move, "released", now=3.5))
    assert router.registry.worker_of(A) is router.registry.workers[W2]
    assert (Peer.WORKER, W2, p.Append(request_id="r1", session_id=A, token_ids=(1,), route=C1)) in out
    assert (Peer.CLIENT, C1, p.MovesDone(request_id="d1", moved=1, failed=0, kept=0)) in out
    assert router.registry.workers[W1].cordoned and router.moves.stats.outcomes == {"moved": 1}
    assert router.moves.stats.pause_count == 1 and abs(router.moves.stats.pause_sum - 1.0) < 1e-9


def test_a_target_that_dies_gives_the_session_back_and_its_copy_is_dropped_should_it_return() -> None:
    router = running((W1, ready("w1", 2, (A,))), (W2, ready("w2", 2)))
    move = drain_w1(router)
    router.client_message(C1, p.encode(p.Info(request_id="r1", session_id=A)), 2.6)
    out = decoded(router.worker_message(W2, p.encode(p.Disconnect(reason="killed")), 2.8))
    assert (Peer.WORKER, W1, p.MoveEnd(migration=move.migration, session_id=A, outcome="abort")) in out
    assert (Peer.WORKER, W1, p.Info(request_id="r1", session_id=A, route=C1)) in out  # served where it is
    router.worker_message(W1, p.encode(p.Heartbeat()), 2.85)  # w1 lives on
    assert (Peer.CLIENT, C1, p.MovesDone(request_id="d1", moved=0, failed=1, kept=1)) in decoded(router.tick(2.9))
    back = decoded(router.worker_message(W2, p.encode(ready("w2", 2, (A,))), 3.0))
    assert (Peer.WORKER, W2, p.Drop(sessions=(A,))) in back
    assert router.registry.worker_of(A) is router.registry.workers[W1]


def test_a_session_two_workers_claim_stays_with_the_first_and_the_second_drops_it() -> None:
    router = running((W1, ready("w1", 2, (A,))))
    out = decoded(router.worker_message(W2, p.encode(ready("w2", 2, (A, B))), 2.0))
    assert (Peer.WORKER, W2, p.Drop(sessions=(A,))) in out
    assert router.registry.worker_of(A) is router.registry.workers[W1]
    assert router.registry.worker_of(B) is router.registry.workers[W2]


def test_a_draining_worker_that_asks_is_evacuated_and_told_when_done() -> None:
    router = running((W1, ready("w1", 4, (A, B))), (W2, ready("w2", 1)))
    out = to(router.worker_message(W1, p.encode(p.Heartbeat(draining=True, evacuate=True)), 2.5), W1)
    moves = [m for m in out if isinstance(m, p.Move)]
    assert [m.session_id for m in moves] in ([A], [B])  # w2 has room for one
    (move,) = moves
    report(router, W2, move, "imported")
    done = to(report(router, W1, move, "released"), W1)
    assert done == [p.Evacuated(moved=1, kept=1)]


def test_rebalance_moves_idle_sessions_from_the_fullest_to_the_emptiest() -> None:
    router = running((W1, ready("w1", 4, (A, B, C))), (W2, ready("w2", 4)))
    sends = router.client_message(C1, p.encode(p.Rebalance(request_id="r1")), 2.5)
    moves = [m for m in to(sends, W1) if isinstance(m, p.Move)]
    assert len(moves) == 1 and moves[0].target == "w2"  # 3 and 0 become 2 and 1


def test_drain_and_rebalance_are_for_admins_with_keys() -> None:
    from broker.router import Settings

    router = Router(Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0, authenticated=True), now=0.0)
    (out,) = decoded(router.client_message(C1, p.encode(p.Rebalance(request_id="r1")), 2.0, user="k" * 40))
    assert isinstance(out[2], p.Error) and out[2].code is p.ErrorCode.UNAUTHORIZED


def test_a_drain_runs_at_most_moves_per_worker_at_once_and_starts_the_next_as_one_ends() -> None:
    from broker.router import Settings

    router = Router(Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0, moves_per_source=2), now=0.0)
    router.worker_message(W1, p.encode(ready("w1", 4, (A, B, C))), 2.0)
    router.worker_message(W2, p.encode(ready("w2", 4)), 2.0)
    sends = router.client_message(C1, p.encode(p.DrainWorker(request_id="d1", worker="w1")), 2.5)
    first = [m for m in to(sends, W1) if isinstance(m, p.Move)]
    assert len(first) == 2 and len({m.session_id for m in first}) == 2  # two of three
    report(router, W2, first[0], "imported")
    started = [m for m in to(report(router, W1, first[0], "released"), W1) if isinstance(m, p.Move)]
    (third,) = {A, B, C} - {m.session_id for m in first}
    assert [m.session_id for m in started] == [third]  # the first's end starts the third


def test_a_move_stalled_for_30_s_is_aborted_and_the_session_serves_on_its_source() -> None:
    from broker.moves import MOVE_TIMEOUT_S

    router = running((W1, ready("w1", 2, (A,))), (W2, ready("w2", 2)))
    move = drain_w1(router)  # at 2.5; the target never reports
    assert router.client_message(C1, p.encode(p.Info(request_id="r1", session_id=A)), 2.6) == []  # held
    late = 2.5 + MOVE_TIMEOUT_S + 0.1
    for worker in (W1, W2):  # both alive all along
        router.worker_message(worker, p.encode(p.Heartbeat()), late - 0.05)
    out = decoded(router.tick(late))
    assert (Peer.WORKER, W2, p.MoveEnd(migration=move.migration, session_id=A, outcome="abort")) in out
    assert not any(i == W1 and isinstance(m, p.Info) for _, i, m in out)  # not before the target has forgotten it
    back = decoded(report(router, W2, move, "aborted", now=late + 0.01))
    assert (Peer.WORKER, W1, p.Info(request_id="r1", session_id=A, route=C1)) in back  # served where it is
    assert (Peer.CLIENT, C1, p.MovesDone(request_id="d1", moved=0, failed=1, kept=1)) in back
    assert router.registry.worker_of(A) is router.registry.workers[W1]


def test_a_release_or_abort_not_reported_on_is_sent_again_until_it_is() -> None:
    from broker.moves import MOVE_END_RESEND_S, MOVE_TIMEOUT_S

    def tick(router: Router, now: float) -> list[p.Message]:
        for worker in (W1, W2):  # both alive all along
            router.worker_message(worker, p.encode(p.Heartbeat()), now - 0.05)
        return [m for _, _, m in decoded(router.tick(now)) if isinstance(m, p.MoveEnd)]

    router = running((W1, ready("w1", 2, (A,))), (W2, ready("w2", 2)))
    move = drain_w1(router)
    router.client_message(C1, p.encode(p.Info(request_id="r1", session_id=A)), 2.6)
    report(router, W2, move, "imported", now=3.0)  # the release to w1 is lost
    release = p.MoveEnd(migration=move.migration, session_id=A, outcome="release")
    assert tick(router, 3.0 + MOVE_END_RESEND_S - 0.1) == []
    assert tick(router, 3.0 + MOVE_END_RESEND_S + 0.1) == [release]
    assert tick(router, 3.0 + 2 * MOVE_END_RESEND_S + 0.2) == [release]  # and again, until w1 reports
    out = decoded(report(router, W1, move, "released", now=14.0))
    assert (Peer.WORKER, W2, p.Info(request_id="r1", session_id=A, route=C1)) in out
    assert router.registry.worker_of(A) is router.registry.workers[W2]

    router = running((W1, ready("w1", 2, (A,))), (W2, ready("w2", 2)))
    move = drain_w1(router)
    abort = p.MoveEnd(migration=move.migration, session_id=A, outcome="abort")
    late = 2.5 + MOVE_TIMEOUT_S + 0.1
    assert tick(router, late) == [abort]  # lost too
    assert tick(router, late + MOVE_END_RESEND_S + 0.1) == [abort]
    report(router, W2, move, "aborted", now=late + MOVE_END_RESEND_S + 0.2)
    assert router.moves.moving == {} and router.registry.worker_of(A) is router.registry.workers[W1]


def test_a_drained_worker_shows_as_draining_in_status_metrics_and_readiness() -> None:
    """`broker drain` places nothing more on the worker: `broker status`, worker_draining and /readyz say so (they
    showed it as taking new sessions, free slots and all, until the worker registered anew)."""
    router = running((W1, ready("w1", 2, (A,))), (W2, ready("w2", 2)))
    move = drain_w1(router)
    report(router, W2, move, "imported")
    report(router, W1, move, "released", now=3.5)
    _, _, status = decoded(router.client_message(C1, p.encode(p.Status(request_id="s1")), 3.6))[0]
    assert isinstance(status, p.StatusReport)
    assert {w.name: w.draining for w in status.workers} == {"w1": True, "w2": False}
    metrics = BrokerMetrics(router, RouterCounters(), clock=lambda: 3.6, process=False)
    text = generate_latest(metrics.registry).decode()
    assert 'sessionserve:worker_draining{device="",model="m",worker="w1"} 1.0' in text
    assert metrics.readiness() == (True, "ready: 2 workers, 1 taking new sessions")


def test_a_move_asks_for_the_checkpoint_only_of_a_target_that_takes_one() -> None:
    """MOVE's `checkpoint` is the target's READY `checkpoints` (a worker that predates checkpoints says nothing: the
    source sends the state alone, which such a target takes); a MOVE_STATE whose checkpoint does not fit is refused."""
    for takes in (False, True):
        router = running((W1, ready("w1", 2, (A,))), (W2, dataclasses.replace(ready("w2", 2), checkpoints=takes)))
        assert drain_w1(router).checkpoint is takes
    fields = dict(migration="m", session_id=A, tokens=(1, 2, 3), computed=3, nbytes=10, chunks=1, model="m",
                  layout="x", digest=bytes(p.DIGEST_BYTES))
    state = p.MoveState(**fields, checkpoint_at=2, checkpoint_bytes=4)  # type: ignore[arg-type]
    assert p.decode(p.encode(state)) == state
    for at, size in ((4, 4), (2, 0), (0, 4), (2, 11)):
        with pytest.raises(p.ProtocolError, match="checkpoint"):
            p.MoveState(**fields, checkpoint_at=at, checkpoint_bytes=size)  # type: ignore[arg-type]
