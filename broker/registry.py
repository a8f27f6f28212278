"""The broker's bookkeeping: which workers exist, what they serve, which worker holds each session, and for each
session its owner, its client (the connection that last used it: whose lease keeps it), its last use and its length.

Pure data, no sockets: the router calls it and tests assert on it with exact values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import structlog

from broker.common.protocol import ErrorCode, Ready, SamplingDefaults, WorkerStatus

log = structlog.get_logger()

# Sessions of dead workers (and sessions closed for idling, or because their client was gone) are remembered so that
# later requests get session_lost (session_expired), not session_not_found. Bounded so that a long-lived broker does not
# grow without limit.
MAX_GONE_SESSIONS = 1 << 20
NO_CLIENT = b""  # the client of a session that nobody has used since a READY that named none


class Gone(Enum):
    """Why a session that was is no more; `code` is what later requests for it are answered."""

    LOST = "lost"  # its worker is gone
    IDLE = "idle"  # its worker closed it after it idled (worker --session-idle-timeout)
    LEASE = "lease"  # the broker closed it: its client was gone (broker --session-grace-ms)

    @property
    def code(self) -> ErrorCode:
        return ErrorCode.SESSION_LOST if self is Gone.LOST else ErrorCode.SESSION_EXPIRED


@dataclass
class WorkerRecord:
    identity: bytes  # the worker's ZeroMQ routing id
    name: str
    model: str
    capacity: int
    free_slots: int  # as the worker last reported it (status only; placement uses `free`)
    max_context: int
    device: str = ""
    draining: bool = False
    sessions: set[str] = field(default_factory=set)
    pending: int = 0  # creates and forks sent to it and not answered yet
    # Sessions with a CLOSE sent to it and not answered yet. The worker frees a slot as it handles the close, and it
    # handles what the broker sends in order: a create sent after the close finds the slot free. So a client may open
    # its next session without waiting for the last one's close (64 sessions turning over on a full worker).
    closing: set[str] = field(default_factory=set)
    bytes_per_session: int = 0
    checkpoints: bool = False  # it takes moved sessions' recurrent-state checkpoints
    sampling_extras: bool = False  # it applies Sampling's extras: logit_bias ... min_tokens (older workers ignore them)
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # its model's recommended sampling (the gateway's defaults)
    tools: bool = False  # it renders tools and function calls (older workers would ignore them)
    seen_at: float = 0.0  # when the broker last heard from it (monotonic)
    cordoned: bool = False  # `broker drain`: no new session is placed here (kept while the worker stays registered)

    @property
    def free(self) -> int:
        """Slots a new session could still take, counting the ones already promised and the ones being closed."""
        return self.capacity - len(self.sessions) - self.pending + len(self.closing)

    @property
    def closed(self) -> bool:
        """Takes no new session: it drains (SIGTERM), or `broker drain` cordoned it. Status shows either as draining."""
        return self.draining or self.cordoned

    def serves(self, model: str | None) -> bool:
        return model is None or model.casefold() == self.model.casefold()

    def status(self, now: float) -> WorkerStatus:
        return WorkerStatus(
            name=self.name,
            model=self.model,
            capacity=self.capacity,
            free_slots=max(self.free, 0),
            sessions=len(self.sessions),
            draining=self.closed,
            device=self.device,
            last_seen_ms=max(0, round((now - self.seen_at) * 1000)),
            max_context=self.max_context,
            sampling_defaults=self.sampling_defaults,
            tools=self.tools,
        )


@dataclass(slots=True)
class SessionRecord:
    worker: bytes  # the identity of the worker holding it
    owner: str  # the client it belongs to ("" = nobody in particular)
    client: bytes  # the route of the client connection that last used it (NO_CLIENT: none known)
    used_at: float  # when a request last addressed it (or it was made, or registered)
    length: int | None = None  # tokens, as the worker last answered (None: not known yet)


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerRecord] = {}
        self._sessions: dict[str, SessionRecord] = {}
        self._owned: dict[str, int] = {}  # client -> live sessions it owns
        self._by_client: dict[bytes, set[str]] = {}  # client route -> the sessions whose lease it holds
        self._gone: OrderedDict[str, Gone] = OrderedDict()

    # -- workers ---------------------------------------------------------------------------------

    def register(self, identity: bytes, ready: Ready, now: float = 0.0,
                 conflicts: list[str] | None = None) -> WorkerRecord:
        """Add a worker, or refresh one that registers again; its session list is authoritative, but for the sessions
        another live worker holds already: those it claims are added to `conflicts` (not its own: it is to drop
        them)."""
        record = self.workers.get(identity)
        if record is None:
            record = self.workers[identity] = WorkerRecord(identity, "", "", 0, 0, 0)
        record.name, record.model, record.capacity = ready.name, ready.model, ready.capacity
        record.free_slots, record.max_context = ready.free_slots, ready.max_context
        record.device, record.draining = ready.device, ready.draining
        record.bytes_per_session = ready.bytes_per_session
        record.checkpoints = ready.checkpoints
        record.sampling_extras = ready.sampling_extras
        record.sampling_defaults = ready.sampling_defaults
        record.tools = ready.tools
        record.seen_at = now
        for sid in list(record.sessions):
            self._forget(sid)
        record.sessions = set()
        record.closing = set()
        owners = ready.owners or ("",) * len(ready.sessions)
        holders = ready.holders or (NO_CLIENT,) * len(ready.sessions)
        for sid, owner, client in zip(ready.sessions, owners, holders, strict=True):
            if not self.add_session(identity, sid, owner, client, now) and conflicts is not None:
                conflicts.append(sid)
        return record

    def remove(self, identity: bytes) -> WorkerRecord | None:
        """Forget a worker; its sessions become lost."""
        record = self.workers.pop(identity, None)
        if record is None:
            return None
        for sid in record.sessions:
            self._forget(sid)
            self._remember_gone(sid, Gone.LOST)
        return record

    def serving(self, model: str | None) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.serves(model)]

    # -- sessions --------------------------------------------------------------------------------

    def add_session(self, identity: bytes, session_id: str, owner: str = "", client: bytes = NO_CLIENT,
                    now: float = 0.0, length: int | None = None) -> bool:
        """Record that `identity` holds the session, which belongs to `owner` ("" = no one in particular) and was last
        used by the client connection `client`. False (and nothing changes) if another live worker holds it."""
        record = self.workers.get(identity)
        if record is None:
            return False
        known = self._sessions.get(session_id)
        if known is not None and known.worker != identity:
            log.warning("session_conflict", session=session_id, holder=self.workers[known.worker].name,
                        claimant=record.name, detail="the first to register keeps it; the other is told to drop it")
            return False
        if known is None:
            self._sessions[session_id] = SessionRecord(identity, owner, client, now, length)
            self._by_client.setdefault(client, set()).add(session_id)
            if owner:
                self._owned[owner] = self._owned.get(owner, 0) + 1
        record.sessions.add(session_id)
        self._gone.pop(session_id, None)
        return True

    def move_session(self, session_id: str, identity: bytes) -> None:
        """The session is held by worker `identity` from now on (a move ended), with its owner, client and length."""
        known = self._sessions.get(session_id)
        record = self.workers.get(identity)
        if known is None or record is None:
            return
        old = self.workers.get(known.worker)
        if old is not None:
            old.sessions.discard(session_id)
            old.closing.discard(session_id)
        known.worker = identity
        record.sessions.add(session_id)

    def drop_session(self, session_id: str, why: Gone | None = None) -> None:
        """The session is closed (why None), expired or closed by its lease."""
        known = self._forget(session_id)
        if known is not None:
            record = self.workers[known.worker]
            record.sessions.discard(session_id)
            record.closing.discard(session_id)
        if why is not None:
            self._remember_gone(session_id, why)

    def used(self, session_id: str, client: bytes, now: float) -> None:
        """A request from the client connection `client` addressed the session: it holds its lease now."""
        known = self._sessions.get(session_id)
        if known is None:
            return
        known.used_at = now
        if known.client != client:
            self._release(session_id, known.client)
            known.client = client
            self._by_client.setdefault(client, set()).add(session_id)

    def set_length(self, session_id: str, length: int) -> None:
        known = self._sessions.get(session_id)
        if known is not None:
            known.length = length

    def worker_of(self, session_id: str) -> WorkerRecord | None:
        known = self._sessions.get(session_id)
        return None if known is None else self.workers[known.worker]

    def session(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def sessions(self) -> Iterator[tuple[str, SessionRecord]]:
        return iter(self._sessions.items())

    def owner_of(self, session_id: str) -> str:
        known = self._sessions.get(session_id)
        return "" if known is None else known.owner

    def owned_by(self, owner: str) -> int:
        """Live sessions of a client."""
        return self._owned.get(owner, 0)

    def held_by(self, client: bytes) -> set[str]:
        """The sessions whose lease the client connection `client` holds (do not change the set)."""
        return self._by_client.get(client, set())

    def clients(self) -> list[bytes]:
        """The client connections that hold sessions (NO_CLIENT among them when some session has none)."""
        return list(self._by_client)

    def gone(self, session_id: str) -> Gone | None:
        """Why a session that was is no more, else None."""
        return self._gone.get(session_id)

    def session_count(self) -> int:
        return len(self._sessions)

    def _forget(self, session_id: str) -> SessionRecord | None:
        known = self._sessions.pop(session_id, None)
        if known is None:
            return None
        self._release(session_id, known.client)
        if known.owner:
            left = self._owned.get(known.owner, 0) - 1
            if left > 0:
                self._owned[known.owner] = left
            else:
                self._owned.pop(known.owner, None)
        return known

    def _release(self, session_id: str, client: bytes) -> None:
        held = self._by_client.get(client)
        if held is not None:
            held.discard(session_id)
            if not held:
                del self._by_client[client]

    def _remember_gone(self, session_id: str, why: Gone) -> None:
        self._gone[session_id] = why
        if len(self._gone) > MAX_GONE_SESSIONS:
            self._gone.popitem(last=False)
