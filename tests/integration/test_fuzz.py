"""Protocol fuzz on real daemons, a CI-sized sample: hypothesis draws mutated and random messages for the broker's
client socket, its worker socket (fake workers, and hostile peers) and a worker's own link, while a good session
checks that nothing it relies on moved. tests/fuzz/ holds the strategies, the targets and the checks;
`python tests/fuzz_stack.py --cases 10000` runs long.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..fuzz.run import drive
from ..fuzz.stack import FuzzStack
from ..fuzz.targets import ClientSocket, HostilePeers, WorkerLink, WorkerSocket

pytestmark = pytest.mark.slow  # about 30 s for the module (400 cases per target)

CASES = 400  # per target
BATCH = 50  # cases between checkpoints
SEED = 20_261_121  # CI runs the same cases every time; fuzz_stack.py draws new ones


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzStack]:
    """A broker with a random:tiny worker, a good session on it, and a second worker behind a fake broker."""
    stack = FuzzStack(tmp_path_factory.mktemp("fuzz"))
    try:
        yield stack
    finally:
        stack.close()


def test_the_broker_client_socket_answers_every_broken_request_with_its_error(stack: FuzzStack) -> None:
    # Fired, checked and finished: the broker's session accounting is back to the good session alone.
    report = drive(ClientSocket(stack, BATCH), CASES, SEED)
    assert (report.cases, report.checkpoints) == (CASES, CASES // BATCH)
    assert report.good_rounds >= CASES // BATCH
    assert {"bad_request", "version_mismatch", "session_not_found"} <= set(report.errors_by_code())
    assert report.answers["REPLY:created"] > 0  # valid requests ran too


def test_the_broker_worker_socket_survives_fake_workers(stack: FuzzStack) -> None:
    # Fired, checked and finished: once the fakes are silent the broker lists the real worker alone.
    report = drive(WorkerSocket(stack, BATCH), CASES, SEED)
    assert (report.cases, report.checkpoints) == (CASES, CASES // BATCH)
    assert report.good_rounds >= CASES // BATCH
    assert report.answers["WELCOME"] > 0 and report.answers["forwarded"] > 0
    # The bystander's creates, one in flight per batch and one more: on the real worker, or lost with a fake.
    bystander = {k.split(" ", 1)[1]: n for k, n in report.answers.items() if k.startswith("bystander ")}
    assert set(bystander) <= {"REPLY:created", "REPLY:closed", "ERROR:session_lost"}
    assert bystander.get("REPLY:created", 0) + bystander.get("ERROR:session_lost", 0) == CASES // BATCH + 1
    assert bystander.get("REPLY:closed", 0) == bystander.get("REPLY:created", 0)


def test_the_broker_worker_socket_survives_hostile_peers(stack: FuzzStack) -> None:
    # Strangers' answers never forwarded, their oversized READYs refused, a registered fake's bad FANOUT parts harmless.
    report = drive(HostilePeers(stack, BATCH), CASES, SEED)
    assert (report.cases, report.checkpoints) == (CASES, CASES // BATCH)
    assert report.good_rounds >= CASES // BATCH
    assert report.answers["forwarded"] > 0 and report.answers["RECONNECT"] > 0
    assert report.answers["READY refused"] > 0  # with their reason, each (or over the peer's rate)
    assert all(d.alive for d in stack.daemons())


def test_a_worker_survives_a_broker_that_sends_garbage(stack: FuzzStack) -> None:
    # Fired, checked and finished: the good session on it is as it was.
    report = drive(WorkerLink(stack, BATCH), CASES, SEED)
    assert (report.cases, report.checkpoints, report.good_rounds) == (CASES, CASES // BATCH, CASES // BATCH)
    assert {"bad_request", "session_not_found"} <= set(report.errors_by_code())
    assert report.answers["HEARTBEAT"] > 0 and report.answers["REPLY:generated"] > 0
    assert stack.lone.alive and all(d.alive for d in stack.daemons())
