"""Stopping a run early: the first SIGINT (Ctrl-C) or SIGTERM asks the run to stop, the next one quits at once.

A stop request is a flag the drivers look at (`StopFlag`: anything with `is_set()`, such as `Stop` or a
multiprocessing Event). Once it is set, a driver sends no new request, cuts short the turns in flight (the
engine or the broker cancels their generations; through the gateway, their connections are closed) and lets
every user close the sessions it holds; the run then ends, its report marked as interrupted. The signal handler
only sets the flag (a handler that did more could break in on whatever the program was doing); the drivers look at
it between engine steps or every `progress.REFRESH_S`.

Client processes (`--processes N`) ignore SIGINT: a terminal sends Ctrl-C to the whole process group, and the
parent stops them through a shared Event, so that each one still closes its sessions and sends its figures.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Protocol

import structlog

log = structlog.get_logger()

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


class Stop:
    """A request to stop the run, set by a signal (`on_signals`) or by the caller of `run()`."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None  # the signal that set it, if one did
        self._told = False

    def set(self, signum: int | None = None) -> None:
        if not self.requested:
            self.signal = signum
            self.requested = True

    def is_set(self) -> bool:
        """Whether a stop was asked for; the first look that finds it set logs that the run is stopping (the signal
        handler itself only sets it)."""
        if self.requested and not self._told:
            self._told = True
            log.warning("loadtest_stopping", signal=signal.Signals(self.signal).name if self.signal else None,
                        next_signal="quits at once")
        return self.requested

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (130 for SIGINT)."""
        return 128 + (self.signal or signal.SIGINT)


@contextmanager
def on_signals(stop: Stop) -> Iterator[Stop]:
    """While in the block, the first SIGINT or SIGTERM sets `stop`; the next raises KeyboardInterrupt (quit now).

    Outside the main thread (where Python runs signal handlers) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        stop.set(signum)

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while in the block: processes started in it (spawned: a new interpreter) keep ignoring it from
    their first instruction, imports included. Outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
