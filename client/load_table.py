"""The load test's summary table (rich), laid out like vLLM's `bench serve` result block."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from client.load_stats import Report, Summary

WIDTH = 100  # columns of the plain-text table


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
    table = ReportTable(title=f"Load test result ({report.mode})", show_header=False, title_justify="left")
    table.add_column("figure", style="cyan", no_wrap=True)
    table.add_column("value", justify="right")
    table.add_row("Successful requests", str(report.completed))
    table.add_row("Failed requests", f"{report.failed} ({_errors(report.request_errors)})" if report.failed else "0")
    table.add_row("Benchmark duration (s)", f"{report.duration_s:.2f}")
    table.add_row("Total input tokens", str(report.total_input_tokens))
    table.add_row("Total generated tokens", str(report.total_output_tokens))
    table.add_row("Request throughput (req/s)", f"{report.requests_per_s:.2f}")
    table.add_row("Output token throughput (tok/s)", f"{report.output_tokens_per_s:.1f}")
    table.add_row("Total token throughput (tok/s)", f"{report.total_tokens_per_s:.1f}")
    _latency_rows(table, "Time to first token", report.ttft)
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
