"""Garbage on both broker sockets gets errors or is dropped; a good session running meanwhile is unaffected."""

from __future__ import annotations

import random
import socket
import threading
import uuid

import msgpack
import zmq

from broker.common import protocol as p

from .cluster import Cluster

V = p.VERSION


def garbage(rng: random.Random) -> list[list[bytes]]:
    """Messages that break the protocol in every way we can think of."""
    pack = msgpack.packb
    rid = {"request_id": "g1"}
    return [
        [rng.randbytes(rng.randint(1, 64))],
        [rng.randbytes(16) for _ in range(5)],
        [b""],
        [b"", b"", b""],
        [b"SSP0", b"CREATE", pack(rid)],  # wrong version
        [b"HTTP/1.1", b"GET /", b""],
        [V, b"NOPE", pack(rid)],  # unknown command
        [V, b"CREATE"],  # too few frames
        [V, b"CREATE", b"\xc1\xc1\xc1"],  # not msgpack
        [V, b"CREATE", pack([1, 2, 3])],  # not a map
        [V, b"CREATE", pack({1: 2})],  # non-string keys
        [V, b"CREATE", pack({"request_id": 12})],  # wrong type
        [V, b"CREATE", pack({"request_id": "x" * 500})],
        [V, b"CREATE", pack({"request_id": "g2", "model": ["a"]})],
        [V, b"GENERATE", pack({"request_id": "g3", "session_id": "0" * 32, "params": {"max_tokens": "many"}})],
        [V, b"GENERATE", pack({"request_id": "g4", "session_id": "0" * 32, "params": {"temperature": float("nan")}})],
        [V, b"APPEND", pack({"request_id": "g5", "session_id": "0" * 32, "token_ids": [True, -1, 2**40]})],
        [V, b"APPEND", pack({"request_id": "g6", "session_id": 5, "text": "x"})],
        [V, b"CREATE", pack(rid), b"payload"],  # payload where none is defined
        [V, b"REPLY", pack({"kind": "generated", "request_id": "g7", "route": b"nobody"})],  # answers from a client
        [V, b"CHUNKS", pack({"chunks": [{"request_id": "g7", "token_ids": [1], "text": "a"}], "route": b"nobody"})],
        [V, b"CHUNKS", pack({"chunks": "g7", "route": b"nobody"})],
        [V, b"CHUNKS", pack({"chunks": [{"request_id": "g7", "token_ids": [-1]}], "route": b"nobody"}), b"x"],
        [V, b"READY", pack({"name": "evil"})],  # control messages on the wrong socket
        [V, b"HEARTBEAT", pack({"broker_id": 5})],
        [V, b"CREATE", b"\x91" * 100_000],  # deeply nested arrays
        [V, b"CREATE", b"\xdd\xff\xff\xff\xff"],  # claims a 4G-item array
        [V, b"CREATE", pack({"request_id": "g8", "junk": "y" * (p.MAX_HEADER_BYTES + 1)})],  # header too big
        [V, b"APPEND", pack({"request_id": "g9", "session_id": "0" * 32, "token_ids": list(range(p.MAX_TOKENS + 1))})],
    ]


def raw_tcp_noise(port: int, rng: random.Random) -> None:
    """Bytes that are not even ZMTP."""
    for size in (1, 64, 4096, 1 << 20):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(rng.randbytes(size))
            except OSError:
                pass  # ZeroMQ may hang up first: that is fine


def test_garbage_on_both_sockets_leaves_a_good_session_unaffected(cluster: Cluster) -> None:
    broker = cluster.start_broker()
    cluster.start_worker("w1", max_sessions=2, max_context=4096)
    cluster.wait_for_workers({"w1"})
    rng = random.Random(4)
    context = zmq.Context()
    replies: dict[str, list[list[bytes]]] = {"clients": [], "workers": []}
    errors: list[BaseException] = []
    garbage_done = threading.Event()
    rounds = 0

    def good_session() -> None:
        nonlocal rounds
        try:
            with cluster.client() as c, c.session() as s:
                s.append(token_ids=[1, 2, 3])
                with s.fork() as first:
                    expected = first.generate(max_tokens=64, ignore_eos=True).token_ids
                while not garbage_done.is_set() or rounds < 3:  # all the while garbage is flying
                    rounds += 1
                    with s.fork() as twin:
                        streamed = [t for ch in twin.generate(max_tokens=64, ignore_eos=True, stream=True)
                                    for t in ch.token_ids]
                        assert streamed == expected
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=good_session)
    worker.start()
    try:
        for name, port in (("clients", cluster.client_port), ("workers", cluster.worker_port)):
            for _ in range(3):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, b"g" + uuid.uuid4().bytes)
                sock.connect(f"tcp://127.0.0.1:{port}")
                for frames in garbage(rng):
                    sock.send_multipart(frames)
                sock.send_multipart([rng.randbytes(p.MAX_MESSAGE_BYTES + 10)])  # over MAXMSGSIZE: dropped peer
                while sock.poll(300):
                    replies[name].append(sock.recv_multipart())
                sock.close()
            raw_tcp_noise(port, rng)
    finally:
        garbage_done.set()
        worker.join(timeout=60)
        context.term()
    assert not errors, errors
    assert rounds >= 3
    assert broker.alive
    assert cluster.workers["w1"].alive

    # The client socket answers what it can with typed errors; the worker socket drops garbage silently,
    # except that an unknown peer sending a heartbeat is asked to register.
    codes = {msgpack.unpackb(r[2])["code"] for r in replies["clients"] if r[:2] == [V, b"ERROR"]}
    assert codes == {"version_mismatch", "bad_request"}
    assert len(replies["clients"]) >= 20
    assert {r[1] for r in replies["workers"]} <= {b"RECONNECT"}
    with cluster.client() as c:
        assert [w.name for w in c.status()] == ["w1"]
