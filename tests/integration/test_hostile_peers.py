"""Peers on the broker's worker socket that are not what they claim, against the real daemons: a message from a peer
that never registered cannot take the broker down, a fake worker cannot hold requests by heartbeating, a create it
takes and drops is placed again, and floods of huge READYs cost the broker neither memory nor a good client's time."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from broker.common import protocol as p
from client import Timeout

from .cluster import Cluster, Measure

PROMPT = [7, 8, 9, 10]


class FakeWorker:
    """A DEALER on the broker's worker socket, in a thread: registers (or not), heartbeats with a step count that
    rises every beat (what used to count as progress), and answers nothing."""

    def __init__(self, address: str, *, capacity: int = 8, register: bool = True, beat_s: float = 0.05) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"fake-{uuid.uuid4().hex[:8]}".encode())
        self.sock.connect(address)
        self.capacity = capacity
        self.register = register
        self.beat_s = beat_s
        self.received: list[p.Message] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.vanish()

    def send(self, frames: list[bytes]) -> None:
        with self._lock:
            self.sock.send_multipart(frames)

    def got(self, kind: type[p.Message]) -> list[p.Message]:
        return [m for m in list(self.received) if isinstance(m, kind)]

    def vanish(self) -> None:
        """Close the connection without a word (a crashed or cut-off fake)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        self.sock.close(linger=0)
        self.context.term()

    def _run(self) -> None:
        if self.register:
            self.send(p.encode(p.Ready(name="fake", model="random-tiny", capacity=self.capacity,
                                       free_slots=self.capacity, max_context=2048)))
        steps = 0
        while not self._stop.is_set():
            steps += 1000
            self.send(p.encode(p.Heartbeat(free_slots=self.capacity, sessions=0, steps=steps)))
            with self._lock:
                while self.sock.poll(0):
                    self.received.append(p.decode(self.sock.recv_multipart()))
            self._stop.wait(self.beat_s)


@pytest.fixture
def guarded(cluster: Cluster) -> Iterator[Cluster]:
    """A broker with a 1 s request deadline and one random:tiny worker w1 of 2 slots."""
    cluster.start_broker(["--request-timeout-ms", "1000"])
    cluster.start_worker("w1", max_sessions=2)
    cluster.wait_for_workers({"w1"})
    yield cluster


def test_a_fanout_with_bad_parts_from_a_peer_that_never_registered_does_not_take_the_broker_down(
    guarded: Cluster,
) -> None:
    """The one message that killed the broker (exit code 1): a FANOUT whose route is no connected client and whose
    part is not a msgpack map, from a peer that is not registered. Then the same from a registered one."""
    bad = [[p.VERSION, b"FANOUT", msgpack.packb({"routes": [b"nobody"], "parts": [part]})]
           for part in (b"\xc1", msgpack.packb([1, 2]), b"")]
    assert guarded.broker is not None
    with FakeWorker(guarded.workers_address, register=False) as stranger:
        for frames in bad:
            stranger.send(frames)
        time.sleep(0.5)
        assert guarded.broker.alive and stranger.got(p.Reconnect)  # it was asked to register, nothing else
        assert not [m for m in stranger.received if not isinstance(m, p.Reconnect)]
    with FakeWorker(guarded.workers_address, capacity=1) as registered:
        time.sleep(0.3)
        assert registered.got(p.Welcome)
        for frames in bad:
            registered.send(frames)
        time.sleep(0.5)
    assert guarded.broker.alive
    with guarded.client() as c, c.session() as s:  # still serving
        s.append(token_ids=PROMPT)
        assert len(s.generate(max_tokens=4, ignore_eos=True).token_ids) == 4
    log = guarded.broker.log_text()
    assert "Traceback" not in log and "broker_loop_error" not in log
    assert "reason=unregistered" in log or '"reason": "unregistered"' in log


def test_a_fake_worker_that_heartbeats_rising_steps_cannot_hold_a_request_past_the_deadline(
    guarded: Cluster, measure: Measure
) -> None:
    """It registers with more free slots than w1, takes the create and answers nothing, heartbeating a step count
    that rises every beat: the request still fails with `timeout` after 1 s (progress is what reaches the client)."""
    with FakeWorker(guarded.workers_address, capacity=8) as fake, guarded.client(timeout=10) as c:
        guarded.wait_for_workers({"w1", "fake"})
        started = time.monotonic()
        with pytest.raises(Timeout, match="worker fake made no progress on this request for 1 s"):
            c.session()
        waited = time.monotonic() - started
        measure("black_holed_create_timed_out_after_s", round(waited, 3))
        assert 1.0 <= waited < 1.0 + 2 * guarded.heartbeat_ms / 1000 + 0.5
        assert len(fake.got(p.CreateSession)) == 1


def test_a_create_placed_on_a_worker_that_vanishes_is_placed_again_on_one_with_room(
    cluster: Cluster, measure: Measure
) -> None:
    cluster.start_broker()  # no request deadline: only the fake's disappearance can end the create
    cluster.start_worker("w1", max_sessions=2)
    cluster.wait_for_workers({"w1"})
    fake = FakeWorker(cluster.workers_address, capacity=8).__enter__()
    try:
        cluster.wait_for_workers({"w1", "fake"})
        with cluster.client(timeout=20) as c:
            result: list[object] = []
            creating = threading.Thread(target=lambda: result.append(c.session()))
            creating.start()
            deadline = time.monotonic() + 10
            while not fake.got(p.CreateSession):  # it took the create
                assert time.monotonic() < deadline
                time.sleep(0.02)
            vanished = time.monotonic()
            fake.vanish()
            creating.join(timeout=15)
            measure("vanish_to_created_elsewhere_s", round(time.monotonic() - vanished, 3))
            [session] = result
            assert session.worker == "w1"  # type: ignore[attr-defined]
            session.append(token_ids=PROMPT)  # type: ignore[attr-defined]
            assert [w.name for w in c.status()] == ["w1"]
    finally:
        if not fake._stop.is_set():
            fake.vanish()


@pytest.mark.parametrize("cluster", [{"heartbeat_ms": 1000}], indirect=True)
def test_floods_of_huge_readies_cost_the_broker_neither_memory_nor_a_good_client_s_time(
    cluster: Cluster, measure: Measure
) -> None:
    """20 peers sending READYs of 200k session ids each (6.8 MB): they were read whole (~0.35 s each), took the
    broker to ~900 MB and kept a good client waiting 9.2 s. Now each is refused unread (its length), with an ERROR
    naming the limit. (The broker's default heartbeats here: ZeroMQ counts a message toward a connection's liveness
    only once it has all arrived, and 136 MB at once on a loaded host can take longer than 100 ms heartbeats allow.)"""
    cluster.start_broker()
    cluster.start_worker("w1", max_sessions=2)
    cluster.wait_for_workers({"w1"})
    guarded = cluster
    assert guarded.broker is not None
    rss_before = _rss_mb(guarded.broker.pid)
    huge = [p.VERSION, b"READY", msgpack.packb({
        "name": "evil", "model": "random-tiny", "capacity": 200_000, "free_slots": 0, "max_context": 2048,
        "sessions": [f"{i:032x}" for i in range(200_000)]}, use_bin_type=True)]
    assert len(huge[2]) > 6_000_000
    peers = [FakeWorker(guarded.workers_address, register=False, beat_s=10.0) for _ in range(20)]
    try:
        for peer in peers:
            peer.send(huge)
        with guarded.client(timeout=30) as c, c.session() as s:
            s.append(token_ids=PROMPT)
            slowest = 0.0
            for _ in range(20):
                started = time.monotonic()
                s.info()
                slowest = max(slowest, time.monotonic() - started)
        deadline = time.monotonic() + 30
        while guarded.broker.log_text().count("ready_refused") < len(peers):  # each refused, unread
            assert time.monotonic() < deadline, "the huge READYs were not all refused"
            time.sleep(0.05)
        refusals = [p.decode(peer.sock.recv_multipart()) for peer in peers if peer.sock.poll(1000)]
    finally:
        for peer in peers:
            peer.sock.close(linger=0)
            peer.context.term()
    # ZeroMQ takes each message whole before the broker sees it (up to 136 MB at once here); glibc keeps what was
    # freed until the broker gives it back, at most a second after a large header (broker.server, malloc_trim).
    peak = rss_after = _rss_mb(guarded.broker.pid)
    deadline = time.monotonic() + 5
    while rss_after - rss_before >= 20 and time.monotonic() < deadline:
        time.sleep(0.1)
        rss_after = _rss_mb(guarded.broker.pid)
    measure("ready_flood_slowest_good_request_s", round(slowest, 3))
    measure("ready_flood_broker_rss_growth_mb", round(peak - rss_before, 1))
    measure("ready_flood_broker_rss_growth_after_trim_mb", round(rss_after - rss_before, 1))
    # Each peer is told why (on a loaded host a peer's connection may drop before the answer reaches it).
    assert refusals and all(isinstance(r, p.Error) and "registration refused: READY of" in r.message
                            for r in refusals), refusals
    assert slowest < 1.0 and rss_after - rss_before < 20
    with guarded.client() as c:
        assert [w.name for w in c.status()] == ["w1"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
