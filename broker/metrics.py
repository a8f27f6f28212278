"""The broker's Prometheus metrics: the router's tables read at scrape time, plus event counters.

Two halves, so that the router's hot path pays one dict increment per event and nothing per scrape:

- `RouterCounters` (broker/counters.py): plain counts the router bumps as things happen (requests by
  command, errors by code, workers registered and lost). No prometheus, no locks: one thread (the
  broker loop) writes.
- `BrokerMetrics(router, counters)`: a private `CollectorRegistry` whose collector reads the router's
  registry, in-flight and held tables and the counters when Prometheus scrapes, on the metrics
  server's thread. It copies what it reads in single C-level steps (`list(d.values())`), which the
  GIL keeps whole, and never writes.

Names follow vLLM's where one exists (`vllm:num_requests_running` -> `sessionserve:num_requests_running`);
ours (workers, sessions, slots) take the same `sessionserve:` prefix (broker/common/metrics.py, shared with the
worker). What a broker exports:

    sessionserve:num_workers                      gauge    workers registered
    sessionserve:num_sessions                     gauge    sessions on live workers
    sessionserve:num_requests_running             gauge    client requests forwarded to a worker, not answered yet
    sessionserve:num_requests_waiting             gauge    requests held while a restarted broker recovers
    sessionserve:recovering                       gauge    1 during that recovery window
    sessionserve:worker_capacity                  gauge    per worker {worker, model, device}: session slots
    sessionserve:worker_sessions                  gauge    per worker: live sessions
    sessionserve:worker_free_slots                gauge    per worker: slots a new session could take
    sessionserve:worker_draining                  gauge    per worker: 1 while it drains or after `broker drain`
    sessionserve:worker_session_bytes             gauge    per worker: device memory of one session's state
    sessionserve:worker_last_seen_seconds         gauge    per worker: since the broker last heard from it
    sessionserve:requests_total{command}          counter  client requests (create, append, generate, ...)
    sessionserve:request_errors_total{code}       counter  errors answered to clients (broker's and workers')
    sessionserve:workers_registered_total         counter  registrations
    sessionserve:worker_reregistrations_total     counter  READY from a worker already registered
    sessionserve:workers_lost_total{reason}       counter  missed_heartbeats, disconnected, unreachable, ...
    sessionserve:sessions_lost_total              counter  sessions on the workers that were lost
    sessionserve:worker_messages_dropped_total{reason}  counter  worker-socket messages not used: unregistered,
                                                   malformed, unexpected, rate_limited, ready_refused, too_large,
                                                   lost_session, not_its_request
    sessionserve:broker_loop_errors_total         counter  messages (or timers) whose handling raised (logged)
    sessionserve:creates_replaced_total           counter  creates placed again after their worker was lost
    sessionserve:sessions_dropped_total           counter  lost sessions a returning worker was told to drop
    sessionserve:sessions_lease_expired_total     counter  sessions closed because their client was gone too long
    sessionserve:clients_gone                     gauge    client connections holding sessions that are gone
    sessionserve:broker_stalls_total              counter  times the broker's process did not run for half a
                                                   heartbeat window (connection losses then get a window)
    sessionserve:session_moves_running            gauge    sessions moving between workers now (broker.moves)
    sessionserve:session_moves_total{outcome}     counter  moves ended: moved, failed (the session stayed on its
                                                   source), lost (its source died before the release)
    sessionserve:session_move_pause_seconds       histogram  how long a moved session's requests were held (from
                                                   the MOVE to the switch of its route)
    process_*                                              resident memory, CPU seconds, open fds
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.common.metrics import PREFIX, label
from broker.common.metrics_http import Readiness
from broker.counters import RouterCounters
from broker.moves import PAUSE_BUCKETS

if TYPE_CHECKING:
    from broker.registry import WorkerRecord
    from broker.router import Router

WORKER_LABELS = ("worker", "model", "device")

T = TypeVar("T")


def _copied(read: Callable[[], T], tries: int = 3) -> T | None:
    """Read a table the broker loop may be changing: retry the rare 'changed size during iteration'."""
    for _ in range(tries):
        try:
            return read()
        except RuntimeError:
            continue
    return None


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, label_name: str, counts: dict[T, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=[label_name])
    totals: dict[str, int] = {}
    for key, n in list(counts.items()):
        text = label(key)
        totals[text] = totals.get(text, 0) + n  # a Command and its name are one series
    for text, n in sorted(totals.items()):
        family.add_metric([text], n)
    return family


class _BrokerCollector(Collector):
    def __init__(self, router: Router, counters: RouterCounters, clock: Callable[[], float]) -> None:
        self.router = router
        self.counters = counters
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        router = self.router
        workers = _copied(lambda: list(router.registry.workers.values())) or []
        yield _gauge("num_workers", "Workers registered with the broker.", len(workers))
        yield _gauge("num_sessions", "Sessions on live workers.", router.registry.session_count())
        yield _gauge("num_requests_running", "Client requests forwarded to a worker and not answered yet.",
                     len(router.inflight))
        yield _gauge("num_requests_waiting", "Client requests held while the broker recovers after a restart.",
                     router.held_count)
        yield _gauge("recovering", "1 while a freshly started broker waits for workers to re-register.",
                     1 if router.recovering(self.clock()) else 0)
        yield _gauge("clients_gone", "Client connections holding sessions that are gone (their sessions are closed "
                     "after the grace period).", router.clients_gone())
        yield from self._per_worker(workers)
        yield from self._counters()
        yield from self._moves()

    def _moves(self) -> Iterable[Metric]:
        moves = self.router.moves
        stats = moves.stats
        yield _gauge("session_moves_running", "Sessions moving between workers now.", len(moves.moving))
        yield _counter("session_moves", "Session moves ended, by outcome (moved, failed, lost).", "outcome",
                       dict(stats.outcomes))
        buckets = [(str(b) if b != float("inf") else "+Inf", n) for b, n in zip(PAUSE_BUCKETS, list(stats.pause_buckets),
                                                                            strict=True)]
        yield HistogramMetricFamily(PREFIX + "session_move_pause_seconds",
                                    "How long a moved session's requests were held (MOVE to the switch of its route).",
                                    buckets=buckets, sum_value=stats.pause_sum)

    def _per_worker(self, workers: list[WorkerRecord]) -> Iterable[Metric]:
        families = {
            "capacity": GaugeMetricFamily(PREFIX + "worker_capacity", "Session slots of the worker.",
                                          labels=WORKER_LABELS),
            "sessions": GaugeMetricFamily(PREFIX + "worker_sessions", "Live sessions on the worker.",
                                          labels=WORKER_LABELS),
            "free": GaugeMetricFamily(PREFIX + "worker_free_slots",
                                      "Slots a new session could take (capacity - sessions - creates in flight + "
                                      "sessions being closed).",
                                      labels=WORKER_LABELS),
            "draining": GaugeMetricFamily(PREFIX + "worker_draining",
                                          "1 while the worker drains, or after `broker drain` (it takes no new session).",
                                          labels=WORKER_LABELS),
            "bytes": GaugeMetricFamily(PREFIX + "worker_session_bytes", "Device memory of one session's state.",
                                       labels=WORKER_LABELS, unit="bytes"),
            "seen": GaugeMetricFamily(PREFIX + "worker_last_seen_seconds",
                                      "Seconds since the broker last heard from the worker.", labels=WORKER_LABELS),
        }
        now = self.clock()
        used: set[tuple[str, str, str]] = set()
        for w in workers:
            labels = (w.name, w.model, w.device)
            if labels in used:  # two live workers with one name: keep their series apart
                labels = (f"{w.name}#{w.identity.hex()[-8:]}", w.model, w.device)
            used.add(labels)
            families["capacity"].add_metric(labels, w.capacity)
            families["sessions"].add_metric(labels, len(w.sessions))
            families["free"].add_metric(labels, max(w.free, 0))
            families["draining"].add_metric(labels, 1 if w.closed else 0)
            if w.bytes_per_session:
                families["bytes"].add_metric(labels, w.bytes_per_session)
            families["seen"].add_metric(labels, max(now - w.seen_at, 0.0))
        return [f for f in families.values() if f.samples]

    def _counters(self) -> Iterable[Metric]:
        c = self.counters
        yield _counter("requests", "Client requests by command.", "command", c.requests)
        yield _counter("request_errors", "Errors answered to clients, by error code.", "code", c.errors)
        yield _counter("workers_lost", "Workers declared gone, by reason.", "reason", c.workers_lost)
        yield CounterMetricFamily(PREFIX + "workers_registered", "Workers that registered.",
                                  value=c.workers_registered)
        yield CounterMetricFamily(PREFIX + "worker_reregistrations",
                                  "READY from a worker already registered (it reconnected).",
                                  value=c.workers_reregistered)
        yield CounterMetricFamily(PREFIX + "sessions_lost", "Sessions on workers that were lost.",
                                  value=c.sessions_lost)
        yield _counter("worker_messages_dropped", "Worker-socket messages not used, by reason.", "reason",
                       c.messages_dropped)
        yield CounterMetricFamily(PREFIX + "broker_loop_errors",
                                  "Messages (or timers) whose handling raised; logged, and the broker went on.",
                                  value=c.loop_errors)
        yield CounterMetricFamily(PREFIX + "creates_replaced", "Creates placed again after their worker was lost.",
                                  value=c.creates_replaced)
        yield CounterMetricFamily(PREFIX + "sessions_dropped",
                                  "Sessions declared lost that a returning worker was told to drop.",
                                  value=c.sessions_dropped)
        yield CounterMetricFamily(PREFIX + "broker_stalls",
                                  "Times the broker's process did not run for half a heartbeat window.", value=c.stalls)
        yield CounterMetricFamily(PREFIX + "sessions_lease_expired",
                                  "Sessions closed because their client was gone longer than the grace period.",
                                  value=c.sessions_lease_closed)


# Workers that take new sessions (registered, not draining) a broker needs to be ready (`broker start --min-workers`):
# one, since a broker without one can serve nothing; 0 makes it ready as soon as it has recovered.
MIN_WORKERS = 1


class BrokerMetrics:
    """The broker process's metrics registry. Serve `registry` with a MetricsServer.

    `readiness()` is the broker's /readyz: not ready while it recovers after a restart (requests for
    unknown sessions are held), or while fewer than `min_workers` workers take new sessions (by default
    one: with none, nothing it is sent can be served). Workers must still be able to reach a broker that is
    not ready: point them at its address directly, or at a Service that publishes not-ready addresses.
    """

    def __init__(self, router: Router, counters: RouterCounters, *, min_workers: int = MIN_WORKERS,
                 clock: Callable[[], float] = time.monotonic, process: bool = True) -> None:
        self.router = router
        self.counters = counters
        self.min_workers = min_workers
        self.clock = clock
        self.registry = CollectorRegistry()
        self.registry.register(_BrokerCollector(router, counters, clock))
        if process:  # process_resident_memory_bytes, process_cpu_seconds_total, open fds (Linux)
            ProcessCollector(registry=self.registry)

    def readiness(self) -> Readiness:
        if self.router.recovering(self.clock()):
            return False, "recovering: waiting for workers to re-register"
        workers = _copied(lambda: list(self.router.registry.workers.values())) or []
        taking = sum(1 for w in workers if not w.closed)
        if taking < self.min_workers:
            return False, f"{taking} workers take new sessions; {self.min_workers} needed"
        return True, f"ready: {len(workers)} workers, {taking} taking new sessions"
