"""A broker and a worker with the bundled SmolLM2 on the CPU, started once for the client tests that need a real
instruct model (its chat template): the README's examples, whole chat turns."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from client.stack import LocalStack


@pytest.fixture(scope="session")
def smol_stack() -> Iterator[LocalStack]:
    """One torch thread (the tests share two cores), the daemons' own heartbeats (generation on a loaded CPU)."""
    with LocalStack(heartbeats=None, env={"WORKER_THREADS": "1", "OMP_NUM_THREADS": "1"}) as stack:
        stack.start_broker()
        stack.start_worker("smol", device="cpu", max_sessions=4, max_context=2048)
        stack.wait_for_workers({"smol"}, timeout=300)
        yield stack
