"""Two workers behind one broker: placement, routing to the right worker, a full system."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from client import CapacityExhausted, ModelNotFound

from .cluster import Cluster


def test_sessions_spread_over_both_workers_and_stay_on_theirs(cluster: Cluster) -> None:
    cluster.start_two_workers(max_sessions=3)
    with cluster.client() as c:
        sessions = [c.session() for _ in range(6)]
        assert Counter(s.worker for s in sessions) == {"w1": 3, "w2": 3}
        for i, s in enumerate(sessions):
            s.append(token_ids=[i + 1, i + 2, i + 3])
        for s in sessions:  # every request of a session reaches the worker that holds it
            info = s.info()
            assert info.worker == s.worker and info.length == 3
            s.generate(max_tokens=2, ignore_eos=True)
            assert s.info().length == 5
        assert {(w.name, w.sessions, w.free_slots) for w in c.status()} == {("w1", 3, 0), ("w2", 3, 0)}

        # Full: a clear error at once, not a hang.
        start = time.monotonic()
        with pytest.raises(CapacityExhausted) as e:
            c.session()
        assert e.value.code == "capacity_exhausted"
        assert time.monotonic() - start < 1.0
        with pytest.raises(CapacityExhausted):
            sessions[0].fork()

        # A close frees a slot on that worker, and the next session goes there.
        freed = sessions.pop(4)
        freed.close()
        again = c.session()
        assert again.worker == freed.worker
        with pytest.raises(ModelNotFound):
            c.session(model="no-such-model")
        again.close()
        by_name = c.session(model="RANDOM-TINY")  # model names match case-insensitively
        assert by_name.model == "random-tiny"
        for s in [*sessions, by_name]:
            s.close()
        assert sum(w.sessions for w in c.status()) == 0
