"""The metrics endpoint of a daemon: a small HTTP server in a daemon thread, beside the ZeroMQ loop.

    GET /metrics   Prometheus text exposition (format 0.0.4) of the process's own CollectorRegistry
    GET /healthz   200 "ok" while the process's serving loop is alive (it beats a `Pulse`), else 503
    GET /readyz    200 when `ready()` says the process can take work, else 503 with the reason
    anything else  404

The handlers only read: collectors take their values at scrape time from the loop's state, so the
loop pays nothing per scrape. A scrape that fails answers 500 and is logged; it never reaches the
serving loop. Requests are not logged one by one (Prometheus scrapes every few seconds).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest

log = structlog.get_logger()

Readiness = tuple[bool, str]  # (ready, why: shown in the /readyz body either way)

REQUEST_TIMEOUT_S = 10.0  # a client that sends nothing for this long is dropped (no thread held forever)
DEFAULT_STALE_S = 30.0  # a loop silent this long is not alive: longer than any step, shorter than a human notices


class Pulse:
    """The serving loop's sign of life: it calls `beat()` every turn; `/healthz` asks `alive()`.

    One float store per turn. The loop must turn at least every `stale_after_s`, busy or idle (the
    broker polls with a timeout of at most 0.25 s, the worker's compute loop waits at most 0.05 s).
    """

    def __init__(self, stale_after_s: float = DEFAULT_STALE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self.last = clock()

    def beat(self) -> None:
        self.last = self._clock()

    def alive(self) -> bool:
        return self._clock() - self.last < self.stale_after_s


def always_ready() -> Readiness:
    return True, "ready"


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in progress never holds the process open
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, alive: Callable[[], bool],
                 ready: Callable[[], Readiness]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)
        self.registry = registry
        self.alive = alive
        self.ready = ready

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke mid-answer (the scraper gave up): not the process's problem."""
        log.debug("metrics_connection_error", client=str(client_address))


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S

    def do_GET(self) -> None:  # noqa: N802 (the name BaseHTTPRequestHandler dispatches to)
        path = self.path.split("?", 1)[0]
        try:
            status, content_type, body = self._route(path)
        except Exception as e:  # a collector failed: answer, log, keep serving
            log.warning("metrics_request_failed", path=path, error=str(e), error_type=type(e).__name__)
            status, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        self._send(status, content_type, body)

    def _route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_PLAIN_0_0_4, generate_latest(self.server.registry)
        if path == "/healthz":
            ok = self.server.alive()
            return (200 if ok else 503), "text/plain; charset=utf-8", b"ok\n" if ok else b"the serving loop is stalled\n"
        if path == "/readyz":
            ready, why = self.server.ready()
            return (200 if ready else 503), "text/plain; charset=utf-8", f"{why}\n".encode()
        return 404, "text/plain; charset=utf-8", b"not found: try /metrics, /healthz or /readyz\n"

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """No line per request (http.server writes one to stderr by default)."""


class MetricsServer:
    """Serves /metrics, /healthz and /readyz on (host, port) from a daemon thread. Port 0 picks a free one.

    `alive()` and `ready()` run on the server's threads: they must only read (a `Pulse`, a flag).
    Binding fails with OSError at construction, so a daemon can refuse to start on a taken port.
    """

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 alive: Callable[[], bool] = lambda: True, ready: Callable[[], Readiness] = always_ready) -> None:
        try:
            self._server = _Server((host, port), registry, alive, ready)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
        self.host = host
        self.port: int = self._server.server_address[1]  # the bound port (port 0: the one picked)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                         name="metrics-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> MetricsServer:
        self._thread.start()
        log.info("metrics_serving", url=f"{self.url}/metrics")
        return self

    def close(self) -> None:
        """Stop serving and free the port. Safe to call twice, or without start()."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
