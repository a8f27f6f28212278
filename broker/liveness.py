"""Heartbeat bookkeeping: when each worker expires and when the next heartbeat is due.

Any message from a worker counts as a sign of life. A worker that stays silent for `liveness`
heartbeat intervals is dead. Times come from the caller (a monotonic clock), so tests need no sleeps.
"""

from __future__ import annotations


class Liveness:
    def __init__(self, interval_s: float, liveness: int, now: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = interval_s * liveness
        self._expiry: dict[bytes, float] = {}
        self.next_heartbeat = now + interval_s

    def seen(self, identity: bytes, now: float) -> None:
        self._expiry[identity] = now + self.timeout_s

    def forget(self, identity: bytes) -> None:
        self._expiry.pop(identity, None)

    def expired(self, now: float) -> list[bytes]:
        """Peers past their expiry, forgotten as they are returned."""
        dead = [identity for identity, expiry in self._expiry.items() if expiry <= now]
        for identity in dead:
            del self._expiry[identity]
        return dead

    def heartbeat_due(self, now: float) -> bool:
        """True once per interval; skips missed beats rather than sending a burst."""
        if now < self.next_heartbeat:
            return False
        self.next_heartbeat += self.interval_s
        if self.next_heartbeat <= now:
            self.next_heartbeat = now + self.interval_s
        return True

    def next_event(self) -> float:
        """The earliest time something may be due (a heartbeat or an expiry)."""
        return min([self.next_heartbeat, *self._expiry.values()])
