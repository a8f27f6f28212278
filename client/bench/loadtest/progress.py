"""Live progress of a load test: running totals, and a rich progress bar on stderr that shows them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

REFRESH_S = 0.25


@dataclass
class Tally:
    """Running totals, updated by the driver as chunks and requests finish (cheap: a few integer adds)."""

    done: int = 0
    failed: int = 0
    output_tokens: int = 0

    def add(self, other: Tally) -> None:
        self.done += other.done
        self.failed += other.failed
        self.output_tokens += other.output_tokens


def requests_text(tally: Tally, requests: int | None) -> str:
    """The bar's count: "12/100 requests, 0 failed" (of a total), or "12 requests, 0 failed" (for a duration)."""
    ended = tally.done + tally.failed
    return f"{ended}/{requests} requests, {tally.failed} failed" if requests is not None else \
        f"{ended} requests, {tally.failed} failed"


class ProgressView:
    """The bar: requests done of the total, or seconds of the duration; failures and output tokens/s."""

    def __init__(self, requests: int | None, duration: float | None, enabled: bool) -> None:
        self.requests = requests
        self.duration = duration
        self.enabled = enabled
        self.start = time.perf_counter()
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressView:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]loadtest[/bold]"), BarColumn(), TextColumn("{task.fields[what]}"),
                TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False, refresh_per_second=1 / REFRESH_S,
            )
            self._progress.start()
            total = self.requests if self.requests is not None else self.duration
            self._task = self._progress.add_task("run", total=total, what=requests_text(Tally(), self.requests),
                                                 rate="0")
        return self

    def started(self) -> None:
        """The load begins now (after client processes or the model are ready)."""
        self.start = time.perf_counter()

    def update(self, tally: Tally) -> None:
        if self._progress is None or self._task is None:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        completed = tally.done + tally.failed if self.requests is not None else min(elapsed, self.duration or elapsed)
        self._progress.update(self._task, completed=completed, what=requests_text(tally, self.requests),
                              rate=f"{tally.output_tokens / elapsed:,.0f}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
