"""What the broker takes from worker-socket peers: READY size and content limits, per-peer rates (broker.admission),
and how the router applies them, with exact values and no sockets."""

from __future__ import annotations

import time

import msgpack

from broker.admission import (
    DEFAULT_MAX_WORKER_SESSIONS,
    HEARTBEAT_BURST,
    READY_BURST,
    Admission,
)
from broker.common import protocol as p
from broker.router import Peer, Router, Settings

SETTINGS = Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0, max_worker_sessions=8)
W1 = b"w1-id"


def ready(capacity: int = 2, sessions: tuple[str, ...] = (), **more: object) -> p.Ready:
    fields: dict[str, object] = {"name": "w1", "model": "m", "max_context": 64, **more}
    return p.Ready(capacity=capacity, free_slots=max(0, capacity - len(sessions)), sessions=sessions, **fields)  # type: ignore[arg-type]


def sids(n: int) -> tuple[str, ...]:
    return tuple(f"{i:032x}" for i in range(n))


def test_the_largest_admissible_ready_fits_the_size_limit_and_one_session_more_does_not_pass_the_content_check() -> None:
    admission = Admission(0.25, max_worker_sessions=8)
    wide = "\U0001d54f" * p.MAX_NAME_CHARS  # 4 bytes a character
    biggest = ready(8, sids(8), owners=("A" * 40,) * 8, holders=(b"r" * p.MAX_ROUTE_BYTES,) * 8, name=wide,
                    model=wide, device=wide, bytes_per_session=2**62)
    header = p.encode(biggest)[2]
    assert admission.too_large(p.Command.READY, len(header)) is None
    assert admission.ready_problem(biggest) is None
    # The limit is no looser than needed: under 1 KiB to spare (for fields a newer worker may add).
    assert 0 < admission.max_ready_bytes - len(header) < 1024
    assert admission.ready_problem(ready(9)) == (
        "capacity 9 is more sessions than this broker takes from one worker: 8 (--max-worker-sessions)")
    assert admission.ready_problem(ready(2, sids(3))) == "READY lists 3 sessions for a capacity of 2"
    assert admission.ready_problem(ready(4, ("a" * 32, "a" * 32))) == "READY lists a session twice"


def test_buckets_refill_per_heartbeat_and_each_peer_has_its_own() -> None:
    admission = Admission(0.25)
    assert [admission.allow(W1, p.Command.READY, 0.0) for _ in range(READY_BURST + 1)] == [True] * READY_BURST + [False]
    assert admission.allow(b"other", p.Command.READY, 0.0)  # another peer: a bucket of its own
    assert not admission.allow(W1, p.Command.READY, 0.2)
    assert admission.has_token(W1, p.Command.READY, 0.25)  # one more per heartbeat
    assert admission.allow(W1, p.Command.READY, 0.25) and not admission.allow(W1, p.Command.READY, 0.25)
    beats = [admission.allow(W1, p.Command.HEARTBEAT, 1.0) for _ in range(HEARTBEAT_BURST + 1)]
    assert beats.count(True) == HEARTBEAT_BURST  # heartbeats: a bucket apart from READY's
    assert [admission.allow(W1, p.Command.READY, 10.0) for _ in range(READY_BURST + 1)].count(True) == READY_BURST


def test_a_ready_with_200k_sessions_is_refused_unread_and_costs_the_broker_next_to_nothing() -> None:
    """The attack measured: READYs listing 200k session ids took ~0.35 s each to read, and 20 peers sending them kept
    a good client waiting 9.2 s. Now such a READY is refused by its length (an ERROR naming the limit) before it is
    decoded, and the peer stays unregistered."""
    router = Router(Settings(heartbeat_s=0.25, recovery_s=0.0), now=0.0, broker_id="b1")
    huge = [p.VERSION, b"READY", msgpack.packb({"name": "evil", "model": "m", "capacity": 200_000, "free_slots": 0,
                                                "max_context": 64, "sessions": list(sids(200_000))})]
    started = time.perf_counter()
    answers = [router.worker_message(bytes([i]) * 8, huge, 1.0) for i in range(20)]
    elapsed = time.perf_counter() - started
    assert elapsed < 0.2, f"20 huge READYs took {elapsed:.3f} s"
    for sends in answers:
        [(peer, message)] = [(s.peer, p.decode(s.frames)) for s in sends]
        assert peer is Peer.WORKER and isinstance(message, p.Error) and message.code is p.ErrorCode.BAD_REQUEST
        assert message.message.startswith("registration refused: READY of ")
        assert f"what {DEFAULT_MAX_WORKER_SESSIONS} sessions take (--max-worker-sessions)" in message.message
    assert not router.registry.workers and router.counters.messages_dropped == {"ready_refused": 20}


def test_the_router_refuses_readies_over_the_limits_and_over_the_rate_and_asks_a_worker_again_later() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    refused = router.worker_message(W1, p.encode(ready(9)), 1.0)
    assert [p.decode(s.frames) for s in refused] == [p.Error(
        request_id=None, code=p.ErrorCode.BAD_REQUEST,
        message="registration refused: capacity 9 is more sessions than this broker takes from one worker: 8 "
                "(--max-worker-sessions)")]
    assert not router.registry.workers
    welcomed = [type(p.decode(s.frames)) for _ in range(READY_BURST - 1)
                for s in router.worker_message(W1, p.encode(ready(2)), 1.0)]
    assert welcomed == [p.Welcome] * (READY_BURST - 1)
    newest = ready(2, sids(1))  # its latest state, over the rate: dropped unread...
    assert router.worker_message(W1, p.encode(newest), 1.0) == []
    assert router.counters.messages_dropped == {"ready_refused": 1, "rate_limited": 1}
    assert router.registry.workers[W1].sessions == set()
    # ... and once its rate allows, the broker asks for it again (RECONNECT), so nothing it said is lost.
    assert [p.decode(s.frames) for s in router.tick(1.0) if s.peer is Peer.WORKER] == [p.Heartbeat(broker_id="b1")]
    out = [p.decode(s.frames) for s in router.tick(1.25) if s.peer is Peer.WORKER]
    assert out == [p.Heartbeat(broker_id="b1"), p.Reconnect(broker_id="b1")]
    router.worker_message(W1, p.encode(newest), 1.3)
    assert router.registry.workers[W1].sessions == set(sids(1))


def test_a_heartbeat_listing_more_expired_sessions_than_a_worker_can_hold_is_dropped_unread() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(ready(2, sids(2))), 1.0)
    flood = p.encode(p.Heartbeat(expired=sids(5000)))
    assert router.worker_message(W1, flood, 1.1) == []
    assert router.counters.messages_dropped == {"too_large": 1}
    assert router.registry.workers[W1].sessions == set(sids(2))


def test_strangers_heartbeats_are_not_read_and_their_requests_and_garbage_are_dropped_and_counted() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    junk_beat = [p.VERSION, b"HEARTBEAT", b"\xc1"]  # a stranger's heartbeat: RECONNECT, without reading it
    assert [p.decode(s.frames) for s in router.worker_message(b"s", junk_beat, 2.0)] == [p.Reconnect(broker_id="b1")]
    assert router.worker_message(b"s", p.encode(p.Info(request_id="i", session_id="a" * 32)), 2.0) == []
    assert router.worker_message(b"s", [b"SSP9", b"READY", b""], 2.0) == []
    assert router.worker_message(b"s", p.encode(p.Disconnect()), 2.0) == []
    assert router.counters.messages_dropped == {"unexpected": 1, "malformed": 1}
