"""Routing cost: request/reply round trips per second through the broker vs a direct pyzmq echo, one run.

    python -m broker.bench.router [--seconds 3] [--window 64]

Three peers, each its own process: the real broker (`python -m broker.cli start`), a stub worker that
answers INFO at once (so the numbers are routing, not inference), and a plain ROUTER echo. The client
side runs here, with 1 request in flight (latency-bound) and with `--window` in flight (throughput),
using the same frames both ways, plus the Client library's `session.info()` for its own overhead.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from broker.common import protocol as p
from client import Client

ROOT = Path(__file__).resolve().parents[1]

SID = "b" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stub_worker(address: str) -> None:
    """Registers holding session SID and answers every INFO at once; heartbeats so it stays alive."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"stub-worker")
    sock.connect(address)
    ready = p.Ready(name="stub", model="stub", capacity=1, free_slots=0, max_context=1, sessions=(SID,))
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


def wait_until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the broker did not come up")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()

    clients, workers, echo = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    broker = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "start", "--clients", clients, "--workers", workers,
         "--log-level", "warning"], env=env, cwd=ROOT,
    )
    peers = [mp.Process(target=stub_worker, args=(workers,), daemon=True),
             mp.Process(target=echo_server, args=(echo,), daemon=True)]
    for peer in peers:
        peer.start()
    try:
        with Client(clients, timeout=2) as c:
            wait_until(lambda: [w.name for w in c.status()] == ["stub"])
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
        broker.terminate()
        broker.wait(timeout=10)


if __name__ == "__main__":
    main()
