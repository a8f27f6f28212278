"""The broker's I/O loop in-process (real sockets on 127.0.0.1): whatever the handling of one message raises is logged
and counted, and the loop goes on serving; liveness bookkeeping without sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import zmq

from broker.common import protocol as p
from broker.liveness import Liveness
from broker.router import Peer, Send
from broker.server import MIN_RECOVERY_MS, BrokerConfig, BrokerServer
from client.stack import free_port


@pytest.fixture
def loop() -> Iterator[BrokerServer]:
    config = BrokerConfig(clients=f"tcp://127.0.0.1:{free_port()}", workers=f"tcp://127.0.0.1:{free_port()}",
                          heartbeat_ms=100, recovery_ms=100)
    server = BrokerServer(config)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def ask_status(address: str, request_id: str) -> p.Message:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart(p.encode(p.Status(request_id=request_id)))
        assert sock.poll(5000), "the broker does not answer"
        return p.decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)
        context.term()


def test_a_message_whose_handling_raises_is_counted_and_the_loop_serves_on(loop: BrokerServer) -> None:
    router = loop.router
    real = router.worker_message
    calls: list[bytes] = []

    def buggy(identity: bytes, frames: Sequence[p.Frame], now: float) -> list[Send]:
        calls.append(bytes(frames[1]))
        if frames[1] == b"HEARTBEAT":
            router._out.append(Send(Peer.WORKER, b"half-made", [b"junk"]))  # output queued before the bug: dropped
            raise RuntimeError("a bug in the broker")
        return real(identity, frames, now)

    router.worker_message = buggy  # type: ignore[method-assign]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = context.socket(zmq.DEALER)
    try:
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(loop.config.workers)
        for _ in range(3):
            peer.send_multipart(p.encode(p.Heartbeat()))
        peer.send_multipart(p.encode(p.Ready(name="w", model="m", capacity=1, free_slots=1, max_context=8)))
        assert peer.poll(5000) and isinstance(p.decode(peer.recv_multipart()), p.Welcome)  # served on
        assert calls[:4] == [b"HEARTBEAT"] * 3 + [b"READY"]
        assert router.counters.loop_errors == 3
        answer = ask_status(loop.config.clients, "s1")
        assert isinstance(answer, p.StatusReport) and [w.name for w in answer.workers] == ["w"]
    finally:
        peer.close(linger=0)
        context.term()


def test_the_recovery_window_is_at_least_two_seconds_and_longer_with_slow_heartbeats() -> None:
    assert BrokerConfig(heartbeat_ms=200).recovery() == MIN_RECOVERY_MS == 2000
    assert BrokerConfig(heartbeat_ms=1000).recovery() == 5000  # (liveness + 2) heartbeats
    assert BrokerConfig(heartbeat_ms=200, recovery_ms=300).recovery() == 300


def test_liveness_a_silent_worker_is_missing_after_a_heartbeat_window_and_gone_after_the_silence() -> None:
    live = Liveness(0.1, 3, now=0.0, silence_s=2.0)
    live.seen(b"w", 1.0)
    assert not live.missing(b"w", 1.29) and live.missing(b"w", 1.3)
    assert live.expired(2.99) == [] and live.next_event() == pytest.approx(0.1)
    assert live.expired(3.0) == [b"w"] and live.expired(4.0) == []
    assert Liveness(0.1, 3, now=0.0).silence_s == pytest.approx(0.3)  # by default the heartbeat window
    assert Liveness(0.1, 3, now=0.0, silence_s=0.01).silence_s == pytest.approx(0.3)  # never shorter


def test_a_relayed_move_chunk_reaches_the_target_byte_for_byte(loop: BrokerServer) -> None:
    """The broker keeps a received MOVE_CHUNK's state in ZeroMQ's message (no copy) and sends it on as it came."""
    import time

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    w1, w2, admin = (context.socket(zmq.DEALER) for _ in range(3))
    session = "a" * 32
    try:
        for sock in (w1, w2, admin):
            sock.setsockopt(zmq.LINGER, 0)
        time.sleep(0.2)  # past the recovery window: the session is placed where w1 says it is
        for sock, name, held in ((w1, "w1", (session,)), (w2, "w2", ())):
            sock.connect(loop.config.workers)
            sock.send_multipart(p.encode(p.Ready(name=name, model="m", capacity=2, free_slots=2 - len(held),
                                                 max_context=8, sessions=held)))
            assert sock.poll(5000) and isinstance(p.decode(sock.recv_multipart()), p.Welcome)
        admin.connect(loop.config.clients)
        admin.send_multipart(p.encode(p.DrainWorker(request_id="d1", worker="w1")))
        assert w1.poll(5000)
        move = p.decode(w1.recv_multipart())
        assert isinstance(move, p.Move) and move.session_id == session and move.target == "w2"
        state = bytes(range(256)) * 8192  # 2 MiB: kept as ZeroMQ's message in the broker
        header = p.MoveState(migration=move.migration, session_id=session, tokens=(1,), computed=1,
                             nbytes=len(state), chunks=1, model="m", layout="x", digest=bytes(p.DIGEST_BYTES))
        w1.send_multipart(p.encode(header))
        w1.send_multipart(p.encode(p.MoveChunk(migration=move.migration, index=0, data=state)), copy=False)
        got: list[p.Message] = []
        while len(got) < 2:
            assert w2.poll(5000), "nothing relayed"
            message = p.decode(w2.recv_multipart())
            if not isinstance(message, p.Heartbeat):
                got.append(message)
        assert got[0] == header
        assert isinstance(got[1], p.MoveChunk) and got[1].index == 0 and got[1].data == state
    finally:
        for sock in (w1, w2, admin):
            sock.close(linger=0)
        context.term()


def test_a_stop_between_two_turns_of_the_loop_is_noticed_as_a_stall() -> None:
    """The loop measured its polls and its turns, not the moment between two turns: a SIGSTOP landing there (the
    loop's pulse, its stop check) went unnoticed, and a broker stopped past the heartbeat window could lose workers
    whose connections libzmq closed meanwhile (a failure of the broker-stop test on a loaded machine)."""
    config = BrokerConfig(clients=f"tcp://127.0.0.1:{free_port()}", workers=f"tcp://127.0.0.1:{free_port()}",
                          heartbeat_ms=100, recovery_ms=100)
    server = BrokerServer(config)
    beats = 0
    real = server.pulse.beat

    def beat() -> None:  # the process not running for 0.5 s at the top of its 5th turn
        nonlocal beats
        beats += 1
        if beats == 5:
            time.sleep(0.5)
        real()

    server.pulse.beat = beat  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while server.router.counters.stalls == 0:
            assert time.monotonic() < deadline, "the stall went unnoticed"
            time.sleep(0.01)
        assert server.router.counters.stalls == 1
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
