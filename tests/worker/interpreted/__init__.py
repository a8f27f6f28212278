"""Kernel checks run by Triton's interpreter on the CPU.

TRITON_INTERPRET is read when triton is imported, so a check cannot run inside the test process (triton is
imported there already): each check is a module of this package that a test runs in a subprocess,
`python -m tests.worker.interpreted.<check>` with TRITON_INTERPRET=1. A check asserts, and prints "ok" last.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_interpreted(check: str, timeout_s: float) -> None:
    """Run the check module `check` of this package in Triton's interpreter; it must exit 0 and print "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", f"{__name__}.{check}"], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
