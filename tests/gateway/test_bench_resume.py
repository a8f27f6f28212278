"""`python -m client.bench.gateway_resume` runs its stack and measures what its docstring says: a regenerate keeps
all of the prompt but the token it runs again, an edited last question (named, or not: a fork) keeps what comes
before it, a new session keeps nothing."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_resume_benchmark_runs_and_reports_what_each_request_kept() -> None:
    out = subprocess.run([sys.executable, "-m", "client.bench.gateway_resume", "--turns", "2", "--words", "12",
                          "--rounds", "1"], capture_output=True, text=True, timeout=240, check=True).stdout
    report = json.loads(out[out.index("{"):])
    regenerate, edit, branch, new = report["regenerate"], report["edit"], report["branch"], report["new"]
    assert regenerate["cached_tokens"] == regenerate["prompt_tokens"] - 1
    assert new["cached_tokens"] == 0 and new["prompt_tokens"] == regenerate["prompt_tokens"]
    for edited in (edit, branch):  # the new question computed, what precedes kept
        assert 0 < edited["cached_tokens"] < edited["prompt_tokens"] - 12
    assert all(case["ms_p50"] > 0 for case in report.values())
