"""Stopping a run early.

A stop request is a flag the drivers look at (`StopFlag`: anything with `is_set()`, such as `Stop` or a
multiprocessing Event). Once it is set, a driver sends no new request, cuts short the turns in flight (the
engine or the broker cancels their generations; through the gateway, their connections are closed) and lets
every user close the sessions it holds; the run then ends, its report marked as interrupted. The drivers look at
it between engine steps or every `progress.REFRESH_S`; client processes (`--processes N`) are told through a shared
Event, so that each one still closes its sessions and sends its figures.
"""

from __future__ import annotations

import signal
from typing import Protocol

import structlog

log = structlog.get_logger()


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


class Stop:
    """A request to stop the run."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the signal that set it, if one did
        self._told = False

    def set(self, signum: int | None = None) -> None:
        if not self.requested:
            self.signal = signum
            self.requested = True

    def is_set(self) -> bool:
        """Whether a stop was asked for; the first look that finds it set logs that the run is stopping."""
        if self.requested and not self._told:
            self._told = True
            log.warning("loadtest_stopping", signal=signal.Signals(self.signal).name if self.signal else None,
                        next_signal="quits at once")
        return self.requested

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (130 for SIGINT)."""
        return 128 + (self.signal or signal.SIGINT)
