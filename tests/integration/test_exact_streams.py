"""Streams stay exact across a kill -9 of the broker: 20 streams in flight, the broker killed and restarted, and
every stream's tokens and text equal its result's, each token once (chunks lost in the outage asked for again)."""

from __future__ import annotations

import time

import pytest

from client import Stream

from .cluster import Cluster

STREAMS = 20
TOKENS = 300


@pytest.mark.parametrize("cluster", [{"recovery_ms": 3000}], indirect=True)  # room for a slow re-registration
def test_twenty_streams_are_exact_across_a_kill_9_and_restart_of_the_broker(cluster: Cluster) -> None:
    cluster.start_broker()
    worker = cluster.start_worker("w1", max_sessions=STREAMS, max_context=1024)
    cluster.wait_for_workers({"w1"})
    with cluster.client(timeout=30) as c:
        sessions = [c.session() for _ in range(STREAMS)]
        for i, s in enumerate(sessions):
            s.append(token_ids=[10 + i, 20, 30])
        # Random bytes (random:tiny's vocabulary is bytes): unfinished UTF-8 characters hold text back now and then.
        streams: list[Stream] = [s.generate(max_tokens=TOKENS, temperature=1.0, seed=i, ignore_eos=True, stream=True)
                                 for i, s in enumerate(sessions)]
        tokens: list[list[int]] = [[] for _ in streams]
        texts = [""] * STREAMS
        live = set(range(STREAMS))
        killed_at: float | None = None
        while live:
            for i in sorted(live):
                chunk = next(streams[i])
                tokens[i] += chunk.token_ids
                texts[i] += chunk.text
                if chunk.finish_reason is not None:
                    live.discard(i)
            if killed_at is None and min(len(t) for t in tokens) >= 3:  # every stream under way
                assert cluster.broker is not None and len(live) == STREAMS
                cluster.broker.kill()
                killed_at = time.monotonic()
                cluster.start_broker()  # same addresses, new broker id, empty tables
        assert killed_at is not None
        for i, stream in enumerate(streams):
            result = stream.result
            assert result is not None and result.finish_reason == "length" and len(result.token_ids) == TOKENS
            assert tokens[i] == result.token_ids, f"stream {i}: tokens differ from the result's"
            assert texts[i] == result.text, f"stream {i}: streamed text differs from the result's"
        assert [s.info().length for s in sessions] == [3 + TOKENS] * STREAMS  # nothing ran twice
        for s in sessions:
            s.close()
    log = worker.log_text()
    assert '"event": "stream_resumed"' in log  # chunks lost in the outage were asked for again, and sent
