"""The bundled SmolLM2 through broker and worker gives exactly the engine's greedy tokens in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from .cluster import Cluster

QUESTION = "What is the capital of France?"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The worker daemon runs beside this process: two OpenMP pools spinning on two cores crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_same_greedy_tokens_as_the_engine_in_process(cluster: Cluster, engine: Any, one_thread: None) -> None:
    cluster.start_broker()
    cluster.start_worker("smol", model=None, max_sessions=4, max_context=2048)

    # In-process reference (the shared engine fixture: the same bundled model on CPU).
    sid = engine.create_session()
    engine.chat(sid, QUESTION)
    turn1 = engine.generate(sid, max_tokens=24)
    engine.chat(sid, "And of Italy?")
    turn2 = engine.generate(sid, max_tokens=12)
    child = engine.fork(sid)
    forked = engine.generate(child, max_tokens=8)
    plain = engine.create_session()
    engine.append(plain, text="The quick brown fox")
    story = engine.generate(plain, max_tokens=16)
    assert "Paris" in turn1.text

    cluster.wait_for_workers({"smol"})
    with cluster.client(timeout=60) as c, c.session() as s:
        assert s.model == engine.model_name
        got1 = s.chat(QUESTION, max_tokens=24)
        assert (got1.token_ids, got1.text, got1.finish_reason) == (turn1.token_ids, turn1.text, turn1.finish_reason)
        got2 = s.chat("And of Italy?", max_tokens=12)
        assert got2.token_ids == turn2.token_ids
        assert got2.session_length == engine.session_length(sid)
        with s.fork() as f:
            assert f.generate(max_tokens=8).token_ids == forked.token_ids
        with c.session() as p:
            p.append(text="The quick brown fox")
            chunks = list(p.generate(max_tokens=16, stream=True))
            assert [t for ch in chunks for t in ch.token_ids] == story.token_ids
            assert "".join(ch.text for ch in chunks) == story.text
