"""The worker's link to the broker: one DEALER socket, a link thread for registration and heartbeats.

    broker <-DEALER-> Link: requests --inbox--> the compute loop (worker.serve.loop), which owns the engine
                            answers <-- sent by the compute loop itself, under the link's lock

The link thread registers (READY with capacity, model and every live session), sends heartbeats on time whatever
the engine is doing, notices a restarted or silent broker and registers again. ZeroMQ reconnects the TCP
connection with exponential backoff (RECONNECT_IVL .. RECONNECT_IVL_MAX, --reconnect-max-ms), and the link sends
READY as soon as a new connection's handshake succeeds (a restarted broker hears from it at once); while there is
no connection it sends no heartbeats or READYs that would pile up for the next broker. ZMTP heartbeats (libzmq's
I/O thread, no GIL needed) keep the connection alive whatever Python does, which is what the broker watches. With
CURVE keys the DEALER authenticates to the broker (broker/common/keys.py); a refused handshake is logged.

A DROP from the broker (sessions it declared lost while this worker was cut off) goes to the compute loop with the
requests; an ERROR from it (a READY it refused: too many slots, over its rate) is logged.

The link reads the socket whatever the compute loop is doing (the broker's heartbeats come on it too), so the requests
it has read and the compute loop has not taken are bounded in bytes here: past MAX_INBOX_BYTES, a request is not
queued but replaced by what answering it takes (config.Unqueued), which the compute loop answers in its turn.
"""

from __future__ import annotations

import queue
import secrets
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from broker.common import protocol as p
from broker.common.keys import HANDSHAKE_FAILED
from broker.common.receive import ENVELOPE, receive
from worker.serve.config import Unqueued, WorkerConfig, WorkerState

log = structlog.get_logger()

# A wait for requests up to this long is the busy compute loop's: it reads the socket itself, and the link thread leaves
# the socket to it (see Link). A longer wait (an idle engine) is for the link thread to hand requests over.
BUSY_WAIT_S = 1e-3
MAX_INBOX_BATCH = 1024  # requests taken in one receive
# And at most about this many received bytes per receive (at least one request, whatever its size). A batch is decoded
# whole before any of it is handled, and a decoded request is several times its wire size (a valid APPEND of 1M token
# ids is 5 MB on the wire and ~25 MB as Python ints): 1024 of them at once took 20+ GB and the kernel killed the worker.
MAX_INBOX_BATCH_BYTES = 16 << 20
# The bytes of requests read off the socket that the compute loop has not taken yet (the inbox). The link reads on
# whatever the compute loop does, so without this bound a client sending valid 3 MB APPENDs faster than the compute
# loop took them (its steps busy, or ~40 ms to decode each) had them all queued: 1,000 of them were 3 GB in the worker.
# 64 MiB is four receive batches (MAX_INBOX_BATCH_BYTES) and eight of the largest requests (p.MAX_MESSAGE_BYTES), far
# more than a full worker's sessions send at once in normal use (64 sessions x 2,048-token prompts are under 1 MiB),
# and small next to a worker's memory. A request that would take the inbox past it is read but not decoded or kept:
# its address (config.Unqueued, a few hundred bytes) takes its place, and the compute loop, when it gets there,
# answers it `overloaded` (as the broker answers a request for a worker whose queue is full), or, a resend
# of a request it has (queued before it, running, answered), as the resend it is: refused on the spot, a resend would
# end its call with an error while its request still ran. The others queue as before, so a small request still fits
# behind a flood of big ones. A CANCEL (nothing answers it) is always queued; the broker's own messages (DROP, moves)
# are not requests: they neither count nor are held back.
MAX_INBOX_BYTES = 64 << 20
# Unqueued requests waiting in the inbox for the compute loop (~400 bytes each). Past this many (a loop stuck for long
# under a flood), the link answers a request it does not queue itself, at once, even one that may be a resend.
MAX_UNQUEUED = 4096
OVERLOAD_LOG_S = 10.0  # requests not queued for MAX_INBOX_BYTES are logged (with their count so far) at most this often
HANDSHAKE_LOG_S = 10.0  # a refused handshake is logged at most this often (ZeroMQ retries every reconnect)
REQUEST_COMMANDS = frozenset(t.COMMAND.value for t in p.REQUEST_TYPES)
UNANSWERED_COMMANDS = frozenset({p.Command.CANCEL.value})  # requests nothing answers: never refused for MAX_INBOX_BYTES
# Requests whose effect depends on the ones before them on their session: while a request of a session waits in the
# inbox as an Unqueued, the session's later ones of these follow it (not queued either), so that a GENERATE never runs
# without the APPEND refused before it. (INFO and CLOSE go on; a CANCEL is never held back.)
ORDERED_COMMANDS = frozenset(t.COMMAND.value for t in (p.Append, p.Chat, p.Generate, p.Fork))
# Passed to the compute loop undecoded: requests, DROP, and the moves of sessions (worker.serve.moves).
LOOP_COMMANDS = REQUEST_COMMANDS | {p.Command.DROP.value} | {t.COMMAND.value for t in p.MOVE_TYPES}
LINK_EVENTS = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

# Received with broker.common.receive: a MOVE_CHUNK's state stays in ZeroMQ's message. Sends pass copy=False: pyzmq
# still copies frames under its copy threshold (64 KiB) and sends longer ones without a copy, keeping them referenced
# until ZeroMQ has sent them.
Frames = list[p.Frame]
WAKE: Frames = []  # in the inbox: no request, the compute loop has something else to do (Link.wake_loop)
Received = p.Message | Unqueued  # what `receive` hands the compute loop


class Link:
    """The DEALER socket to the broker, shared by the compute loop and the link thread under one lock.

    - The compute loop sends its answers itself (`send`: encoded on its thread, sent under the lock), so
      a step's CHUNKS leave with no hand-off. Handing them to the link thread woke that thread every
      step, and every wake-up took the GIL from the compute loop in the middle of launching the next
      step (H100, 64 sessions: launching a decode step took 0.82 ms in the worker against 0.22 ms in
      process, and the GPU waited for the host).
    - The link thread waits, without the lock, on a stop signal, the handshake monitor and its timers, and
      while the engine is idle on the socket's file descriptor too; it receives, registers and sends
      heartbeats under the lock. Requests reach the compute loop through a queue as bytes.
    - While the engine has work, the compute loop reads the socket itself whenever it looks for requests
      (`busy`), and the link thread stops watching it: a burst of requests (64 sessions closing, opening and
      sending prompts at once) is not read by one thread for the other, every wake-up of the link thread
      taking the GIL from the compute loop (H100, 64 sessions: the loop's time per request fell 14%, and
      the full stack's output tokens/s rose 10%, 54.3k against 49.2k, in one same-machine comparison).
    ZeroMQ sockets are not thread-safe, but one may move between threads across a full memory barrier,
    which the lock is. ZMQ_FD is edge-triggered and any use of the socket can consume its signal, so
    while the link thread waits on it every use under the lock ends by reading everything the socket holds
    (`_receive_all`); a switch between busy and idle wakes the link thread, which reads first.
    """

    def __init__(self, config: WorkerConfig, ready: Callable[[], p.Ready], state: Callable[[], WorkerState],
                 steps: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.identity = f"{config.name}-{secrets.token_hex(4)}".encode()[-255:]
        self._ready = ready
        self._state = state
        self._steps = steps
        self._context = zmq.Context()
        self._lock = threading.Lock()  # held for every use of the dealer, and of the state below it
        self._dealer: zmq.Socket[bytes] | None = None  # from start() until the link thread closes it
        self._inbox: queue.SimpleQueue[Frames | Unqueued] = queue.SimpleQueue()  # requests, as received
        # Bytes of requests (and a count of Unqueued) ever put in the inbox (under the lock, by whichever thread reads
        # the socket) and ever taken from it (by the compute thread alone, in receive): their differences are the
        # inbox's, read without a lock.
        self._inbox_in = self._inbox_out = 0
        self._unqueued_in = self._unqueued_out = 0
        self._overloaded = 0  # requests not queued for MAX_INBOX_BYTES
        self._held: dict[str, int] = {}  # session id -> its Unqueued in the inbox (under the lock; ORDERED_COMMANDS)
        # Sessions with an ordered request answered at once (past MAX_UNQUEUED), held until every Unqueued then in the
        # inbox is taken: the compute loop is then past where that request would have run.
        self._held_drain: set[str] = set()
        self._overload_logged_at = -OVERLOAD_LOG_S
        wake = f"inproc://wake-{secrets.token_hex(8)}"
        self._wake_rx: zmq.Socket[bytes] = self._context.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx: zmq.Socket[bytes] = self._context.socket(zmq.PAIR)  # used by the compute thread only
        self._wake_tx.connect(wake)
        self._stop = threading.Event()
        self._farewell: str | None = None
        self._refuse_code = p.ErrorCode.WORKER_DRAINING
        self._thread = threading.Thread(target=self._run, name="worker-link", daemon=True)
        self.heartbeat_s = config.heartbeat_ms / 1000
        self.liveness = config.liveness
        self.broker_id: str | None = None
        self.busy = False  # the compute loop reads the socket itself: set by receive(), read by the link thread
        self.registered = threading.Event()
        now = time.monotonic()
        self._last_heard = now  # any message from the broker
        self._next_beat = now
        self._ready_backoff = self.heartbeat_s  # READY resend interval while the broker is silent
        self._next_ready = now + self._ready_backoff
        self._monitor: zmq.Socket[bytes] | None = None
        self._handshake_logged_at = -HANDSHAKE_LOG_S
        self.connected = False  # a connection to the broker whose handshake succeeded, as the monitor last said
        self._handshakes = 0

    # -- compute-thread side --

    def start(self) -> None:
        with self._lock:
            self._dealer = self._connect()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, messages: Sequence[p.Message]) -> None:
        """Encode (here, on the caller's thread) and send, in order. Before start() or after stop(): dropped.

        On the compute thread only (it alone sets `busy`; busy, it reads the socket itself at its next receive)."""
        if not messages:
            return
        encoded = [(m, p.encode_frames(m)) for m in messages]
        with self._lock:
            dealer = self._dealer
            if dealer is None:
                log.warning("send_without_link", messages=len(encoded))
                return
            for m, frames in encoded:
                self._send(dealer, m, frames)
            if not self.busy:  # the link thread waits on the socket's signal, which sending may have taken
                self._take_incoming(dealer)

    @property
    def inbox_bytes(self) -> int:
        """Bytes of requests read off the socket and not yet taken by `receive`. Off the compute thread, it may count
        some just taken (never fewer than are there)."""
        return self._inbox_in - self._inbox_out

    @property
    def unqueued(self) -> int:
        """Requests not queued for MAX_INBOX_BYTES whose answers wait in the inbox (as inbox_bytes is read)."""
        return self._unqueued_in - self._unqueued_out

    def wake_loop(self) -> None:
        """From any thread: make a waiting `receive` return (empty) now."""
        self._inbox.put(WAKE)

    def receive(self, timeout_s: float) -> list[Received]:
        """Requests from the broker: waits up to timeout_s for the first, then takes what is there (at most a batch:
        MAX_INBOX_BATCH requests, MAX_INBOX_BATCH_BYTES; the rest waits in the inbox for the next call).

        A wait up to BUSY_WAIT_S is the busy compute loop's (between steps, or while a prefill runs): it reads the
        socket itself. A longer one (an idle engine) waits for the link thread to hand requests over.
        Decoded here, on the caller's thread; a malformed one is answered with its error when it names a
        route and a request id, and logged either way. A request not queued (MAX_INBOX_BYTES) comes as its Unqueued."""
        busy = timeout_s <= BUSY_WAIT_S
        if busy != self.busy:
            self.busy = busy
            self._wake()  # the link thread changes what it waits on
        if busy:
            self._read_socket(timeout_s)
            timeout_s = 0.0
        try:
            first = self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return []
        batch = [first]
        size = _size(first)
        while len(batch) < MAX_INBOX_BATCH and size < MAX_INBOX_BATCH_BYTES:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
            size += _size(item)
        requests: list[Received] = []
        errors: list[p.Message] = []
        taken = unqueued = 0
        for item in batch:
            if isinstance(item, Unqueued):
                unqueued += 1
                if item.command in ORDERED_COMMANDS and item.session_id:
                    with self._lock:  # its session's later requests are queued again from here
                        left = self._held.get(item.session_id, 0) - 1
                        if left > 0:
                            self._held[item.session_id] = left
                        else:
                            self._held.pop(item.session_id, None)
                requests.append(item)
                continue
            if not item:  # WAKE
                continue
            if _is_request(item):
                taken += _size(item)
            try:
                requests.append(p.decode(item))
            except p.ProtocolError as e:
                errors += _refusal(e)
        self._inbox_out += taken
        self._unqueued_out += unqueued
        if self._held_drain and self.unqueued == 0:
            with self._lock:
                if self.unqueued == 0:
                    self._held_drain.clear()
        self.send(errors)
        return requests

    def stop(self, farewell: str | None = None, refuse: p.ErrorCode = p.ErrorCode.WORKER_DRAINING) -> None:
        """Answer requests nobody will serve with `refuse`, say DISCONNECT(farewell) when given, close the
        socket. Call it once the compute loop has stopped taking requests."""
        self._farewell = farewell
        self._refuse_code = refuse
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._wake_tx.close(linger=0)
        if not self._thread.is_alive():  # term() would wait for the thread's sockets
            if self._thread.ident is None:  # never started: the link thread did not close its socket
                self._wake_rx.close(linger=0)
            self._context.term()

    def _read_socket(self, timeout_s: float) -> None:
        """On the busy compute thread: read what the socket holds, waiting up to timeout_s for it (under the lock)."""
        with self._lock:
            dealer = self._dealer
            if dealer is None:
                return
            if timeout_s > 0 and self._inbox.empty() and not _readable(dealer):
                select.select([self._fd], [], [], timeout_s)  # the socket's signal: anything to read
            self._take_incoming(dealer)

    def _take_incoming(self, dealer: zmq.Socket[bytes]) -> None:
        """On the compute thread, under the lock: read what the socket holds; past a batch, the link thread reads on."""
        if self._receive_all(dealer):
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending

    # -- the link thread --

    def _run(self) -> None:
        dealer = self._dealer
        assert dealer is not None
        # Both wait on the stop signal and wake-ups and the monitor; `idle` (the compute loop not reading the socket)
        # also on the socket's signal, waited on without the lock.
        busy, idle = zmq.Poller(), zmq.Poller()
        idle.register(self._fd, zmq.POLLIN)
        for poller in (busy, idle):
            poller.register(self._wake_rx, zmq.POLLIN)
            if self._monitor is not None:
                poller.register(self._monitor, zmq.POLLIN)
        with self._lock:
            now = time.monotonic()
            self._last_heard = now
            self._next_beat = now + self.heartbeat_s
            self._next_ready = now + self._ready_backoff
            self._send(dealer, self._ready())
            more = self._receive_all(dealer)
        try:
            while not self._stop.is_set():
                timeout = 0.0 if more else max(0.0, min(self._next_beat, self._next_ready) - time.monotonic())
                poller = busy if self.busy else idle
                events = dict(poller.poll(round(timeout * 1000) + (0 if more else 1)))
                if self._wake_rx in events:
                    self._drain_wakes()
                with self._lock:
                    if self._monitor is not None and self._monitor in events:
                        self._link_events(dealer)
                    more = self._receive_all(dealer)
                    self._timers(dealer, time.monotonic())
                    more = self._receive_all(dealer) or more
            with self._lock:
                self._refuse_unserved(dealer)
                if self._farewell is not None:
                    self._send(dealer, p.Disconnect(reason=self._farewell))
        except Exception:
            log.exception("link_failed")
        finally:
            with self._lock:
                self._dealer = None
            if self._monitor is not None:
                self._monitor.close(linger=0)
            dealer.close(linger=1000)  # give the last answers and DISCONNECT a second to leave
            self._wake_rx.close(linger=0)

    def _connect(self) -> zmq.Socket[bytes]:
        dealer: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, self.identity)
        dealer.setsockopt(zmq.SNDHWM, self.config.hwm)
        dealer.setsockopt(zmq.RCVHWM, self.config.hwm)
        dealer.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, self.config.reconnect_max_ms)
        # ZMTP heartbeats find a dead TCP connection (a vanished host) and make ZeroMQ reconnect.
        dealer.setsockopt(zmq.HEARTBEAT_IVL, self.config.heartbeat_ms)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.config.heartbeat_ms * self.config.liveness)
        if self.config.curve is not None:
            self.config.curve.apply(dealer)
        self._monitor = dealer.get_monitor_socket(LINK_EVENTS)  # a broker that wants keys refuses none too
        dealer.connect(self.config.broker)
        self._fd = cast(int, dealer.getsockopt(zmq.FD))
        return dealer

    def _link_events(self, dealer: zmq.Socket[bytes]) -> None:
        """The DEALER's connection events (under the lock): a refused handshake is logged; a new connection gets READY
        at once (after the first, whose READY was queued before it); no connection, no heartbeats."""
        assert self._monitor is not None
        refused = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = int(event["event"])
            if kind & HANDSHAKE_FAILED:
                refused = True
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self._handshakes += 1
                if self._handshakes > 1:
                    log.info("broker_connected", broker=self.config.broker)
                    self._send(dealer, self._ready())
                    self._ready_backoff = self.heartbeat_s
                    now = time.monotonic()
                    self._last_heard = now  # the broker's silence counts from the new connection
                    self._next_ready = now + self._ready_backoff
            elif kind == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    log.warning("broker_disconnected", broker=self.config.broker)
                self.connected = False
                self.registered.clear()
        now = time.monotonic()
        if refused and now - self._handshake_logged_at >= HANDSHAKE_LOG_S:
            self._handshake_logged_at = now
            log.error("broker_refused_handshake", broker=self.config.broker,
                      detail="the broker does not accept this worker's key (is its .key in the broker's workers/?), "
                             "--broker-key is not the broker's public key, or the broker wants keys and none were given")

    def _receive_all(self, dealer: zmq.Socket[bytes]) -> bool:
        """Read what the socket holds, at most a batch: MAX_INBOX_BATCH messages, about MAX_INBOX_BATCH_BYTES (under the
        lock, which the compute loop's answers and the link's heartbeats wait for). True when more is waiting."""
        size = 0
        for _ in range(MAX_INBOX_BATCH):
            if size >= MAX_INBOX_BATCH_BYTES:
                return True  # maybe: the caller reads on (the lock let go meanwhile)
            if not _readable(dealer):  # also takes the socket's pending signal
                return False
            try:
                frames = receive(dealer, ENVELOPE)
            except zmq.Again:
                return False
            self._last_heard = time.monotonic()
            size += _size(frames)
            self._on_message(dealer, frames)
        return _readable(dealer)

    def _on_message(self, dealer: zmq.Socket[bytes], frames: Frames) -> None:
        if len(frames) >= 3 and frames[0] == p.VERSION and frames[1] in LOOP_COMMANDS:
            if frames[1] in REQUEST_COMMANDS:
                size = _size(frames)
                queued = self._inbox_in - self._inbox_out
                if queued + size > MAX_INBOX_BYTES and frames[1] not in UNANSWERED_COMMANDS:
                    self._not_queued(dealer, frames, queued)
                    return
                if (self._held or self._held_drain) and frames[1] in ORDERED_COMMANDS:
                    sid = p.peek_address(frames[2]).session_id
                    if sid in self._held or sid in self._held_drain:
                        self._not_queued(dealer, frames, queued, after_refused=True)
                        return
                self._inbox_in += size
            self._inbox.put(frames)  # decoded (and checked) by the compute loop
            return
        try:
            message = p.decode(frames)
        except p.ProtocolError as e:
            for error in _refusal(e):
                self._send(dealer, error)
            return
        if isinstance(message, p.Welcome):
            self._welcomed(message)
        elif isinstance(message, p.Heartbeat):
            if message.broker_id is not None and message.broker_id != self.broker_id:
                log.info("broker_changed", broker_id=message.broker_id, was=self.broker_id)
                self._send(dealer, self._ready())
        elif isinstance(message, p.Reconnect):
            log.info("broker_asks_register", broker_id=message.broker_id)
            self._send(dealer, self._ready())
        elif isinstance(message, p.Error) and message.request_id is None:
            log.error("broker_refused_registration", code=message.code.value, error=message.message)
        else:
            log.warning("broker_message_unexpected", command=message.COMMAND.name)

    def _not_queued(self, dealer: zmq.Socket[bytes], frames: Frames, queued: int, after_refused: bool = False) -> None:
        """A request that would take the inbox past MAX_INBOX_BYTES, or (`after_refused`) that follows one of its
        session's that did (under the lock): its Unqueued goes in its place, or, past MAX_UNQUEUED of them, its
        overloaded answer goes at once."""
        self._overloaded += 1
        now = time.monotonic()
        if now - self._overload_logged_at >= OVERLOAD_LOG_S:
            self._overload_logged_at = now
            log.warning("requests_not_queued", overloaded=self._overloaded, queued_bytes=queued,
                        limit_bytes=MAX_INBOX_BYTES, unqueued=self.unqueued)
        command = bytes(frames[1])
        request_id, session_id, route = p.peek_address(frames[2])
        if request_id is None or not route:  # the broker always sends both: not a request of its
            log.warning("request_unanswerable", command=command.decode(errors="replace"))
            return
        message = (f"worker {self.config.name} is overloaded: {queued >> 20} MiB of requests were waiting for it "
                   f"(at most {MAX_INBOX_BYTES >> 20} MiB): retry later")
        if after_refused:
            message = (f"worker {self.config.name} is overloaded: it did not keep an earlier request of session "
                       f"{session_id}, so this one is not run after it either: retry later")
        if self.unqueued < MAX_UNQUEUED:
            self._unqueued_in += 1
            if session_id and command in ORDERED_COMMANDS:
                self._held[session_id] = self._held.get(session_id, 0) + 1
            self._inbox.put(Unqueued(command, request_id, session_id, route, message))
        else:
            if session_id and command in ORDERED_COMMANDS:
                self._held_drain.add(session_id)
            self._send(dealer, p.Error(request_id=request_id, code=p.ErrorCode.OVERLOADED, message=message, route=route))

    def _welcomed(self, welcome: p.Welcome) -> None:
        if welcome.broker_id != self.broker_id:
            log.info(
                "registered", broker_id=welcome.broker_id, heartbeat_ms=welcome.heartbeat_ms, liveness=welcome.liveness
            )
        self.broker_id = welcome.broker_id
        self.heartbeat_s = welcome.heartbeat_ms / 1000
        self.liveness = welcome.liveness
        self._ready_backoff = self.heartbeat_s
        self._next_beat = min(self._next_beat, time.monotonic() + self.heartbeat_s)
        self.registered.set()

    def _timers(self, dealer: zmq.Socket[bytes], now: float) -> None:
        if not self.connected:  # nothing to send to: what is sent now would reach the next broker all at once
            self._next_beat = now + self.heartbeat_s
            self._last_heard = now
            return
        if now >= self._next_beat:
            self._send(dealer, self._state().heartbeat(self._steps()))
            self._next_beat = now + self.heartbeat_s
        silent = now - self._last_heard > self.heartbeat_s * self.liveness
        if silent and now >= self._next_ready:
            # The broker is gone or restarting: keep offering READY, backing off, until one is welcomed.
            if self.registered.is_set():
                log.warning("broker_silent", seconds=round(now - self._last_heard, 2))
            self.registered.clear()
            self._send(dealer, self._ready())
            self._ready_backoff = min(self._ready_backoff * 2, self.config.reconnect_max_ms / 1000)
            self._next_ready = now + self._ready_backoff
        elif not silent:
            self._next_ready = now + self._ready_backoff

    def _refuse_unserved(self, dealer: zmq.Socket[bytes]) -> None:
        """Requests that arrived too late to be served get an answer rather than silence."""
        received: list[Frames] = []
        message = f"worker {self.config.name} is shutting down"
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Unqueued):
                self._send(dealer, p.Error(request_id=item.request_id, code=self._refuse_code, message=message,
                                           route=item.route))
            else:
                received.append(item)
        while True:
            try:
                received.append(receive(dealer, ENVELOPE))
            except zmq.Again:
                break
        unserved: list[p.Message] = []
        for frames in received:
            try:
                unserved.append(p.decode(frames))
            except p.ProtocolError:
                continue
        for request in unserved:
            route: bytes = getattr(request, "route", b"")
            if isinstance(request, p.REQUEST_TYPES) and not isinstance(request, p.Cancel) and route:
                self._send(dealer, p.Error(request_id=request.request_id, code=self._refuse_code, message=message,
                                           route=route))

    def _drain_wakes(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _send(self, dealer: zmq.Socket[bytes], message: p.Message, frames: Frames | None = None) -> None:
        try:
            dealer.send_multipart(p.encode(message) if frames is None else frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # Queue full (broker away for long): drop. Final answers stay cached for the client's resend.
            log.warning("send_dropped", command=message.COMMAND.name, request=getattr(message, "request_id", None))


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: the enums' operators cost more than the call


def _readable(dealer: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, dealer.getsockopt(_EVENTS)) & _POLLIN)


def _is_request(frames: Frames) -> bool:
    return len(frames) >= 3 and frames[1] in REQUEST_COMMANDS


def _size(item: Frames | Unqueued) -> int:
    """The bytes of a received message (payload frames are memoryviews); 0 for an Unqueued."""
    if isinstance(item, Unqueued):
        return 0
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in item)


def _refusal(e: p.ProtocolError) -> list[p.Message]:
    """Log a malformed message from the broker; its error answer when it names a route and a request id."""
    log.warning("broker_message_invalid", code=e.code.value, error=e.message, request=e.request_id)
    return [p.error_for(e)] if e.route and e.request_id else []
