"""The broker's logic: frames in, frames out. No sockets (broker/server.py does the I/O).

- A client request is validated, then placed (CREATE), answered here (STATUS) or forwarded to the
  worker holding its session with the client's routing id added as `route`.
- A worker's answer (REPLY, CHUNKS, ERROR) is forwarded to its route unchanged; the broker only
  reads the header to find the route and to keep its tables (session created, forked, closed; request
  finished). CHUNKS, the streamed tokens of one engine step for one client, is checked no further than
  its route and the type of its list: the client checks the chunks, so nothing is done here per token.
- A worker that misses `liveness` heartbeats, disconnects, or cannot be reached is gone: every request
  in flight on it fails at once with session_lost, and later requests for its sessions get session_lost.
- A freshly started broker is "recovering" for a while: requests for sessions it does not know yet
  are held until the workers have re-registered (they send the sessions they hold), then answered.
- Sessions have owners. With authentication on, a session belongs to the client key that created it
  (forks to the key that forked) and any other key gets `unauthorized`; without it, to the client's
  routing id, used only to count sessions against the per-client cap.
- A request whose worker makes no progress (no answer, no engine step) for `request_timeout_s` fails with
  `timeout`, checked once per heartbeat; the worker and its other sessions stay.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from enum import Enum

import structlog

from broker.common import protocol as p
from broker.counters import RouterCounters
from broker.liveness import Liveness
from broker.placement import NoPlacement, place
from broker.registry import Registry, WorkerRecord

log = structlog.get_logger()

MAX_HELD = 100_000  # requests held while recovering; past this they are refused
ANSWERS = frozenset({p.Command.REPLY, p.Command.CHUNKS, p.Command.ERROR, p.Command.FANOUT})

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
    frames: list[bytes]
    key: RequestKey | None = None  # the client request this belongs to, for failure handling


@dataclass(frozen=True, slots=True)
class Settings:
    heartbeat_s: float = 1.0
    liveness: int = 3
    recovery_s: float = 5.0  # how long a new broker waits for workers to re-register
    authenticated: bool = False  # clients carry CURVE keys: sessions are owned by them
    max_sessions_per_client: int = 0  # 0: no cap
    request_timeout_s: float = 0.0  # 0: requests wait for their worker as long as it lives


MAX_SESSIONS_FLAG = "--max-sessions-per-client"


@dataclass(slots=True)
class InFlight:
    worker: bytes
    command: p.Command
    session_id: str  # the session addressed; for CREATE and FORK the new session
    sent_at: float = 0.0
    owner: str = ""  # CREATE and FORK: whose the new session will be


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
        self.liveness = Liveness(settings.heartbeat_s, settings.liveness, now)
        self.inflight: dict[RequestKey, InFlight] = {}
        self.held: list[Held] = []
        self.recover_until = now + settings.recovery_s
        self._asked_to_register: dict[bytes, float] = {}
        self._pending_by_owner: dict[str, int] = {}  # creates and forks in flight per owner
        # Generations failed with session_lost when their worker was declared dead: should that worker come
        # back (it was only stopped or cut off), they are cancelled rather than left generating for nobody.
        self._orphans: dict[bytes, list[p.Cancel]] = {}
        self._out: list[Send] = []
        self.counters = RouterCounters()  # read by broker.metrics at scrape time

    # -- entry points (each returns what to send) ---------------------------------------------------

    def client_message(self, route: bytes, frames: list[bytes], now: float, user: str = "") -> list[Send]:
        """`user`: the client's CURVE public key (Z85) when the broker authenticates clients."""
        try:
            envelope = p.decode_envelope(frames)
            if envelope.command not in p.REQUEST_COMMANDS:
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
        elif isinstance(message, p.CreateSession):
            self._create(route, message, now, user)
        elif isinstance(message, p.SESSION_REQUEST_TYPES):
            self._route(route, message, now, user)
        return self._flush()

    def worker_message(self, identity: bytes, frames: list[bytes], now: float) -> list[Send]:
        try:
            envelope = p.decode_envelope(frames)
        except p.ProtocolError as e:
            log.warning("worker_message_invalid", code=e.code.value, error=e.message, identity=identity.hex())
            return []
        record = self.registry.workers.get(identity)
        if record is not None:
            self.liveness.seen(identity, now)
            record.seen_at = now
        if envelope.command in ANSWERS:
            if record is not None:
                record.progress_at = now
            self._answer(identity, envelope, frames)
            if record is None:
                self._ask_to_register(identity, now)
            return self._flush()
        try:
            message = p.parse(envelope)
        except p.ProtocolError as e:
            log.warning("worker_message_invalid", code=e.code.value, error=e.message, identity=identity.hex())
            return []
        if isinstance(message, p.Ready):
            self._register(identity, message, now)
        elif isinstance(message, p.Heartbeat):
            if record is None:
                self._ask_to_register(identity, now)
            else:
                self._heartbeat(record, message, now)
        elif isinstance(message, p.Disconnect):
            self._worker_gone(identity, f"disconnected: {message.reason}" if message.reason else "disconnected")
        else:
            log.warning("worker_message_unexpected", command=message.COMMAND.name, identity=identity.hex())
        return self._flush()

    def tick(self, now: float) -> list[Send]:
        """Time passes: expire silent workers, send heartbeats, answer what was held past recovery."""
        for identity in self.liveness.expired(now):
            self._worker_gone(identity, "missed heartbeats")
        if self.liveness.heartbeat_due(now):
            beat = p.encode(p.Heartbeat(broker_id=self.broker_id))
            self._out.extend(Send(Peer.WORKER, identity, beat) for identity in self.registry.workers)
            self._asked_to_register = {
                i: t for i, t in self._asked_to_register.items() if now - t < 10 * self.settings.heartbeat_s
            }
            if self.settings.request_timeout_s > 0:
                self._time_out(now)
        if self.held and not self.recovering(now):
            self._release_held(now)
        return self._flush()

    def undeliverable(self, send: Send, failure: Failure, now: float) -> list[Send]:
        """A send failed. A worker that cannot be reached is gone; a client that is gone stops its generation."""
        if send.peer is Peer.WORKER:
            if failure is Failure.UNREACHABLE:
                self._worker_gone(send.identity, "unreachable")
            elif send.key is not None:
                flight = self.inflight.pop(send.key, None)
                self._settle_pending(flight)
                name = self._name(send.identity)
                self._error(*send.key, p.ErrorCode.INTERNAL, f"worker {name} is overloaded (queue full): retry later")
            return self._flush()
        if send.key is not None:
            keys = [send.key]
        elif len(send.frames) > 2 and send.frames[1] == p.Command.CHUNKS.value:
            # A stream batch: the client of every generation in it is gone. Read its request ids only now.
            keys = [(send.identity, rid) for rid in p.chunk_request_ids(p.decode_envelope(send.frames).header)]
        else:
            log.debug("client_send_failed", failure=failure.value)
            return self._flush()
        log.info("client_send_failed", failure=failure.value, requests=[key[1] for key in keys][:8])
        if failure is Failure.UNREACHABLE:
            for key in keys:
                self._cancel_generation(key)
        return self._flush()

    def next_tick(self) -> float:
        deadline = self.liveness.next_event()
        return min(deadline, self.recover_until) if self.held else deadline

    def recovering(self, now: float) -> bool:
        return now < self.recover_until

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
            worker = place(self.registry.workers.values(), request.model)
        except NoPlacement as e:
            if e.code is p.ErrorCode.MODEL_NOT_FOUND and self.recovering(now):
                self._hold(route, request, user)
                return
            log.info("create_refused", code=e.code.value, model=request.model, request=request.request_id)
            self._error(route, request.request_id, e.code, e.message)
            return
        session_id = secrets.token_hex(16)
        self._promise(worker, owner)
        self.inflight[key] = InFlight(worker.identity, p.Command.CREATE, session_id, now, owner)
        self._to_worker(worker, replace(request, session_id=session_id, owner=user, route=route), key)

    def _route(self, route: bytes, request: p.SessionRequest, now: float, user: str) -> None:
        worker = self.registry.worker_of(request.session_id)
        if worker is None:
            self._unknown_session(route, request, now, user)
            return
        if self.settings.authenticated and self.registry.owner_of(request.session_id) != user:
            if not isinstance(request, p.Cancel):
                log.warning("request_unauthorized", command=request.COMMAND.name, session=request.session_id,
                            request=request.request_id)
                self._error(route, request.request_id, p.ErrorCode.UNAUTHORIZED,
                            f"session {request.session_id} belongs to another client")
            return
        if isinstance(request, p.Cancel):  # one-way: nothing to track
            self._to_worker(worker, request.routed(route), None)
            return
        key = (route, request.request_id)
        flight = self.inflight.get(key)
        if flight is not None and (flight.command is not request.COMMAND or flight.worker != worker.identity):
            self._reused_id(route, request.request_id, flight)
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
            self.inflight[key] = InFlight(worker.identity, p.Command.FORK, child, sent_at, owner)
            self._to_worker(worker, replace(request, child_id=child, route=route), key)
            return
        self.inflight[key] = InFlight(worker.identity, request.COMMAND, request.session_id, sent_at)
        if isinstance(request, p.Close):
            worker.closing.add(request.session_id)  # its slot is free for what comes after it (WorkerRecord.closing)
        self._to_worker(worker, request.routed(route), key)

    def _unknown_session(self, route: bytes, request: p.SessionRequest, now: float, user: str) -> None:
        if isinstance(request, p.Cancel):
            return
        gone = self.registry.gone(request.session_id)
        if gone is p.ErrorCode.SESSION_LOST:
            self._error(route, request.request_id, gone, "the worker holding this session is gone")
        elif gone is p.ErrorCode.SESSION_EXPIRED:
            self._error(route, request.request_id, gone, "the worker closed this session after it idled too long "
                        "(worker --session-idle-timeout)")
        elif self.recovering(now):
            self._hold(route, request, user)
        else:
            self._error(route, request.request_id, p.ErrorCode.SESSION_NOT_FOUND, f"no session {request.session_id}")

    def _hold(self, route: bytes, request: p.CreateSession | p.SessionRequest, user: str) -> None:
        if len(self.held) >= MAX_HELD:
            self._error(route, request.request_id, p.ErrorCode.INTERNAL, "the broker is restarting: retry shortly")
            return
        self.held.append(Held(route, request, user))

    def _release_held(self, now: float) -> None:
        held, self.held = self.held, []
        for h in held:
            if isinstance(h.request, p.CreateSession):
                self._create(h.route, h.request, now, h.user)
            else:
                self._route(h.route, h.request, now, h.user)

    def _reused_id(self, route: bytes, request_id: str, flight: InFlight) -> None:
        """A request id still in flight for another request: refused, so that the first keeps its accounting."""
        self._error(route, request_id, p.ErrorCode.BAD_REQUEST,
                    f"request id {request_id} is in flight for a {flight.command.name}: use a new id per request")

    def _status(self, request_id: str, now: float) -> p.StatusReport:
        workers = tuple(w.status(now) for w in self.registry.workers.values())
        return p.StatusReport(request_id=request_id, broker_id=self.broker_id, workers=workers)

    def _time_out(self, now: float) -> None:
        """Fail the requests whose worker has made no progress for request_timeout_s."""
        limit = self.settings.request_timeout_s
        stale: list[tuple[RequestKey, InFlight]] = []
        for key, flight in self.inflight.items():
            record = self.registry.workers.get(flight.worker)
            if record is not None and now - max(flight.sent_at, record.progress_at) > limit:
                stale.append((key, flight))
        for key, flight in stale:
            del self.inflight[key]
            self._settle_pending(flight)
            name = self._name(flight.worker)
            log.warning("request_timed_out", worker=name, command=flight.command.name, request=key[1],
                        session=flight.session_id)
            self._error(*key, p.ErrorCode.TIMEOUT, f"worker {name} made no progress on this request for {limit:g} s")
            if flight.command is p.Command.GENERATE:  # should it come back, it stops generating for nobody
                cancel = p.Cancel(request_id=secrets.token_hex(8), session_id=flight.session_id, target=key[1],
                                  route=key[0])
                self._out.append(Send(Peer.WORKER, flight.worker, p.encode(cancel)))

    # -- worker messages -------------------------------------------------------------------------

    def _register(self, identity: bytes, ready: p.Ready, now: float) -> None:
        before = self.registry.workers.get(identity)
        again = before is not None
        # A worker cut off for a while re-sends READY on its backoff; they all arrive when the link is back.
        # Repeats that change nothing are logged at debug.
        unchanged = before is not None and (before.sessions, before.draining) == (set(ready.sessions), ready.draining)
        self.registry.register(identity, ready, now)
        self.counters.worker_registered(again)
        self.liveness.seen(identity, now)
        self._asked_to_register.pop(identity, None)
        (log.debug if unchanged else log.info)(
            "worker_reregistered" if again else "worker_registered",
            worker=ready.name, model=ready.model, capacity=ready.capacity, sessions=len(ready.sessions),
            draining=ready.draining, device=ready.device,
        )
        welcome = p.Welcome(
            broker_id=self.broker_id,
            heartbeat_ms=max(1, round(self.settings.heartbeat_s * 1000)),
            liveness=self.settings.liveness,
        )
        self._out.append(Send(Peer.WORKER, identity, p.encode(welcome)))
        for cancel in self._orphans.pop(identity, ()):
            self._out.append(Send(Peer.WORKER, identity, p.encode(cancel)))
        if self.held:
            self._release_held(now)

    def _heartbeat(self, record: WorkerRecord, beat: p.Heartbeat, now: float) -> None:
        record.draining = beat.draining
        if beat.free_slots is not None:
            record.free_slots = beat.free_slots
        if beat.steps is not None and beat.steps != record.steps:
            record.steps = beat.steps
            record.progress_at = now
        expired = [sid for sid in beat.expired if self.registry.worker_of(sid) is record]
        for sid in expired:
            self.registry.drop_session(sid, p.ErrorCode.SESSION_EXPIRED)
        if expired:
            log.info("sessions_expired", worker=record.name, sessions=len(expired))

    def _answer(self, identity: bytes, envelope: p.Envelope, frames: list[bytes]) -> None:
        if envelope.command is p.Command.FANOUT:  # the hot path: one per engine step, for all streaming clients
            try:
                fanout = p.parse(envelope)
            except p.ProtocolError as e:
                log.warning("worker_fanout_invalid", error=e.message, worker=self._name(identity))
                return
            assert isinstance(fanout, p.Fanout)
            self._out.extend(Send(Peer.CLIENT, route, chunks) for route, chunks in fanout.sends())
            return
        route = p.route_of(envelope.header)
        if not route:
            log.warning("worker_answer_without_route", command=envelope.command.name, worker=self._name(identity))
            return
        if envelope.command is p.Command.CHUNKS:  # the hot path: one per client per engine step
            chunks = envelope.header.get("chunks")
            if not isinstance(chunks, list) or not chunks or envelope.payload:
                log.warning("worker_chunks_invalid", worker=self._name(identity))
                return
            self._out.append(Send(Peer.CLIENT, route, frames))
            return
        if envelope.command is p.Command.ERROR:
            self.counters.error(envelope.header.get("code"))
        request_id = p.request_id_of(envelope.header)
        key = None if request_id is None else (route, request_id)
        if key is not None:
            flight = self.inflight.pop(key, None)
            self._account(identity, flight, envelope)
        self._out.append(Send(Peer.CLIENT, route, frames, key))

    def _account(self, identity: bytes, flight: InFlight | None, envelope: p.Envelope) -> None:
        """Keep the session table in step with a final answer."""
        self._settle_pending(flight)
        kind = envelope.header.get("kind")
        if envelope.command is p.Command.REPLY and kind in ("created", "forked", "closed"):
            try:
                reply = p.parse(envelope)
            except p.ProtocolError as e:
                log.warning("worker_reply_invalid", error=e.message, worker=self._name(identity))
                return
            owner = flight.owner if flight is not None else ""
            if isinstance(reply, p.Created):
                self.registry.add_session(identity, reply.session_id, owner)
            elif isinstance(reply, p.Forked):
                self.registry.add_session(identity, reply.child_id, owner)
            elif isinstance(reply, p.Closed) and self.registry.worker_of(reply.session_id) is self.registry.workers.get(identity):
                self.registry.drop_session(reply.session_id)  # only the worker holding a session closes it
        elif envelope.command is p.Command.ERROR and flight is not None:
            code = envelope.header.get("code")
            if code == p.ErrorCode.SESSION_EXPIRED.value:
                self.registry.drop_session(flight.session_id, p.ErrorCode.SESSION_EXPIRED)
            elif flight.command is p.Command.CLOSE and code == p.ErrorCode.SESSION_NOT_FOUND.value:
                self.registry.drop_session(flight.session_id)

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

    def _worker_gone(self, identity: bytes, reason: str) -> None:
        self.liveness.forget(identity)
        record = self.registry.remove(identity)
        if record is None:
            return
        self.counters.worker_lost(reason, len(record.sessions))
        failed = [key for key, flight in self.inflight.items() if flight.worker == identity]
        planned = reason == "disconnected: drained" and not record.sessions and not failed  # a clean shutdown
        (log.info if planned else log.warning)(
            "worker_lost", worker=record.name, reason=reason, sessions=len(record.sessions), failed=len(failed))
        orphans = self._orphans.setdefault(identity, [])
        for key in failed:
            flight = self.inflight.pop(key)
            self._settle_pending(flight)
            self._error(*key, p.ErrorCode.SESSION_LOST, f"worker {record.name} is gone ({reason})")
            if flight.command is p.Command.GENERATE and len(orphans) < MAX_HELD:
                orphans.append(p.Cancel(request_id=secrets.token_hex(8), session_id=flight.session_id, target=key[1],
                                        route=key[0]))
        if not orphans:
            del self._orphans[identity]

    def _ask_to_register(self, identity: bytes, now: float) -> None:
        """An unknown worker (this broker restarted, or it was declared dead): ask it for READY, once a beat."""
        last = self._asked_to_register.get(identity)
        if last is not None and now - last < self.settings.heartbeat_s:
            return
        self._asked_to_register[identity] = now
        self._out.append(Send(Peer.WORKER, identity, p.encode(p.Reconnect(broker_id=self.broker_id))))

    # -- helpers ------------------------------------------------------------------------------

    def _to_worker(self, worker: WorkerRecord, request: p.Request, key: RequestKey | None) -> None:
        self._out.append(Send(Peer.WORKER, worker.identity, p.encode(request), key))

    def _reply(self, route: bytes, message: p.Message) -> None:
        self._out.append(Send(Peer.CLIENT, route, p.encode(message)))

    def _error(self, route: bytes, request_id: str | None, code: p.ErrorCode, message: str) -> None:
        self.counters.error(code)
        self._reply(route, p.Error(request_id=request_id, code=code, message=message))

    def _name(self, identity: bytes) -> str:
        record = self.registry.workers.get(identity)
        return record.name if record is not None else identity.hex()

    def _flush(self) -> list[Send]:
        out, self._out = self._out, []
        return out
