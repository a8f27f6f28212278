"""The worker process: one engine, driven by one compute loop, connected to the broker by a link thread.

    broker <-DEALER-> Link: requests --inbox--> Serve (compute loop, owns the engine)
                            answers <-- sent by the compute loop itself, under the link's lock

- `Link` holds the socket, shared by two threads under one lock (see the class). The link thread
  registers (READY with capacity, model and every live session), sends heartbeats on time whatever the
  engine is doing, notices a restarted or silent broker and registers again. ZeroMQ reconnects the TCP
  connection with exponential backoff (RECONNECT_IVL .. RECONNECT_IVL_MAX). While the engine is idle,
  requests cross to the compute loop as bytes; while it has work, the compute loop reads them from the
  socket itself. The compute loop decodes them, and encodes and sends its answers itself, so neither a
  burst of requests nor a step's output needs a hand-off between threads (whose every wake-up costs the
  loop the GIL).
- `Serve` owns the engine (not thread-safe): it admits requests between batched steps, runs
  `engine.step()` while there is work, and turns a step's chunks into one FANOUT message for all client
  routes (the streamed requests that moved) plus a final
  REPLY for each request that finished. Every request
  id is remembered with its final answer, so a resent request is answered again, never run twice.
- Sessions idle longer than `session_idle_timeout_s` (no request, no generation) are closed; the broker
  hears of it in the next HEARTBEAT (`expired`), and a later request gets `session_expired`.
- With CURVE keys the DEALER authenticates to the broker (broker/keys.py); a refused handshake is logged.
- SIGTERM/SIGINT: drain. New sessions and generations get worker_draining (the broker stops placing
  here when the next heartbeat says so), generations in flight finish, then DISCONNECT and exit.
  A second signal, or the drain timeout, cancels what is still running.
"""

from __future__ import annotations

import queue
import secrets
import select
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import structlog
import zmq

from broker.common import protocol as p
from broker.common.keys import HANDSHAKE_FAILED, CurveClient, drain_events
from broker.common.metrics_http import Pulse
from worker.serve.metrics import NoMetrics, WorkerMetrics, WorkerSnapshot, torch_memory

log = structlog.get_logger()

IDLE_WAIT_S = 0.05  # how long the compute loop waits for a request when the engine is idle
# While a step with prompt tokens runs (a turnover: sessions closing, opening and sending prompts), the compute
# loop waits for requests in slices this long, then looks whether the step is done: requests are taken within
# about this, instead of queueing behind a step of several milliseconds.
PREFILL_WAIT_SLICE_S = 1e-4
# A wait for requests up to this long is the busy compute loop's: it reads the socket itself, and the link thread leaves
# the socket to it (see Link). A longer wait (an idle engine) is for the link thread to hand requests over.
BUSY_WAIT_S = 1e-3
# The loop stays busy this long after its last step or request, waiting BUSY_WAIT_S at a time: 64 sessions turning over
# at once leave the engine without work for ~10 ms while their closes and creates come, and handed over by the link
# thread each of those cost the loop ~150 us (H100) against ~60 us read by the loop itself.
BUSY_LINGER_S = 0.25
SLOT_KEEP_S = 2.0  # a closed session's slot stays mapped this long for a new session, then is released
MAX_STEP_FAILURES = 3  # consecutive failed engine steps before the worker gives up and leaves
MAX_INBOX_BATCH = 1024  # requests admitted between two steps
MAX_EXPIRED_REMEMBERED = 1 << 16  # expired session ids answered with session_expired (oldest forgotten first)
HANDSHAKE_LOG_S = 10.0  # a refused handshake is logged at most this often (ZeroMQ retries every reconnect)
REQUEST_COMMANDS = frozenset(t.COMMAND.value for t in p.REQUEST_TYPES)  # passed to the compute loop undecoded

Frames = list[bytes]


class EngineAPI(Protocol):
    """The part of worker.engine.Engine the daemon drives (see that module for the semantics)."""

    model_name: str
    max_context: int
    while_prefilling: Callable[[], object] | None  # called while step() waits for a step with prompt tokens

    @property
    def capacity(self) -> int: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def bytes_per_session(self) -> int: ...
    def create_session(self, session_id: str | None = None) -> str: ...
    def fork(self, session_id: str, child_id: str | None = None) -> str: ...
    def close(self, session_id: str) -> None: ...
    def append(self, session_id: str, token_ids: Sequence[int] | None = None, text: str | None = None) -> int: ...
    def chat(self, session_id: str, content: str, role: str = "user") -> int: ...
    def sessions(self) -> list[str]: ...
    def session_length(self, session_id: str) -> int: ...
    def start_generate(self, session_id: str, params: Any, request_id: str | None = None, *,
                       prompt_ids: Sequence[int] | None = None, prompt: str | None = None) -> str: ...
    def cancel(self, request_id: str) -> None: ...
    def release_idle_slots(self, older_than_s: float) -> int: ...
    def has_work(self) -> bool: ...
    def step(self) -> Sequence[Any]: ...


@dataclass(frozen=True)
class WorkerConfig:
    broker: str = "tcp://127.0.0.1:5556"
    name: str = "worker"
    heartbeat_ms: int = 1000  # until the broker's WELCOME says otherwise
    liveness: int = 3
    reconnect_max_ms: int = 2000  # ZeroMQ's reconnect backoff ceiling, and READY's resend ceiling
    drain_timeout_s: float = 60.0
    request_cache: int = 4096  # final answers kept for resent requests
    hwm: int = 100_000
    curve: CurveClient | None = None  # the broker's public key and this worker's pair
    session_idle_timeout_s: float = 0.0  # 0: sessions never expire
    metrics: bool = False  # keep Prometheus metrics (for --metrics-port)


@dataclass(frozen=True)
class WorkerState:
    """What the Link reports; replaced (never mutated) by the compute loop, so reading it needs no lock."""

    free_slots: int
    sessions: tuple[str, ...]
    draining: bool = False
    owners: tuple[str, ...] = ()  # one per session

    def heartbeat(self, steps: int, expired: tuple[str, ...] = ()) -> p.Heartbeat:
        return p.Heartbeat(free_slots=self.free_slots, sessions=len(self.sessions), draining=self.draining,
                           steps=steps, expired=expired)


class SessionExpired(Exception):
    code = "session_expired"


class Draining(Exception):
    code = "worker_draining"


def error_code(exc: BaseException) -> p.ErrorCode:
    """The wire code of an exception: its `code` attribute when that is one (engine, cuda_state, protocol)."""
    code = getattr(exc, "code", None)
    if isinstance(code, p.ErrorCode):
        return code
    if isinstance(code, str) and code in p.ERROR_CODES:
        return p.ERROR_CODES[code]
    return p.ErrorCode.INTERNAL


# -- the I/O thread -------------------------------------------------------------------------------------


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
        self._inbox: queue.SimpleQueue[Frames] = queue.SimpleQueue()  # requests, as received
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
        encoded = [(m, p.encode(m)) for m in messages]
        with self._lock:
            dealer = self._dealer
            if dealer is None:
                log.warning("send_without_link", messages=len(encoded))
                return
            for m, frames in encoded:
                self._send(dealer, m, frames)
            if not self.busy:  # the link thread waits on the socket's signal, which sending may have taken
                self._take_incoming(dealer)

    def receive(self, timeout_s: float) -> list[p.Message]:
        """Requests from the broker: waits up to timeout_s for the first, then takes what is there.

        A wait up to BUSY_WAIT_S is the busy compute loop's (between steps, or while a prefill runs): it reads the
        socket itself. A longer one (an idle engine) waits for the link thread to hand requests over.
        Decoded here, on the caller's thread; a malformed one is answered with its error when it names a
        route and a request id, and logged either way."""
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
        while len(batch) < MAX_INBOX_BATCH:
            try:
                batch.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        requests: list[p.Message] = []
        errors: list[p.Message] = []
        for frames in batch:
            try:
                requests.append(p.decode(frames))
            except p.ProtocolError as e:
                errors += _refusal(e)
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
                if self._monitor is not None and self._monitor in events:
                    self._handshake_failed()
                with self._lock:
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
        self._monitor = dealer.get_monitor_socket(HANDSHAKE_FAILED)  # a broker that wants keys refuses none too
        dealer.connect(self.config.broker)
        self._fd = cast(int, dealer.getsockopt(zmq.FD))
        return dealer

    def _handshake_failed(self) -> None:
        assert self._monitor is not None
        drain_events(self._monitor)
        now = time.monotonic()
        if now - self._handshake_logged_at >= HANDSHAKE_LOG_S:
            self._handshake_logged_at = now
            log.error("broker_refused_handshake", broker=self.config.broker,
                      detail="the broker does not accept this worker's key (is its .key in the broker's workers/?), "
                             "--broker-key is not the broker's public key, or the broker wants keys and none were given")

    def _receive_all(self, dealer: zmq.Socket[bytes]) -> bool:
        """Read what the socket holds, at most a batch (under the lock). True when more is waiting."""
        for _ in range(MAX_INBOX_BATCH):
            if not _readable(dealer):  # also takes the socket's pending signal
                return False
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._last_heard = time.monotonic()
            self._on_message(dealer, frames)
        return _readable(dealer)

    def _on_message(self, dealer: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) >= 3 and frames[0] == p.VERSION and frames[1] in REQUEST_COMMANDS:
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
        else:
            log.warning("broker_message_unexpected", command=message.COMMAND.name)

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
        while True:
            try:
                received.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                received.append(dealer.recv_multipart(zmq.NOBLOCK))
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
                message = f"worker {self.config.name} is shutting down"
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
            dealer.send_multipart(p.encode(message) if frames is None else frames, zmq.NOBLOCK)
        except zmq.Again:
            # Queue full (broker away for long): drop. Final answers stay cached for the client's resend.
            log.warning("send_dropped", command=message.COMMAND.name, request=getattr(message, "request_id", None))


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: the enums' operators cost more than the call


def _readable(dealer: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, dealer.getsockopt(_EVENTS)) & _POLLIN)


def _refusal(e: p.ProtocolError) -> list[p.Message]:
    """Log a malformed message from the broker; its error answer when it names a route and a request id."""
    log.warning("broker_message_invalid", code=e.code.value, error=e.message, request=e.request_id)
    return [p.error_for(e)] if e.route and e.request_id else []


# -- the compute loop -----------------------------------------------------------------------------------


@dataclass
class Active:
    """A generation in flight."""

    request_id: str  # the client's
    session_id: str
    route: bytes
    stream: bool
    appended: int = 0  # prompt tokens the request appended first
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


class Serve:
    def __init__(self, engine: EngineAPI, config: WorkerConfig, sampling: Callable[[p.Sampling], Any]) -> None:
        self.engine = engine
        engine.while_prefilling = self._take_requests
        self.config = config
        self._sampling = sampling  # protocol Sampling -> the engine's SamplingParams
        self.draining = False
        self._drain_deadline = float("inf")
        self._active: dict[str, Active] = {}  # engine request id -> generation
        self._by_session: dict[str, str] = {}  # session id -> engine request id
        self._done: OrderedDict[tuple[str, str], p.Message] = OrderedDict()  # (session, request id) -> answer
        self._answers: list[p.Message] = []  # answers to the requests being admitted, sent after the batch
        self._step_failures = 0
        self._step_end = 0.0  # perf_counter() at the end of the last engine step
        self._busy_at = -BUSY_LINGER_S  # monotonic() when the loop last had work or requests
        self.steps = 0  # engine steps run: the progress the broker watches for
        self._owners: dict[str, str] = {}  # session id -> the client key it belongs to ("" = none)
        self._last_used: dict[str, float] = {}  # session id -> when a request or generation last touched it
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._next_expiry_check = float("inf") if config.session_idle_timeout_s <= 0 else 0.0
        self._next_slot_release = 0.0
        self.state = WorkerState(engine.free_slots, tuple(engine.sessions()))
        self._state_stale = False  # sessions were created or closed since `state` was made
        self.link = Link(config, self.ready_message, lambda: self.state, lambda: self.steps)
        self.pulse = Pulse()  # /healthz: run() beats it every turn
        self.metrics: WorkerMetrics | NoMetrics = NoMetrics()
        if config.metrics:
            self.metrics = WorkerMetrics(self.metrics_snapshot, worker=config.name, model=engine.model_name,
                                         device=engine.device, max_context=engine.max_context,
                                         memory=torch_memory(engine.device))

    def metrics_snapshot(self) -> WorkerSnapshot:
        """Read on the metrics thread: only values this loop replaces whole."""
        state = self.state
        table = getattr(self.engine, "table", None)  # the real engine's session table (not the test fakes)
        return WorkerSnapshot(sessions=len(state.sessions), capacity=self.engine.capacity, free_slots=state.free_slots,
                              running=len(self._active), bytes_per_session=self.engine.bytes_per_session,
                              draining=state.draining,
                              mapped_bytes=None if table is None else table.backend.mapped_bytes())

    def ready_message(self) -> p.Ready:
        state = self.state
        return p.Ready(
            name=self.config.name, model=self.engine.model_name, capacity=self.engine.capacity,
            free_slots=state.free_slots, max_context=self.engine.max_context, sessions=state.sessions,
            draining=state.draining, device=self.engine.device, bytes_per_session=self.engine.bytes_per_session,
            owners=state.owners,
        )

    def drain(self) -> None:
        """Stop taking new work; a second call cancels what is still running."""
        if self.draining:
            self._drain_deadline = 0.0
            return
        self.draining = True
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        self._refresh_state()
        log.info("worker_draining", generations=len(self._active))

    def run(self) -> int:
        """Serve until drained. Returns the process exit code."""
        self.link.start()
        try:
            while not (self.draining and not self.engine.has_work()):
                if not self.link.alive:
                    log.error("worker_link_died")
                    return 1
                self.pulse.beat()
                self._admit(self.link.receive(self._wait_s(time.monotonic())))
                now = time.monotonic()
                if self.draining and now >= self._drain_deadline:
                    self._cancel_all()
                if now >= self._next_expiry_check:
                    self._expire_idle(now)
                if now >= self._next_slot_release:
                    self._release_slots(now)
                if self.engine.has_work() and not self._step():
                    self.link.stop("engine failed", refuse=p.ErrorCode.SESSION_LOST)
                    return 1
        except BaseException:
            log.exception("worker_failed")
            self.link.stop("worker failed", refuse=p.ErrorCode.SESSION_LOST)
            raise
        log.info("worker_drained")
        self.link.stop("drained")
        return 0

    def _wait_s(self, now: float) -> float:
        """How long the loop may wait for requests now: not at all with work to do, briefly (reading the socket itself)
        within BUSY_LINGER_S of its last step or request, else long (the link thread hands requests over)."""
        if self.engine.has_work():
            self._busy_at = now
            return 0.0
        return BUSY_WAIT_S if now - self._busy_at < BUSY_LINGER_S else IDLE_WAIT_S

    # -- requests --

    def _admit(self, requests: list[p.Message]) -> None:
        """Handle a batch of requests, each answer sent as soon as it is made: the first clients of a burst
        (64 sessions turning over at once) are not held back by the rest of it."""
        if requests:
            self._busy_at = time.monotonic()
        for request in requests:
            self._handle(request)
            if self._answers:
                answers, self._answers = self._answers, []
                self.link.send(answers)
        if self._state_stale:  # once per batch: a burst of creates or closes builds it once, not once each
            self._refresh_state()

    def _take_requests(self) -> None:
        """Inside engine.step(), while it waits for a step with prompt tokens: the requests that come meanwhile are
        handled now (they queue their device work behind the running steps), not after the step."""
        self._admit(self.link.receive(PREFILL_WAIT_SLICE_S))

    def _handle(self, request: p.Message) -> None:
        self.metrics.request(request.COMMAND)
        if isinstance(request, p.Cancel):
            engine_id = self._by_session.get(request.session_id)
            active = self._active.get(engine_id) if engine_id else None
            if active is not None and active.request_id == request.target:
                self.engine.cancel(engine_id)  # type: ignore[arg-type]
            return
        rid: str = getattr(request, "request_id", "")
        route: bytes = getattr(request, "route", b"")
        key = (getattr(request, "session_id", None) or "", rid)
        if self._resent(key, route):
            return
        try:
            if key[0] in self._expired:
                raise SessionExpired(f"session {key[0]} was closed after idling more than "
                                     f"{self.config.session_idle_timeout_s:g} s (worker --session-idle-timeout)")
            if key[0] in self._last_used:
                self._last_used[key[0]] = time.monotonic()
            answer = self._execute(request)
        except Exception as e:
            code = error_code(e)
            if code is p.ErrorCode.INTERNAL:
                log.exception("request_failed", command=request.COMMAND.name, request=rid, session=key[0] or None)
            else:
                log.info("request_refused", command=request.COMMAND.name, code=code.value, error=str(e), request=rid,
                         session=key[0] or None)
            answer = p.Error(request_id=rid, code=code, message=str(e) or type(e).__name__)
            self.metrics.error(code)
        if answer is not None:
            self._answer(key, answer.routed(route))

    def _resent(self, key: tuple[str, str], route: bytes) -> bool:
        """A request id seen before: answer from the cache, or follow the running generation. No re-run."""
        done = self._done.get(key)
        if done is not None:
            self._answers.append(done.routed(route))
            return True
        engine_id = self._by_session.get(key[0])
        active = self._active.get(engine_id) if engine_id else None
        if active is not None and active.request_id == key[1]:
            active.route = route  # the rest of the stream (and the full answer) goes to the new route
            return True
        return False

    def _execute(self, request: p.Message) -> p.Message | None:
        e = self.engine
        name = self.config.name
        if isinstance(request, p.CreateSession):
            self._refuse_if_draining("new sessions")
            if request.session_id is None:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "CREATE needs the broker's session_id")
            sid = e.create_session(request.session_id)
            self._owners[sid] = request.owner
            self._last_used[sid] = time.monotonic()
            self._state_stale = True
            # Per-session lines are debug: at info, rendering one cost ~20 us of the compute loop's time, which a burst
            # of creates and closes spends while the GPU waits (the metrics count sessions; --log-level debug shows them).
            log.debug("session_created", session=sid, request=request.request_id)
            return p.Created(request_id=request.request_id, session_id=sid, model=e.model_name, worker=name,
                             max_context=e.max_context)
        if isinstance(request, p.Append):
            ids = list(request.token_ids) if request.token_ids is not None else None
            length = e.append(request.session_id, token_ids=ids, text=request.text)
            return p.Appended(request_id=request.request_id, session_id=request.session_id, length=length)
        if isinstance(request, p.Chat):
            length = e.chat(request.session_id, request.content, role=request.role)
            return p.Appended(request_id=request.request_id, session_id=request.session_id, length=length)
        if isinstance(request, p.Generate):
            self._refuse_if_draining("new generations")
            before = e.session_length(request.session_id)
            engine_id = e.start_generate(request.session_id, self._sampling(request.params),
                                         prompt_ids=request.prompt_ids, prompt=request.prompt)
            appended = e.session_length(request.session_id) - before
            self._active[engine_id] = Active(request.request_id, request.session_id, request.route, request.stream,
                                             appended)
            self._by_session[request.session_id] = engine_id
            self.metrics.generation_started(engine_id, time.perf_counter())
            return None  # answered when the generation finishes
        if isinstance(request, p.Fork):
            self._refuse_if_draining("new sessions")
            if request.child_id is None:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "FORK needs the broker's child_id")
            child = e.fork(request.session_id, request.child_id)
            self._owners[child] = self._owners.get(request.session_id, "")
            self._last_used[child] = time.monotonic()
            self._state_stale = True
            log.debug("session_forked", session=child, parent=request.session_id, request=request.request_id)
            return p.Forked(request_id=request.request_id, session_id=request.session_id, child_id=child,
                            length=e.session_length(child), worker=name)
        if isinstance(request, p.Close):
            e.close(request.session_id)  # a generation on it ends "cancelled" in the next step
            self._owners.pop(request.session_id, None)
            self._last_used.pop(request.session_id, None)
            self._state_stale = True
            log.debug("session_closed", session=request.session_id, request=request.request_id)
            return p.Closed(request_id=request.request_id, session_id=request.session_id)
        if isinstance(request, p.Info):
            return p.SessionInfo(request_id=request.request_id, session_id=request.session_id,
                                 length=e.session_length(request.session_id), model=e.model_name, worker=name,
                                 max_context=e.max_context, busy=request.session_id in self._by_session)
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"a worker does not serve {request.COMMAND.name}")

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise Draining(f"worker {self.config.name} is draining: it takes no {what}")

    def _answer(self, key: tuple[str, str], answer: p.Message) -> None:
        self._done[key] = answer
        if len(self._done) > self.config.request_cache:
            self._done.popitem(last=False)
        self._answers.append(answer)

    # -- steps --

    def _step(self) -> bool:
        """One engine step and its answers. False once the engine has failed too often to go on."""
        t0 = time.perf_counter()
        try:
            chunks = self.engine.step()
        except Exception:
            self._step_failures += 1
            log.exception("step_failed", failures=self._step_failures, generations=len(self._active))
            self._fail_all("the engine step failed")
            return self._step_failures < MAX_STEP_FAILURES
        self._step_failures = 0
        self.steps += 1
        t1 = self._step_end = time.perf_counter()
        new_tokens = 0
        # The streamed requests that moved, by client route: one FANOUT for them all, then the final answers.
        batches: dict[bytes, list[p.StreamChunk]] = {}
        finals: list[p.Message] = []
        for chunk in chunks:
            active = self._active.get(chunk.request_id)
            if active is None:
                continue
            ids = chunk.token_ids
            if ids:
                if not active.token_ids:
                    self.metrics.first_token(chunk.request_id, t1)
                active.token_ids += ids
                new_tokens += len(ids)
            if chunk.text:
                active.text.append(chunk.text)
            if chunk.finish_reason is not None:
                finals.append(self._finish(chunk.request_id, active, chunk.finish_reason))
            elif active.stream and (ids or chunk.text):
                batch = batches.get(active.route)
                if batch is None:
                    batch = batches[active.route] = []
                batch.append(p.new_stream_chunk((active.request_id, tuple(ids), chunk.text)))
        # Valid by construction (see Message.unchecked): no per-token checks here; the client checks them all.
        out: list[p.Message] = []
        if batches:
            out.append(p.Fanout.unchecked(routes=tuple(batches), parts=tuple(map(p.chunks_part, batches.values()))))
        self.link.send(out + finals)
        e = self.engine
        self.metrics.step(t1, t1 - t0, getattr(e, "last_rows", len(chunks)), getattr(e, "last_prefill_tokens", 0), new_tokens)
        return True

    def _finish(self, engine_id: str, active: Active, finish_reason: str) -> p.Message:
        """A generation ended: its whole answer, remembered for a resend."""
        self._retire(engine_id, active)
        self.metrics.generation_finished(engine_id, self._step_end, len(active.token_ids), finish_reason)
        try:
            length = self.engine.session_length(active.session_id)
        except Exception:  # closed while generating
            length = 0
        answer = p.Generated.unchecked(request_id=active.request_id, session_id=active.session_id,
                                       token_ids=tuple(active.token_ids), text="".join(active.text),
                                       finish_reason=finish_reason, length=length, appended=active.appended,
                                       route=active.route)
        key = (active.session_id, active.request_id)
        self._done[key] = answer
        if len(self._done) > self.config.request_cache:
            self._done.popitem(last=False)
        return answer

    def _retire(self, engine_id: str, active: Active) -> None:
        if active.session_id in self._last_used:
            self._last_used[active.session_id] = time.monotonic()
        del self._active[engine_id]
        if self._by_session.get(active.session_id) == engine_id:
            del self._by_session[active.session_id]

    def _fail_all(self, why: str) -> None:
        errors: list[p.Message] = []
        for engine_id, active in list(self._active.items()):
            self._retire(engine_id, active)
            self.metrics.generation_finished(engine_id, time.perf_counter(), len(active.token_ids), "error")
            self.metrics.error(p.ErrorCode.INTERNAL)
            try:
                self.engine.cancel(engine_id)
            except Exception:
                log.exception("cancel_failed", request=active.request_id)
            errors.append(p.Error(request_id=active.request_id, code=p.ErrorCode.INTERNAL, message=why,
                                  route=active.route))
        self.link.send(errors)

    def _cancel_all(self) -> None:
        for engine_id in list(self._active):
            self.engine.cancel(engine_id)
        self._drain_deadline = float("inf")

    def _expire_idle(self, now: float) -> None:
        """Close the sessions idle longer than the timeout (not generating); tell the broker at once."""
        timeout = self.config.session_idle_timeout_s
        self._next_expiry_check = now + min(1.0, timeout / 4)
        idle = [sid for sid, t in self._last_used.items() if now - t > timeout and sid not in self._by_session]
        if not idle:
            return
        for sid in idle:
            try:
                self.engine.close(sid)
            except Exception:
                log.exception("expire_failed", session=sid)
            del self._last_used[sid]
            self._owners.pop(sid, None)
            self._expired[sid] = None
            if len(self._expired) > MAX_EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)
        self._refresh_state()
        log.info("sessions_expired", sessions=len(idle), idle_timeout_s=timeout)
        self.link.send([self.state.heartbeat(self.steps, tuple(idle))])

    def _release_slots(self, now: float) -> None:
        """Unmap the slots closed sessions left mapped that no new session took within SLOT_KEEP_S."""
        self._next_slot_release = now + SLOT_KEEP_S / 2
        released = self.engine.release_idle_slots(SLOT_KEEP_S)
        if released:
            log.debug("slots_released", slots=released)

    def _refresh_state(self) -> None:
        self._state_stale = False
        sessions = tuple(self.engine.sessions())
        owners = tuple(self._owners.get(sid, "") for sid in sessions)
        self.state = WorkerState(self.engine.free_slots, sessions, self.draining, owners)
