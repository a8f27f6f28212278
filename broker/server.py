"""The broker's I/O loop: two ROUTER sockets, a poll with the next timer as timeout, the router's output sent.

Majordomo's shape: poll, dispatch on the socket a message came from, then run the timers (dead workers,
heartbeats). Every send is NOBLOCK: a peer that is gone (EHOSTUNREACH, thanks to ROUTER_MANDATORY) or
full (EAGAIN at its high-water mark) never blocks the loop; the router decides what that means.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq

from . import protocol as p
from .router import Failure, Peer, Router, Send, Settings

log = structlog.get_logger()

# Messages read from one socket before looking at the other and at the timers: keeps both fair.
RECV_BATCH = 256
MAX_POLL_S = 0.25  # a stop request is noticed within this
# Plain ints: pyzmq's send_multipart combines enum flags per frame, which costs ~10% of the broker's time.
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)


@dataclass(frozen=True)
class BrokerConfig:
    clients: str = "tcp://127.0.0.1:5555"
    workers: str = "tcp://127.0.0.1:5556"
    heartbeat_ms: int = 1000
    liveness: int = 3
    recovery_ms: int | None = None  # None: (liveness + 2) heartbeats
    hwm: int = 100_000  # messages queued per peer before sends to it fail with EAGAIN
    max_message_bytes: int = p.MAX_MESSAGE_BYTES

    def settings(self) -> Settings:
        recovery = self.recovery_ms if self.recovery_ms is not None else (self.liveness + 2) * self.heartbeat_ms
        return Settings(heartbeat_s=self.heartbeat_ms / 1000, liveness=self.liveness, recovery_s=recovery / 1000)


class BrokerServer:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.router = Router(config.settings(), time.monotonic())
        self._context = zmq.Context()
        try:
            self.clients = self._router_socket(config.clients)
            try:
                self.workers = self._router_socket(config.workers)
            except OSError:
                self.clients.close(linger=0)
                raise
        except OSError:
            self._context.term()
            raise

    def _router_socket(self, address: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        # All options before bind: they apply to connections accepted from then on.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> EHOSTUNREACH, not a silent drop
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer that reconnects with its id takes it over
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)  # bigger: ZeroMQ drops the peer
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close()
            raise OSError(f"cannot bind {address}: {e}") from e
        return sock

    def serve(self, should_stop: Callable[[], bool]) -> None:
        log.info(
            "broker_started", broker_id=self.router.broker_id, clients=self.config.clients,
            workers=self.config.workers, heartbeat_ms=self.config.heartbeat_ms, liveness=self.config.liveness,
        )
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        while not should_stop():
            now = time.monotonic()
            timeout_s = min(max(self.router.next_tick() - now, 0.0), MAX_POLL_S)
            ready = dict(poller.poll(round(timeout_s * 1000)))
            if self.workers in ready:
                self._drain(self.workers, self.router.worker_message)
            if self.clients in ready:
                self._drain(self.clients, self.router.client_message)
            now = time.monotonic()
            if now >= self.router.next_tick():
                self._send_all(self.router.tick(now))
        log.info("broker_stopping", workers=len(self.router.registry.workers), inflight=len(self.router.inflight))

    def close(self) -> None:
        self.clients.close(linger=0)
        self.workers.close(linger=0)
        self._context.term()

    def _drain(self, sock: zmq.Socket[bytes], handle: Callable[[bytes, list[bytes], float], list[Send]]) -> None:
        for _ in range(RECV_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:  # a ROUTER always prepends the peer's id; nothing to answer to
                continue
            self._send_all(handle(frames[0], frames[1:], time.monotonic()))

    def _send_all(self, sends: list[Send]) -> None:
        queue = deque(sends)
        while queue:
            send = queue.popleft()
            failure = self._send(send)
            if failure is not None:
                queue.extend(self.router.undeliverable(send, failure, time.monotonic()))

    def _send(self, send: Send) -> Failure | None:
        sock = self.clients if send.peer is Peer.CLIENT else self.workers
        try:
            # The first frame decides (EHOSTUNREACH, EAGAIN); once it is taken the rest of the message is too.
            sock.send(send.identity, _MORE)
            last = len(send.frames) - 1
            for i, frame in enumerate(send.frames):
                sock.send(frame, _MORE if i < last else _LAST)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return Failure.UNREACHABLE
            if e.errno == zmq.EAGAIN:
                return Failure.FULL
            log.error("send_failed", peer=send.peer.value, error=str(e))
            return Failure.UNREACHABLE
        return None
