"""The README's Python examples, run as written against a broker and a worker with the bundled SmolLM2 on the CPU:
every line an example marks `# -> TEXT` must be printed, in that order."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from typing import Any

import pytest

from client.stack import LocalStack
from worker.engine import Engine

from .test_client_lifecycle import ROOT

README = ROOT / "README.md"
ADDRESS = "tcp://127.0.0.1:5555"  # the examples' broker address, replaced by the test stack's


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def expected(example: str) -> list[str]:
    return [line.strip() for line in re.findall(r"# -> (.*)$", example, re.M)]


def printed_by(example: str, namespace: dict[str, Any]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(README), "exec"), namespace)
    return [line.strip() for line in out.getvalue().splitlines() if line.strip()]


def in_order(wanted: list[str], lines: list[str]) -> bool:
    rest = iter(lines)
    return all(any(line == w for line in rest) for w in wanted)


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    """A broker and one worker with the bundled model on the CPU (one torch thread: the tests share two cores)."""
    with LocalStack(heartbeats=None, env={"WORKER_THREADS": "1", "OMP_NUM_THREADS": "1"}) as stack:
        stack.start_broker()
        stack.start_worker("readme", device="cpu", max_sessions=4)
        stack.wait_for_workers({"readme"}, timeout=300)
        yield stack


def test_the_readme_has_client_examples_with_what_they_print() -> None:
    clients = [e for e in examples() if ADDRESS in e]
    assert len(clients) == 2 and all(expected(e) for e in clients)


@pytest.mark.parametrize("index", [i for i, e in enumerate(examples()) if ADDRESS in e])
def test_a_readme_client_example_prints_what_it_shows(stack: LocalStack, index: int) -> None:
    example = examples()[index]
    lines = printed_by(example.replace(ADDRESS, stack.clients), {"__name__": "__readme__"})
    assert in_order(expected(example), lines), f"printed {lines}, the README shows {expected(example)}"


def test_the_readme_engine_example_prints_what_it_shows(smol_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run with the bundled model the tests load once: Engine.load with the example's arguments gives it back."""
    [example] = [e for e in examples() if "Engine.load(" in e]

    def load(model: str | None, device: str, max_sessions: int, max_context: int) -> Engine:
        assert (model, device, max_sessions, max_context) == (None, "auto", 8, 2048)  # what smol_engine was loaded with
        return smol_engine

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    assert smol_engine.sessions() == []
    lines = printed_by(example, {"__name__": "__readme__"})
    assert in_order(expected(example), lines) and len(lines) == 2, f"printed {lines}"
    assert smol_engine.sessions() == []  # the example closes what it opens
