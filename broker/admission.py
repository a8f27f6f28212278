"""What the broker takes from a peer on its worker socket before reading it: READY limits and per-peer rates.

A peer on the worker socket is hostile until it has registered, and even then only as trusted as its key (an open
broker has none). So:

- READY size. A READY lists every session a worker holds (its id, owner and holder route each): one longer than what
  `max_worker_sessions` sessions take is refused unread, and one offering more slots than that, or listing more
  sessions than slots (or a session twice), is refused once read. A refused READY is answered with an ERROR naming the
  limit, and the peer stays unregistered.
- HEARTBEAT size. A heartbeat lists at most `max_worker_sessions` expired sessions: a longer one is dropped unread.
- Rates. Each peer's READYs and HEARTBEATs come out of token buckets of its own, refilled per heartbeat interval:
  READY (`READY_BURST`, one more per heartbeat) and HEARTBEAT (`HEARTBEAT_BURST`, `HEARTBEAT_REFILL` more per
  heartbeat; a worker sends one per heartbeat, plus one when it expires idle sessions). A message over its peer's rate
  is dropped unread (and counted). (A DISCONNECT ends a registration once: it has no rate.) Buckets are kept for at
  most `MAX_PEERS` peers, the least recently heard forgotten first.

Answers (REPLY, CHUNKS, ERROR, FANOUT) are not rate-limited: they are the hot path, and only a registered worker's are
read at all (broker.router). Times come from the caller, so tests need no sleeps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from broker.common import protocol as p

DEFAULT_MAX_WORKER_SESSIONS = 4096  # `broker start --max-worker-sessions`
MAX_WORKER_SESSIONS_FLAG = "--max-worker-sessions"
READY_BASE_BYTES = 4096  # the scalar fields: name, model, device (256 characters each), counts
# msgpack of one session in a READY: its id (2 + 32 bytes), owner (2 + 40) and holder route (2 + 255).
READY_BYTES_PER_SESSION = 34 + 42 + 2 + p.MAX_ROUTE_BYTES
HEARTBEAT_BASE_BYTES = 1024
HEARTBEAT_BYTES_PER_SESSION = 34  # an expired session's id
READY_BURST = 4
READY_REFILL = 1.0  # per heartbeat interval
HEARTBEAT_BURST = 32
HEARTBEAT_REFILL = 4.0
OTHER_BURST = 8  # a command without a rate of its own (the router asks for READY and HEARTBEAT only)
OTHER_REFILL = 1.0
MAX_PEERS = 4096


@dataclass(slots=True)
class Bucket:
    tokens: float
    at: float


RATES: dict[p.Command, tuple[float, float]] = {  # command -> (burst, refill per heartbeat)
    p.Command.READY: (READY_BURST, READY_REFILL),
    p.Command.HEARTBEAT: (HEARTBEAT_BURST, HEARTBEAT_REFILL),
}


class Admission:
    def __init__(self, heartbeat_s: float, max_worker_sessions: int = DEFAULT_MAX_WORKER_SESSIONS) -> None:
        self.heartbeat_s = heartbeat_s
        self.max_worker_sessions = max_worker_sessions
        self.max_ready_bytes = READY_BASE_BYTES + max_worker_sessions * READY_BYTES_PER_SESSION
        self.max_heartbeat_bytes = HEARTBEAT_BASE_BYTES + max_worker_sessions * HEARTBEAT_BYTES_PER_SESSION
        self._buckets: OrderedDict[tuple[bytes, p.Command], Bucket] = OrderedDict()

    def allow(self, identity: bytes, command: p.Command, now: float) -> bool:
        """Take one token from the peer's bucket for this command: False when it has none (the message is dropped)."""
        bucket = self._bucket(identity, command, now)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def has_token(self, identity: bytes, command: p.Command, now: float) -> bool:
        """Whether `allow` would let one through now (nothing taken)."""
        return self._bucket(identity, command, now).tokens >= 1.0

    def forget(self, identity: bytes) -> None:
        for command in RATES:
            self._buckets.pop((identity, command), None)

    def too_large(self, command: p.Command, header_bytes: int) -> str | None:
        """Why a READY or HEARTBEAT header this long is refused unread, or None."""
        if command is p.Command.READY and header_bytes > self.max_ready_bytes:
            return (f"READY of {header_bytes} bytes: the limit is {self.max_ready_bytes} bytes, what "
                    f"{self.max_worker_sessions} sessions take ({MAX_WORKER_SESSIONS_FLAG})")
        if command is p.Command.HEARTBEAT and header_bytes > self.max_heartbeat_bytes:
            return f"HEARTBEAT of {header_bytes} bytes: the limit is {self.max_heartbeat_bytes} bytes"
        return None

    def ready_problem(self, ready: p.Ready) -> str | None:
        """Why a well-formed READY is refused, or None."""
        if ready.capacity > self.max_worker_sessions:
            return (f"capacity {ready.capacity} is more sessions than this broker takes from one worker: "
                    f"{self.max_worker_sessions} ({MAX_WORKER_SESSIONS_FLAG})")
        if len(ready.sessions) > ready.capacity:
            return f"READY lists {len(ready.sessions)} sessions for a capacity of {ready.capacity}"
        if len(set(ready.sessions)) != len(ready.sessions):
            return "READY lists a session twice"
        return None

    def _bucket(self, identity: bytes, command: p.Command, now: float) -> Bucket:
        burst, refill = RATES.get(command, (OTHER_BURST, OTHER_REFILL))
        key = (identity, command)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket(burst, now)
            while len(self._buckets) > MAX_PEERS * 2:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(0.0, now - bucket.at)
            bucket.tokens = min(burst, bucket.tokens + elapsed / self.heartbeat_s * refill)
            bucket.at = now
        return bucket
