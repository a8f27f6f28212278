"""The broker's logic without sockets: frames in, frames out, time passed in explicitly."""

from __future__ import annotations

from dataclasses import replace

import msgpack

from broker.common import protocol as p
from broker.registry import Gone
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


def test_token_ids_past_the_workers_whole_context_are_refused_at_the_broker() -> None:
    """An id list longer than the worker's max_context (64 here) never fits the session: refused without a trip to
    the worker (a flood of megabyte lists piled up in its queue); one that may fit goes on."""
    sid = "b" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    for request in (p.Append(request_id="a1", session_id=sid, token_ids=(7,) * 65),
                    p.Generate(request_id="g1", session_id=sid, prompt_ids=(7,) * 65)):
        peer, identity, error = one(router.client_message(C1, p.encode(request), 2.0))
        assert (peer, identity) == (Peer.CLIENT, C1) and isinstance(error, p.Error)
        assert (error.code, error.message) == (p.ErrorCode.BAD_REQUEST,
                                               f"65 token ids exceed max_context 64 of session {sid}")
    assert not router.inflight
    fits = p.Append(request_id="a2", session_id=sid, token_ids=(7,) * 64)
    assert one(router.client_message(C1, p.encode(fits), 2.1)) == (Peer.WORKER, W1, fits.routed(C1))


def test_sampling_extras_go_only_to_a_worker_that_says_it_applies_them() -> None:
    """A worker older than logit_bias and the penalties would ignore them and answer as if it had applied them: the
    broker refuses such a GENERATE for its sessions; one without them, or for a worker that applies them, goes on."""
    old, new = "c" * 32, "d" * 32
    router = running((W1, ready("w1", sessions=(old,))), (W2, replace(ready("w2", sessions=(new,)),
                                                                                 sampling_extras=True)))
    for i, params in enumerate((p.Sampling(presence_penalty=0.5), p.Sampling(repetition_penalty=1.1),
                                p.Sampling(logit_bias=(p.LogitBias(3, -5.0),)), p.Sampling(min_p=0.1),
                                p.Sampling(min_tokens=4))):
        peer, identity, error = one(router.client_message(
            C1, p.encode(p.Generate(request_id=f"g{i}", session_id=old, params=params)), 2.0))
        assert (peer, identity) == (Peer.CLIENT, C1) and isinstance(error, p.Error)
        assert (error.code, error.message) == (
            p.ErrorCode.BAD_REQUEST,
            "worker w1 does not apply logit_bias, penalties, min_p or min_tokens (an older worker): upgrade it")
    assert not router.inflight
    plain = p.Generate(request_id="p1", session_id=old, params=p.Sampling(frequency_penalty=0.0))
    assert one(router.client_message(C1, p.encode(plain), 2.1)) == (Peer.WORKER, W1, plain.routed(C1))
    penalized = p.Generate(request_id="p2", session_id=new, params=p.Sampling(frequency_penalty=1.0))
    assert one(router.client_message(C1, p.encode(penalized), 2.1)) == (Peer.WORKER, W2, penalized.routed(C1))


def test_tools_go_only_to_a_worker_that_says_it_renders_them() -> None:
    """A worker older than tools would render a conversation without them (its messages' calls dropped): the broker
    refuses a GENERATE with tools or function calls for its sessions."""
    old, new = "c" * 32, "d" * 32
    router = running((W1, ready("w1", sessions=(old,))), (W2, replace(ready("w2", sessions=(new,)), tools=True)))
    call = p.ChatMessage("assistant", "", (p.ToolCall("call_1", "f", "{}"),))
    for i, (messages, tools) in enumerate((((p.ChatMessage("user", "q"),), '[{"type": "function"}]'),
                                           ((call,), ""), ((p.ChatMessage("tool", "21", tool_call_id="call_1"),), ""))):
        asked = p.Generate(request_id=f"g{i}", session_id=old, messages=messages, tools=tools)
        peer, identity, error = one(router.client_message(C1, p.encode(asked), 2.0))
        assert (peer, identity) == (Peer.CLIENT, C1) and isinstance(error, p.Error)
        assert (error.code, error.message) == (
            p.ErrorCode.BAD_REQUEST, "worker w1 does not render tools or function calls (an older worker): upgrade it")
        sent = replace(asked, session_id=new)
        assert one(router.client_message(C1, p.encode(sent), 2.1)) == (Peer.WORKER, W2, sent.routed(C1))
        router.worker_message(W2, p.encode(p.Error(request_id=f"g{i}", code=p.ErrorCode.INTERNAL, route=C1)), 2.2)
    plain = p.Generate(request_id="p1", session_id=old, messages=(p.ChatMessage("user", "q"),))
    assert one(router.client_message(C1, p.encode(plain), 2.3)) == (Peer.WORKER, W1, plain.routed(C1))


def test_status_lists_each_worker_s_recommended_sampling_as_its_last_ready_said() -> None:
    """The gateway gives a model's recommended sampling (generation_config.json) to requests that leave parameters
    out: the broker keeps each worker's, from its READY, and STATUS reports it; a READY again replaces it."""
    qwen = p.SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    router = running((W1, replace(ready("w1"), sampling_defaults=qwen)), (W2, ready("w2")))
    _, _, report = one(router.client_message(C1, p.encode(p.Status(request_id="s1")), 2.0))
    assert isinstance(report, p.StatusReport)
    assert {w.name: w.sampling_defaults for w in report.workers} == {"w1": qwen, "w2": p.SamplingDefaults()}
    router.worker_message(W1, p.encode(replace(ready("w1"), sampling_defaults=p.SamplingDefaults(max_tokens=9))), 2.1)
    _, _, report = one(router.client_message(C1, p.encode(p.Status(request_id="s2")), 2.2))
    assert isinstance(report, p.StatusReport)
    assert {w.name: w.sampling_defaults.given() for w in report.workers} == {"w1": {"max_tokens": 9}, "w2": {}}


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


def to_workers(sends: list[Send]) -> list[tuple[Peer, bytes, p.Message]]:
    """What goes to workers (the leases that go to clients left out)."""
    return [(peer, identity, m) for peer, identity, m in decoded(sends) if peer is Peer.WORKER]


def test_a_dead_worker_fails_in_flight_requests_at_once_and_later_ones_are_lost() -> None:
    sid = "d" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid)), 2.0)
    assert not [s for s in router.tick(2.7) if s.peer is Peer.CLIENT and s.frames[1] != b"LEASE"]  # beats, leases
    sends = decoded(router.tick(2.75))  # last heard at 2.0, 3 x 0.25 s later: dead
    assert (Peer.CLIENT, C1, p.Error(request_id="g1", code=p.ErrorCode.SESSION_LOST,
                                     message="worker w1 is gone (missed heartbeats)")) in sends
    assert not router.registry.workers and not router.inflight
    _, _, later = one(router.client_message(C2, p.encode(p.Info(request_id="i1", session_id=sid)), 3.0))
    assert isinstance(later, p.Error) and later.code is p.ErrorCode.SESSION_LOST


def test_session_lost_is_final_a_worker_that_comes_back_drops_the_sessions_declared_lost() -> None:
    """It was only stopped (SIGSTOP, a cut cable): it comes back listing the session its client was told is lost. The
    broker does not take it back: it tells the worker to drop it (which ends its generation too), answers nothing of
    the worker's about it, and later requests still get session_lost."""
    sid, other = "d" * 32, "e" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid, stream=True)), 2.0)
    router.tick(2.75)  # dead
    back = decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(sid, other))), 4.0))
    assert [m for _, _, m in back] == [p.Welcome(broker_id="b1", heartbeat_ms=250, liveness=3),
                                       p.Drop(sessions=(sid,))]
    assert router.registry.workers[W1].sessions == {other}  # a session made meanwhile is its own to keep
    assert router.registry.worker_of(sid) is None and router.registry.gone(sid) is Gone.LOST
    _, _, later = one(router.client_message(C2, p.encode(p.Info(request_id="i1", session_id=sid)), 4.1))
    assert isinstance(later, p.Error) and later.code is p.ErrorCode.SESSION_LOST
    # Its answers about the lost session, sent before it handled the DROP, reach nobody.
    done = p.Generated(request_id="g1", session_id=sid, token_ids=(1,), text="a", finish_reason="cancelled",
                       length=5, route=C1)
    assert router.worker_message(W1, p.encode(done), 4.2) == []
    assert router.counters.messages_dropped == {"lost_session": 1} and router.counters.sessions_dropped == 1
    # Nor do its streamed chunks of the lost generation; another client's, in the same fanout, do.
    router.client_message(C2, p.encode(p.Generate(request_id="g9", session_id=other, stream=True)), 4.2)
    assert router.worker_message(W1, p.encode(chunks(C1, "g1")), 4.2) == []
    sent = router.worker_message(W1, p.encode(fanout(chunks(C1, "g1"), chunks(C2, "g9"))), 4.2)
    assert [(s.identity, p.decode(s.frames)) for s in sent] == [(C2, chunks(b"", "g9"))]
    # Still answering for it a beat later (it missed the DROP): told again, once a beat.
    [(_, identity, told)] = decoded(router.worker_message(W1, p.encode(done), 4.3))
    assert identity == W1 and told == p.Drop(sessions=(sid,))
    assert router.worker_message(W1, p.encode(done), 4.4) == []
    # It registers again (the DROP was lost with a second outage): told again; once it no longer lists it, forgotten.
    again = decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(sid, other))), 5.0))
    assert [m for _, _, m in again][1:] == [p.Drop(sessions=(sid,))]
    assert [type(m) for _, _, m in decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(other,))), 6.0))] == [
        p.Welcome]
    assert router._lost_count == 0 and not router._lost and not router._lost_requests


def test_disconnect_and_unreachable_workers_are_gone_too() -> None:
    sid, sid2 = "e" * 32, "f" * 32
    router = running((W1, ready("w1", sessions=(sid,))), (W2, ready("w2", sessions=(sid2,))))
    router.worker_message(W1, p.encode(p.Disconnect(reason="drained")), 2.1)
    assert router.registry.gone(sid) is Gone.LOST and set(router.registry.workers) == {W2}
    _, _, not_found = one(router.client_message(C1, p.encode(p.Info(request_id="x", session_id="0" * 32)), 2.2))
    assert isinstance(not_found, p.Error) and not_found.code is p.ErrorCode.SESSION_NOT_FOUND
    _, _, request = one(router.client_message(C1, p.encode(p.Info(request_id="i2", session_id=sid2)), 2.2))
    failed = Send(Peer.WORKER, W2, p.encode(request), (C1, "i2"))
    _, identity, error = one(router.undeliverable(failed, Failure.UNREACHABLE, 2.3))
    assert identity == C1 and isinstance(error, p.Error) and error.code is p.ErrorCode.SESSION_LOST
    assert error.message == "worker w2 is gone (unreachable)"
    assert not router.registry.workers


def test_a_create_whose_worker_vanishes_before_answering_is_placed_again() -> None:
    """A fake (or dying) worker took the create and left without answering: the create goes to a worker that has
    room, under a new session id (where it is answered as usual); should the first come back listing the session it
    made, that one is dropped there."""
    router = running((W1, ready("w1", capacity=4)), (W2, ready("w2", capacity=2)))
    _, first, request = create(router, C1, "r1")
    assert first == W1 and isinstance(request, p.CreateSession) and request.session_id is not None
    [(_, identity, again)] = to_workers(router.worker_message(W1, p.encode(p.Disconnect(reason="gone")), 2.1))
    assert identity == W2 and isinstance(again, p.CreateSession) and again.route == C1
    assert again.request_id == "r1" and again.session_id not in (None, request.session_id)
    assert router.registry.workers[W2].pending == 1 and router.counters.creates_replaced == 1
    [answer] = created(router, W2, again, now=2.2)
    assert answer.identity == C1 and p.decode(answer.frames).session_id == again.session_id  # type: ignore[attr-defined]
    back = to_workers(router.worker_message(W1, p.encode(ready("w1", capacity=4, sessions=(request.session_id,))), 3.0))
    assert [m for _, _, m in back][1:] == [p.Drop(sessions=(request.session_id,))]
    # With no other worker, the create is refused as any create would be.
    _, _, lonely = create(router, C2, "r2", now=3.1)
    assert isinstance(lonely, p.CreateSession)
    router.worker_message(W2, p.encode(p.Disconnect()), 3.2)
    router.worker_message(W1, p.encode(p.Disconnect()), 3.2)
    assert not router.registry.workers and not router.inflight


def test_a_full_worker_queue_is_an_overloaded_error_for_that_request_only() -> None:
    router = running((W1, ready("w1")))
    _, _, request = create(router, C1, "r1")
    failed = Send(Peer.WORKER, W1, p.encode(request), (C1, "r1"))
    _, identity, error = one(router.undeliverable(failed, Failure.FULL, 2.1))
    assert identity == C1 and isinstance(error, p.Error) and error.code is p.ErrorCode.OVERLOADED
    assert W1 in router.registry.workers and router.registry.workers[W1].pending == 0


def cancels_after_the_window(router: Router, since: float, workers: tuple[bytes, ...] = (W1,)) -> list[p.Cancel]:
    """The CANCELs the ticks send up to the client grace (5 s) and a beat after `since`, the workers alive."""
    out: list[p.Cancel] = []
    now = since
    grace = router.settings.client_grace_s
    while now < since + grace + 0.25:
        if now + 0.25 < since + grace:
            assert [m for m in out if isinstance(m, p.Cancel)] == []  # not before
        now += 0.25
        for worker in workers:
            router.worker_message(worker, p.encode(p.Heartbeat()), now - 0.01)
        out += [m for _, _, m in decoded(router.tick(now)) if isinstance(m, p.Cancel)]
    return out


def test_a_client_that_went_away_has_its_generation_cancelled_after_its_grace() -> None:
    sid = "a" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid, stream=True)), 2.0)
    chunk = router.worker_message(W1, p.encode(p.Chunks(chunks=(p.StreamChunk("g1", (1,), ""),), route=C1)), 2.1)
    assert router.undeliverable(chunk[0], Failure.UNREACHABLE, 2.1) == []  # it may be paused: not yet
    assert router.undeliverable(chunk[0], Failure.UNREACHABLE, 2.2) == []
    [cancel] = cancels_after_the_window(router, 2.2)
    assert cancel.target == "g1" and cancel.session_id == sid  # once


def test_a_client_that_speaks_again_within_the_window_keeps_its_generation() -> None:
    """A client paused for a few seconds (its connection closed by the broker's heartbeats meanwhile) reconnects and
    resends its stream's request: the generation goes on and the stream resumes."""
    sid = "a" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    generate = p.Generate(request_id="g1", session_id=sid, stream=True)
    router.client_message(C1, p.encode(generate), 2.0)
    chunk = router.worker_message(W1, p.encode(p.Chunks(chunks=(p.StreamChunk("g1", (1,), ""),), route=C1)), 2.1)
    assert router.undeliverable(chunk[0], Failure.UNREACHABLE, 2.1) == []
    router.worker_message(W1, p.encode(p.Heartbeat()), 2.4)
    router.tick(2.4)
    [(_, _, resent)] = decoded(router.client_message(C1, p.encode(replace(generate, resume=1)), 2.5))
    assert isinstance(resent, p.Generate) and resent.resume == 1
    assert cancels_after_the_window(router, 2.5) == []


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
    assert router.held_count == 1
    sends = decoded(router.tick(1.0))  # a heartbeat is due too
    assert (Peer.CLIENT, C2, p.Error(request_id="i2", code=p.ErrorCode.SESSION_NOT_FOUND,
                                     message=f"no session {'8' * 32}")) in sends
    assert router.held_count == 0


def test_a_worker_registering_while_the_broker_recovers_releases_only_what_it_can_take() -> None:
    mine, other = "1" * 32, "2" * 32
    router = Router(SETTINGS, now=0.0, broker_id="new")
    for i in range(1000):  # requests for a session no worker has re-registered yet, and creates of another model
        router.client_message(C2, p.encode(p.Info(request_id=f"o{i}", session_id=other)), 0.1)
    router.client_message(C2, p.encode(p.CreateSession(request_id="c-other", model="other")), 0.1)
    router.client_message(C1, p.encode(p.Info(request_id="i1", session_id=mine)), 0.1)
    router.client_message(C1, p.encode(p.Append(request_id="a1", session_id=mine, token_ids=(1,))), 0.1)
    router.client_message(C1, p.encode(p.CreateSession(request_id="c1", model="m")), 0.1)
    assert router.held_count == 1004
    sends = decoded(router.worker_message(W1, p.encode(ready("w1", capacity=4, sessions=(mine,))), 0.2))
    to_w1 = [m for peer, _, m in sends if peer is Peer.WORKER and not isinstance(m, p.Welcome)]
    assert [(type(m), getattr(m, "request_id", None)) for m in to_w1] == [
        (p.Info, "i1"), (p.Append, "a1"), (p.CreateSession, "c1")]
    assert router.held_count == 1001 and set(router.held) == {other, ""}
    router.worker_message(W1, p.encode(p.Heartbeat()), 1.0)
    ended = decoded(router.tick(1.1))  # the window is over: the rest are answered
    errors = [m for peer, _, m in ended if peer is Peer.CLIENT and isinstance(m, p.Error)]
    assert len(errors) == 1001 and {e.code for e in errors} == {p.ErrorCode.SESSION_NOT_FOUND, p.ErrorCode.MODEL_NOT_FOUND}
    assert router.held_count == 0 and router.held == {}


def test_answers_from_a_peer_that_is_not_registered_are_never_forwarded_and_it_is_asked_to_register() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b2")
    done = p.Generated(request_id="g1", session_id="a" * 32, token_ids=(), text="", finish_reason="stop", length=1,
                       route=C1)
    sends = router.worker_message(W1, p.encode(done), 0.1)
    assert [(s.peer, s.identity) for s in sends] == [(Peer.WORKER, W1)]
    assert p.decode(sends[0].frames) == p.Reconnect(broker_id="b2")
    assert router.worker_message(W1, p.encode(fanout(chunks(C1, "g1"))), 0.2) == []  # asked once a beat
    assert router.counters.messages_dropped == {"unregistered": 2}


def test_a_fanout_with_bad_parts_from_a_stranger_does_not_take_the_broker_down() -> None:
    """One FANOUT from a peer that never registered, to a route that is no client, whose part is not a msgpack map:
    it used to be forwarded, its send failed, and decoding the part to cancel its generations raised out of the
    broker's loop. Now a stranger's answers are dropped unread, and a registered worker's bad parts are sent on and,
    when they cannot be delivered, read without raising."""
    router = running((W1, ready("w1")))
    for part in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"chunks": "x"}), b""):
        bad = [p.VERSION, b"FANOUT", msgpack.packb({"routes": [b"nobody"], "parts": [part]})]
        assert [p.decode(s.frames) for s in router.worker_message(b"stranger", bad, 2.0)] in (
            [p.Reconnect(broker_id="b1")], [])
        [send] = router.worker_message(W1, bad, 2.1)  # registered: forwarded as is
        assert (send.peer, send.identity, send.frames) == (Peer.CLIENT, b"nobody", [p.VERSION, b"CHUNKS", part])
        assert router.undeliverable(send, Failure.UNREACHABLE, 2.2) == []
    assert W1 in router.registry.workers


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
                                    workers=(p.WorkerStatus("w1", "m", 3, 2, 1, False, "", max_context=64),))
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
    assert router.undeliverable(sends[0], Failure.UNREACHABLE, 2.9) == []
    assert sorted(c.target for c in cancels_after_the_window(router, 2.9)) == ["g1", "g3"]


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
    assert router.undeliverable(send, Failure.UNREACHABLE, 2.1) == []
    cancels = cancels_after_the_window(router, 2.1, (W1, W2))
    assert sorted((c.target, c.session_id) for c in cancels) == [("g1", sid), ("g2", sid2)]
    assert set(router.inflight) == {(C1, "g3")}  # not in the batch: another worker's, it fails on its own


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
    """Progress is what reaches the client: a worker's heartbeats with a rising step count (a fake worker's, or a
    hung one's) keep nothing alive; streamed tokens to the request's client do."""
    settings = Settings(heartbeat_s=0.25, liveness=100, recovery_s=1.0, request_timeout_s=1.0)
    sid, streamed = "c" * 32, "d" * 32
    router = Router(settings, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", sessions=(sid, streamed))), 2.0)
    router.client_message(C1, p.encode(p.Generate(request_id="g1", session_id=sid)), 2.0)
    router.client_message(C2, p.encode(p.Generate(request_id="g2", session_id=streamed, stream=True)), 2.0)

    def errors(now: float) -> list[tuple[bytes, p.Message]]:
        return [(identity, m) for peer, identity, m in decoded(router.tick(now))
                if peer is Peer.CLIENT and not isinstance(m, p.Lease)]

    for step, now in enumerate((2.5, 2.75, 3.0), start=1):  # rising steps, and tokens for C2's stream
        router.worker_message(W1, p.encode(p.Heartbeat(steps=step)), now)
        router.worker_message(W1, p.encode(fanout(chunks(C2, "g2"))), now)
        assert errors(now) == []
    router.worker_message(W1, p.encode(p.Heartbeat(steps=4)), 3.25)
    router.worker_message(W1, p.encode(fanout(chunks(C2, "g2"))), 3.25)
    out = router.tick(3.25)
    assert [(identity, m) for peer, identity, m in decoded(out) if peer is Peer.CLIENT and not isinstance(m, p.Lease)] == [
        (C1, p.Error(request_id="g1", code=p.ErrorCode.TIMEOUT,
                     message="worker w1 made no progress on this request for 1 s"))]
    cancels = [m for peer, _, m in decoded(out) if isinstance(m, p.Cancel)]
    assert len(cancels) == 1 and cancels[0].target == "g1" and cancels[0].session_id == sid
    assert set(router.inflight) == {(C2, "g2")} and router.registry.worker_of(sid) is not None  # the worker stays
    assert errors(4.0) == []  # C2's tokens last reached it at 3.25
    [(client, timed_out)] = errors(4.5)
    assert client == C2 and isinstance(timed_out, p.Error) and timed_out.code is p.ErrorCode.TIMEOUT


def test_a_create_that_timed_out_and_is_answered_late_closes_the_session_on_its_worker() -> None:
    settings = Settings(heartbeat_s=0.25, liveness=100, recovery_s=1.0, request_timeout_s=1.0)
    router = Router(settings, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", capacity=1)), 2.0)
    _, _, request = create(router, C1, "c1", now=2.0)
    assert isinstance(request, p.CreateSession) and request.session_id is not None
    router.worker_message(W1, p.encode(p.Heartbeat(steps=1)), 3.25)
    [(_, _, timed_out)] = [d for d in decoded(router.tick(3.25)) if d[0] is Peer.CLIENT and not isinstance(d[2], p.Lease)]
    assert isinstance(timed_out, p.Error) and timed_out.code is p.ErrorCode.TIMEOUT
    assert router.registry.workers[W1].free == 1  # the create no longer holds the slot
    [(peer, identity, close)] = decoded(created(router, W1, request, now=3.5))  # made after all: not forwarded
    assert (peer, identity) == (Peer.WORKER, W1) and isinstance(close, p.Close)
    assert close.session_id == request.session_id and close.route == b"\x00lease"
    assert router.registry.worker_of(request.session_id) is None
    closed = p.Closed(request_id=close.request_id, session_id=request.session_id, route=close.route)
    assert router.worker_message(W1, p.encode(closed), 3.6) == []  # its answer goes nowhere


def test_a_malformed_answer_to_a_create_is_not_forwarded_the_client_gets_an_error_and_the_session_is_closed() -> None:
    router = running((W1, ready("w1", capacity=2)))
    _, _, request = create(router, C1, "c1")
    assert isinstance(request, p.CreateSession) and request.session_id is not None
    header = {"kind": "created", "request_id": "c1", "session_id": request.session_id, "model": "m", "worker": "w1",
              "route": C1}  # no max_context
    out = decoded(router.worker_message(W1, [p.VERSION, b"REPLY", msgpack.packb(header)], 2.1))
    assert [(peer, identity, type(m)) for peer, identity, m in out] == [(Peer.WORKER, W1, p.Close), (Peer.CLIENT, C1, p.Error)]
    close, error = out[0][2], out[1][2]
    assert isinstance(close, p.Close) and close.session_id == request.session_id
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.INTERNAL and error.request_id == "c1"
    assert error.message == "worker w1 answered this CREATE with a malformed message (missing field max_context)"
    assert router.registry.worker_of(request.session_id) is None and router.registry.workers[W1].pending == 0


def test_a_length_past_the_protocol_limit_is_not_kept_and_the_session_list_still_answers() -> None:
    sid = "a" * 32
    router = running((W1, ready("w1", sessions=(sid,))))
    router.client_message(C1, p.encode(p.Info(request_id="i1", session_id=sid)), 2.1)
    header = {"kind": "info", "request_id": "i1", "session_id": sid, "length": 2**63, "model": "m", "worker": "w1",
              "max_context": 64, "route": C1}
    router.worker_message(W1, [p.VERSION, b"REPLY", msgpack.packb(header)], 2.2)
    _, _, listed = one(router.client_message(C2, p.encode(p.Sessions(request_id="l1")), 2.3))
    assert isinstance(listed, p.SessionList) and [(e.session_id, e.length) for e in listed.sessions] == [(sid, None)]


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


def test_a_request_id_in_flight_cannot_be_reused_for_the_same_command_on_another_session() -> None:
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    router = running((W1, ready("w1", capacity=4, sessions=(a, b, c))))
    peer, _, close_a = one(router.client_message(C1, p.encode(p.Close(request_id="x", session_id=a)), 2.1))
    assert peer is Peer.WORKER and isinstance(close_a, p.Close)
    assert one(router.client_message(C1, p.encode(p.Close(request_id="x", session_id=a)), 2.1))[2] == close_a  # resent
    _, _, refused = one(router.client_message(C1, p.encode(p.Close(request_id="x", session_id=b)), 2.1))
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.BAD_REQUEST
    assert refused.message == f"request id x is in flight for a CLOSE of session {a}: use a new id per request"
    peer, _, fork = one(router.client_message(C1, p.encode(p.Fork(request_id="f", session_id=c)), 2.1))
    assert peer is Peer.WORKER and isinstance(fork, p.Fork)
    assert one(router.client_message(C1, p.encode(p.Fork(request_id="f", session_id=c)), 2.1))[2] == fork  # resent
    _, _, refused = one(router.client_message(C1, p.encode(p.Fork(request_id="f", session_id=b)), 2.1))
    assert isinstance(refused, p.Error) and refused.message.startswith(f"request id f is in flight for a FORK of session {c}")
    # The first close's answer closes a (and only a); b is still routed to its worker.
    router.worker_message(W1, p.encode(p.Closed(request_id="x", session_id=a, route=C1)), 2.2)
    assert router.registry.worker_of(a) is None and router.registry.worker_of(b) is router.registry.workers[W1]
    assert router.registry.workers[W1].closing == set()


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


def test_a_restarted_broker_waits_for_every_worker_it_hears_from_past_its_recovery_window() -> None:
    """A worker that reconnects late (its reconnect backoff) must not find its sessions answered session_not_found:
    a peer heard from within the recovery window is waited for until it registers, or for a heartbeat window after
    it was first heard (liveness x heartbeat: 0.75 s here)."""
    sid = "9" * 32
    router = Router(SETTINGS, now=0.0, broker_id="new")
    assert router.client_message(C1, p.encode(p.Info(request_id="i1", session_id=sid)), 0.1) == []  # held
    router.worker_message(W1, p.encode(p.Heartbeat(free_slots=1)), 0.9)  # heard just before the window (1 s) ends
    assert router.recovering(1.5) and router.next_tick() <= 1.65
    assert not [s for s in router.tick(1.5) if s.peer is Peer.CLIENT]  # still held
    sends = decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(sid,))), 1.6))
    assert sends[1] == (Peer.WORKER, W1, p.Info(request_id="i1", session_id=sid, route=C1))  # released to it
    assert router.held_count == 0 and not router.recovering(1.6)
    # A stranger that never registers holds recovery up for one window only; one first heard after it ends, never.
    router = Router(SETTINGS, now=0.0, broker_id="new")
    router.client_message(C1, p.encode(p.Info(request_id="i2", session_id=sid)), 0.1)
    router.worker_message(b"quiet", p.encode(p.Heartbeat()), 0.5)
    assert router.recovering(1.2) and not router.recovering(1.25)
    router.worker_message(b"late", p.encode(p.Heartbeat()), 1.3)
    assert not router.recovering(1.3)
    [(peer, _, answer)] = [s for s in decoded(router.tick(1.3)) if s[0] is Peer.CLIENT]
    assert answer == p.Error(request_id="i2", code=p.ErrorCode.SESSION_NOT_FOUND, message=f"no session {sid}")


# Workers connected but silent are gone after silence_s only: these tests send no worker heartbeats.
LEASED = Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0, session_grace_s=1.0, silence_s=1000.0)


def lease_round(router: Router, now: float, gone: frozenset[bytes] = frozenset()) -> list[Send]:
    """A tick, as the server runs it: its LEASEs to the `gone` clients fail (their connections are closed)."""
    out = router.tick(now)
    for send in out:
        if send.peer is Peer.CLIENT and send.identity in gone:
            out += router.undeliverable(send, Failure.UNREACHABLE, now)
    return out


def closes_in(sends: list[Send]) -> list[p.Close]:
    return [m for _, _, m in to_workers(sends) if isinstance(m, p.Close)]


def test_a_gone_client_s_sessions_are_closed_after_the_grace_period_and_a_returning_one_keeps_them() -> None:
    router = Router(LEASED, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", capacity=4)), 1.0)
    made = {}
    for client, rid in ((C1, "r1"), (C2, "r2")):
        _, _, request = create(router, client, rid, now=1.0)
        assert isinstance(request, p.CreateSession) and request.session_id is not None
        created(router, W1, request, now=1.0)
        made[client] = request.session_id
    # Every heartbeat, each client holding sessions gets a LEASE; C1's connection is gone: its LEASEs fail.
    gone = frozenset({C1})
    leases = [s for s in lease_round(router, 1.25, gone) if s.peer is Peer.CLIENT]
    assert sorted(s.identity for s in leases) == [C1, C2] and p.decode(leases[0].frames) == p.Lease(broker_id="b1")
    lease_round(router, 1.5, gone)  # known gone from here on
    listing = one(router.client_message(C2, p.encode(p.Sessions(request_id="l1")), 2.0))[2]
    assert isinstance(listing, p.SessionList) and listing.total == 2
    states = {e.session_id: (e.client, e.gone_ms, e.worker, e.length, e.idle_ms) for e in listing.sessions}
    assert states == {made[C1]: ("gone", 500, "w1", 0, 1000), made[C2]: ("connected", 0, "w1", 0, 1000)}
    assert not closes_in(lease_round(router, 1.75, gone) + lease_round(router, 2.0, gone) + lease_round(router, 2.25, gone))
    closes = closes_in(lease_round(router, 2.5, gone))  # gone 1 s: closed
    assert [(c.session_id, c.route) for c in closes] == [(made[C1], b"\x00lease")]
    assert router.registry.workers[W1].free == 4 - 2 + 1  # its slot is free for what comes after the close
    assert not closes_in(lease_round(router, 2.75, gone))  # once
    # The worker's answer goes to nobody; the session is gone, and later requests hear why.
    answer = p.Closed(request_id=closes[0].request_id, session_id=made[C1], route=b"\x00lease")
    assert router.worker_message(W1, p.encode(answer), 2.8) == []
    assert router.registry.worker_of(made[C1]) is None and router.counters.sessions_lease_closed == 1
    _, _, later = one(router.client_message(C1, p.encode(p.Info(request_id="i1", session_id=made[C1])), 3.0))
    assert later == p.Error(request_id="i1", code=p.ErrorCode.SESSION_EXPIRED, message=(
        "the broker closed this session: its client was gone for more than 1 s (broker --session-grace-ms)"))
    assert router.registry.worker_of(made[C2]) is not None  # the connected client's session stays


def test_a_client_that_comes_back_within_the_grace_period_or_uses_the_session_from_elsewhere_keeps_it() -> None:
    router = Router(LEASED, now=0.0, broker_id="b1")
    sid = "a" * 32
    router.worker_message(W1, p.encode(p.Ready(name="w1", model="m", capacity=4, free_slots=3, max_context=64,
                                               sessions=(sid,), holders=(C1,))), 1.0)
    gone = frozenset({C1})
    for now in (1.25, 1.5, 1.75):
        lease_round(router, now, gone)
    router.client_message(C1, p.encode(p.Status(request_id="s")), 2.0)  # it reconnected (same routing id)
    assert not closes_in(lease_round(router, 2.25) + lease_round(router, 2.5) + lease_round(router, 3.0))
    listing = one(router.client_message(C1, p.encode(p.Sessions(request_id="l")), 3.0))[2]
    assert isinstance(listing, p.SessionList) and [e.client for e in listing.sessions] == ["connected"]
    # Gone again; another connection uses the session meanwhile: the lease is that one's now.
    lease_round(router, 3.25, gone)
    lease_round(router, 3.5, gone)
    router.client_message(C2, p.encode(p.Info(request_id="i1", session_id=sid)), 3.6)
    assert not closes_in([s for now in (3.75, 4.0, 4.5, 5.0, 5.5) for s in lease_round(router, now, gone)])
    assert router.registry.session(sid) is not None and router.registry.session(sid).client == C2  # type: ignore[union-attr]


def test_sessions_whose_client_is_not_known_after_a_restart_are_closed_unless_used_within_the_grace_period() -> None:
    """A READY from a worker that names no holders: nobody holds the lease; a client that uses the session takes it."""
    router = Router(LEASED, now=0.0, broker_id="b1")
    kept, orphan = "b" * 32, "c" * 32
    router.worker_message(W1, p.encode(ready("w1", capacity=4, sessions=(kept, orphan))), 1.0)
    router.client_message(C1, p.encode(p.Info(request_id="i1", session_id=kept)), 1.5)
    closes = closes_in([s for t in (1.25, 1.5, 1.75, 2.0, 2.25) for s in lease_round(router, t)])
    assert [c.session_id for c in closes] == [orphan]
    # With holders in the READY, the lease is theirs from the start.
    router = Router(LEASED, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(p.Ready(name="w1", model="m", capacity=4, free_slots=2, max_context=64,
                                               sessions=(kept, orphan), holders=(C1, C2))), 1.0)
    assert [s.identity for s in router.tick(1.25) if s.peer is Peer.CLIENT] == [C1, C2]
    assert not closes_in([s for t in (1.5, 2.0, 2.5) for s in lease_round(router, t)])


def test_without_a_grace_period_nothing_is_closed_but_the_listing_still_tells_who_is_gone() -> None:
    router = Router(Settings(heartbeat_s=0.25, recovery_s=1.0, silence_s=1000.0), now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", capacity=4)), 1.0)
    _, _, request = create(router, C1, "r1", now=1.0)
    created(router, W1, request, now=1.0)  # type: ignore[arg-type]
    gone = frozenset({C1})
    assert not closes_in([s for t in (1.25, 1.5, 10.0, 100.0) for s in lease_round(router, t, gone)])
    listing = one(router.client_message(C2, p.encode(p.Sessions(request_id="l")), 100.0))[2]
    assert isinstance(listing, p.SessionList) and [(e.client, e.gone_ms) for e in listing.sessions] == [("gone", 98500)]


def test_with_keys_a_client_lists_and_closes_its_own_sessions_and_an_admin_key_any() -> None:
    admin = "C" * 40
    router = Router(Settings(heartbeat_s=0.25, recovery_s=1.0, authenticated=True), now=0.0, broker_id="b1")
    router.admins = frozenset({admin})
    router.worker_message(W1, p.encode(ready("w1", capacity=4)), 2.0)
    owned = {}
    for client, user in ((C1, ALICE), (C2, BOB)):
        _, _, request = one(router.client_message(client, p.encode(p.CreateSession(request_id="r")), 2.0, user=user))
        created(router, W1, request)  # type: ignore[arg-type]
        owned[user] = request.session_id  # type: ignore[attr-defined]

    def listed(user: str) -> list[tuple[str, str]]:
        answer = one(router.client_message(b"ops", p.encode(p.Sessions(request_id="l")), 2.1, user=user))[2]
        assert isinstance(answer, p.SessionList)
        return sorted((e.session_id, e.owner) for e in answer.sessions)

    assert listed(ALICE) == [(owned[ALICE], ALICE)]
    assert listed(admin) == sorted([(owned[ALICE], ALICE), (owned[BOB], BOB)])
    _, _, refused = one(router.client_message(b"ops", p.encode(p.Close(request_id="x", session_id=owned[BOB])), 2.2,
                                              user=ALICE))
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.UNAUTHORIZED
    _, identity, close = one(router.client_message(b"ops", p.encode(p.Close(request_id="x", session_id=owned[BOB])),
                                                   2.2, user=admin))
    assert identity == W1 and isinstance(close, p.Close)
    assert router.registry.session(owned[BOB]).client == C2  # type: ignore[union-attr]  # the admin took no lease
    _, _, generate = one(router.client_message(b"ops", p.encode(p.Generate(request_id="g", session_id=owned[ALICE])),
                                               2.3, user=admin))
    assert isinstance(generate, p.Error) and generate.code is p.ErrorCode.UNAUTHORIZED  # admins close, not use


def test_after_a_stall_of_its_own_the_broker_gives_a_worker_whose_connection_closed_a_window_to_come_back() -> None:
    """The broker's process did not run for a while: libzmq's heartbeat timeout closed w1's connection although w1 had
    answered (its answer waited unread). w1 is not declared gone: it reconnects and says READY, and the request whose
    send failed meanwhile is sent to it then. A worker that does not come back within the window is gone."""
    sid, sid2 = "a" * 32, "b" * 32
    router = Router(Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0, silence_s=1000.0), now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready("w1", sessions=(sid,))), 2.0)
    router.worker_message(W2, p.encode(ready("w2", sessions=(sid2,))), 2.0)
    router.stalled(2.4, 0.6)
    info = p.Info(request_id="i1", session_id=sid)
    [forward] = router.client_message(C1, p.encode(info), 2.41)
    assert router.undeliverable(forward, Failure.UNREACHABLE, 2.41) == []  # held, not session_lost
    beat = Send(Peer.WORKER, W2, p.encode(p.Heartbeat(broker_id="b1")))
    assert router.undeliverable(beat, Failure.UNREACHABLE, 2.42) == []
    # No placement on a worker that may be gone: with no other, the create waits for them.
    assert router.client_message(C2, p.encode(p.CreateSession(request_id="r1")), 2.43) == []
    back = decoded(router.worker_message(W1, p.encode(ready("w1", sessions=(sid,))), 2.5))
    assert back[0] == (Peer.WORKER, W1, info.routed(C1))  # sent again, then welcomed, then the create placed
    assert isinstance(back[1][2], p.Welcome) and router.registry.worker_of(sid) is not None
    assert back[2][1] == W1 and isinstance(back[2][2], p.CreateSession) and back[2][2].route == C2
    router.tick(2.75)  # w2 never came back: gone a heartbeat window (0.75 s) after it was found unreachable
    assert W2 in router.registry.workers
    router.tick(3.25)
    assert W2 not in router.registry.workers and router.registry.gone(sid2) is Gone.LOST
    # Outside the window after a stall, a closed connection is a gone worker at once.
    [forward] = router.client_message(C1, p.encode(p.Info(request_id="i2", session_id=sid)), 3.3)
    answers = {m.request_id: m.code for _, _, m in decoded(router.undeliverable(forward, Failure.UNREACHABLE, 3.3))
               if isinstance(m, p.Error)}
    assert answers == {"i1": p.ErrorCode.SESSION_LOST, "i2": p.ErrorCode.SESSION_LOST,
                       "r1": p.ErrorCode.MODEL_NOT_FOUND}  # the create, placed again: no worker left
    assert router.counters.stalls == 1
