"""The daemons' structlog set-up: lines go to the process's stderr as it is when they are written, and a line that
cannot be written is dropped, never raised into the code that logged."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from broker.common import logs


@pytest.fixture(autouse=True)
def _restore() -> object:
    """Put back the suite's set-up (tests/conftest.py: warnings and up), not structlog's defaults: those print debug
    lines to stdout, into what later tests in this process capture (the README example's printed lines)."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_lines_follow_stderr_and_a_closed_one_fails_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    logs.configure("info", json=True, role="test")
    log = structlog.get_logger()
    log.info("one", n=1)
    first.close()  # the stream it was configured with is gone (a closed pipe, a test harness's capture)
    log.info("lost")  # dropped: it raised ValueError into the caller (a worker's loop died of it)
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    log.warning("two", n=2)
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == ["two"]
    assert json.loads(second.getvalue())["role"] == "test" and json.loads(second.getvalue())["n"] == 2
