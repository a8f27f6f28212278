"""The load test's report: its figures under vLLM `bench serve` names, and its summary table (rich), laid out
like vLLM's `bench serve` result block."""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from client.bench.loadtest.stats import INTERRUPTED, RawRun, Summary, e2e, itls, timeline, tpot, ttft

WIDTH = 100  # columns of the plain-text table


# -- the figures --------------------------------------------------------------------------------


@dataclass
class Report:
    mode: str  # "full-stack", "in-process" or "http"
    config: dict[str, Any]
    duration_s: float  # from the run's start to the end of its last request
    completed: int
    failed: int
    request_errors: dict[str, int]  # error code -> failed requests
    total_input_tokens: int
    total_output_tokens: int
    ttft: Summary
    ttft_later: Summary  # the turns that did not open their session (no CREATE in their time on either path)
    tpot: Summary
    itl: Summary
    e2el: Summary
    ops: dict[str, Summary]  # session create / fork / close
    op_errors: dict[str, dict[str, int]]
    counts: dict[str, int]
    timeline: list[tuple[float, float]]
    # The run was stopped early (Ctrl-C: interrupt.py): the figures are those of its first `duration_s` seconds, and
    # the requests it cut short (`cut_short`) are in none of them, neither completed nor failed.
    interrupted: bool = False
    cut_short: int = 0
    # The distributions themselves (ms), for plots; not part of to_dict().
    ttft_ms: list[float] = field(default_factory=list, repr=False)
    itl_ms: list[float] = field(default_factory=list, repr=False)
    tpot_ms: list[float] = field(default_factory=list, repr=False)
    e2el_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def output_tokens_per_s(self) -> float:
        return self.total_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.total_input_tokens + self.total_output_tokens) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every figure, flat under vLLM's names where vLLM has one."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "config": self.config,
            "interrupted": self.interrupted,
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "cut_short": self.cut_short,
            "errors": dict(self.request_errors),
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.requests_per_s,
            "output_throughput": self.output_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,  # the same, under the Report property's name
            "total_token_throughput": self.total_tokens_per_s,
        }
        for name in ("ttft", "ttft_later", "tpot", "itl", "e2el"):
            out.update(getattr(self, name).flat(name))
        out["session_ops"] = {
            kind: {"count": s.count, "mean_ms": s.mean, "p50_ms": s.p50, "p99_ms": s.p99,
                   "errors": dict(self.op_errors.get(kind, {}))}
            for kind, s in self.ops.items()
        }
        out["counts"] = dict(self.counts)
        out["output_throughput_over_time"] = [{"t": t, "tokens_per_s": v} for t, v in self.timeline]
        return out

    def table(self) -> ReportTable:
        """The summary table: a rich renderable, whose str() is the plain-text table (so print() works too)."""
        return report_table(self)

    def render(self, width: int = 100) -> str:
        """The summary table as plain text."""
        return render(self, width)


def build_report(raw: RawRun, mode: str, config: dict[str, Any]) -> Report:
    done = [r for r in raw.requests if r.error is None]
    failed = [r for r in raw.requests if r.error is not None and r.error != INTERRUPTED]
    last_end = max((r.end for r in raw.requests), default=raw.finish)
    ttft_ms = [t * 1e3 for t in map(ttft, done) if t is not None]
    itl_ms = [g * 1e3 for r in done for g in itls(r)]
    tpot_ms = [t * 1e3 for t in map(tpot, done) if t is not None]
    e2el_ms = [e2e(r) * 1e3 for r in done]
    return Report(
        mode=mode,
        config=config,
        duration_s=max(last_end - raw.start, 0.0),
        completed=len(done),
        failed=len(failed),
        request_errors=dict(Counter(r.error for r in failed if r.error is not None)),
        total_input_tokens=sum(r.prompt_tokens for r in done),
        total_output_tokens=sum(r.output_tokens for r in done),
        ttft=Summary.of(ttft_ms),
        ttft_later=Summary.of([t * 1e3 for r in done if not r.opened and (t := ttft(r)) is not None]),
        tpot=Summary.of(tpot_ms),
        itl=Summary.of(itl_ms),
        e2el=Summary.of(e2el_ms),
        ops={kind: Summary.of([s * 1e3 for s in values]) for kind, values in raw.ops.items()},
        op_errors={kind: dict(codes) for kind, codes in raw.op_errors.items()},
        counts=dict(raw.counts),
        timeline=timeline(done, raw.start, last_end),
        interrupted=raw.interrupted,
        cut_short=sum(r.error == INTERRUPTED for r in raw.requests),
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        tpot_ms=tpot_ms,
        e2el_ms=e2el_ms,
    )


# -- the table ----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _latency_rows(table: Table, title: str, summary: Summary) -> None:
    table.add_section()
    table.add_row(f"[bold]{title}[/bold] (ms)", f"n={summary.count}")
    for label, value in (("mean", summary.mean), ("p50", summary.p50), ("p90", summary.p90), ("p99", summary.p99)):
        table.add_row(f"  {label}", _ms(value))


def _errors(codes: dict[str, int]) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items())) or "none"


class ReportTable(Table):
    """A rich Table that prints as plain text with print() (rich's Console.print() renders it in colour)."""

    def __str__(self) -> str:
        out = io.StringIO()
        Console(file=out, width=WIDTH, color_system=None, legacy_windows=False).print(self)
        return out.getvalue()


def report_table(report: Report) -> ReportTable:
    title = f"Load test result ({report.mode})" + (", INTERRUPTED: partial" if report.interrupted else "")
    table = ReportTable(title=title, show_header=False, title_justify="left")
    table.add_column("figure", style="cyan", no_wrap=True)
    table.add_column("value", justify="right")
    table.add_row("Successful requests", str(report.completed))
    table.add_row("Failed requests", f"{report.failed} ({_errors(report.request_errors)})" if report.failed else "0")
    if report.interrupted:
        table.add_row("Requests cut short (interrupted)", str(report.cut_short))
        table.add_row("Benchmark duration until interrupted (s)", f"{report.duration_s:.2f}")
    else:
        table.add_row("Benchmark duration (s)", f"{report.duration_s:.2f}")
    table.add_row("Total input tokens", str(report.total_input_tokens))
    table.add_row("Total generated tokens", str(report.total_output_tokens))
    table.add_row("Request throughput (req/s)", f"{report.requests_per_s:.2f}")
    table.add_row("Output token throughput (tok/s)", f"{report.output_tokens_per_s:.1f}")
    table.add_row("Total token throughput (tok/s)", f"{report.total_tokens_per_s:.1f}")
    _latency_rows(table, "Time to first token", report.ttft)
    if report.ttft_later.count != report.ttft.count:
        _latency_rows(table, "TTFT, turns after a session's first", report.ttft_later)
    _latency_rows(table, "Time per output token", report.tpot)
    _latency_rows(table, "Inter-token latency", report.itl)
    _latency_rows(table, "End-to-end latency", report.e2el)
    table.add_section()
    table.add_row("[bold]Session operations[/bold] (ms)", "mean / p50 / p99 (n)")
    for kind, s in report.ops.items():
        errors = report.op_errors.get(kind)
        suffix = f", failed: {_errors(errors)}" if errors else ""
        table.add_row(f"  {kind}", f"{_ms(s.mean)} / {_ms(s.p50)} / {_ms(s.p99)} ({s.count}{suffix})")
    if report.counts:
        table.add_section()
        for name, n in sorted(report.counts.items()):
            table.add_row(name.replace("_", " "), str(n))
    return table


def render(report: Report, width: int = WIDTH) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(report_table(report))
    return out.getvalue()
