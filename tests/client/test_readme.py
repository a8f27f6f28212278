"""The README's Python examples, run as written against a broker and a worker with the bundled SmolLM2 on the CPU:
every line an example marks `# -> TEXT` must be printed, in that order."""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

import pytest
import torch

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


def test_the_readme_has_client_examples_with_what_they_print() -> None:
    clients = [e for e in examples() if ADDRESS in e]
    assert len(clients) == 2 and all(expected(e) for e in clients)


@pytest.mark.parametrize("index", [i for i, e in enumerate(examples()) if ADDRESS in e])
def test_a_readme_client_example_prints_what_it_shows(smol_stack: LocalStack, index: int) -> None:
    example = examples()[index]
    lines = printed_by(example.replace(ADDRESS, smol_stack.clients), {"__name__": "__readme__"})
    assert in_order(expected(example), lines), f"printed {lines}, the README shows {expected(example)}"


def test_the_readme_engine_example_prints_what_it_shows(smol_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run with the bundled model the tests load once: Engine.load with the example's arguments gives it back."""
    [example] = [e for e in examples() if "Engine.load(" in e]

    def load(model: str | None, device: str, max_sessions: int, max_context: int) -> Engine:
        assert (model, device, max_sessions, max_context) == (None, "auto", 8, 2048)  # what smol_engine was loaded with
        return smol_engine

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    assert smol_engine.sessions() == []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with the daemons of other tests (docs/tuning.md#cpu-threads)
    try:
        lines = printed_by(example, {"__name__": "__readme__"})
    finally:
        torch.set_num_threads(threads)
    assert in_order(expected(example), lines) and len(lines) == 2, f"printed {lines}"
    assert smol_engine.sessions() == []  # the example closes what it opens
