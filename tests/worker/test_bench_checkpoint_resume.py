"""worker.bench.resume on the tiny hybrid preset: each case starts from what it says (the checkpoint before the
prompt's last token, or before its tail, or nothing) and times its first token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from worker.bench.resume import measure
from worker.engine import Engine


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load("random:tiny-qwen3.5-moe", device="cpu", max_sessions=4, max_context=512)
    eng.enable_hibernation(host_cache_bytes=1 << 30, session_store=None)
    yield eng
    eng.unload()


def test_each_case_starts_where_it_says(engine: Engine) -> None:
    cases = measure(engine, context=200, tail=2, turn=8, repeats=1)
    assert {name: case["computed_before"] for name, case in cases.items()} == {
        "regenerate, from the checkpoint": 199, "regenerate, from the start": 0,
        "next turn, from the checkpoint": 198, "next turn, from the start": 0,
        "edited last question, from the checkpoint": 198, "edited last question, from the start": 0,
        "next turn after hibernation, from the checkpoint": 198, "next turn after hibernation, from the start": 0}
    assert all(case["first_token_ms"] > 0 for case in cases.values())
    assert engine.checkpoints is not None and len(engine.checkpoints) == 0  # every session closed, its checkpoint too
