"""The client library's log: silent unless the application asks for it.

A library does not print on its own. When the process has configured structlog (the daemons, the load-test
harness, an application that uses structlog), the client's lines go through structlog like everyone's; otherwise
they go to the standard library logger "client", which has a NullHandler: nothing is printed unless the
application configures `logging` (e.g. `logging.basicConfig(level=logging.DEBUG)` shows the resends).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

_stdlib = logging.getLogger("client")
_stdlib.addHandler(logging.NullHandler())
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class ClientLog:
    """`log.debug(event, **fields)` and the like, as structlog's loggers take them."""

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)

    @staticmethod
    def _log(level: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger("client"), level)(event, **fields)
            return
        number = _LEVELS[level]
        if _stdlib.isEnabledFor(number):
            _stdlib.log(number, "%s %s", event, " ".join(f"{k}={v!r}" for k, v in fields.items()))


log = ClientLog()
