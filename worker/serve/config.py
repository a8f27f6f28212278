"""The worker daemon's settings, the state it reports to the broker, and a request its link did not queue."""

from __future__ import annotations

from dataclasses import dataclass

from broker.common import protocol as p
from broker.common.keys import CurveClient


@dataclass(frozen=True)
class WorkerConfig:
    broker: str = "tcp://127.0.0.1:5556"
    name: str = "worker"
    heartbeat_ms: int = 1000  # until the broker's WELCOME says otherwise
    liveness: int = 3
    reconnect_max_ms: int = 500  # ZeroMQ's reconnect backoff ceiling, and READY's resend ceiling
    drain_timeout_s: float = 60.0
    request_cache: int = 4096  # final answers kept for resent requests
    hwm: int = 100_000
    curve: CurveClient | None = None  # the broker's public key and this worker's pair
    session_idle_timeout_s: float = 0.0  # 0: sessions never expire
    metrics: bool = False  # keep Prometheus metrics (for --metrics-port)
    hibernate_after_s: float = 0.0  # idle sessions hibernate after this long (0: only when pages run out)
    # The model's recommended sampling, announced in READY (worker.serve.generation_config)
    sampling_defaults: p.SamplingDefaults = p.SamplingDefaults()
    # Tests of moves only (WORKER_TEST_MOVE_PAUSE=STEP:SECONDS, WORKER_TEST_CORRUPT_MOVES=1, read once by `worker
    # start`): sleep that long at a step of a move (export, release, import), so that a test can kill a process
    # there; flip a byte of every state this worker sends.
    test_move_pause: tuple[str, float] | None = None
    test_corrupt_moves: bool = False


@dataclass(frozen=True)
class WorkerState:
    """What the Link reports; replaced (never mutated) by the compute loop, so reading it needs no lock."""

    free_slots: int
    sessions: tuple[str, ...]
    draining: bool = False
    owners: tuple[str, ...] = ()  # one per session
    evacuate: bool = False  # draining, and waiting for the broker to move its sessions (EVACUATED)

    def heartbeat(self, steps: int, expired: tuple[str, ...] = ()) -> p.Heartbeat:
        return p.Heartbeat(free_slots=self.free_slots, sessions=len(self.sessions), draining=self.draining,
                           steps=steps, expired=expired, evacuate=self.evacuate)


@dataclass(frozen=True, slots=True)
class Unqueued:
    """A request the link read but did not queue, its backlog full (worker.serve.link.MAX_INBOX_BYTES): what answering
    it takes, handed to the compute loop in the request's place, in its order (Dispatch.unqueued answers it)."""

    command: bytes
    request_id: str
    session_id: str  # "" for a request that names none
    route: bytes
    message: str  # why: what the overloaded answer says
