"""The broker's logic: frames in, frames out. No sockets (broker/server.py does the I/O).

- A client request is validated, then placed (CREATE), answered here (STATUS, SESSIONS) or forwarded to the worker
  holding its session with the client's routing id added as `route`.
- A registered worker's answer (REPLY, CHUNKS, ERROR, FANOUT) is forwarded to its route unchanged; the broker only
  reads the header to find the route and to keep its tables (session created, forked, closed, its length; request
  finished), and only an answer to a request in flight on that very worker changes them. CHUNKS and FANOUT parts, the
  streamed tokens of one engine step, are checked no further than their routes and the type of their lists: the client
  checks the chunks, so nothing is done here per token. A peer that is not registered gets nothing forwarded: its
  answers are dropped (counted) and it is asked to register. Every message from the worker socket is taken through
  broker.admission first (READY and HEARTBEAT size limits, per-peer rates); what is not used is dropped and counted by
  reason (`RouterCounters.messages_dropped`).
- A worker is gone when it disconnects, when a send to it fails (its connection is gone: ZMTP heartbeats close a
  stopped or cut-off peer's connection within `liveness` heartbeats; see broker.liveness), or when it sends nothing
  at all for `silence_s`. Every request in flight on it fails at once with session_lost, except creates, which are
  placed again on another worker; later requests for its sessions get session_lost. session_lost is final: should
  that worker come back, the sessions are not taken back but dropped there (DROP), and its answers for them are not
  forwarded.
- A freshly started broker is "recovering": requests for sessions it does not know yet are held until `recovery_s`
  has passed and every peer heard from on the worker socket meanwhile has registered (or stayed unregistered a
  heartbeat window since it was first heard), then answered.
- Sessions have owners. With authentication on, a session belongs to the client key that created it (forks to the key
  that forked) and any other key gets `unauthorized`, except keys in the broker's admins/ (INFO, CLOSE, CANCEL and
  SESSIONS of any session); without it, to the client's routing id, used only to count sessions against the per-client
  cap.
- Sessions have leases: the client connection that last used a session holds it. Every heartbeat the broker sends a
  LEASE to each such connection; one whose send fails is gone, and its sessions are closed (a CLOSE of the broker's own)
  once it has been gone for `session_grace_s`, unless a client uses them meanwhile. Later requests get
  session_expired.
- A request on which nothing reaches its client (no answer, and no streamed tokens from its worker to its route) for
  `request_timeout_s` fails with `timeout`, checked once per heartbeat; the worker and its other sessions stay. What a
  worker says about its own progress is not taken into account.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import structlog

from broker.admission import DEFAULT_MAX_WORKER_SESSIONS, Admission
from broker.common import protocol as p
from broker.counters import RouterCounters
from broker.liveness import Liveness
from broker.moves import DEFAULT_MOVES_PER_SOURCE, Moves
from broker.moves import Held as MoveHeld
from broker.placement import NoPlacement, place
from broker.registry import NO_CLIENT, Gone, Registry, WorkerRecord

log = structlog.get_logger()

MAX_HELD = 100_000  # requests held while recovering; past this they are refused
MAX_AWAITED = 4096  # unregistered peers a recovering broker waits for
MAX_LOST_SESSIONS = 1 << 16  # sessions declared lost, remembered (per worker) to be dropped should it come back
MAX_TIMED_OUT = 4096  # creates and forks that timed out, remembered so that a late new session is closed, not leaked
DROP_LOG_S = 10.0  # dropped messages are logged at warning at most this often per reason (a flood is counted)
ANSWERS = frozenset({p.Command.REPLY, p.Command.CHUNKS, p.Command.ERROR, p.Command.FANOUT})
CONTROL = frozenset({p.Command.READY, p.Command.HEARTBEAT, p.Command.DISCONNECT})  # what else a worker sends
MOVE_RELAYED = frozenset({p.Command.MOVE_STATE, p.Command.MOVE_CHUNK})  # source -> target, through the broker
LEASE_ROUTE = b"\x00lease"  # the route of the broker's own CLOSEs: no client has it (ids from a zero byte are ZeroMQ's)
ADMIN_COMMANDS = frozenset({p.Command.INFO, p.Command.CLOSE, p.Command.CANCEL})  # what an admin key may do to any session

RequestKey = tuple[bytes, str]  # (client route, request id)


class Peer(Enum):
    CLIENT = "client"
    WORKER = "worker"


class Failure(Enum):
    UNREACHABLE = "unreachable"  # EHOSTUNREACH: the peer is not connected
    FULL = "full"  # EAGAIN: the peer's queue is at its high-water mark


@dataclass(frozen=True, slots=True)
class Send:
    peer: Peer
    identity: bytes
    frames: Sequence[p.Frame]
    key: RequestKey | None = None  # the client request this belongs to, for failure handling


@dataclass(frozen=True, slots=True)
class Settings:
    heartbeat_s: float = 1.0
    liveness: int = 3
    recovery_s: float = 5.0  # how long a new broker waits for workers to re-register
    authenticated: bool = False  # clients carry CURVE keys: sessions are owned by them
    max_sessions_per_client: int = 0  # 0: no cap
    request_timeout_s: float = 0.0  # 0: requests wait for their worker as long as it lives
    silence_s: float | None = None  # a connected worker silent this long is gone (None: heartbeat x liveness)
    max_worker_sessions: int = DEFAULT_MAX_WORKER_SESSIONS  # session slots one worker may offer (READY limits)
    session_grace_s: float = 0.0  # a gone client's sessions are closed after this; 0: never
    moves_per_source: int = DEFAULT_MOVES_PER_SOURCE  # session moves running at once from one worker
    # How long a client that could not be reached may take to speak again (a GC pause, a paused VM: the broker's
    # heartbeats closed its connection meanwhile) before its generations are stopped; 0: at the next heartbeat.
    client_grace_s: float = 5.0


MAX_SESSIONS_FLAG = "--max-sessions-per-client"
GRACE_FLAG = "--session-grace-ms"


@dataclass(slots=True)
class InFlight:
    worker: bytes
    command: p.Command
    session_id: str  # the session addressed; for CREATE and FORK the new session
    sent_at: float = 0.0
    owner: str = ""  # CREATE and FORK: whose the new session will be
    create: p.CreateSession | None = None  # CREATE: the client's request, placed again should its worker vanish
    user: str = ""  # CREATE: the client's key
    parent: str = ""  # FORK: the session forked

    def addressed(self) -> str:
        """The session the client's request named (a fork's parent, not its new child)."""
        return self.parent if self.command is p.Command.FORK else self.session_id


@dataclass(slots=True)
class Held:
    route: bytes
    request: p.CreateSession | p.SessionRequest
    user: str


class Router:
    def __init__(self, settings: Settings, now: float, broker_id: str | None = None) -> None:
        self.settings = settings
        self.broker_id = broker_id or secrets.token_hex(8)
        self.registry = Registry()
        self.liveness = Liveness(settings.heartbeat_s, settings.liveness, now, settings.silence_s)
        self.admission = Admission(settings.heartbeat_s, settings.max_worker_sessions)
        self.admins: frozenset[str] = frozenset()  # client keys that may see and close any session (keys/admins/)
        self.inflight: dict[RequestKey, InFlight] = {}
        # Requests held while recovering (or while a suspended worker of their model is away), by the session they
        # name ("" for creates), each session's in the order they came; how many in all.
        self.held: dict[str, list[Held]] = {}
        self.held_count = 0
        self.recover_until = now + settings.recovery_s
        # Unregistered peers heard from while recovering -> until when they are waited for (a heartbeat window).
        self._awaited: dict[bytes, float] = {}
        self._asked_to_register: dict[bytes, float] = {}
        self._told_to_drop: dict[bytes, float] = {}
        self._ready_owed: set[bytes] = set()  # registered workers whose READY was over its rate: asked again later
        self._pending_by_owner: dict[str, int] = {}  # creates and forks in flight per owner
        # Sessions declared lost with their worker (and the new sessions of creates and forks in flight on it), by
        # worker identity: should it come back (it was only stopped or cut off), they are dropped there, not taken back.
        self._lost: OrderedDict[bytes, set[str]] = OrderedDict()
        self._lost_count = 0
        # The requests on those sessions answered session_lost, by worker: their streamed chunks, should the worker come
        # back still generating them (until it has dropped the sessions), are not forwarded either.
        self._lost_requests: dict[bytes, set[RequestKey]] = {}
        # Creates and forks answered TIMEOUT -> (their worker, the new session's id): should the worker make the session
        # after all, it is closed there (its client was told the request failed and will not use it).
        self._timed_out: OrderedDict[RequestKey, tuple[bytes, str]] = OrderedDict()
        # (worker, client route) -> when that worker's streamed tokens last reached that client: request progress.
        self._delivered: dict[tuple[bytes, bytes], float] = {}
        self._client_gone: dict[bytes, float] = {}  # client routes holding sessions -> since when they are gone
        # Generations whose client could not be reached -> since when: cancelled unless the client speaks again within
        # Settings.client_grace_s (a client paused for a moment, its connection closed meanwhile, reconnects and resumes).
        self._unreachable: dict[RequestKey, float] = {}
        self._lease_failed: set[bytes] = set()  # routes whose sends failed since the last lease round
        self._drops_logged: dict[str, float] = {}
        # Workers found unreachable right after the broker stalled -> (since when, the sends to retry when they are back).
        self._suspended: dict[bytes, tuple[float, list[Send]]] = {}
        self._distrust_until = -1.0  # after a stall of the broker's own: connection losses are not trusted until then
        self._now = now
        self._out: list[Send] = []
        self.counters = RouterCounters()  # read by broker.metrics at scrape time
        self.moves = Moves(self.registry, self._move_send, self._route_held, self._move_answer,
                           per_source=settings.moves_per_source)

    # -- entry points (each returns what to send) ---------------------------------------------------

    def client_message(self, route: bytes, frames: Sequence[p.Frame], now: float, user: str = "") -> list[Send]:
        """`user`: the client's CURVE public key (Z85) when the broker authenticates clients."""
        self._now = now
        self._client_gone.pop(route, None)  # it spoke: it is there
        if self._unreachable:  # and its generations go on (its resends resume their streams)
            for key in [k for k in self._unreachable if k[0] == route]:
                del self._unreachable[key]
        try:
            envelope = p.decode_envelope(frames)
            if envelope.command not in p.REQUEST_COMMANDS and envelope.command not in p.BROKER_COMMANDS:
                raise p.ProtocolError(
                    p.ErrorCode.BAD_REQUEST, f"{envelope.command.name} is not a client request",
                    request_id=p.request_id_of(envelope.header),
                )
            message = p.parse(envelope)
        except p.ProtocolError as e:
            log.warning("client_message_invalid", code=e.code.value, error=e.message, request=e.request_id)
            self._error(route, e.request_id, e.code, e.message)
            return self._flush()
        self.counters.request(envelope.command)
        if isinstance(message, p.Status):
            self._reply(route, self._status(message.request_id, now))
        elif isinstance(message, p.Sessions):
            self._reply(route, self._session_list(message.request_id, now, user))
        elif isinstance(message, p.CreateSession):
            self._create(route, message, now, user)
        elif isinstance(message, p.SESSION_REQUEST_TYPES):
            self._route(route, message, now, user)
        elif isinstance(message, (p.DrainWorker, p.Rebalance)):
            self._moves_request(route, message, now, user)
        return self._flush()

    def worker_message(self, identity: bytes, frames: Sequence[p.Frame], now: float) -> list[Send]:
        self._now = now
        command = _command_of(frames)
        record = self.registry.workers.get(identity)
        if record is not None:
            self.liveness.seen(identity, now)
            record.seen_at = now
            if identity in self._suspended:
                self._resume(record)
        elif self.recovering(now):
            self._await(identity, now)
        if command is None:
            self._drop("malformed", identity, "not a message of this protocol (version, command or frames)")
            return []
        if command in ANSWERS:
            if record is None:  # nothing is forwarded for a peer that is not registered
                self._drop("unregistered", identity, f"{command.name} from a peer that is not registered")
                self._ask_to_register(identity, now)
                return self._flush()
            try:
                envelope = p.decode_envelope(frames)
            except p.ProtocolError as e:
                self._drop("malformed", identity, f"{command.name}: {e.message}")
                return []
            self._answer(record, envelope, frames, now)
            return self._flush()
        if command in MOVE_RELAYED or command is p.Command.MOVE_REPORT:
            self._move_message(identity, record, command, frames, now)
            return self._flush()
        if command not in CONTROL:  # a request, WELCOME, RECONNECT, DROP...: nothing a worker sends; dropped unread
            self._drop("unexpected", identity, f"{command.name} is not a worker's message")
            return []
        if record is None and command is not p.Command.READY:  # a stranger's heartbeat or farewell: not even read
            if command is p.Command.HEARTBEAT:
                self._ask_to_register(identity, now)
            return self._flush()
        if command is not p.Command.DISCONNECT and not self.admission.allow(identity, command, now):
            self._drop("rate_limited", identity, f"{command.name} over this peer's rate")
            if command is p.Command.READY and record is not None:
                self._ready_owed.add(identity)  # its newest state: asked for again once its rate allows
            return []
        too_large = self.admission.too_large(command, len(frames[2]))
        if too_large is not None:
            if command is p.Command.READY:
                self._refuse_ready(identity, too_large)
            else:
                self._drop("too_large", identity, too_large)
            return self._flush()
        try:
            message = p.decode(frames)
        except p.ProtocolError as e:
            self._drop("malformed", identity, f"{command.name}: {e.message}")
            return []
        if isinstance(message, p.Ready):
            self._register(identity, message, now)
        elif isinstance(message, p.Heartbeat) and record is not None:
            self._heartbeat(record, message)
        elif isinstance(message, p.Disconnect):
            self._worker_gone(identity, f"disconnected: {message.reason}" if message.reason else "disconnected", now)
        return self._flush()

    def tick(self, now: float) -> list[Send]:
        """Time passes: expire silent workers, send heartbeats and leases, close what lost its lease, time requests
        out, answer what was held past recovery."""
        self._now = now
        live = self.liveness
        silent = "missed heartbeats" if live.silence_s <= live.timeout_s else f"silent for {live.silence_s:g} s"
        for identity in live.expired(now):
            self._worker_gone(identity, silent, now)
        for identity, (since, _) in list(self._suspended.items()):
            if now - since >= live.timeout_s:
                self._worker_gone(identity, "unreachable", now)
        if live.heartbeat_due(now):
            beat = p.encode(p.Heartbeat(broker_id=self.broker_id))
            self._out.extend(Send(Peer.WORKER, identity, beat) for identity in self.registry.workers)
            self._asked_to_register = {
                i: t for i, t in self._asked_to_register.items() if now - t < 10 * self.settings.heartbeat_s
            }
            self._told_to_drop = {i: t for i, t in self._told_to_drop.items() if now - t < self.settings.heartbeat_s}
            self._awaited = {i: until for i, until in self._awaited.items() if until > now}
            self._ask_owed_readies(now)
            self._leases(now)
            if self.settings.request_timeout_s > 0:
                self._time_out(now)
        if self.held and not self.recovering(now):
            self._release_held(now)
        if self._unreachable:
            self._cancel_unreachable(now)
        self.moves.tick(now)
        return self._flush()

    def _cancel_unreachable(self, now: float) -> None:
        """Stop the generations whose client has not come back Settings.client_grace_s after it could not be reached
        (it is gone: nobody would read them)."""
        for key, since in list(self._unreachable.items()):
            if key not in self.inflight:
                del self._unreachable[key]  # ended meanwhile
            elif now - since >= self.settings.client_grace_s:
                del self._unreachable[key]
                log.info("generation_cancelled_client_gone", request=key[1])
                self._cancel_generation(key)

    def undeliverable(self, send: Send, failure: Failure, now: float) -> list[Send]:
        """A send failed. A worker that cannot be reached is gone (unless the broker itself was stalled: see `stalled`);
        a client that cannot be reached and does not speak again within Settings.client_grace_s has its generations
        stopped (`tick`)."""
        self._now = now
        if send.peer is Peer.WORKER:
            if failure is Failure.UNREACHABLE and send.identity in self.registry.workers and (
                    now < self._distrust_until or send.identity in self._suspended):
                self._suspend(send, now)
            elif failure is Failure.UNREACHABLE:
                # Its connection dropped: after a silence of a heartbeat window, ZMTP heartbeats closed it.
                missing = self.liveness.missing(send.identity, now)
                self._worker_gone(send.identity, "missed heartbeats" if missing else "unreachable", now)
            elif send.key is not None:
                flight = self.inflight.pop(send.key, None)
                self._settle_pending(flight)
                name = self._name(send.identity)
                self._error(*send.key, p.ErrorCode.OVERLOADED, f"worker {name} is overloaded (queue full): retry later")
            return self._flush()
        if failure is Failure.UNREACHABLE and now < self._distrust_until:
            return self._flush()  # closed by the broker's own stall, maybe: the client reconnects and resends
        if failure is Failure.UNREACHABLE and self.registry.held_by(send.identity):
            self._lease_failed.add(send.identity)
        if send.key is not None:
            keys = [send.key]
        elif len(send.frames) > 2 and send.frames[1] == p.Command.CHUNKS.value:
            # A stream batch: the client of every generation in it is gone. Read its request ids only now.
            keys = [(send.identity, rid) for rid in _chunk_request_ids(send.frames)]
        else:
            return self._flush()  # a LEASE, or an answer to a request no longer tracked
        log.info("client_send_failed", failure=failure.value, requests=[key[1] for key in keys][:8])
        if failure is Failure.UNREACHABLE:
            for key in keys:
                flight = self.inflight.get(key)
                if flight is not None and flight.command is p.Command.GENERATE:
                    self._unreachable.setdefault(key, now)  # cancelled by tick unless the client comes back
        return self._flush()

    def stalled(self, now: float, seconds: float) -> None:
        """The broker's process did not run for `seconds` (a loaded host, a paused VM). libzmq runs its timers before
        reading what came meanwhile, so its heartbeat timeouts may have closed connections whose peers had answered:
        for a heartbeat window, a worker found unreachable is not declared gone but given that window to come back
        (its DEALER reconnects by itself and says READY), its requests held for it meanwhile; and a client found
        unreachable keeps its generations (it reconnects with the same routing id, and resends)."""
        self.counters.stalls += 1
        self._distrust_until = now + self.liveness.timeout_s
        log.warning("broker_stalled", seconds=round(seconds, 3),
                    detail="workers whose connections closed meanwhile get a heartbeat window to come back")

    def next_tick(self) -> float:
        deadline = self.liveness.next_event()
        return min(deadline, self._recovery_ends()) if self.held else deadline

    def recovering(self, now: float) -> bool:
        """A restarted broker's window: `recovery_s` from the start, and until every peer heard from on the worker
        socket meanwhile has registered or stayed unregistered a heartbeat window since it was first heard."""
        return now < self._recovery_ends()

    def clients_gone(self) -> int:
        """Client connections holding sessions that are gone (read by the metrics thread: one C-level call)."""
        return len(self._client_gone)

    def discard_output(self) -> None:
        """Forget what the handling of a message that raised had queued (the server logs and counts it)."""
        self._out = []

    def _recovery_ends(self) -> float:
        return max(self.recover_until, *self._awaited.values()) if self._awaited else self.recover_until

    def _await(self, identity: bytes, now: float) -> None:
        """An unregistered peer spoke within the recovery window: it may be a worker about to re-register."""
        if now < self.recover_until and identity not in self._awaited and len(self._awaited) < MAX_AWAITED:
            self._awaited[identity] = now + self.liveness.timeout_s

    # -- client requests -------------------------------------------------------------------------

    def _owner(self, route: bytes, user: str) -> str:
        """Whom a new session belongs to: the client's key, or without authentication its routing id."""
        return user if self.settings.authenticated else "route:" + route.hex()

    def _over_cap(self, route: bytes, request_id: str, owner: str) -> bool:
        """Refuse a new session past the per-client cap (live sessions plus the ones being made)."""
        cap = self.settings.max_sessions_per_client
        if cap <= 0:
            return False
        held = self.registry.owned_by(owner) + self._pending_by_owner.get(owner, 0)
        if held < cap:
            return False
        log.info("create_refused", code="bad_request", reason="per_client_cap", sessions=held, request=request_id)
        self._error(route, request_id, p.ErrorCode.BAD_REQUEST,
                    f"this client holds {held} sessions: the limit is {cap} per client ({MAX_SESSIONS_FLAG})")
        return True

    def _create(self, route: bytes, request: p.CreateSession, now: float, user: str) -> None:
        key = (route, request.request_id)
        flight = self.inflight.get(key)
        if flight is not None and flight.command is not p.Command.CREATE:
            self._reused_id(route, request.request_id, flight)
            return
        if flight is not None and flight.worker in self.registry.workers:
            # A resend: same worker, same session id; the worker answers it from its request cache.
            again = replace(request, session_id=flight.session_id, owner=user, route=route)
            self._to_worker(self.registry.workers[flight.worker], again, key)
            return
        owner = self._owner(route, user)
        if self._over_cap(route, request.request_id, owner):
            return
        try:
            worker = place((w for w in self.registry.workers.values() if w.identity not in self._suspended),
                           request.model)
        except NoPlacement as e:
            suspended = any(self.registry.workers[i].serves(request.model) for i in self._suspended)
            if (e.code is p.ErrorCode.MODEL_NOT_FOUND and self.recovering(now)) or suspended:
                self._hold(route, request, user)  # until the workers are back (or the window ends)
                return
            log.info("create_refused", code=e.code.value, model=request.model, request=request.request_id)
            self._error(route, request.request_id, e.code, e.message)
            return
        session_id = secrets.token_hex(16)
        self._promise(worker, owner)
        self.inflight[key] = InFlight(worker.identity, p.Command.CREATE, session_id, now, owner, request, user)
        self._to_worker(worker, replace(request, session_id=session_id, owner=user, route=route), key)

    def _route(self, route: bytes, request: p.SessionRequest, now: float, user: str) -> None:
        worker = self.registry.worker_of(request.session_id)
        if worker is None:
            self._unknown_session(route, request, now, user)
            return
        if self.settings.authenticated and self.registry.owner_of(request.session_id) != user:
            if request.COMMAND not in ADMIN_COMMANDS or user not in self.admins:
                if not isinstance(request, p.Cancel):
                    log.warning("request_unauthorized", command=request.COMMAND.name, session=request.session_id,
                                request=request.request_id)
                    self._error(route, request.request_id, p.ErrorCode.UNAUTHORIZED,
                                f"session {request.session_id} belongs to another client")
                return
            log.info("admin_request", command=request.COMMAND.name, session=request.session_id, admin=user)
        else:  # the session's own client (without keys, any client): its connection holds the lease now
            self.registry.used(request.session_id, route, now)
        if isinstance(request, p.Cancel):  # one-way: nothing to track (during a move: to the source, which may run it)
            self._to_worker(worker, request.routed(route), None)
            return
        key = (route, request.request_id)
        flight = self.inflight.get(key)
        if request.session_id in self.moves.moving and not (flight is not None and flight.worker == worker.identity):
            refused = self.moves.hold(route, request, user)  # a resend of what runs on the source goes there
            if refused is not None:
                self._error(route, request.request_id, refused.code, refused.message)
            return
        if flight is not None and (flight.command is not request.COMMAND or flight.worker != worker.identity
                                   or flight.addressed() != request.session_id):
            self._reused_id(route, request.request_id, flight)
            return
        if flight is None and (self._too_long(route, request, worker) or self._unapplied(route, request, worker)):
            return
        sent_at = now if flight is None else flight.sent_at  # a resend does not move the deadline
        if isinstance(request, p.Fork):
            if flight is not None and flight.command is p.Command.FORK:
                child, owner = flight.session_id, flight.owner  # a resend: answered from the worker's cache
            else:
                owner = self.registry.owner_of(request.session_id) or self._owner(route, user)
                if self._over_cap(route, request.request_id, owner):
                    return
                child = secrets.token_hex(16)
                self._promise(worker, owner)
            self.inflight[key] = InFlight(worker.identity, p.Command.FORK, child, sent_at, owner,
                                          parent=request.session_id)
            self._to_worker(worker, replace(request, child_id=child, route=route), key)
            return
        self.inflight[key] = InFlight(worker.identity, request.COMMAND, request.session_id, sent_at)
        if isinstance(request, p.Close):
            worker.closing.add(request.session_id)  # its slot is free for what comes after it (WorkerRecord.closing)
        self._to_worker(worker, request.routed(route), key)

    def _too_long(self, route: bytes, request: p.SessionRequest, worker: WorkerRecord) -> bool:
        """Refuse token ids that could never fit the session's worker (more than its whole context), here rather than
        on the worker: such a list can be megabytes, and a flood of them would pile up in the worker's queue."""
        ids = request.token_ids if isinstance(request, p.Append) else (
            request.prompt_ids if isinstance(request, p.Generate) else None)
        if ids is None or not worker.max_context or len(ids) <= worker.max_context:
            return False
        self._error(route, request.request_id, p.ErrorCode.BAD_REQUEST,
                    f"{len(ids)} token ids exceed max_context {worker.max_context} of session {request.session_id}")
        return True

    def _unapplied(self, route: bytes, request: p.SessionRequest, worker: WorkerRecord) -> bool:
        """Refuse sampling's extras (logit_bias, the penalties, min_p, min_tokens), tools and function calls for a worker
        that would ignore them (one older than them says nothing of them in its READY): answered as if applied, they
        would be silently wrong."""
        if not isinstance(request, p.Generate):
            return False
        if request.params.extended and not worker.sampling_extras:
            self._error(route, request.request_id, p.ErrorCode.BAD_REQUEST,
                        f"worker {worker.name} does not apply logit_bias, penalties, min_p or min_tokens (an older "
                        "worker): upgrade it")
            return True
        if request.uses_tools and not worker.tools:
            self._error(route, request.request_id, p.ErrorCode.BAD_REQUEST,
                        f"worker {worker.name} does not render tools or function calls (an older worker): upgrade it")
            return True
        return False

    def _unknown_session(self, route: bytes, request: p.SessionRequest, now: float, user: str) -> None:
        if isinstance(request, p.Cancel):
            return
        gone = self.registry.gone(request.session_id)
        if gone is not None:
            self._error(route, request.request_id, gone.code, self._gone_message(gone))
        elif self.recovering(now):
            self._hold(route, request, user)
        else:
            self._error(route, request.request_id, p.ErrorCode.SESSION_NOT_FOUND, f"no session {request.session_id}")

    def _gone_message(self, gone: Gone) -> str:
        if gone is Gone.LOST:
            return "the worker holding this session is gone"
        if gone is Gone.IDLE:
            return "the worker closed this session after it idled too long (worker --session-idle-timeout)"
        return (f"the broker closed this session: its client was gone for more than "
                f"{self.settings.session_grace_s:g} s (broker {GRACE_FLAG})")

    def _hold(self, route: bytes, request: p.CreateSession | p.SessionRequest, user: str) -> None:
        if self.held_count >= MAX_HELD:
            self._error(route, request.request_id, p.ErrorCode.INTERNAL, "the broker is restarting: retry shortly")
            return
        self.held.setdefault("" if isinstance(request, p.CreateSession) else request.session_id, []).append(
            Held(route, request, user))
        self.held_count += 1

    def _release_held(self, now: float, worker: WorkerRecord | None = None) -> None:
        """Route the held requests again: all of them, or (a worker just registered) those it can take now, the
        requests for its sessions and the creates of its model. The others stay held: a READY costs the requests it
        releases, not every request held."""
        if worker is None:
            held, self.held = [h for hs in self.held.values() for h in hs], {}
        else:
            held = [h for sid in worker.sessions if sid in self.held for h in self.held.pop(sid)]
            kept: list[Held] = []
            for h in self.held.pop("", []):
                (held if worker.serves(getattr(h.request, "model", None)) else kept).append(h)
            if kept:
                self.held[""] = kept
        self.held_count -= len(held)
        for h in held:
            if isinstance(h.request, p.CreateSession):
                self._create(h.route, h.request, now, h.user)
            else:
                self._route(h.route, h.request, now, h.user)

    def _reused_id(self, route: bytes, request_id: str, flight: InFlight) -> None:
        """A request id still in flight for another request (another command, or another session): refused, so that
        the first keeps its accounting."""
        what = flight.command.name if flight.command is p.Command.CREATE else \
            f"{flight.command.name} of session {flight.addressed()}"
        self._error(route, request_id, p.ErrorCode.BAD_REQUEST,
                    f"request id {request_id} is in flight for a {what}: use a new id per request")

    def _status(self, request_id: str, now: float) -> p.StatusReport:
        workers = tuple(w.status(now) for w in self.registry.workers.values())
        return p.StatusReport(request_id=request_id, broker_id=self.broker_id, workers=workers)

    def _session_list(self, request_id: str, now: float, user: str) -> p.SessionList:
        """The sessions the asker may see (all of them without keys or for an admin key, else its own), the longest
        idle first, at most MAX_SESSIONS_REPORTED."""
        everyone = not self.settings.authenticated or user in self.admins
        visible = [(sid, s) for sid, s in self.registry.sessions() if everyone or s.owner == user]
        visible.sort(key=lambda item: item[1].used_at)
        entries = []
        for sid, s in visible[: p.MAX_SESSIONS_REPORTED]:
            gone_since = self._client_gone.get(s.client)
            if s.client == NO_CLIENT:
                gone_since = s.used_at
            entries.append(p.SessionEntry(
                session_id=sid, worker=self.registry.workers[s.worker].name,
                owner=s.owner if self.settings.authenticated else "", length=s.length,
                idle_ms=max(0, round((now - s.used_at) * 1000)),
                client="connected" if gone_since is None else "gone",
                gone_ms=0 if gone_since is None else max(0, round((now - gone_since) * 1000)),
            ))
        return p.SessionList(request_id=request_id, sessions=tuple(entries), total=len(visible))

    def _time_out(self, now: float) -> None:
        """Fail the requests on which nothing reached their client for request_timeout_s: no answer, and (streams) no
        tokens from their worker to their route."""
        limit = self.settings.request_timeout_s
        self._delivered = {k: t for k, t in self._delivered.items() if now - t <= limit}
        stale: list[tuple[RequestKey, InFlight]] = []
        for key, flight in self.inflight.items():
            if flight.worker in self.registry.workers:
                progress = max(flight.sent_at, self._delivered.get((flight.worker, key[0]), 0.0))
                if now - progress > limit:
                    stale.append((key, flight))
        for key, flight in stale:
            del self.inflight[key]
            self._settle_pending(flight)
            if key[0] == LEASE_ROUTE:  # a close of the broker's own: the next lease round sends it again
                continue
            if flight.command in (p.Command.CREATE, p.Command.FORK):
                self._timed_out[key] = (flight.worker, flight.session_id)
                if len(self._timed_out) > MAX_TIMED_OUT:
                    self._timed_out.popitem(last=False)
            name = self._name(flight.worker)
            log.warning("request_timed_out", worker=name, command=flight.command.name, request=key[1],
                        session=flight.session_id)
            self._error(*key, p.ErrorCode.TIMEOUT, f"worker {name} made no progress on this request for {limit:g} s")
            if flight.command is p.Command.GENERATE:  # should it come back, it stops generating for nobody
                cancel = p.Cancel(request_id=secrets.token_hex(8), session_id=flight.session_id, target=key[1],
                                  route=key[0])
                self._out.append(Send(Peer.WORKER, flight.worker, p.encode(cancel)))

    # -- leases ----------------------------------------------------------------------------------

    def _leases(self, now: float) -> None:
        """Once per heartbeat: learn which clients holding sessions are gone (their last LEASE failed), close the
        sessions of those gone longer than the grace period (none with a grace of 0), and send every holder its next
        LEASE."""
        grace = self.settings.session_grace_s
        clients = self.registry.clients()
        failed, self._lease_failed = self._lease_failed, set()
        for client in clients:
            if client in failed or client == NO_CLIENT:
                self._client_gone.setdefault(client, now)
            else:
                self._client_gone.pop(client, None)  # its last LEASE was delivered
        for client in [c for c in self._client_gone if not self.registry.held_by(c)]:
            del self._client_gone[client]
        for client, since in list(self._client_gone.items()) if grace > 0 else ():
            expired = [sid for sid in self.registry.held_by(client)
                       if now - max(since, self._used_at(sid)) >= grace]
            for sid in expired:
                self._close_for_lease(sid, now)
        lease = p.encode(p.Lease(broker_id=self.broker_id))
        self._out.extend(Send(Peer.CLIENT, client, lease) for client in clients if client != NO_CLIENT)

    def _used_at(self, session_id: str) -> float:
        known = self.registry.session(session_id)
        return 0.0 if known is None else known.used_at

    def _close_for_lease(self, session_id: str, now: float) -> None:
        worker = self.registry.worker_of(session_id)
        if worker is None or session_id in worker.closing or session_id in self.moves.moving:
            return  # (a moving session is closed by a later round, on the worker it moved to)
        key = (LEASE_ROUTE, f"lease-{secrets.token_hex(8)}")
        close = p.Close(request_id=key[1], session_id=session_id, route=LEASE_ROUTE)
        self.inflight[key] = InFlight(worker.identity, p.Command.CLOSE, session_id, now)
        worker.closing.add(session_id)
        log.info("session_lease_expired", session=session_id, worker=worker.name,
                 grace_s=self.settings.session_grace_s)
        self._out.append(Send(Peer.WORKER, worker.identity, p.encode(close), key))

    # -- worker messages -------------------------------------------------------------------------

    def _register(self, identity: bytes, ready: p.Ready, now: float) -> None:
        problem = self.admission.ready_problem(ready)
        if problem is not None:
            self._refuse_ready(identity, problem)
            return
        ready, dropped = self._without_lost(identity, ready)
        ready = self._without_moving_in(identity, ready)
        before = self.registry.workers.get(identity)
        again = before is not None
        # A worker cut off for a while re-sends READY on its backoff; they all arrive when the link is back.
        # Repeats that change nothing are logged at debug.
        unchanged = before is not None and (before.sessions, before.draining) == (set(ready.sessions), ready.draining)
        conflicts: list[str] = []
        record = self.registry.register(identity, ready, now, conflicts)
        dropped += tuple(conflicts)  # another worker holds them (a move's two copies after a broker restart)
        self.counters.worker_registered(again)
        self.liveness.seen(identity, now)
        self._asked_to_register.pop(identity, None)
        self._awaited.pop(identity, None)
        self._ready_owed.discard(identity)
        (log.debug if unchanged and not dropped else log.info)(
            "worker_reregistered" if again else "worker_registered",
            worker=ready.name, model=ready.model, capacity=ready.capacity, sessions=len(ready.sessions),
            draining=ready.draining, device=ready.device, dropped=len(dropped),
        )
        welcome = p.Welcome(
            broker_id=self.broker_id,
            heartbeat_ms=max(1, round(self.settings.heartbeat_s * 1000)),
            liveness=self.settings.liveness,
        )
        self._out.append(Send(Peer.WORKER, identity, p.encode(welcome)))
        if dropped:
            self.counters.sessions_dropped += len(dropped)
            self._told_to_drop[identity] = now
            self._out.append(Send(Peer.WORKER, identity, p.encode(p.Drop(sessions=dropped))))
        if self.held:
            self._release_held(now, record)
        if ready.evacuate:
            self.moves.evacuate(record, now)

    def _without_moving_in(self, identity: bytes, ready: p.Ready) -> p.Ready:
        """The READY without the sessions moving to this worker: the copy it imported is not routed to before the
        source has closed its own (broker.moves)."""
        kept = [i for i, sid in enumerate(ready.sessions) if not self.moves.claimed_by_target(identity, sid)]
        if len(kept) == len(ready.sessions):
            return ready
        return replace(ready, sessions=tuple(ready.sessions[i] for i in kept),
                       owners=tuple(ready.owners[i] for i in kept) if ready.owners else (),
                       holders=tuple(ready.holders[i] for i in kept) if ready.holders else ())

    def _without_lost(self, identity: bytes, ready: p.Ready) -> tuple[p.Ready, tuple[str, ...]]:
        """The READY without the sessions declared lost with this worker, and those (to be dropped there). The worker's
        lost sessions it no longer lists are forgotten: they are gone there."""
        lost = self._lost.get(identity)
        if not lost:
            return ready, ()
        dropped = tuple(sid for sid in ready.sessions if sid in lost)
        self._lost_count -= len(lost) - len(dropped)
        if dropped:
            self._lost[identity] = set(dropped)
        else:
            del self._lost[identity]
            self._lost_requests.pop(identity, None)  # it holds none of them: nothing of theirs comes any more
            return ready, ()
        kept = [i for i, sid in enumerate(ready.sessions) if sid not in lost]
        log.warning("lost_sessions_dropped", worker=ready.name, sessions=len(dropped))
        return replace(ready, sessions=tuple(ready.sessions[i] for i in kept),
                       owners=tuple(ready.owners[i] for i in kept) if ready.owners else (),
                       holders=tuple(ready.holders[i] for i in kept) if ready.holders else ()), dropped

    def _refuse_ready(self, identity: bytes, why: str) -> None:
        """A READY this broker does not take: counted, logged, and the peer told why."""
        self._drop("ready_refused", identity, why)
        error = p.Error(request_id=None, code=p.ErrorCode.BAD_REQUEST, message=f"registration refused: {why}")
        self._out.append(Send(Peer.WORKER, identity, p.encode(error)))

    def _heartbeat(self, record: WorkerRecord, beat: p.Heartbeat) -> None:
        if beat.evacuate:  # it drains and asks for its sessions to move where they can (once per evacuation)
            self.moves.evacuate(record, self._now)
        record.draining = beat.draining
        if beat.free_slots is not None:
            record.free_slots = beat.free_slots
        expired = [sid for sid in beat.expired if self.registry.worker_of(sid) is record]
        for sid in expired:
            self.registry.drop_session(sid, Gone.IDLE)
        if expired:
            log.info("sessions_expired", worker=record.name, sessions=len(expired))

    def _answer(self, record: WorkerRecord, envelope: p.Envelope, frames: Sequence[p.Frame], now: float) -> None:
        """A registered worker's answer: forwarded to its client; only an answer to a request in flight on this very
        worker changes the tables."""
        identity = record.identity
        track = self.settings.request_timeout_s > 0
        if envelope.command is p.Command.FANOUT:  # the hot path: one per engine step, for all streaming clients
            try:
                fanout = p.parse(envelope)
            except p.ProtocolError as e:
                self._drop("malformed", identity, f"FANOUT: {e.message}")
                return
            assert isinstance(fanout, p.Fanout)
            held_by = self.registry.held_by
            lost_here = identity in self._lost_requests  # (rare: a worker back from the dead, before it dropped them)
            for route, part in fanout.sends():
                if lost_here and self._of_lost_requests(identity, route, part):
                    continue
                self._out.append(Send(Peer.CLIENT, route, part))
                if track and held_by(route):  # a client with a request in flight holds its session's lease
                    self._delivered[identity, route] = now
            return
        route = p.route_of(envelope.header)
        if not route:
            self._drop("malformed", identity, f"{envelope.command.name} without a route")
            return
        if envelope.command is p.Command.CHUNKS:  # one client's tokens of one engine step
            listed = envelope.header.get("chunks")
            if not isinstance(listed, list) or not listed or envelope.payload:
                self._drop("malformed", identity, "CHUNKS without a list of chunks")
                return
            if identity in self._lost_requests and self._of_lost_requests(identity, route, frames):
                return
            self._out.append(Send(Peer.CLIENT, route, frames))
            if track and self.registry.held_by(route):
                self._delivered[identity, route] = now
            return
        lost = self._lost.get(identity)
        named = _named_sessions(envelope.header) & lost if lost else None
        if named:  # declared lost: nothing more is heard of them, and the worker is told (again) to drop them
            self._drop("lost_session", identity, f"{envelope.command.name} for a session declared lost")
            self._tell_to_drop(identity, tuple(sorted(named)), now)
            return
        request_id = p.request_id_of(envelope.header)
        key = None if request_id is None else (route, request_id)
        if key is not None:
            flight = self.inflight.get(key)
            if flight is not None and flight.worker != identity:
                self._drop("not_its_request", identity, "an answer to a request in flight on another worker")
                return
            if flight is None and self._timed_out.get(key, (b"",))[0] == identity:
                self._late_answer(identity, self._timed_out.pop(key)[1], envelope)
                return
            if flight is not None:
                del self.inflight[key]
                problem = self._account(identity, flight, envelope, key)
                if problem is not None:  # not forwarded: the client gets a typed error, the worker's new session goes
                    if flight.command in (p.Command.CREATE, p.Command.FORK):
                        self._close_made(identity, flight.session_id, "malformed_answer")
                    self._error(route, request_id, p.ErrorCode.INTERNAL,
                                f"worker {record.name} answered this {flight.command.name} with a malformed "
                                f"message ({problem})")
                    return
                if flight.create is not None and envelope.command is p.Command.ERROR and \
                        envelope.header.get("code") == p.ErrorCode.WORKER_DRAINING.value:
                    record.draining = True  # it drains (its heartbeat will say so): the create goes elsewhere
                    self.counters.creates_replaced += 1
                    self._create(route, flight.create, now, flight.user)
                    return
        if route == LEASE_ROUTE:  # the answer to a close of the broker's own
            return
        if envelope.command is p.Command.ERROR:
            self.counters.error(envelope.header.get("code"))
        self._out.append(Send(Peer.CLIENT, route, frames, key))

    def _of_lost_requests(self, identity: bytes, route: bytes, frames: Sequence[p.Frame]) -> bool:
        """Whether a CHUNKS message for `route` carries tokens of a generation answered session_lost on this worker."""
        lost = self._lost_requests[identity]
        return any((route, rid) in lost for rid in _chunk_request_ids(frames))

    def _account(self, identity: bytes, flight: InFlight, envelope: p.Envelope, key: RequestKey) -> str | None:
        """Keep the session table in step with a final answer to `flight`, a request in flight on this worker. What is
        wrong with an answer that creates, forks or closes a session but does not parse (it is not forwarded)."""
        self._settle_pending(flight)
        header = envelope.header
        kind = header.get("kind")
        holds = self.registry.worker_of(flight.session_id) is self.registry.workers.get(identity)
        if envelope.command is p.Command.REPLY and kind in ("created", "forked", "closed"):
            try:
                reply = p.parse(envelope)
            except p.ProtocolError as e:
                self._drop("malformed", identity, f"REPLY: {e.message}")
                return e.message
            if isinstance(reply, p.Created) and reply.session_id == flight.session_id:
                self.registry.add_session(identity, reply.session_id, flight.owner, key[0], self._now, 0)
            elif isinstance(reply, p.Forked) and reply.child_id == flight.session_id:
                self.registry.add_session(identity, reply.child_id, flight.owner, key[0], self._now, reply.length)
            elif isinstance(reply, p.Closed) and reply.session_id == flight.session_id and holds:
                # only the worker holding a session closes it
                self.registry.drop_session(reply.session_id, Gone.LEASE if key[0] == LEASE_ROUTE else None)
                if key[0] == LEASE_ROUTE:
                    self.counters.sessions_lease_closed += 1
        elif envelope.command is p.Command.REPLY and holds:
            length = header.get("length")
            if type(length) is int and 0 <= length <= p.MAX_COUNT and header.get("session_id") == flight.session_id:
                self.registry.set_length(flight.session_id, length)
        elif envelope.command is p.Command.ERROR and holds:
            code = header.get("code")
            if code == p.ErrorCode.SESSION_EXPIRED.value:
                self.registry.drop_session(flight.session_id, Gone.IDLE)
            elif flight.command is p.Command.CLOSE and code == p.ErrorCode.SESSION_NOT_FOUND.value:
                self.registry.drop_session(flight.session_id, Gone.LEASE if key[0] == LEASE_ROUTE else None)
        return None

    def _late_answer(self, identity: bytes, session_id: str, envelope: p.Envelope) -> None:
        """The answer to a create or fork that timed out (its client was answered TIMEOUT): not forwarded; a session
        it made is closed on its worker."""
        header = envelope.header
        made = header.get("session_id" if header.get("kind") == "created" else "child_id")
        if envelope.command is p.Command.REPLY and header.get("kind") in ("created", "forked") and made == session_id:
            self._close_made(identity, session_id, "late_answer")
        else:
            log.info("late_answer_dropped", worker=self._name(identity), command=envelope.command.name)

    def _close_made(self, identity: bytes, session_id: str, why: str) -> None:
        """Close a session a worker made that the broker does not route to (nothing will): a CLOSE of the broker's own,
        its answer not forwarded (route LEASE_ROUTE), not tracked (should it be lost, the worker's idle timeout reaps
        the session)."""
        log.warning("unrouted_session_closed", worker=self._name(identity), session=session_id, why=why)
        close = p.Close(request_id=f"unrouted-{secrets.token_hex(8)}", session_id=session_id, route=LEASE_ROUTE)
        self._out.append(Send(Peer.WORKER, identity, p.encode(close)))

    def _cancel_generation(self, key: RequestKey) -> None:
        """The client of a generation in flight cannot be reached: stop it (once) rather than generate for nobody."""
        flight = self.inflight.get(key)
        if flight is not None and flight.command is p.Command.GENERATE:
            del self.inflight[key]
            cancel = p.Cancel(request_id=secrets.token_hex(8), session_id=flight.session_id, target=key[1], route=key[0])
            self._out.append(Send(Peer.WORKER, flight.worker, p.encode(cancel)))

    def _promise(self, worker: WorkerRecord, owner: str) -> None:
        """A create or fork is on its way to `worker`: its slot and the owner's cap count it until answered."""
        worker.pending += 1
        self._pending_by_owner[owner] = self._pending_by_owner.get(owner, 0) + 1

    def _settle_pending(self, flight: InFlight | None) -> None:
        if flight is None:
            return
        record = self.registry.workers.get(flight.worker)
        if flight.command is p.Command.CLOSE:
            if record is not None:  # answered (Closed drops the session too), failed or timed out: not closing now
                record.closing.discard(flight.session_id)
        elif flight.command in (p.Command.CREATE, p.Command.FORK):
            if record is not None:
                record.pending = max(0, record.pending - 1)
            left = self._pending_by_owner.get(flight.owner, 0) - 1
            if left > 0:
                self._pending_by_owner[flight.owner] = left
            else:
                self._pending_by_owner.pop(flight.owner, None)

    def _suspend(self, send: Send, now: float) -> None:
        """A worker found unreachable while the broker distrusts connection losses: held for a heartbeat window, and
        the requests sent to it meanwhile kept to be sent again when it is back."""
        if send.identity not in self._suspended:
            log.warning("worker_unreachable_after_stall", worker=self._name(send.identity),
                        detail=f"given {self.liveness.timeout_s:g} s to come back")
        _, retry = self._suspended.setdefault(send.identity, (now, []))
        if send.key is not None and len(retry) < MAX_HELD:
            retry.append(send)

    def _resume(self, record: WorkerRecord) -> None:
        """A suspended worker spoke again (its READY, after it reconnected): it is back, with its sessions."""
        _, retry = self._suspended.pop(record.identity)
        log.info("worker_back", worker=record.name, requests_sent_again=len(retry))
        self._out.extend(retry)

    def _worker_gone(self, identity: bytes, reason: str, now: float) -> None:
        self.liveness.forget(identity)
        self._ready_owed.discard(identity)
        self._suspended.pop(identity, None)
        if identity not in self.registry.workers:
            return
        copies, held = self.moves.worker_gone(identity, now)
        record = self.registry.remove(identity)
        if record is None:
            return
        self._remember_lost(identity, copies)  # copies of sessions moving to it: dropped there should it come back
        self.counters.worker_lost(reason, len(record.sessions))
        failed = [key for key, flight in self.inflight.items() if flight.worker == identity]
        planned = reason == "disconnected: drained" and not record.sessions and not failed  # a clean shutdown
        (log.info if planned else log.warning)(
            "worker_lost", worker=record.name, reason=reason, sessions=len(record.sessions), failed=len(failed))
        lost = set(record.sessions)
        again: list[tuple[RequestKey, p.CreateSession, str]] = []
        for key in failed:
            flight = self.inflight.pop(key)
            self._settle_pending(flight)
            if flight.command in (p.Command.CREATE, p.Command.FORK):
                lost.add(flight.session_id)  # it may have been made there before the worker vanished
            if flight.create is not None:
                again.append((key, flight.create, flight.user))
            elif key[0] != LEASE_ROUTE:
                self._error(*key, p.ErrorCode.SESSION_LOST, f"worker {record.name} is gone ({reason})")
                if flight.command is p.Command.GENERATE:
                    self._lost_requests.setdefault(identity, set()).add(key)
        self._remember_lost(identity, lost)
        for (route, request_id), request, user in again:
            log.info("create_placed_again", request=request_id, lost_worker=record.name)
            self.counters.creates_replaced += 1
            self._create(route, request, now, user)
        self._route_held(held)

    def _remember_lost(self, identity: bytes, sessions: Iterable[str]) -> None:
        known = self._lost.setdefault(identity, set())
        before = len(known)
        known.update(sessions)
        self._lost_count += len(known) - before
        self._lost.move_to_end(identity)
        if not known:
            del self._lost[identity]
        while self._lost_count > MAX_LOST_SESSIONS and len(self._lost) > 1:
            gone, oldest = self._lost.popitem(last=False)
            self._lost_count -= len(oldest)
            self._lost_requests.pop(gone, None)

    def _ask_to_register(self, identity: bytes, now: float) -> None:
        """An unknown worker (this broker restarted, or it was declared dead): ask it for READY, once a beat."""
        last = self._asked_to_register.get(identity)
        if last is not None and now - last < self.settings.heartbeat_s:
            return
        self._asked_to_register[identity] = now
        self._out.append(Send(Peer.WORKER, identity, p.encode(p.Reconnect(broker_id=self.broker_id))))

    def _tell_to_drop(self, identity: bytes, sessions: tuple[str, ...], now: float) -> None:
        """DROP again, for a worker still answering for sessions declared lost (it missed the first): once a beat."""
        last = self._told_to_drop.get(identity)
        if last is not None and now - last < self.settings.heartbeat_s:
            return
        self._told_to_drop[identity] = now
        self._out.append(Send(Peer.WORKER, identity, p.encode(p.Drop(sessions=sessions))))

    def _ask_owed_readies(self, now: float) -> None:
        """Registered workers whose READY was over their rate send it again, now that their rate allows."""
        for identity in list(self._ready_owed):
            if identity not in self.registry.workers:
                self._ready_owed.discard(identity)
            elif self.admission.has_token(identity, p.Command.READY, now):
                self._ready_owed.discard(identity)
                self._out.append(Send(Peer.WORKER, identity, p.encode(p.Reconnect(broker_id=self.broker_id))))

    # -- moving sessions (broker.moves) -----------------------------------------------------------

    def _moves_request(self, route: bytes, request: p.DrainWorker | p.Rebalance, now: float, user: str) -> None:
        """DRAIN or REBALANCE from a client (with keys, an admin's): answered once the moves have ended."""
        if self.settings.authenticated and user not in self.admins:
            self._error(route, request.request_id, p.ErrorCode.UNAUTHORIZED,
                        f"{request.COMMAND.name} is for admin keys (the broker's keys/admins/)")
            return
        key = (route, request.request_id)
        if isinstance(request, p.Rebalance):
            self.moves.rebalance(key, now, lambda sid: not any(
                f.session_id == sid for f in self.inflight.values()))
            return
        named = [w for w in self.registry.workers.values() if w.name == request.worker]
        if len(named) != 1:
            self._error(route, request.request_id, p.ErrorCode.BAD_REQUEST,
                        f"no worker named {request.worker!r}" if not named else
                        f"{len(named)} workers are named {request.worker!r}")
            return
        self.moves.drain(named[0], key, now)

    def _move_message(self, identity: bytes, record: WorkerRecord | None, command: p.Command, frames: Sequence[p.Frame],
                      now: float) -> None:
        """MOVE_STATE and MOVE_CHUNK (relayed to their move's target) and MOVE_REPORT from a registered worker."""
        if record is None:
            self._drop("unregistered", identity, f"{command.name} from a peer that is not registered")
            self._ask_to_register(identity, now)
            return
        if command in MOVE_RELAYED:
            why = self.moves.relay(record, command, frames)
        else:
            try:
                report = p.decode(frames)
            except p.ProtocolError as e:
                self._drop("malformed", identity, f"{command.name}: {e.message}")
                return
            assert isinstance(report, p.MoveReport)
            why = self.moves.report(record, report, now)
        if why is not None:
            self._drop("unexpected", identity, why)

    def _move_send(self, identity: bytes, message: p.Message | Sequence[p.Frame]) -> None:
        frames = p.encode(message) if isinstance(message, p.Message) else message
        self._out.append(Send(Peer.WORKER, identity, frames))

    def _route_held(self, held: list[MoveHeld]) -> None:
        """Requests held while their session moved, routed now (to where it is, or answered if it is gone)."""
        for route, request, user in held:
            self._route(route, request, self._now, user)

    def _move_answer(self, key: RequestKey, message: p.Message) -> None:
        self._reply(key[0], message)

    # -- helpers ------------------------------------------------------------------------------

    def _to_worker(self, worker: WorkerRecord, request: p.Request, key: RequestKey | None) -> None:
        self._out.append(Send(Peer.WORKER, worker.identity, p.encode(request), key))

    def _reply(self, route: bytes, message: p.Message) -> None:
        self._out.append(Send(Peer.CLIENT, route, p.encode(message)))

    def _error(self, route: bytes, request_id: str | None, code: p.ErrorCode, message: str) -> None:
        self.counters.error(code)
        self._reply(route, p.Error(request_id=request_id, code=code, message=message))

    def _drop(self, reason: str, identity: bytes, detail: str) -> None:
        """A worker-socket message not used: counted by reason, logged at warning at most every DROP_LOG_S per reason
        (a flood is counted, not logged), each one at debug."""
        self.counters.dropped(reason)
        now = self._now
        loud = now - self._drops_logged.get(reason, -DROP_LOG_S) >= DROP_LOG_S
        if loud:
            self._drops_logged[reason] = now
        (log.warning if loud else log.debug)("worker_message_dropped", reason=reason, peer=identity.hex()[:64],
                                             detail=detail[:256], dropped=self.counters.messages_dropped.get(reason, 0))

    def _name(self, identity: bytes) -> str:
        record = self.registry.workers.get(identity)
        return record.name if record is not None else identity.hex()

    def _flush(self) -> list[Send]:
        out, self._out = self._out, []
        return out


def _command_of(frames: Sequence[p.Frame]) -> p.Command | None:
    """The command of a message whose version and frame count are right, read without unpacking its header."""
    if len(frames) < 3 or frames[0] != p.VERSION:
        return None
    return p.COMMANDS.get(bytes(frames[1]))


def _named_sessions(header: dict[str, Any]) -> set[str]:
    """The session ids an answer's header names (its session, and a fork's child)."""
    return {v for v in (header.get("session_id"), header.get("child_id")) if isinstance(v, str)}


def _chunk_request_ids(frames: Sequence[p.Frame]) -> list[str]:
    """The request ids of a CHUNKS message the broker forwarded without reading it (a FANOUT part); none if its header
    is not valid (the client it was for would have dropped it)."""
    try:
        return p.chunk_request_ids(p.decode_envelope(frames).header)
    except p.ProtocolError:
        return []
