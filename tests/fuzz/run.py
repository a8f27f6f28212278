"""Running the fuzz: `drive` fires a target's hypothesis-drawn cases (checkpoint every batch); `run_all` runs each
named target in turn on one stack."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from .checks import FuzzFailure, Report
from .stack import FuzzStack
from .strategies import Case
from .targets import TARGETS, Target


def fuzz_settings(cases: int) -> settings:
    """No shrinking (a case changes live daemons: replaying a smaller one proves nothing), no database, no deadline."""
    return settings(
        max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def drive(target: Target, cases: int, seed: int) -> Report:
    """Fire `cases` hypothesis-drawn cases at the target (checkpoint every batch), finish and release it."""
    started = time.monotonic()

    @fuzz_settings(cases)
    @given(target.strategy())
    def one(case: Case) -> None:
        target.fire(case)

    with target:
        hypothesis_seed(seed)(one)()
        target.finish()
    target.report.seconds = time.monotonic() - started
    return target.report


def run_all(tmp: Path, cases: int, seed: int, batch: int, names: Sequence[str] = tuple(TARGETS),
            progress: Callable[[Report], None] | None = None) -> Iterator[Report]:
    """One stack, each named target in turn; yields each target's report as it finishes."""
    stack = FuzzStack(tmp)
    try:
        for name in names:
            target = TARGETS[name](stack, batch)
            report = drive(target, cases, seed)
            if progress is not None:
                progress(report)
            yield report
        dead = [d.log.name for d in [*stack.daemons(), stack.lone] if not d.alive]
        if dead:
            raise FuzzFailure(f"processes died: {dead}")
    finally:
        stack.close()
