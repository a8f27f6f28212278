"""structlog set-up, done once in each process's main() (broker, worker): JSON lines when stderr is not
a terminal, readable console lines when it is. Modules only call `structlog.get_logger()`.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog

LEVELS = ("debug", "info", "warning", "error")


class _Stderr:
    """The process's stderr as it is at each line, and never a reason to fail: a log line that cannot be written (a
    closed or broken pipe, a stream a test harness closed) is dropped rather than raised into the code that logged,
    which would take a daemon's loop down over its log (Python's logging handlers swallow such errors the same way)."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (OSError, ValueError):
            return 0

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def configure(level: str = "info", json: bool | None = None, **context: object) -> None:
    """`context` goes on every line of the process, from every thread (e.g. role="worker", worker="gpu0")."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    def add_process_context(
        logger: object, method: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        for key, value in context.items():
            event.setdefault(key, value)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_process_context,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _Stderr())),  # print() needs write and flush
        cache_logger_on_first_use=True,
    )
