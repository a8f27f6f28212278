"""The load test's measurements: raw samples, their merge, and their statistics (vLLM `bench serve` definitions).

Times are `time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux, so samples taken by several client
processes on one host share one clock). Definitions, as vLLM's `bench serve` has them:

- A turn's start: its request sent; for the turn that opens its session (sent right after the session's create, on
  every path: natively the CREATE's send, through the gateway the turn that opens the session), the create's send.
- TTFT: from the start of the turn to the first chunk that carries a token. `ttft_later`: the turns that did not open
  their session.
- ITL: the gaps between consecutive chunks that carry tokens (a chunk of k coalesced tokens is one gap).
- TPOT: (end - first token) / (output tokens - 1), per request, for requests with more than one token.
- E2E latency: from the start of the turn to its final chunk.
- Percentiles interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
TIMELINE_BINS = 40  # throughput-over-time resolution when the run is short
TIMELINE_MAX_BIN_S = 1.0
SESSION_OPS = ("create", "fork", "close")
INTERRUPTED = "interrupted"  # the error code of a request cut short because the run was stopped (interrupt.py)


# -- raw samples --------------------------------------------------------------------------------


@dataclass
class RequestSample:
    """One generate request (one turn: the prompt appended, then tokens generated, streamed)."""

    start: float  # the turn began (prompt sent)
    forked: bool = False  # ran on a fork child
    prompt_tokens: int = 0  # tokens the turn's prompt added to the session
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    end: float = 0.0  # the final chunk (or the error) arrived
    error: str | None = None  # the wire error code when the request failed; INTERRUPTED when the run cut it short
    opened: bool = False  # the turn opened its session (natively a CREATE before it): its TTFT counts from that

    @classmethod
    def begun(cls, now: float, forked: bool, opened_at: float | None) -> RequestSample:
        """A turn's sample, from `now` (the driver's clock), or from its session's create when the turn opened it
        (workload.session_opened_at)."""
        return cls(start=now if opened_at is None else opened_at, forked=forked, opened=opened_at is not None)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)


@dataclass
class RawRun:
    """Everything one client process measured; runs of several processes merge into one."""

    start: float  # the run began (every process starts on one signal)
    finish: float = 0.0  # the last session was closed
    requests: list[RequestSample] = field(default_factory=list)
    ops: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in SESSION_OPS})  # seconds, successes
    op_errors: dict[str, Counter[str]] = field(default_factory=dict)  # op -> error code -> count
    counts: Counter[str] = field(default_factory=Counter)  # sessions_opened, context_rollovers, forks, ...
    interrupted: bool = False  # the run was stopped before its end (interrupt.py)

    def op(self, kind: str, seconds: float) -> None:
        self.ops.setdefault(kind, []).append(seconds)

    def op_failed(self, kind: str, code: str) -> None:
        self.op_errors.setdefault(kind, Counter())[code] += 1


def merge(runs: Sequence[RawRun]) -> RawRun:
    """One run from several processes' runs."""
    merged = RawRun(start=min(r.start for r in runs), finish=max(r.finish for r in runs),
                    interrupted=any(r.interrupted for r in runs))
    for run in runs:
        merged.requests += run.requests
        for kind, values in run.ops.items():
            merged.ops.setdefault(kind, []).extend(values)
        for kind, codes in run.op_errors.items():
            merged.op_errors.setdefault(kind, Counter()).update(codes)
        merged.counts.update(run.counts)
    merged.requests.sort(key=lambda r: r.start)
    return merged


# -- per-request figures ------------------------------------------------------------------------


def ttft(sample: RequestSample) -> float | None:
    return sample.chunk_times[0] - sample.start if sample.chunk_times else None


def itls(sample: RequestSample) -> list[float]:
    times = sample.chunk_times
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)]


def tpot(sample: RequestSample) -> float | None:
    n = sample.output_tokens
    if n < 2:
        return None
    return (sample.end - sample.chunk_times[0]) / (n - 1)


def e2e(sample: RequestSample) -> float:
    return sample.end - sample.start


# -- distributions ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of a non-empty sequence, linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """A latency distribution in milliseconds; every figure is None when there were no values."""

    count: int
    mean: float | None = None
    std: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Summary:
        if not values_ms:
            return cls(0)
        mean = sum(values_ms) / len(values_ms)
        std = math.sqrt(sum((v - mean) ** 2 for v in values_ms) / len(values_ms))
        p50, p90, p99 = (percentile(values_ms, q) for q in PERCENTILES)
        return cls(len(values_ms), mean, std, p50, p90, p99, max(values_ms))

    def flat(self, name: str) -> dict[str, float | None]:
        """vLLM's keys: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p50_ttft_ms, p90_ttft_ms, p99_ttft_ms."""
        return {
            f"mean_{name}_ms": self.mean, f"median_{name}_ms": self.p50, f"std_{name}_ms": self.std,
            f"p50_{name}_ms": self.p50, f"p90_{name}_ms": self.p90, f"p99_{name}_ms": self.p99,
        }


def timeline(samples: Iterable[RequestSample], start: float, end: float) -> list[tuple[float, float]]:
    """Output tokens/s over time: (bin centre in seconds from start, tokens/s in that bin). Bins are `width` wide but
    the last, which ends at `end` (a run of 40.5 s in 1 s bins: its last bin is 0.5 s, its tokens over 0.5 s)."""
    span = max(end - start, 1e-9)
    width = min(TIMELINE_MAX_BIN_S, span / TIMELINE_BINS)
    count = max(1, math.ceil(span / width - 1e-9))  # 1e-9: span / (span / 40) may come out a hair over 40
    bins = [0] * count
    for sample in samples:
        for t, n in zip(sample.chunk_times, sample.chunk_tokens, strict=True):
            bins[min(max(int((t - start) / width), 0), count - 1)] += n
    out = []
    for i, n in enumerate(bins):
        low, high = i * width, span if i == count - 1 else (i + 1) * width
        out.append(((low + high) / 2, n / (high - low)))
    return out
