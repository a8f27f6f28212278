"""Shared fixtures: the bundled model is loaded once per test run."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@pytest.fixture(scope="session")
def smol_engine() -> Iterator[object]:
    """The real bundled SmolLM2 on CPU, 8 sessions of 2048 tokens. Tests close what they open."""
    from worker.engine import Engine

    engine = Engine.load(model=None, device="cpu", max_sessions=8, max_context=2048)
    yield engine
    engine.table.close()


@pytest.fixture
def engine(smol_engine: object) -> Iterator[object]:
    """The shared engine, checked to be left with no sessions by each test."""
    from worker.engine import Engine

    assert isinstance(smol_engine, Engine)
    for sid in smol_engine.sessions():
        smol_engine.close(sid)
    yield smol_engine
    for sid in smol_engine.sessions():
        smol_engine.close(sid)
