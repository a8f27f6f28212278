"""The broker's bookkeeping: which workers exist, what they serve, and which worker holds each session.

Pure data, no sockets: the router calls it and tests assert on it with exact values.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from broker.common.protocol import ErrorCode, Ready, WorkerStatus

log = structlog.get_logger()

# Sessions of dead workers (and sessions their worker closed for idling) are remembered so that later
# requests get session_lost (session_expired), not session_not_found. Bounded so that a long-lived broker
# does not grow without limit.
MAX_GONE_SESSIONS = 1 << 20


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
    seen_at: float = 0.0  # when the broker last heard from it (monotonic)
    steps: int = 0  # engine steps it reported
    progress_at: float = 0.0  # when it last answered a request or reported more steps

    @property
    def free(self) -> int:
        """Slots a new session could still take, counting the ones already promised and the ones being closed."""
        return self.capacity - len(self.sessions) - self.pending + len(self.closing)

    def serves(self, model: str | None) -> bool:
        return model is None or model.casefold() == self.model.casefold()

    def status(self, now: float) -> WorkerStatus:
        return WorkerStatus(
            name=self.name,
            model=self.model,
            capacity=self.capacity,
            free_slots=max(self.free, 0),
            sessions=len(self.sessions),
            draining=self.draining,
            device=self.device,
            last_seen_ms=max(0, round((now - self.seen_at) * 1000)),
        )


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerRecord] = {}
        self._holder: dict[str, bytes] = {}  # session id -> worker identity
        self._owner: dict[str, str] = {}  # session id -> the client it belongs to ("" = nobody in particular)
        self._owned: dict[str, int] = {}  # client -> live sessions it owns
        self._gone: OrderedDict[str, ErrorCode] = OrderedDict()  # session id -> session_lost or session_expired

    # -- workers ---------------------------------------------------------------------------------

    def register(self, identity: bytes, ready: Ready, now: float = 0.0) -> WorkerRecord:
        """Add a worker, or refresh one that registers again; its session list is authoritative."""
        record = self.workers.get(identity)
        if record is None:
            record = self.workers[identity] = WorkerRecord(identity, "", "", 0, 0, 0)
        record.name, record.model, record.capacity = ready.name, ready.model, ready.capacity
        record.free_slots, record.max_context = ready.free_slots, ready.max_context
        record.device, record.draining = ready.device, ready.draining
        record.bytes_per_session = ready.bytes_per_session
        record.seen_at = record.progress_at = now
        for sid in list(record.sessions):
            self._forget(sid)
        record.sessions = set()
        record.closing = set()
        owners = ready.owners or ("",) * len(ready.sessions)
        for sid, owner in zip(ready.sessions, owners, strict=True):
            self.add_session(identity, sid, owner)
        return record

    def remove(self, identity: bytes) -> WorkerRecord | None:
        """Forget a worker; its sessions become lost."""
        record = self.workers.pop(identity, None)
        if record is None:
            return None
        for sid in record.sessions:
            self._forget(sid)
            self._remember_gone(sid, ErrorCode.SESSION_LOST)
        return record

    def serving(self, model: str | None) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.serves(model)]

    # -- sessions --------------------------------------------------------------------------------

    def add_session(self, identity: bytes, session_id: str, owner: str = "") -> bool:
        """Record that `identity` holds the session, which belongs to `owner` ("" = no one in particular).
        False (and nothing changes) if another live worker holds it."""
        record = self.workers.get(identity)
        if record is None:
            return False
        holder = self._holder.get(session_id)
        if holder is not None and holder != identity:
            log.error("session_conflict", session=session_id, holder=self.workers[holder].name, claimant=record.name)
            return False
        if holder is None:
            self._holder[session_id] = identity
            self._owner[session_id] = owner
            if owner:
                self._owned[owner] = self._owned.get(owner, 0) + 1
        record.sessions.add(session_id)
        self._gone.pop(session_id, None)
        return True

    def drop_session(self, session_id: str, why: ErrorCode | None = None) -> None:
        """The session is closed (why None) or expired (why session_expired)."""
        identity = self._forget(session_id)
        if identity is not None:
            record = self.workers[identity]
            record.sessions.discard(session_id)
            record.closing.discard(session_id)
        if why is not None:
            self._remember_gone(session_id, why)

    def worker_of(self, session_id: str) -> WorkerRecord | None:
        identity = self._holder.get(session_id)
        return None if identity is None else self.workers[identity]

    def owner_of(self, session_id: str) -> str:
        return self._owner.get(session_id, "")

    def owned_by(self, owner: str) -> int:
        """Live sessions of a client."""
        return self._owned.get(owner, 0)

    def gone(self, session_id: str) -> ErrorCode | None:
        """session_lost or session_expired for a session that was, else None."""
        return self._gone.get(session_id)

    def session_count(self) -> int:
        return len(self._holder)

    def _forget(self, session_id: str) -> bytes | None:
        identity = self._holder.pop(session_id, None)
        owner = self._owner.pop(session_id, "")
        if owner:
            left = self._owned.get(owner, 0) - 1
            if left > 0:
                self._owned[owner] = left
            else:
                self._owned.pop(owner, None)
        return identity

    def _remember_gone(self, session_id: str, code: ErrorCode) -> None:
        self._gone[session_id] = code
        if len(self._gone) > MAX_GONE_SESSIONS:
            self._gone.popitem(last=False)
