"""The processes under fuzz: a broker and a random:tiny worker with a good session on it, and a second worker behind
a ROUTER of ours; the checks that need them all (alive, good session, accounting, workers listed)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from client.stack import Daemon

from ..integration.cluster import Cluster, free_port
from ..integration.cluster import Daemon as TestDaemon
from .checks import ANSWER_WAIT_S, GoodSession
from .strategies import Known

if TYPE_CHECKING:
    from .targets import Target

HEARTBEAT_MS = 100
SILENCE_MS = 1000


class FuzzStack:
    """A broker and a random:tiny worker on the CPU (the client and worker socket targets), a good session on that
    worker, and a second worker connected to a ROUTER of ours (the worker link target). `close()` stops them all."""

    MODEL = "random:tiny"
    MODEL_NAME = "random-tiny"
    VOCAB = 512
    MAX_SESSIONS = 64
    MAX_CONTEXT = 256

    def __init__(self, tmp: Path) -> None:
        self.cluster = Cluster(tmp, heartbeat_ms=HEARTBEAT_MS)
        self.worker_name = "w1"
        self.lone_name = "lone"
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.lone_router: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.lone_router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.lone_router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.lone_router.setsockopt(zmq.LINGER, 0)
        self.lone_port = free_port()
        self.lone_router.bind(f"tcp://127.0.0.1:{self.lone_port}")
        self.good = GoodSession(self.cluster.clients)
        self.lone: Daemon
        try:
            # Fakes that fall silent (the fuzzer stops sending while it checks) are given up after a second, so that
            # a create placed on one is placed again and answered within a checkpoint.
            self.cluster.start_broker(["--worker-silence-ms", str(SILENCE_MS)])
            self.cluster.start_worker(self.worker_name, model=self.MODEL, max_sessions=self.MAX_SESSIONS,
                                      max_context=self.MAX_CONTEXT)
            self.lone = TestDaemon(
                "worker.cli",
                ["--broker", f"tcp://127.0.0.1:{self.lone_port}", "--model", self.MODEL, "--device", "cpu",
                 "--name", self.lone_name, "--max-sessions", str(self.MAX_SESSIONS), "--max-context",
                 str(self.MAX_CONTEXT), "--reconnect-max-ms", "200"],
                tmp / "worker-lone.log",
            )
            self.cluster.wait_for_workers({self.worker_name})
            self.good.start()
        except BaseException:
            self.close()
            raise

    def known(self) -> Known:
        return Known(self.MODEL_NAME, self.VOCAB, [uuid.uuid4().hex], names=[self.worker_name])

    def daemons(self) -> list[Daemon]:
        assert self.cluster.broker is not None
        return [self.cluster.broker, *self.cluster.workers.values()]

    def check_alive(self, target: Target) -> None:
        dead = [d for d in self.daemons() if not d.alive]
        if dead:
            raise target.fail(f"a process died: {[d.log.name for d in dead]}", self.daemons())

    def check_good(self, target: Target) -> None:
        """The good session made at least one more round since the last check, every one of them right."""
        rounds = self.good.wait_rounds()
        target.report.good_rounds = rounds
        if self.good.errors:
            raise target.fail(f"the good session was disturbed: {self.good.errors[:3]}", self.daemons())

    def status(self) -> list[Any]:
        with self.cluster.client(timeout=5.0) as c:
            return c.status()

    def check_accounting(self, target: Target) -> None:
        """With nothing in flight, the broker counts exactly the sessions that exist: the good one alone."""
        deadline = time.monotonic() + ANSWER_WAIT_S
        while True:
            workers = self.status()
            mine = [w for w in workers if w.name == self.worker_name]
            if mine and mine[0].sessions == 1 and mine[0].free_slots == mine[0].capacity - 1:
                return
            if time.monotonic() > deadline:
                raise target.fail(f"the broker's accounting did not return to baseline (1 session, capacity - 1 free): "
                                  f"{workers}", self.daemons())
            time.sleep(0.05)

    def check_workers(self, target: Target, names: set[str]) -> None:
        try:
            self.cluster.wait_for_workers(names, timeout=ANSWER_WAIT_S)
        except (TimeoutError, RuntimeError) as e:
            raise target.fail(str(e), self.daemons()) from e

    def close(self) -> None:
        self.good.stop()
        self.cluster.close()
        if hasattr(self, "lone"):
            self.lone.close()
        self.lone_router.close(linger=0)
        self.context.term()
