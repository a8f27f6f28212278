"""The client's socket: one DEALER to the broker, answers sorted into one mailbox per request id.

Several calls may be open at once on one thread (e.g. two interleaved streams): whichever call waits
reads the socket for all of them. A CHUNKS message (one engine step's tokens for several of this
client's streams) is split here into its per-request chunks. A Transport belongs to one thread, like the
ZeroMQ socket it owns.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from broker.common import protocol as p
from broker.common.keys import HANDSHAKE_FAILED, HANDSHAKE_REFUSED, CurveClient
from client.calls import Answer, Call, addressed, decode_answer
from client.errors import ClientError, Timeout, Unauthorized

log = structlog.get_logger()

RECV_BATCH = 1024
REFUSAL_CHECK_S = 0.1  # until the broker has answered once, a waiting call looks this often for a refused handshake


class HandshakeWatch:
    """Notices refused handshakes (ZeroMQ retries them silently), so that a call can say so at once: `refused()` is
    whether the last handshake this socket tried was refused (a later one that succeeds, e.g. once the key is
    allowed, clears it)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        address = f"inproc://handshake-{uuid.uuid4().hex}"
        sock.monitor(address, HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(sock.context.underlying)  # also for asyncio
        self._pair: zmq.Socket[bytes] = self._context.socket(zmq.PAIR)
        self._pair.connect(address)
        self._refused = False

    def refused(self) -> bool:
        while True:
            try:
                event = recv_monitor_message(self._pair, zmq.NOBLOCK)
            except zmq.Again:
                return self._refused
            self._refused = bool(int(event["event"]) & HANDSHAKE_FAILED)

    def close(self) -> None:
        self._pair.close(linger=0)


def timed_out(watch: HandshakeWatch, address: str, timeout_s: float, request_id: str) -> ClientError:
    """The error for a wait with no answer: Unauthorized when the broker refused our handshake."""
    if watch.refused():
        return Unauthorized(HANDSHAKE_REFUSED, request_id=request_id)
    return Timeout(f"no answer within {timeout_s:g} s from {address}", request_id=request_id)


def send_failed(watch: HandshakeWatch, address: str) -> ClientError:
    """The error for a send the socket did not take (no connection would have it): Unauthorized when that is because
    the broker refused our handshake."""
    if watch.refused():
        return Unauthorized(HANDSHAKE_REFUSED)
    return Timeout(f"cannot send to {address}: the send queue is full (is the broker up?)")


def connect_client(context: zmq.Context[Any], sock: zmq.Socket[Any], address: str,
                   curve: CurveClient | None = None) -> HandshakeWatch:
    """Set up and connect a DEALER with a stable routing id (after a broker restart it reconnects as the same
    peer); returns the watch on its handshakes. A malformed address is a ClientError, after the socket and
    the context are freed (a context with an open socket would wait forever in term())."""
    watch = HandshakeWatch(sock)
    try:
        _connect(sock, address, curve)
    except zmq.ZMQError as e:
        watch.close()
        sock.close(linger=0)
        context.term()
        raise ClientError(f"cannot connect to {address!r}: {e}") from e
    return watch


def _connect(sock: zmq.Socket[Any], address: str, curve: CurveClient | None) -> None:
    sock.setsockopt(zmq.ROUTING_ID, b"c" + uuid.uuid4().bytes)  # ids starting with 0 are ZeroMQ's own
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings find a vanished broker host and reconnect
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    if curve is not None:
        curve.apply(sock)
    sock.connect(address)


class Transport:
    def __init__(self, address: str, resend_after_s: float, curve: CurveClient | None = None) -> None:
        self.address = address
        self.resend_after_s = resend_after_s
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        self._watch = connect_client(self._context, self._socket, address, curve)
        self._mail: dict[str, deque[Answer]] = {}
        self._heard = False  # the broker has answered once: its handshake succeeded
        self.closed = False

    def start(self, request: p.Message) -> Call:
        """Send a request; its answers collect in a mailbox until `finish`."""
        if self.closed:
            raise ClientError("the client is closed")
        call = Call.of(request, time.monotonic(), self.resend_after_s)
        self._mail[call.request_id] = deque()
        self._send(call.frames)
        return call

    def next(self, call: Call, timeout_s: float) -> Answer:
        """The call's next answer; resends on schedule; Timeout when nothing comes within timeout_s."""
        box = self._mail[call.request_id]
        deadline = time.monotonic() + timeout_s
        while not box:
            now = time.monotonic()
            if now >= deadline:
                raise timed_out(self._watch, self.address, timeout_s, call.request_id)
            wait_s = call.wake_at(deadline) - now
            if not self._heard:  # a refused handshake is said at once, not after the timeout
                if self._watch.refused():
                    raise Unauthorized(HANDSHAKE_REFUSED, request_id=call.request_id)
                wait_s = min(wait_s, REFUSAL_CHECK_S)
            if call.resend_due(now):
                log.debug("request_resent", request=call.request_id)
                self._send(call.frames)
                call.resent(now)
            self._pump(wait_s)
        call.heard(time.monotonic())
        return box.popleft()

    def finish(self, call: Call) -> None:
        self._mail.pop(call.request_id, None)

    def oneway(self, request: p.Message) -> None:
        """Send something nothing answers (CANCEL). Best effort: a closed client sends nothing."""
        if not self.closed:
            self._send(p.encode(request))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._watch.close()
            self._socket.close(linger=0)
            self._context.term()

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again as e:
            raise send_failed(self._watch, self.address) from e

    def _pump(self, timeout_s: float) -> None:
        if not self._socket.poll(max(0, round(timeout_s * 1000)), zmq.POLLIN):
            return
        for _ in range(RECV_BATCH):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._heard = True
            for request_id, item in addressed(decode_answer(frames)):
                box = self._mail.get(request_id)
                if box is not None:
                    box.append(item)
