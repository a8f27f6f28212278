"""The gateway's Prometheus metrics (names as the daemons', prefix `sessionserve:gateway_`).

    requests_total{endpoint, status}           HTTP requests answered, by endpoint and status code
    request_duration_seconds{endpoint}         from the request to its last byte (histogram)
    time_to_first_token_seconds                from the request to its first generated token (histogram)
    num_requests_running                       requests in progress
    prompt_tokens_total, cached_tokens_total   prompt tokens of the answers, and those not computed again
    generation_tokens_total                    tokens generated (a stream cut short: those it sent)
    sessions{state}                            live sessions the gateway holds: idle (kept for the next turn), busy
    sessions_opened_total{how}                 sessions a request used: new, resumed by session_id, resumed by prefix,
                                               asked_again (a fork of the session whose last answer it asks again),
                                               branch (a fork of the session it shares earlier turns with)
    sessions_closed_total{why}                 evicted (for a free slot or the idle cap), replaced, ended, gone
    turns_from_start_total                     turns sent to a resumed session whole, from its start (its worker
                                               refused the new part alone; its last answer's text may not stand for
                                               its tokens; a named conversation edited; an answer asked again)

With `gateway start --processes N` the processes' numbers are summed (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

PREFIX = "sessionserve:gateway_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class GatewayMetrics:
    def __init__(self, sessions: Callable[[], tuple[int, int]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        shared = multiprocess_dir() is not None
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered.", ["endpoint", "status"], registry=r)
        self.duration = Histogram(PREFIX + "request_duration_seconds", "Request to last byte.", ["endpoint"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        mode = {"multiprocess_mode": "livesum"} if shared else {}
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in progress.", registry=r, **mode)  # type: ignore[arg-type]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the answers.", registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "Prompt tokens a live session held already.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.sessions = Gauge(PREFIX + "sessions", "Live sessions held.", ["state"], registry=r, **mode)  # type: ignore[arg-type]
        self.opened = Counter(PREFIX + "sessions_opened", "Sessions a request used.", ["how"], registry=r)
        self.closed = Counter(PREFIX + "sessions_closed", "Sessions the gateway closed.", ["why"], registry=r)
        self.rewritten = Counter(PREFIX + "turns_from_start", "Turns a resumed session took whole from its start.",
                                 registry=r)
        self._sessions = sessions

    def sync_sessions(self) -> None:
        """The sessions gauge from the store (after each request: with several processes, each keeps its own)."""
        if self._sessions is not None:
            idle, busy = self._sessions()
            self.sessions.labels("idle").set(idle)
            self.sessions.labels("busy").set(busy)

    def scrape(self) -> bytes:
        self.sync_sessions()
        if multiprocess_dir() is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
