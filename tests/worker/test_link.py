"""The worker's link to the broker, without a broker: what one receive takes from the inbox."""

from __future__ import annotations

import uuid

from broker.common import protocol as p
from worker.serve.config import WorkerConfig, WorkerState
from worker.serve.link import Link


def unstarted_link() -> Link:
    return Link(WorkerConfig(name="lt"), ready=lambda: p.Ready(name="lt", model="m", capacity=1, free_slots=1,
                                                                max_context=8),
                state=lambda: WorkerState(1, ()))


def test_one_receive_decodes_a_bounded_number_of_bytes_of_big_requests_and_the_rest_comes_next_in_order() -> None:
    # Valid 1M-token APPENDs are 5 MB each on the wire and ~25 MB decoded. A receive used to decode a whole batch of up
    # to 1024 of them before any was handled: a flood of them took the worker past its memory (the kernel killed it).
    link = unstarted_link()
    try:
        sid = uuid.uuid4().hex
        ids = tuple(range(70_000, 71_000)) * (p.MAX_TOKENS // 1000)
        count = 8  # 40 MB on the wire, ~200 MB decoded
        for i in range(count):
            link._inbox.put(list(p.encode_frames(p.Append(request_id=f"a{i}", session_id=sid, token_ids=ids,
                                                          route=b"c"))))
        batches = []
        while got := link.receive(0.0):
            batches.append([m.request_id for m in got])  # type: ignore[union-attr]
        assert max(map(len, batches)) <= 4  # at most ~20 MB of them decoded at once
        assert sum(batches, []) == [f"a{i}" for i in range(count)]
    finally:
        link.stop()
