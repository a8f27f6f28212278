"""What happened since the broker started, counted by the router as it happens.

Plain counts (requests by command, errors by code, workers registered and lost): no prometheus, no locks,
one thread (the broker loop) writes. broker/metrics.py reads them when Prometheus scrapes.
"""

from __future__ import annotations

from enum import Enum

from broker.common.metrics import OTHER, bump


def lost_reason(reason: str) -> str:
    """The bounded label of a free-text reason: 'missed heartbeats' -> 'missed_heartbeats',
    'disconnected: drained' -> 'disconnected'."""
    head = reason.split(":", 1)[0].strip().lower()
    return "_".join(head.split()) or "unknown"


class RouterCounters:
    """What happened since the broker started, counted by the router. Every method is O(1)."""

    __slots__ = ("requests", "errors", "workers_lost", "workers_registered", "workers_reregistered", "sessions_lost",
                 "messages_dropped", "loop_errors", "creates_replaced", "sessions_dropped", "sessions_lease_closed",
                 "stalls")

    def __init__(self) -> None:
        self.requests: dict[str | Enum, int] = {}  # by command (a Command, or its name)
        self.errors: dict[object, int] = {}  # by wire error code (an ErrorCode, or its value)
        self.workers_lost: dict[str, int] = {}  # by lost_reason()
        self.workers_registered = 0
        self.workers_reregistered = 0  # a known worker sent READY again (its broker restarted, or it reconnected)
        self.sessions_lost = 0  # sessions that were on a worker when it was lost
        self.messages_dropped: dict[str, int] = {}  # worker-socket messages not used, by reason
        self.loop_errors = 0  # messages (or timers) whose handling raised: logged, and the loop went on
        self.creates_replaced = 0  # creates placed again after the worker they were sent to was lost
        self.sessions_dropped = 0  # lost sessions a returning worker was told to drop
        self.sessions_lease_closed = 0  # sessions closed because their client was gone past the grace period
        self.stalls = 0  # times the broker's own process was found not to have run for half a heartbeat window

    def request(self, command: str | Enum) -> None:
        """A valid client request arrived (call once per request, resends included)."""
        bump(self.requests, command, OTHER)

    def error(self, code: object) -> None:
        """An ERROR went to a client: made by the broker, or forwarded from a worker (its header's code as sent:
        anything that is not a string or an enum counts as "invalid")."""
        bump(self.errors, code if isinstance(code, (str, Enum)) else "invalid", OTHER)

    def worker_registered(self, again: bool = False) -> None:
        if again:
            self.workers_reregistered += 1
        else:
            self.workers_registered += 1

    def dropped(self, reason: str) -> None:
        """A worker-socket message was dropped unused: `reason` is one of a few fixed words (unregistered, malformed,
        unexpected, rate_limited, ready_refused, too_large, lost_session, not_its_request)."""
        bump(self.messages_dropped, reason, OTHER)

    def worker_lost(self, reason: str, sessions: int = 0) -> None:
        """A registered worker is gone (missed heartbeats, disconnected, unreachable) with `sessions` on it."""
        bump(self.workers_lost, lost_reason(reason), OTHER)
        self.sessions_lost += sessions
