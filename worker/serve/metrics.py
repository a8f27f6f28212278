"""The worker's Prometheus metrics, built for a compute loop whose engine step takes about a millisecond.

The compute loop only does plain arithmetic on this object: no prometheus call, no lock, no allocation
per token. Prometheus reads it on the metrics server's thread through a custom collector:

- gauges (sessions, slots, generations running, memory) come from a `snapshot()` callable at scrape time;
- counters are ints and dicts bumped in O(1);
- histograms are our own bucket counts (`Buckets`): one bisect per observation, and an observation
  may carry a weight. `step()` adds one inter-token latency observation per decoding generation with
  a single bisect, instead of one `Histogram.observe` (and one lock) per token.

Per generation (keyed by the engine's request id): `generation_started` -> `first_token` (TTFT) ->
`generation_finished` (end-to-end latency, tokens, finish reason). Inter-token latency is the time
between the ends of consecutive engine steps, counted once for every generation that got a token in
the step and had one before it. All times come from one clock (time.perf_counter()).

A scrape reads counts the loop may be writing: each number is whole (the GIL), the histogram's buckets
are copied in one step and made cumulative from that copy, so they are always consistent with their
count; the sum may be one step ahead. Names follow vLLM's (`vllm:time_to_first_token_seconds` ->
`sessionserve:time_to_first_token_seconds`). Every series has the labels {worker, model, device}:

    sessionserve:num_sessions, session_capacity, free_slots        gauges   the session table
    sessionserve:kv_cache_usage_perc                               gauge    the fuller of slots resident sessions hold /
                                                                            capacity and state pages held / budget (0..1)
    sessionserve:session_bytes, session_state_bytes                gauges   one session's state; memory mapped for slots
    sessionserve:num_requests_running                              gauge    generations in flight
    sessionserve:draining                                          gauge    1 while draining
    sessionserve:sessions{where}                                   gauge    sessions resident / host / disk (hibernated)
    sessionserve:state_pages, state_page_budget                    gauges   pages sessions hold; the most they may hold
    sessionserve:sessions_hibernated_total                         counter  sessions hibernated (idle, or pages short)
    sessionserve:session_restore_seconds{source}                   histogram a hibernated session back in a slot
    sessionserve:state_checkpoints_held                            gauge    recurrent-state checkpoints held (hybrid
                                                                            models only: worker.engine.checkpoints)
    sessionserve:state_checkpoints_total{event}                    counter  checkpoints taken, put back (a turn that
                                                                            started from one), restored (with a
                                                                            hibernated or moved session)
    sessionserve:session_moves_total{event}                        counter  moves seen here: sent, released (out),
                                                                            imported (in), failed (here)
    sessionserve:gpu_memory_allocated_bytes, ..._reserved_bytes    gauges   torch's CUDA allocator (CUDA only)
    sessionserve:engine_steps_total                                counter  engine steps that ran a batch
    sessionserve:prompt_tokens_total, generation_tokens_total      counters prompt tokens computed / delivered
    sessionserve:requests_total{command}                           counter  requests from the broker
    sessionserve:request_errors_total{code}                        counter  requests answered with an error
    sessionserve:request_success_total{finished_reason}            counter  generations ended: stop, length, cancelled, capacity
    sessionserve:time_to_first_token_seconds                       histogram admission -> first token
    sessionserve:inter_token_latency_seconds                       histogram between two tokens of a generation
    sessionserve:e2e_request_latency_seconds                       histogram admission -> end of a generation
    sessionserve:request_generation_tokens                         histogram tokens per generation
    sessionserve:engine_step_duration_seconds                      histogram one engine step
    sessionserve:engine_step_batch_size                            histogram requests per step (decode + prefill)
    sessionserve:iteration_tokens_total                            histogram tokens per step (prefill + generated)
    process_*                                                               resident memory, CPU seconds, open fds

Steps per second: rate(sessionserve:engine_steps_total[1m]).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from broker.common.metrics import OTHER, PREFIX, bump, label
from broker.common.metrics_http import Readiness

log = structlog.get_logger()

# vLLM's buckets (v1/metrics/loggers.py), with finer ones below 10 ms where our GPU steps live.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RESTORE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RESTORE_SOURCES = ("host", "disk")
FINISH_REASONS = ("stop", "length", "cancelled", "capacity")  # "error": counted in request_errors_total, not here
MAX_OPEN = 1 << 16  # generations tracked at once; past this the oldest is forgotten (a missed finish)
LABELS = ("worker", "model", "device")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
    raise AssertionError("unreachable")


class Buckets:
    """A histogram as bucket counts, observations weighted: `observe(v, w)` is w observations of v.

    counts[i] holds the observations in (bounds[i-1], bounds[i]] (Prometheus's `le`), the last one
    those above every bound (+Inf).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"bucket bounds must be increasing and not empty, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += weight
        self.sum += value * weight

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """([(le, observations <= le), ..., ("+Inf", count)], sum), from one copy of the counts."""
        counts, total = list(self.counts), self.sum
        running = list(itertools.accumulate(counts))
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        return list(zip(les, (float(n) for n in running), strict=True)), total


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """The worker's state at scrape time; built by the daemon from values it keeps for other threads."""

    sessions: int
    capacity: int
    free_slots: int
    running: int  # generations in flight
    bytes_per_session: int = 0
    draining: bool = False
    mapped_bytes: int | None = None  # what the session table has mapped (slots in use plus the spare), if known
    resident: int | None = None  # sessions in a slot; None: the engine does not hibernate sessions
    in_host: int = 0  # hibernated sessions in host memory
    on_disk: int = 0  # hibernated sessions in the session store
    pages: int | None = None  # pages the sessions hold, if known
    page_budget: int = 0
    hibernated: int = 0  # sessions hibernated so far
    moves: dict[str, int] | None = None  # worker.serve.moves' counts by event; None: this worker does not move sessions
    checkpoints: tuple[int, int, int, int] | None = None  # held, taken, put back, restored; None: no recurrent state


def torch_memory(device: str) -> Callable[[], dict[str, float]] | None:
    """The CUDA caching allocator's counters for `device` (no driver call, so safe from another thread).
    None on CPU. Session state lives outside this allocator (cuda_state maps it): see session_state_bytes."""
    if not device.startswith("cuda"):
        return None

    def read() -> dict[str, float]:
        import torch

        return {
            "gpu_memory_allocated_bytes": float(torch.cuda.memory_allocated(device)),
            "gpu_memory_reserved_bytes": float(torch.cuda.memory_reserved(device)),
        }

    return read


def worker_readiness(registered: bool, draining: bool) -> Readiness:
    """A worker takes work once the broker welcomed it, until it drains."""
    if draining:
        return False, "draining"
    if not registered:
        return False, "not registered with the broker"
    return True, "ready"


class NoMetrics:
    """WorkerMetrics' hooks doing nothing: a worker without --metrics-port pays for none of them."""

    def request(self, command: str | Enum) -> None:
        pass

    def error(self, code: object) -> None:
        pass

    def generation_started(self, key: str, t: float) -> None:
        pass

    def first_token(self, key: str, t: float) -> None:
        pass

    def step(self, end: float, duration_s: float, rows: int, prefill_tokens: int, new_tokens: int) -> None:
        pass

    def generation_finished(self, key: str, t: float, tokens: int, reason: str) -> None:
        pass


class WorkerMetrics:
    """Counters and histograms of one worker process, and its registry (serve it with a MetricsServer).

    snapshot: read on the scrape thread; it must only read values the compute loop replaces whole.
    memory: extra gauges (name without prefix -> value), e.g. torch_memory(device); None: none.
    """

    def __init__(self, snapshot: Callable[[], WorkerSnapshot], *, worker: str, model: str, device: str,
                 max_context: int = 2048, memory: Callable[[], dict[str, float]] | None = None,
                 process: bool = True) -> None:
        self.labels = (worker, model, device)
        self._snapshot = snapshot
        self._memory = memory
        # counters (compute thread only)
        self.steps = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.requests: dict[str | Enum, int] = {}
        self.errors: dict[object, int] = {}
        self.finished: dict[str, int] = {}
        # histograms
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.e2e = Buckets(E2E_BUCKETS)
        self.step_time = Buckets(STEP_BUCKETS)
        self.batch = Buckets(BATCH_BUCKETS)
        self.iteration_tokens = Buckets(ITERATION_TOKENS_BUCKETS)
        self.request_tokens = Buckets(buckets_1_2_5(max(max_context, 1)))
        self.restore = {source: Buckets(RESTORE_BUCKETS) for source in RESTORE_SOURCES}
        # generations in flight: key -> start time; and those still waiting for their first token
        self._started: dict[str, float] = {}
        self._waiting_first: dict[str, float] = {}
        self._first_tokens = 0  # first tokens since the last step(): not inter-token gaps
        self._last_step_end: float | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(self))
        if process:  # process_resident_memory_bytes, process_cpu_seconds_total, open fds (Linux)
            ProcessCollector(registry=self.registry)

    # -- hooks for the compute loop (all O(1)) -------------------------------------------------------

    def request(self, command: str | Enum) -> None:
        """A request from the broker (a Command or its name), before it runs."""
        bump(self.requests, command, OTHER)

    def error(self, code: object) -> None:
        """A request answered with an error (an ErrorCode or its value)."""
        bump(self.errors, code if isinstance(code, (str, Enum)) else "invalid", OTHER)

    def generation_started(self, key: str, t: float) -> None:
        if len(self._started) >= MAX_OPEN:
            oldest = next(iter(self._started))
            del self._started[oldest]
            self._waiting_first.pop(oldest, None)
        self._started[key] = t
        self._waiting_first[key] = t

    def first_token(self, key: str, t: float) -> None:
        """The generation's first token was sampled at t (call before the step() that produced it)."""
        start = self._waiting_first.pop(key, None)
        if start is not None:
            self.ttft.observe(t - start)
            self._first_tokens += 1

    def step(self, end: float, duration_s: float, rows: int, prefill_tokens: int, new_tokens: int) -> None:
        """One engine step call ended at `end` after `duration_s`: it launched a batch of `rows` requests
        computing `prefill_tokens` prompt tokens (rows 0: it launched none), and delivered `new_tokens` tokens to
        generations (one per generation that moved; on a GPU, from the batch launched by the call before).
        Steps, prompt tokens and batch sizes count launched batches. Every delivered token that was not a
        first token is one inter-token gap of (end - the last call that delivered tokens)."""
        if rows:
            self.steps += 1
            self.prompt_tokens += prefill_tokens
            self.step_time.observe(duration_s)
            self.batch.observe(rows)
            self.iteration_tokens.observe(prefill_tokens + new_tokens)
        if not new_tokens:
            return
        self.generation_tokens += new_tokens
        gaps = new_tokens - self._first_tokens
        self._first_tokens = 0
        last = self._last_step_end
        if gaps > 0 and last is not None:
            self.itl.observe(end - last, gaps)
        self._last_step_end = end

    def generation_finished(self, key: str, t: float, tokens: int, reason: str) -> None:
        """The generation ended at t with `tokens` tokens: reason stop, length, cancelled, or error."""
        start = self._started.pop(key, None)
        waiting = self._waiting_first.pop(key, None)
        if reason not in FINISH_REASONS:
            return  # an engine failure: the error is counted by error()
        bump(self.finished, reason, OTHER)
        if start is None:
            return
        if waiting is not None and reason != "cancelled":
            self.ttft.observe(t - start)  # ended at its first sampled token (EOS or a stop id)
        self.e2e.observe(t - start)
        self.request_tokens.observe(tokens)

    def restored(self, seconds: float, source: str) -> None:
        """A hibernated session was brought back from `source` ("host" or "disk") in `seconds`."""
        buckets = self.restore.get(source)
        if buckets is not None:
            buckets.observe(seconds)

    # -- the scrape ---------------------------------------------------------------------------------

    def snapshot(self) -> WorkerSnapshot:
        return self._snapshot()

    def memory(self) -> dict[str, float]:
        if self._memory is None:
            return {}
        try:
            return self._memory()
        except Exception as e:  # a memory probe must not fail the scrape
            log.debug("metrics_memory_failed", error=str(e))
            return {}


def _slots_used(s: WorkerSnapshot) -> int:
    """Slots resident sessions hold. Not capacity - free slots where the resident count is known: with hibernation on,
    free_slots counts the idle resident sessions too (a create would hibernate one), so a full table read empty."""
    return s.capacity - s.free_slots if s.resident is None else s.resident


def _usage(s: WorkerSnapshot) -> float:
    """kv_cache_usage_perc: the fuller of the slots resident sessions hold and the state pages held."""
    usage = _slots_used(s) / s.capacity if s.capacity else 0.0
    if s.pages is not None and s.page_budget:
        usage = max(usage, s.pages / s.page_budget)
    return min(max(usage, 0.0), 1.0)


class _WorkerCollector(Collector):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        s = m.snapshot()
        yield from self._gauges(s, m.memory())
        if s.moves is not None:
            yield self._by("session_moves", "Session moves seen by this worker: states sent and sessions released (moved "
                           "out), imported (moved in), failed here.", "event", s.moves)
        yield self._counter("engine_steps", "Engine steps run.", m.steps)
        yield self._counter("generation_tokens", "Tokens generated.", m.generation_tokens)
        yield self._counter("prompt_tokens", "Prompt tokens computed (prefill).", m.prompt_tokens)
        yield self._by("requests", "Requests from the broker, by command.", "command", m.requests)
        yield self._by("request_errors", "Requests answered with an error, by error code.", "code", m.errors)
        yield self._by("request_success", "Generations finished, by reason.", "finished_reason", m.finished)
        yield self._histogram("time_to_first_token_seconds", "Time from a generation's admission to its first token.",
                              m.ttft)
        yield self._histogram("inter_token_latency_seconds", "Time between consecutive tokens of a generation.", m.itl)
        yield self._histogram("e2e_request_latency_seconds", "Time from a generation's admission to its end.", m.e2e)
        yield self._histogram("request_generation_tokens", "Tokens generated per finished generation.",
                              m.request_tokens)
        yield self._histogram("engine_step_duration_seconds", "Duration of one engine step.", m.step_time)
        yield self._histogram("engine_step_batch_size", "Requests (decode rows and prefill chunks) in one engine step.",
                              m.batch)
        yield self._histogram("iteration_tokens_total", "Tokens per engine step (prefill and generated).",
                              m.iteration_tokens)
        restore = HistogramMetricFamily(PREFIX + "session_restore_seconds",
                                        "Time to bring a hibernated session back into a slot, by where it was.",
                                        labels=[*LABELS, "source"])
        for source, buckets in m.restore.items():
            cumulative, total = buckets.cumulative()
            restore.add_metric([*m.labels, source], cumulative, total)
        yield restore

    def _gauges(self, s: WorkerSnapshot, memory: dict[str, float]) -> Iterator[Metric]:
        values: list[tuple[str, str, float]] = [
            ("num_sessions", "Live sessions.", s.sessions),
            ("session_capacity", "Session slots.", s.capacity),
            ("free_slots", "Sessions a create can admit now (with hibernation on, idle resident sessions count: one "
             "would hibernate for it).", s.free_slots),
            ("num_requests_running", "Generations in flight.", s.running),
            ("kv_cache_usage_perc", "Fraction of the session table in use: slots held by resident sessions, or state "
             "pages held, whichever is fuller (1 = full).", _usage(s)),
            ("draining", "1 while the worker drains.", 1 if s.draining else 0),
        ]
        if s.bytes_per_session:
            values.append(("session_bytes", "Device memory of one session's state.", s.bytes_per_session))
            values.append(("session_state_bytes", "Memory mapped for session state (slots in use, and the spare).",
                           _slots_used(s) * s.bytes_per_session if s.mapped_bytes is None else s.mapped_bytes))
        if s.pages is not None:
            values.append(("state_pages", "Pages of state memory the sessions hold.", s.pages))
            values.append(("state_page_budget", "Pages of state memory the sessions may hold together.", s.page_budget))
        values += [(name, name.replace("_", " ") + ".", value) for name, value in sorted(memory.items())]
        for name, doc, value in values:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(self.m.labels, value)
            yield family
        if s.resident is not None:
            where = GaugeMetricFamily(PREFIX + "sessions", "Sessions by where their state is: resident (in a slot), "
                                      "host (hibernated in host memory), disk (hibernated in the session store).",
                                      labels=[*LABELS, "where"])
            for name, value in (("resident", s.resident), ("host", s.in_host), ("disk", s.on_disk)):
                where.add_metric([*self.m.labels, name], value)
            yield where
            yield self._counter("sessions_hibernated", "Sessions hibernated (idle, or pages short).", s.hibernated)
        if s.checkpoints is not None:
            held, taken, used, restored = s.checkpoints
            family = GaugeMetricFamily(PREFIX + "state_checkpoints_held", "Recurrent-state checkpoints held (each in a slot "
                                       "no session needs).", labels=LABELS)
            family.add_metric(self.m.labels, held)
            yield family
            yield self._by("state_checkpoints", "Recurrent-state checkpoints taken, put back (a turn started from one), "
                           "and brought back with a hibernated or moved session.", "event",
                           {"taken": taken, "used": used, "restored": restored})

    def _counter(self, name: str, doc: str, value: int) -> Metric:
        family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        family.add_metric(self.m.labels, value)
        return family

    def _by(self, name: str, doc: str, label_name: str, counts: dict[Any, int]) -> Metric:
        family = CounterMetricFamily(PREFIX + name, doc, labels=[*LABELS, label_name])
        totals: dict[str, int] = {}
        for key, n in list(counts.items()):
            text = label(key)
            totals[text] = totals.get(text, 0) + n
        for text, n in sorted(totals.items()):
            family.add_metric([*self.m.labels, text], n)
        return family

    def _histogram(self, name: str, doc: str, buckets: Buckets) -> Metric:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=LABELS)
        cumulative, total = buckets.cumulative()
        family.add_metric(self.m.labels, cumulative, total)
        return family
