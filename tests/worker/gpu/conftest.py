"""The engines the GPU tests share: one CPU engine for the references and one GPU engine, each loaded once for
the whole package (as when these tests were one module), and the references computed once."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from .device import Loaded, device_free_bytes
from .references import CANDIDATES, CONTEXT, MODEL, SAFE_MARGIN, TOKENS, Reference, cpu_greedy


@pytest.fixture(scope="package")
def cpu_engine() -> Iterator[object]:
    from worker.engine import Engine

    engine = Engine.load(model=MODEL, device="cpu", max_sessions=8, max_context=CONTEXT)
    yield engine
    engine.table.close()


@pytest.fixture(scope="package")
def references(cpu_engine: object) -> list[Reference]:
    """8 prompts whose CPU greedy continuations have safe margins at every token."""
    rng = random.Random(1234)
    safe: list[Reference] = []
    for _ in range(0, CANDIDATES, 8):
        prompts = [[rng.randrange(300, 49000) for _ in range(rng.randrange(6, 24))] for _ in range(8)]
        safe += [r for r in cpu_greedy(cpu_engine, prompts, TOKENS) if min(r.margins) >= SAFE_MARGIN]
        if len(safe) >= 8:
            return safe[:8]
    pytest.fail(f"only {len(safe)} of {CANDIDATES} random prompts have CPU margins >= {SAFE_MARGIN}")


@pytest.fixture(scope="package")
def loaded() -> Iterator[Loaded]:
    from worker.engine import Engine

    warm = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (warm @ warm).sum().item()  # the context and the cuBLAS handle exist before the baseline
    del warm
    torch.cuda.empty_cache()
    before = device_free_bytes()
    engine = Engine.load(model=MODEL, device="cuda", max_sessions=8, max_context=CONTEXT)
    torch.cuda.empty_cache()
    yield Loaded(engine, before, device_free_bytes())
    engine.table.close()


@pytest.fixture
def gpu_engine(loaded: Loaded) -> Iterator[object]:
    """The package's GPU engine, with no sessions (and no slots kept mapped) before and after each test."""
    from worker.engine import Engine

    engine = loaded.engine
    assert isinstance(engine, Engine)
    for sid in engine.sessions():
        engine.close(sid)
    engine.release_idle_slots(0.0)
    yield engine
    for sid in engine.sessions():
        engine.close(sid)
    engine.release_idle_slots(0.0)
