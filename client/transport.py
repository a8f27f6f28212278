"""The client's socket: one DEALER to the broker, answers sorted into one mailbox per request id.

Several calls may be open at once on one thread (e.g. two interleaved streams): whichever call waits
reads the socket for all of them. A CHUNKS message (one engine step's tokens for several of this
client's streams) is split here into its per-request chunks. A Transport belongs to one thread, like the
ZeroMQ socket it owns.

A client that never reached a broker says so after `connect_timeout` (BrokerUnreachable) instead of waiting out
every call's timeout. A Transport dropped without close() (garbage-collected, in any thread, or left open at exit)
closes its sockets and ends its ZeroMQ context by itself, waiting at most LINGER_MS for what is still queued.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections import deque
from typing import Any

import zmq

from broker.common import protocol as p
from broker.common.arguments import address_problem
from broker.common.keys import HANDSHAKE_FAILED, HANDSHAKE_REFUSED, CurveClient
from client.calls import CONNECT_TIMEOUT_S, Answer, Call, Orphans, addressed, decode_answer
from client.errors import BadRequest, BrokerUnreachable, ClientError, Timeout, Unauthorized
from client.logs import log

RECV_BATCH = 1024
REFUSAL_CHECK_S = 0.1  # until the broker has answered once, a waiting call looks this often for a refused handshake
LINGER_MS = 100  # what a closed client still has queued (a CANCEL) gets this long to leave, never more


class HandshakeWatch:
    """Watches the socket's handshakes, so that a call can say at once why nothing answers: `refused()` is whether
    the last handshake this socket tried was refused (ZeroMQ retries it silently; a later one that succeeds, e.g.
    once the key is allowed, clears it), `connected()` whether any ever succeeded."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        address = f"inproc://handshake-{uuid.uuid4().hex}"
        sock.monitor(address, HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(sock.context.underlying)  # also for asyncio
        self.pair: zmq.Socket[bytes] = self._context.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.LINGER, 0)
        self.pair.connect(address)
        self._refused = False
        self._connected = False

    def refused(self) -> bool:
        self._read()
        return self._refused

    def connected(self) -> bool:
        """Whether a handshake with the broker has ever succeeded (a broker answers at this address)."""
        if not self._connected:
            self._read()
        return self._connected

    def close(self) -> None:
        self.pair.close(linger=0)

    def _read(self) -> None:
        while not self.pair.closed:
            try:
                event = self.pair.recv_multipart(zmq.NOBLOCK)[0]
            except zmq.Again:
                return
            if int.from_bytes(event[:2], "little") == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                self._refused = False
            else:
                self._refused = True


def timed_out(watch: HandshakeWatch, address: str, timeout_s: float, request_id: str) -> ClientError:
    """The error for a wait with no answer: Unauthorized when the broker refused our handshake."""
    if watch.refused():
        return Unauthorized(HANDSHAKE_REFUSED, request_id=request_id)
    return Timeout(f"no answer within {timeout_s:g} s from {address}", request_id=request_id)


def unreachable(watch: HandshakeWatch, address: str, call: Call, now: float, connect_timeout_s: float) -> ClientError | None:
    """The error for a call that has waited `connect_timeout_s` on a socket that never reached a broker, else None."""
    if now - call.started < connect_timeout_s or watch.connected():
        return None
    if watch.refused():
        return Unauthorized(HANDSHAKE_REFUSED, request_id=call.request_id)
    return BrokerUnreachable(f"no broker at {address}: nothing accepted a connection within {connect_timeout_s:g} s "
                             "(is the broker running, and is this its client address?)", request_id=call.request_id)


def connect_wake_at(watch: HandshakeWatch, call: Call, connect_timeout_s: float) -> float:
    """When a waiting call must look at the connection again (never, once connected)."""
    return float("inf") if watch.connected() else call.started + connect_timeout_s


def release(context: zmq.Context[Any], sockets: list[zmq.Socket[Any]]) -> None:
    """Close the sockets and end the context, whichever thread runs it (close(), or the finalizer of a client
    dropped unclosed): ending the context waits at most LINGER_MS for queued messages, never for an open socket."""
    for sock in sockets:
        if not sock.closed:
            sock.close(linger=LINGER_MS)
    context.term()


def send_failed(watch: HandshakeWatch, address: str) -> ClientError:
    """The error for a send the socket did not take (no connection would have it): Unauthorized when that is because
    the broker refused our handshake."""
    if watch.refused():
        return Unauthorized(HANDSHAKE_REFUSED)
    return Timeout(f"cannot send to {address}: the send queue is full (is the broker up?)")


def connect_client(context: zmq.Context[Any], sock: zmq.Socket[Any], address: str,
                   curve: CurveClient | None = None) -> HandshakeWatch:
    """Set up and connect a DEALER with a stable routing id (after a broker restart it reconnects as the same
    peer); returns the watch on its handshakes. A malformed address is a BadRequest, after the socket and
    the context are freed (a context with an open socket would wait forever in term())."""
    problem = address_problem(address)
    if problem is not None:
        context.destroy(linger=0)
        raise BadRequest(f"the broker's address: {problem}")
    watch = HandshakeWatch(sock)
    try:
        _connect(sock, address, curve)
    except zmq.ZMQError as e:
        release(context, [watch.pair, sock])
        raise BadRequest(f"cannot connect to {address!r}: {e} (an address is tcp://HOST:PORT)") from e
    return watch


def _connect(sock: zmq.Socket[Any], address: str, curve: CurveClient | None) -> None:
    sock.setsockopt(zmq.ROUTING_ID, b"c" + uuid.uuid4().bytes)  # ids starting with 0 are ZeroMQ's own
    sock.setsockopt(zmq.LINGER, LINGER_MS)
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
    def __init__(self, address: str, resend_after_s: float, curve: CurveClient | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.resend_after_s = resend_after_s
        self.connect_timeout_s = connect_timeout_s
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        self._watch = connect_client(self._context, self._socket, address, curve)
        self._release = weakref.finalize(self, release, self._context, [self._watch.pair, self._socket])
        self._mail: dict[str, deque[Answer]] = {}
        self.orphans = Orphans()
        self._heard = False  # the broker has answered once: its handshake succeeded
        self.closed = False

    def start(self, request: p.Message) -> Call:
        """Send a request; its answers collect in a mailbox until `finish`."""
        if self.closed:
            raise ClientError("the client is closed")
        call = Call.of(request, time.monotonic(), self.resend_after_s)
        self._send(call.frames)
        self._mail[call.request_id] = deque()  # once sent: a send that failed leaves no mailbox
        return call

    def next(self, call: Call, timeout_s: float) -> Answer:
        """The call's next answer; resends on schedule; Timeout when nothing comes within timeout_s, BrokerUnreachable
        when the client never reached a broker within connect_timeout_s."""
        if self.closed:
            raise ClientError("the client is closed", request_id=call.request_id)
        box = self._mail[call.request_id]
        deadline = time.monotonic() + timeout_s
        while not box:
            now = time.monotonic()
            if now >= deadline:
                raise timed_out(self._watch, self.address, timeout_s, call.request_id)
            error = unreachable(self._watch, self.address, call, now, self.connect_timeout_s)
            if error is not None:
                raise error
            wait_s = min(call.wake_at(deadline), connect_wake_at(self._watch, call, self.connect_timeout_s)) - now
            if not self._heard:  # a refused handshake is said at once, not after the timeout
                if self._watch.refused():
                    raise Unauthorized(HANDSHAKE_REFUSED, request_id=call.request_id)
                wait_s = min(wait_s, REFUSAL_CHECK_S)
            if call.resend_due(now):
                self.resend(call)
                call.resent(now)
            self._pump(wait_s)
        call.heard(time.monotonic())
        return box.popleft()

    def resend(self, call: Call) -> None:
        """Send the call's request again (a stream's says where to resume it)."""
        log.debug("request_resent", request=call.request_id, resume=call.resume)
        self._send(call.resend_frames())

    def finish(self, call: Call) -> None:
        self._mail.pop(call.request_id, None)

    def oneway(self, request: p.Message) -> None:
        """Send something nothing answers (CANCEL). Best effort: a closed client sends nothing."""
        if not self.closed:
            self._send(p.encode(request))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._release()

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
                else:
                    self.orphans.answered(request_id, item, self.oneway)
