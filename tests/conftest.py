"""Shared fixtures: the bundled model is loaded once per test process. And how the suite spreads over two processes.

The README's test command runs the suite in two pytest-xdist workers (`-n 2 --dist loadgroup`; without them, one
process, as tests/gpu_run.sh runs the GPU tests). Every test that starts daemons (tests/integration, tests/gateway,
tests/client, tests/fuzz) is in one group, so they run one after another in one worker, as they would alone: their
timings (heartbeats, deadlines) see one other process, never another cluster. Every other module is a group of its
own, so that its tests run in one worker in file order, as they do in one process (a module's fixtures and module
state are made once, by the tests that come first). Workers run with one torch thread each so that the two do not
oversubscribe a two-core machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

DAEMON_DIRS = frozenset({"integration", "gateway", "client", "fuzz"})  # under tests/: tests that start daemons


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    tests = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(tests).parts if item.path.is_relative_to(tests) else ()
        if parts and parts[0] in DAEMON_DIRS:
            item.add_marker(pytest.mark.xdist_group("daemons"))
        else:
            item.add_marker(pytest.mark.xdist_group("/".join(parts) or item.nodeid.split("::")[0]))


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
