"""Heartbeat bookkeeping: when each worker was last heard from, when one has been silent too long, and when the next
heartbeat is due.

A worker is alive while its connection is: ZeroMQ's own (ZMTP) heartbeats, sent and answered by libzmq's I/O threads
without the GIL, close the connection of a peer that answers nothing for `liveness` heartbeat intervals (a stopped
process, a vanished host), and the broker's next send to it fails (broker.router). A worker whose Python is busy (its
compute thread holding the GIL, a loaded host) keeps its connection, so it is not declared dead for being slow to
send its own heartbeats. Any message from a worker counts as a sign of life; one connected but silent for `silence_s`
(its application wedged while libzmq still answers) is gone too. Times come from the caller (a monotonic clock), so
tests need no sleeps.
"""

from __future__ import annotations


class Liveness:
    def __init__(self, interval_s: float, liveness: int, now: float, silence_s: float | None = None) -> None:
        self.interval_s = interval_s
        self.timeout_s = interval_s * liveness  # the heartbeat window
        self.silence_s = max(self.timeout_s, silence_s if silence_s is not None else self.timeout_s)
        self._heard: dict[bytes, float] = {}
        self.next_heartbeat = now + interval_s

    def seen(self, identity: bytes, now: float) -> None:
        self._heard[identity] = now

    def forget(self, identity: bytes) -> None:
        self._heard.pop(identity, None)

    def expired(self, now: float) -> list[bytes]:
        """Peers silent for `silence_s`, forgotten as they are returned."""
        dead = [identity for identity, heard in self._heard.items() if now - heard >= self.silence_s]
        for identity in dead:
            del self._heard[identity]
        return dead

    def missing(self, identity: bytes, now: float) -> bool:
        """Whether the peer has been silent for a heartbeat window (what closes its connection, ZMTP heartbeats on)."""
        heard = self._heard.get(identity)
        return heard is not None and now - heard >= self.timeout_s

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
        if not self._heard:
            return self.next_heartbeat
        return min(self.next_heartbeat, min(self._heard.values()) + self.silence_s)
