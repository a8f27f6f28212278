"""The broker's bookkeeping: which workers exist, what they serve, and which worker holds each session.

Pure data, no sockets: the router calls it and tests assert on it with exact values.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from .protocol import Ready, WorkerStatus

log = structlog.get_logger()

# Sessions of dead workers are remembered so that later requests get session_lost, not
# session_not_found. Bounded so that a long-lived broker does not grow without limit.
MAX_LOST_SESSIONS = 1 << 20


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

    @property
    def free(self) -> int:
        """Slots a new session could still take, counting the ones already promised."""
        return self.capacity - len(self.sessions) - self.pending

    def serves(self, model: str | None) -> bool:
        return model is None or model.casefold() == self.model.casefold()

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            name=self.name,
            model=self.model,
            capacity=self.capacity,
            free_slots=max(self.free, 0),
            sessions=len(self.sessions),
            draining=self.draining,
            device=self.device,
        )


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerRecord] = {}
        self._owner: dict[str, bytes] = {}  # session id -> worker identity
        self._lost: OrderedDict[str, None] = OrderedDict()

    # -- workers ---------------------------------------------------------------------------------

    def register(self, identity: bytes, ready: Ready) -> WorkerRecord:
        """Add a worker, or refresh one that registers again; its session list is authoritative."""
        record = self.workers.get(identity)
        if record is None:
            record = self.workers[identity] = WorkerRecord(identity, "", "", 0, 0, 0)
        record.name, record.model, record.capacity = ready.name, ready.model, ready.capacity
        record.free_slots, record.max_context = ready.free_slots, ready.max_context
        record.device, record.draining = ready.device, ready.draining
        for sid in record.sessions - set(ready.sessions):
            self._owner.pop(sid, None)
        record.sessions = set()
        for sid in ready.sessions:
            self.add_session(identity, sid)
        return record

    def remove(self, identity: bytes) -> WorkerRecord | None:
        """Forget a worker; its sessions become lost."""
        record = self.workers.pop(identity, None)
        if record is None:
            return None
        for sid in record.sessions:
            self._owner.pop(sid, None)
            self._remember_lost(sid)
        return record

    def serving(self, model: str | None) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.serves(model)]

    # -- sessions --------------------------------------------------------------------------------

    def add_session(self, identity: bytes, session_id: str) -> bool:
        """Record that `identity` holds the session. False (and nothing changes) if another live worker does."""
        record = self.workers.get(identity)
        if record is None:
            return False
        owner = self._owner.get(session_id)
        if owner is not None and owner != identity:
            log.error("session_conflict", session=session_id, holder=self.workers[owner].name, claimant=record.name)
            return False
        self._owner[session_id] = identity
        record.sessions.add(session_id)
        self._lost.pop(session_id, None)
        return True

    def drop_session(self, session_id: str) -> None:
        identity = self._owner.pop(session_id, None)
        if identity is not None:
            self.workers[identity].sessions.discard(session_id)

    def worker_of(self, session_id: str) -> WorkerRecord | None:
        identity = self._owner.get(session_id)
        return None if identity is None else self.workers[identity]

    def is_lost(self, session_id: str) -> bool:
        return session_id in self._lost

    def session_count(self) -> int:
        return len(self._owner)

    def _remember_lost(self, session_id: str) -> None:
        self._lost[session_id] = None
        if len(self._lost) > MAX_LOST_SESSIONS:
            self._lost.popitem(last=False)
