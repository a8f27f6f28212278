"""Routing cost: request/reply round trips per second through the broker vs a direct pyzmq echo, one run.

    python -m broker.bench.router [--seconds 3] [--window 64]

Three peers, each its own process: the real broker (`python -m broker.cli start`, started by client/stack.py,
its log in a temporary folder), a stub worker that answers INFO at once (so the numbers are routing, not
inference), and a plain ROUTER echo. The client
side runs here, with 1 request in flight (latency-bound) and with `--window` in flight (throughput),
using the same frames both ways, plus the Client library's `session.info()` for its own overhead.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import zmq

from broker.common import protocol as p
from client import Client
from client.stack import LocalStack, free_address

SID = "b" * 32
STUB = "stub"  # the stub worker's name
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def stub_worker(address: str) -> None:
    """Registers holding session SID and answers every INFO at once; heartbeats so it stays alive."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"stub-worker")
    sock.connect(address)
    ready = p.Ready(name=STUB, model="stub", capacity=1, free_slots=0, max_context=1, sessions=(SID,))
    sock.send_multipart(p.encode(ready))
    beat = p.encode(p.Heartbeat(free_slots=0, sessions=1))
    next_beat = time.monotonic()
    while True:
        if sock.poll(100):
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = p.decode(frames)
                if isinstance(message, p.Info):
                    answer = p.SessionInfo(request_id=message.request_id, session_id=SID, length=0, model="stub",
                                           worker="stub", max_context=1, route=message.route)
                    sock.send_multipart(p.encode(answer))
        if time.monotonic() >= next_beat:
            sock.send_multipart(beat)
            next_beat = time.monotonic() + 0.5


def echo_server(address: str) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        sock.send_multipart(sock.recv_multipart())


def round_trips(address: str, seconds: float, window: int) -> float:
    """Replies per second with `window` INFO requests kept in flight on one DEALER."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    requests = [p.encode(p.Info(request_id=f"r{i}", session_id=SID)) for i in range(1024)]
    for i in range(window):
        sock.send_multipart(requests[i % 1024])
    sent = window
    done = 0
    # warm up, then measure
    for phase_seconds, counting in ((0.3, False), (seconds, True)):
        start = time.perf_counter()
        counted = 0
        while time.perf_counter() - start < phase_seconds:
            sock.recv_multipart()
            counted += 1
            sock.send_multipart(requests[sent % 1024])
            sent += 1
        if counting:
            done = counted
            elapsed = time.perf_counter() - start
    for _ in range(window):
        sock.recv_multipart()
    sock.close()
    context.term()
    return done / elapsed


def client_round_trips(address: str, seconds: float) -> float:
    with Client(address, timeout=10) as c:
        s = c.attach(SID)
        for _ in range(200):
            s.info()
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            s.info()
            n += 1
        return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()

    stack = LocalStack(heartbeats=None, log_level="warning")
    clients, echo = stack.clients, free_address()
    stack.start_broker()
    peers = [mp.Process(target=stub_worker, args=(stack.workers_address,), daemon=True),
             mp.Process(target=echo_server, args=(echo,), daemon=True)]
    for peer in peers:
        peer.start()
    try:
        stack.wait_for_workers({STUB}, timeout=START_TIMEOUT_S)
        rows = []
        for window in (1, args.window):
            via_broker = round_trips(clients, args.seconds, window)
            direct = round_trips(echo, args.seconds, window)
            rows.append((f"{window} in flight", via_broker, direct))
        library = client_round_trips(clients, args.seconds)
        print(f"{'round trips/s':<28}{'via broker':>14}{'direct echo':>14}{'broker/direct':>15}")
        for name, via, direct in rows:
            print(f"{name:<28}{via:>14,.0f}{direct:>14,.0f}{via / direct:>15.2f}")
        print(f"{'Client.info(), 1 in flight':<28}{library:>14,.0f}{rows[0][2]:>14,.0f}{library / rows[0][2]:>15.2f}")
    finally:
        for peer in peers:
            peer.terminate()
        stack.stop(STOP_TIMEOUT_S)


if __name__ == "__main__":
    main()
