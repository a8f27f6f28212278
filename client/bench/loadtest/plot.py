"""The load test's plot: TTFT, ITL and end-to-end latency (histograms and CDFs), output tokens/s over time.

Drawn on a bare matplotlib Figure (the Agg canvas), so no GUI backend or pyplot state is involved.
"""

from __future__ import annotations

from pathlib import Path

from client.bench.loadtest.report import Report

HIST_BINS = 50


def plot(report: Report, path: str | Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8), layout="constrained")
    axes = fig.subplots(2, 3)
    distributions = (("TTFT", report.ttft_ms), ("ITL", report.itl_ms), ("E2E latency", report.e2el_ms))
    for ax, (name, values) in zip(axes[0], distributions, strict=True):
        ax.hist(values, bins=HIST_BINS, color="tab:blue")
        ax.set_title(f"{name} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    cdf = axes[1][0]
    for name, values in distributions:
        ordered = sorted(values)
        if ordered:
            cdf.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    cdf.set_xscale("symlog", linthresh=1.0)
    cdf.set_title("latency CDFs")
    cdf.set_xlabel("ms")
    cdf.set_ylabel("fraction of values")
    cdf.legend()
    tpot = axes[1][1]
    tpot.hist(report.tpot_ms, bins=HIST_BINS, color="tab:green")
    tpot.set_title(f"TPOT (n={len(report.tpot_ms)})")
    tpot.set_xlabel("ms")
    over_time = axes[1][2]
    if report.timeline:
        times, rates = zip(*report.timeline, strict=True)
        over_time.plot(times, rates, color="tab:orange")
    over_time.axhline(report.output_tokens_per_s, color="gray", linestyle="--", label=f"mean {report.output_tokens_per_s:,.0f}")
    over_time.set_title("output tokens/s over time")
    over_time.set_xlabel("s since start")
    over_time.set_ylabel("tokens/s")
    over_time.legend()
    interrupted = f", INTERRUPTED after {report.duration_s:.2f} s" if report.interrupted else ""
    fig.suptitle(f"loadtest ({report.mode}{interrupted}): {report.completed} requests, {report.failed} failed, "
                 f"{report.output_tokens_per_s:,.0f} output tok/s")
    fig.savefig(Path(path), dpi=100)
