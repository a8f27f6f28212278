"""The broker's logic without sockets: frames in, frames out, time passed in explicitly."""

from __future__ import annotations

import msgpack

from broker.common import protocol as p
from broker.router import Failure, Peer, Router, Send, Settings

SETTINGS = Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0)
W1, W2 = b"w1-id", b"w2-id"
C1, C2 = b"client-1", b"client-2"


def decoded(sends: list[Send]) -> list[tuple[Peer, bytes, p.Message]]:
    return [(s.peer, s.identity, p.decode(s.frames)) for s in sends]


def one(sends: list[Send]) -> tuple[Peer, bytes, p.Message]:
    out = decoded(sends)
    assert len(out) == 1, out
    return out[0]


def ready(name: str, capacity: int = 2, sessions: tuple[str, ...] = ()) -> p.Ready:
    return p.Ready(name=name, model="m", capacity=capacity, free_slots=capacity - len(sessions), max_context=64,
                   sessions=sessions)


def running(*workers: tuple[bytes, p.Ready]) -> Router:
    """A router past its recovery window with these workers registered."""
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    for identity, r in workers:
        router.worker_message(identity, p.encode(r), 2.0)
    return router


def create(router: Router, client: bytes, rid: str, now: float = 2.0) -> tuple[Peer, bytes, p.Message]:
    return one(router.client_message(client, p.encode(p.CreateSession(request_id=rid)), now))


def created(router: Router, worker: bytes, request: p.CreateSession, now: float = 2.0) -> list[Send]:
    assert request.session_id is not None
    answer = p.Created(request_id=request.request_id, session_id=request.session_id, model="m", worker="w",
                       max_context=64, route=request.route)
    return router.worker_message(worker, p.encode(answer), now)


def test_registration_is_welcomed_with_the_liveness_settings() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    assert one(router.worker_message(W1, p.encode(ready("w1")), 0.1)) == (
        Peer.WORKER, W1, p.Welcome(broker_id="b1", heartbeat_ms=250, liveness=3)
    )


def test_create_is_placed_forwarded_with_route_and_session_id_and_the_answer_comes_back() -> None:
    router = running((W1, ready("w1")), (W2, ready("w2", sessions=("a" * 32,))))
    peer, identity, request = create(router, C1, "r1")
    assert (peer, identity) == (Peer.WORKER, W1)  # the emptier worker
    assert isinstance(request, p.CreateSession) and request.route == C1 and request.session_id is not None
    assert router.registry.workers[W1].pending == 1
    answer = created(router, W1, request)
    assert answer[0].peer is Peer.CLIENT and answer[0].identity == C1
    assert isinstance(p.decode(answer[0].frames), p.Created)
    assert router.registry.worker_of(request.session_id) is router.registry.workers[W1]
    assert router.registry.workers[W1].pending == 0 and not router.inflight


def test_session_requests_go_to_the_session_s_worker() -> None:
    sid = "b" * 32
    router = running((W1, ready("w1")), (W2, ready("w2", sessions=(sid,))))
    gen = p.Generate(request_id="g1", session_id=sid, stream=True)
    peer, identity, forwarded = one(router.client_message(C1, p.encode(gen), 2.0))
    assert (peer, identity, forwarded) == (Peer.WORKER, W2, gen.routed(C1))
    chunk = p.Chunks(chunks=(p.StreamChunk("g1", (1,), "a"),), route=C1)
    assert router.worker_message(W2, p.encode(chunk), 2.1)[0].frames == p.encode(chunk)  # forwarded unchanged
    assert (C1, "g1") in router.inflight
    done = p.Generated(request_id="g1", session_id=sid, token_ids=(1, 2), text="ab", finish_reason="length",
                       length=9, route=C1)
    router.worker_message(W2, p.encode(done), 2.2)
    assert not router.inflight


def test_pending_creates_count_against_capacity() -> None:
    router = running((W1, ready("w1", capacity=1)))
    create(router, C1, "r1")
    peer, identity, error = create(router, C2, "r2")
    assert (peer, identity) == (Peer.CLIENT, C2)
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.CAPACITY_EXHAUSTED and error.request_id == "r2"


def test_a_session_whose_close_is_on_its_way_frees_its_slot_for_the_next_create() -> None:
    """The worker handles the close before a create sent after it, so the create may take the closing session's slot."""
    old, other = "a" * 32, "b" * 32
    router = running((W1, ready("w1", capacity=2, sessions=(old, other))))
    assert isinstance(create(router, C1, "r0")[2], p.Error)  # full
    close = p.Close(request_id="x1", session_id=old)
    assert one(router.client_message(C1, p.encode(close), 2.0)) == (Peer.WORKER, W1, close.routed(C1))
    assert router.registry.workers[W1].free == 1
    peer, identity, request = create(router, C1, "r1")  # sent before the Closed came back
    assert (peer, identity) == (Peer.WORKER, W1) and isinstance(request, p.CreateSession)
    refused = create(router, C2, "r2")[2]  # the one slot is taken now
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.CAPACITY_EXHAUSTED
    router.worker_message(W1, p.encode(p.Closed(request_id="x1", session_id=old, route=C1)), 2.1)
    created(router, W1, request)
    record = router.registry.workers[W1]
    assert record.sessions == {other, request.session_id} and not record.closing and record.free == 0
    # A close that fails leaves the session live and its slot taken.
    router.client_message(C1, p.encode(p.Close(request_id="x2", session_id=other)), 2.2)
    assert record.free == 1
    failed = p.Error(request_id="x2", code=p.ErrorCode.INTERNAL, message="boom", route=C1)
    router.worker_message(W1, p.encode(failed), 2.3)
    assert record.sessions == {other, request.session_id} and not record.closing and record.free == 0


def test_a_resent_create_goes_to_the_same_worker_with_the_same_session_id() -> None:
    router = running((W1, ready("w1", capacity=1)), (W2, ready("w2", capacity=1)))
    _, first_worker, first = create(router, C1, "r1")
    _, again_worker, again = create(router, C1, "r1")
    assert (again_worker, again) == (first_worker, first)
    assert sum(w.pending for w in router.registry.workers.values()) == 1


def test_unknown_sessions_are_not_found_and_malformed_requests_are_bad() -> None:
    router = running((W1, ready("w1")))
    _, _, error = one(router.client_message(C1, p.encode(p.Info(request_id="i1", session_id="c" * 32)), 2.0))
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.SESSION_NOT_FOUND and error.request_id == "i1"
    _, _, error = one(router.client_message(C1, [p.VERSION, b"INFO", msgpack.packb({"request_id": "i2"})], 2.0))
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.BAD_REQUEST and error.request_id == "i2"
    _, _, error = one(router.client_message(C1, [b"garbage"], 2.0))
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.VERSION_MISMATCH
    _, _, error = one(router.client_message(C1, p.encode(ready("evil")), 2.0))
    assert isinstance(error, p.Error) and "not a client request" in error.message
    assert router.worker_message(W1, [b"garbage"], 2.0) == []  # the worker socket drops garbage
    assert router.worker_message(W1, p.encode(p.Status(request_id="s")), 2.0) == []


def test_a_dead_worker_fails_in_flight_requests_at_once_and_later_ones_are_lost() -> None:
    sid = "d" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid)), 2.0)
    assert all(peer is Peer.WORKER for peer, _, _ in decoded(router.tick(2.7)))  # heartbeats only
    sends = decoded(router.tick(2.75))  # last heard at 2.0, 3 x 0.25 s later: dead
    assert (Peer.CLIENT, C1, p.Error(request_id="g1", code=p.ErrorCode.SESSION_LOST,
                                     message="worker w1 is gone (missed heartbeats)")) in sends
    assert not router.registry.workers and not router.inflight
    _, _, later = one(router.client_message(C2, p.encode(p.Info(request_id="i1", session_id=sid)), 3.0))
    assert isinstance(later, p.Error) and later.code is p.ErrorCode.SESSION_LOST
    # It was only stopped: it comes back, its session with it, and the generation failed for the client stops.
    back = decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(sid,))), 4.0))
    assert [type(m) for _, _, m in back] == [p.Welcome, p.Cancel]
    cancel = back[1][2]
    assert isinstance(cancel, p.Cancel) and (cancel.session_id, cancel.target, cancel.route) == (sid, "g1", C1)
    assert router.registry.worker_of(sid) is not None and router.registry.gone(sid) is None
    assert [type(m) for _, _, m in decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(sid,))), 5.0))] == [
        p.Welcome]  # once


def test_disconnect_and_unreachable_workers_are_gone_too() -> None:
    sid = "e" * 32
    router = running((W1, ready("w1", sessions=(sid,))), (W2, ready("w2")))
    router.worker_message(W1, p.encode(p.Disconnect(reason="drained")), 2.1)
    assert router.registry.gone(sid) is p.ErrorCode.SESSION_LOST and set(router.registry.workers) == {W2}
    _, _, request = create(router, C1, "r1", now=2.2)
    _, _, not_found = one(router.client_message(C1, p.encode(p.Info(request_id="x", session_id="f" * 32)), 2.2))
    assert isinstance(not_found, p.Error) and not_found.code is p.ErrorCode.SESSION_NOT_FOUND
    failed = Send(Peer.WORKER, W2, p.encode(request), (C1, "r1"))
    _, identity, error = one(router.undeliverable(failed, Failure.UNREACHABLE, 2.3))
    assert identity == C1 and isinstance(error, p.Error) and error.code is p.ErrorCode.SESSION_LOST
    assert not router.registry.workers


def test_a_full_worker_queue_is_an_internal_error_for_that_request_only() -> None:
    router = running((W1, ready("w1")))
    _, _, request = create(router, C1, "r1")
    failed = Send(Peer.WORKER, W1, p.encode(request), (C1, "r1"))
    _, identity, error = one(router.undeliverable(failed, Failure.FULL, 2.1))
    assert identity == C1 and isinstance(error, p.Error) and error.code is p.ErrorCode.INTERNAL
    assert W1 in router.registry.workers and router.registry.workers[W1].pending == 0


def test_a_client_that_went_away_has_its_generation_cancelled() -> None:
    sid = "a" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid, stream=True)), 2.0)
    chunk = router.worker_message(W1, p.encode(p.Chunks(chunks=(p.StreamChunk("g1", (1,), ""),), route=C1)), 2.1)
    peer, identity, cancel = one(router.undeliverable(chunk[0], Failure.UNREACHABLE, 2.1))
    assert (peer, identity) == (Peer.WORKER, W1)
    assert isinstance(cancel, p.Cancel) and cancel.target == "g1" and cancel.session_id == sid
    assert router.undeliverable(chunk[0], Failure.UNREACHABLE, 2.2) == []  # only once


def test_a_restarted_broker_holds_requests_until_workers_re_register() -> None:
    sid = "9" * 32
    router = Router(SETTINGS, now=0.0, broker_id="new")
    info = p.Info(request_id="i1", session_id=sid)
    assert router.client_message(C1, p.encode(info), 0.1) == []  # held: recovering
    assert router.client_message(C1, p.encode(p.CreateSession(request_id="c1")), 0.1) == []  # no worker yet
    # The worker does not know the broker restarted: its heartbeat is answered with RECONNECT (once a beat).
    assert one(router.worker_message(W1, p.encode(p.Heartbeat(free_slots=1)), 0.2))[2] == p.Reconnect(broker_id="new")
    assert router.worker_message(W1, p.encode(p.Heartbeat(free_slots=1)), 0.3) == []
    sends = decoded(router.worker_message(W1, p.encode(ready("w1", capacity=2, sessions=(sid,))), 0.4))
    assert sends[0] == (Peer.WORKER, W1, p.Welcome(broker_id="new", heartbeat_ms=250, liveness=3))
    assert sends[1] == (Peer.WORKER, W1, info.routed(C1))
    assert isinstance(sends[2][2], p.CreateSession) and sends[2][1] == W1
    # After the recovery window, unknown sessions are simply not found.
    router.client_message(C2, p.encode(p.Info(request_id="i2", session_id="8" * 32)), 0.5)
    assert router.held
    sends = decoded(router.tick(1.0))  # a heartbeat is due too
    assert (Peer.CLIENT, C2, p.Error(request_id="i2", code=p.ErrorCode.SESSION_NOT_FOUND,
                                     message=f"no session {'8' * 32}")) in sends
    assert not router.held


def test_answers_from_an_unknown_worker_are_forwarded_and_it_is_asked_to_register() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b2")
    done = p.Generated(request_id="g1", session_id="a" * 32, token_ids=(), text="", finish_reason="stop", length=1,
                       route=C1)
    sends = router.worker_message(W1, p.encode(done), 0.1)
    assert [(s.peer, s.identity) for s in sends] == [(Peer.CLIENT, C1), (Peer.WORKER, W1)]
    assert p.decode(sends[1].frames) == p.Reconnect(broker_id="b2")


def test_fork_and_close_keep_the_session_table() -> None:
    sid = "1" * 32
    router = running((W1, ready("w1", capacity=3, sessions=(sid,))))
    _, _, fork = one(router.client_message(C1, p.encode(p.Fork(request_id="f1", session_id=sid)), 2.0))
    assert isinstance(fork, p.Fork) and fork.child_id is not None and router.registry.workers[W1].pending == 1
    forked = p.Forked(request_id="f1", session_id=sid, child_id=fork.child_id, length=3, worker="w1", route=C1)
    router.worker_message(W1, p.encode(forked), 2.1)
    assert router.registry.workers[W1].sessions == {sid, fork.child_id}
    router.client_message(C1, p.encode(p.Close(request_id="x1", session_id=sid)), 2.2)
    router.worker_message(W1, p.encode(p.Closed(request_id="x1", session_id=sid, route=C1)), 2.3)
    assert router.registry.workers[W1].sessions == {fork.child_id}


def test_status_and_heartbeats() -> None:
    router = running((W1, ready("w1", capacity=3, sessions=("1" * 32,))))
    _, _, report = one(router.client_message(C1, p.encode(p.Status(request_id="s1")), 2.0))
    assert report == p.StatusReport(request_id="s1", broker_id="b1",
                                    workers=(p.WorkerStatus("w1", "m", 3, 2, 1, False, ""),))
    router.worker_message(W1, p.encode(p.Heartbeat(free_slots=2, sessions=1, draining=True)), 2.1)
    assert router.registry.workers[W1].draining
    beats = decoded(router.tick(2.25))
    assert beats == [(Peer.WORKER, W1, p.Heartbeat(broker_id="b1"))]


def chunks(route: bytes, *request_ids: str) -> p.Chunks:
    return p.Chunks(chunks=tuple(p.StreamChunk(rid, (1,), "a") for rid in request_ids), route=route)


def test_a_chunks_batch_goes_to_its_client_untouched_and_leaves_the_tables_alone() -> None:
    sid, sid2 = "a" * 32, "b" * 32
    router = running((W1, ready("w1", sessions=(sid, sid2))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid, stream=True)), 2.0)
    router.client_message(C1, p.encode(p.Generate(request_id="g2", session_id=sid2, stream=True)), 2.0)
    frames = p.encode(chunks(C1, "g1", "g2"))
    [send] = router.worker_message(W1, frames, 2.6)
    assert (send.peer, send.identity, send.key) == (Peer.CLIENT, C1, None)
    assert send.frames is frames  # forwarded as received: nothing re-encoded
    assert set(router.inflight) == {(C1, "g1"), (C1, "g2")}  # still streaming
    router.tick(2.8)  # silent since 2.0 but for the batch: alive
    assert W1 in router.registry.workers


def test_malformed_chunks_batches_from_a_worker_are_dropped() -> None:
    router = running((W1, ready("w1")))
    pack = msgpack.packb
    for frames in (
        [p.VERSION, b"CHUNKS", pack({"chunks": [{"request_id": "g1"}]})],  # no route: nowhere to send it
        [p.VERSION, b"CHUNKS", pack({"chunks": "g1", "route": C1})],
        [p.VERSION, b"CHUNKS", pack({"chunks": [], "route": C1})],
        [p.VERSION, b"CHUNKS", pack({"route": C1})],
        [*p.encode(chunks(C1, "g1")), b"payload"],
        [p.VERSION, b"CHUNKS", b"\xc1"],
    ):
        assert router.worker_message(W1, frames, 2.1) == [], frames


def fanout(*parts: p.Chunks) -> p.Fanout:
    return p.Fanout(routes=tuple(c.route for c in parts), parts=tuple(p.chunks_part(c.chunks) for c in parts))


def test_a_fanout_becomes_one_chunks_message_per_client_with_the_worker_s_part_as_its_header() -> None:
    sid, sid2, sid3 = "a" * 32, "b" * 32, "c" * 32
    router = running((W1, ready("w1", capacity=3, sessions=(sid, sid2, sid3))))
    for client, rid, session in ((C1, "g1", sid), (C2, "g2", sid2), (C1, "g3", sid3)):
        router.client_message(client, p.encode(p.Generate(request_id=rid, session_id=session, stream=True)), 2.0)
    message = fanout(chunks(C1, "g1", "g3"), chunks(C2, "g2"))
    sends = router.worker_message(W1, p.encode(message), 2.6)
    assert [(s.peer, s.identity, s.key) for s in sends] == [(Peer.CLIENT, C1, None), (Peer.CLIENT, C2, None)]
    assert [s.frames for s in sends] == [[p.VERSION, b"CHUNKS", part] for part in message.parts]  # sent as made
    assert [p.decode(s.frames) for s in sends] == [chunks(b"", "g1", "g3"), chunks(b"", "g2")]
    assert set(router.inflight) == {(C1, "g1"), (C2, "g2"), (C1, "g3")}  # still streaming
    router.tick(2.8)  # silent since 2.0 but for the fanout: alive
    assert W1 in router.registry.workers
    # A client gone mid-stream: the generations of its part are cancelled, as with a CHUNKS of its own.
    cancels = decoded(router.undeliverable(sends[0], Failure.UNREACHABLE, 2.9))
    assert [(identity, c.target) for _, identity, c in cancels] == [(W1, "g1"), (W1, "g3")]  # type: ignore[attr-defined]


def test_malformed_fanouts_from_a_worker_are_dropped() -> None:
    router = running((W1, ready("w1")))
    pack = msgpack.packb
    part = p.chunks_part(chunks(C1, "g1").chunks)
    for frames in (
        [p.VERSION, b"FANOUT", pack({"routes": [C1, C2], "parts": [part]})],  # a route without its part
        [p.VERSION, b"FANOUT", pack({"routes": [], "parts": []})],
        [p.VERSION, b"FANOUT", pack({"routes": [b""], "parts": [part]})],
        [p.VERSION, b"FANOUT", pack({"routes": [b"x" * 256], "parts": [part]})],
        [p.VERSION, b"FANOUT", pack({"routes": ["client-1"], "parts": [part]})],
        [p.VERSION, b"FANOUT", pack({"routes": C1, "parts": part})],
        [p.VERSION, b"FANOUT", pack({"parts": [part]})],
        [*p.encode(fanout(chunks(C1, "g1"))), b"payload"],
        [p.VERSION, b"FANOUT", b"\xc1"],
    ):
        assert router.worker_message(W1, frames, 2.1) == [], frames
    assert W1 in router.registry.workers


def test_a_client_cannot_send_chunks() -> None:
    router = running((W1, ready("w1")))
    for message in (chunks(C2, "g1"), fanout(chunks(C2, "g1"))):
        _, identity, error = one(router.client_message(C1, p.encode(message), 2.0))
        assert identity == C1 and isinstance(error, p.Error) and error.code is p.ErrorCode.BAD_REQUEST
        assert "not a client request" in error.message


def test_a_client_that_went_away_mid_batch_has_every_generation_of_the_batch_cancelled() -> None:
    sid, sid2, sid3 = "a" * 32, "b" * 32, "c" * 32
    router = running((W1, ready("w1", sessions=(sid, sid2))), (W2, ready("w2", sessions=(sid3,))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid, stream=True)), 2.0)
    router.client_message(C1, p.encode(p.Generate(request_id="g2", session_id=sid2, stream=True)), 2.0)
    router.client_message(C1, p.encode(p.Generate(request_id="g3", session_id=sid3, stream=True)), 2.0)
    [send] = router.worker_message(W1, p.encode(chunks(C1, "g1", "g2")), 2.1)
    assert router.undeliverable(send, Failure.FULL, 2.1) == []  # a full queue: the client may catch up
    cancels = decoded(router.undeliverable(send, Failure.UNREACHABLE, 2.1))
    assert [(peer, identity) for peer, identity, _ in cancels] == [(Peer.WORKER, W1), (Peer.WORKER, W1)]
    assert [(c.target, c.session_id) for _, _, c in cancels] == [("g1", sid), ("g2", sid2)]  # type: ignore[attr-defined]
    assert set(router.inflight) == {(C1, "g3")}  # not in the batch: another worker's, it fails on its own
    assert router.undeliverable(send, Failure.UNREACHABLE, 2.2) == []  # only once


ALICE, BOB = "A" * 40, "B" * 40  # Z85 public keys, as the server passes them with authentication on


def test_with_authentication_a_session_is_usable_only_by_its_creator_and_its_forks_are_its_too() -> None:
    router = Router(Settings(heartbeat_s=0.25, recovery_s=1.0, authenticated=True), now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", capacity=4)), 2.0)
    _, _, request = one(router.client_message(C1, p.encode(p.CreateSession(request_id="r1")), 2.0, user=ALICE))
    assert isinstance(request, p.CreateSession) and request.owner == ALICE and request.session_id is not None
    created(router, W1, request)
    sid = request.session_id
    for message in (p.Info(request_id="i1", session_id=sid), p.Fork(request_id="f1", session_id=sid),
                    p.Close(request_id="c1", session_id=sid), p.Generate(request_id="g1", session_id=sid)):
        peer, identity, error = one(router.client_message(C2, p.encode(message), 2.1, user=BOB))
        assert (peer, identity) == (Peer.CLIENT, C2)
        assert isinstance(error, p.Error) and error.code is p.ErrorCode.UNAUTHORIZED
        assert error.message == f"session {sid} belongs to another client"
    assert router.client_message(C2, p.encode(p.Cancel(request_id="x1", session_id=sid, target="g1")), 2.1, user=BOB) == []
    # the owner on another connection (same key, new routing id) is the owner: forks are hers too
    peer, identity, fork = one(router.client_message(C2, p.encode(p.Fork(request_id="f2", session_id=sid)), 2.2, user=ALICE))
    assert peer is Peer.WORKER and isinstance(fork, p.Fork) and fork.child_id is not None
    forked = p.Forked(request_id="f2", session_id=sid, child_id=fork.child_id, length=1, worker="w1", route=C2)
    router.worker_message(W1, p.encode(forked), 2.3)
    assert router.registry.owner_of(fork.child_id) == ALICE and router.registry.owned_by(ALICE) == 2


def test_the_per_client_cap_counts_live_and_pending_sessions_and_names_the_limit() -> None:
    router = Router(Settings(heartbeat_s=0.25, recovery_s=1.0, max_sessions_per_client=2), now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", capacity=8)), 2.0)
    _, _, first = create(router, C1, "r1")
    assert isinstance(first, p.CreateSession)
    created(router, W1, first)
    _, _, second = create(router, C1, "r2")  # pending: not answered yet, counts already
    peer, identity, refused = create(router, C1, "r3")
    assert (peer, identity) == (Peer.CLIENT, C1) and isinstance(refused, p.Error)
    assert refused.code is p.ErrorCode.BAD_REQUEST
    assert refused.message == "this client holds 2 sessions: the limit is 2 per client (--max-sessions-per-client)"
    assert first.session_id is not None
    peer, _, fork_refused = one(router.client_message(C1, p.encode(p.Fork(request_id="f1", session_id=first.session_id)), 2.1))
    assert isinstance(fork_refused, p.Error) and fork_refused.code is p.ErrorCode.BAD_REQUEST
    assert create(router, C2, "r4")[0] is Peer.WORKER  # another client is not affected
    closed = p.Closed(request_id="c1", session_id=first.session_id, route=C1)
    router.client_message(C1, p.encode(p.Close(request_id="c1", session_id=first.session_id)), 2.2)
    router.worker_message(W1, p.encode(closed), 2.3)
    assert create(router, C1, "r5", now=2.4)[0] is Peer.WORKER  # a closed session frees a place


def test_a_request_on_a_worker_that_makes_no_progress_times_out_and_the_generation_is_cancelled() -> None:
    settings = Settings(heartbeat_s=0.25, liveness=100, recovery_s=1.0, request_timeout_s=1.0)
    sid = "c" * 32
    router = Router(settings, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", sessions=(sid,))), 2.0)
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid)), 2.0)
    for step, now in enumerate((2.5, 3.0, 3.5, 4.0), start=1):  # heartbeats with progress: no timeout
        router.worker_message(W1, p.encode(p.Heartbeat(steps=step)), now)
        assert not [s for s in router.tick(now) if s.peer is Peer.CLIENT]
    router.worker_message(W1, p.encode(p.Heartbeat(steps=4)), 4.5)  # stuck from 4.0 on, but still beating
    assert not [s for s in router.tick(4.75) if s.peer is Peer.CLIENT]
    out = decoded(router.tick(5.25))
    errors = [(identity, m) for peer, identity, m in out if peer is Peer.CLIENT]
    assert errors == [(C1, p.Error(request_id="g1", code=p.ErrorCode.TIMEOUT,
                                   message="worker w1 made no progress on this request for 1 s"))]
    cancels = [m for peer, _, m in out if isinstance(m, p.Cancel)]
    assert len(cancels) == 1 and cancels[0].target == "g1" and cancels[0].session_id == sid
    assert not router.inflight and router.registry.worker_of(sid) is not None  # the worker and session stay


def test_sessions_a_worker_expired_answer_session_expired() -> None:
    sid, other = "d" * 32, "e" * 32
    router = running((W1, ready("w1", capacity=4, sessions=(sid, other))))
    router.worker_message(W1, p.encode(p.Heartbeat(free_slots=3, sessions=1, expired=(sid,))), 2.1)
    assert router.registry.worker_of(sid) is None and router.registry.worker_of(other) is not None
    _, _, error = one(router.client_message(C1, p.encode(p.Info(request_id="i1", session_id=sid)), 2.2))
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.SESSION_EXPIRED
    assert router.registry.workers[W1].free == 3


def test_only_the_worker_holding_a_session_can_report_it_closed() -> None:
    sid = "f" * 32
    router = running((W1, ready("w1", sessions=(sid,))), (W2, ready("w2")))
    forged = p.Closed(request_id="x", session_id=sid, route=C2)
    router.worker_message(W2, p.encode(forged), 2.1)
    router.worker_message(b"stranger", p.encode(forged), 2.1)
    assert router.registry.worker_of(sid) is router.registry.workers[W1]


def test_a_request_id_in_flight_cannot_be_reused_for_another_request() -> None:
    sid = "a" * 32
    router = running((W1, ready("w1", capacity=4, sessions=(sid,))))
    create(router, C1, "r1")
    peer, _, refused = one(router.client_message(C1, p.encode(p.Info(request_id="r1", session_id=sid)), 2.1))
    assert peer is Peer.CLIENT and isinstance(refused, p.Error) and refused.code is p.ErrorCode.BAD_REQUEST
    assert refused.message == "request id r1 is in flight for a CREATE: use a new id per request"
    assert router.inflight[(C1, "r1")].command is p.Command.CREATE and router.registry.workers[W1].pending == 1


def test_error_messages_are_cut_to_the_limit_never_refused() -> None:
    error = p.Error(request_id=None, code=p.ErrorCode.BAD_REQUEST, message="x" * 10_000)
    assert len(error.message) == 4096
    router = running((W1, ready("w1")))
    long_reason = p.Disconnect(reason="z" * 4096)
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id="a" * 32)), 2.0)
    router.worker_message(W1, p.encode(ready("w1", sessions=("a" * 32,))), 2.0)
    router.client_message(C1, p.encode(p.Generate(request_id="g2", session_id="a" * 32)), 2.0)
    _, _, lost = one(router.worker_message(W1, p.encode(long_reason), 2.1))
    assert isinstance(lost, p.Error) and lost.code is p.ErrorCode.SESSION_LOST and len(lost.message) == 4096
