"""The worker's compute loop: take requests, run a step, send its answers; the one thread that owns the engine.

    broker <-DEALER-> Link (worker.serve.link): requests --> Serve.run: Dispatch.handle  --> engine calls
                                                answers  <--           engine.step()     --> Dispatch.step_answers

- `Serve.run` loops: take the requests that are there (waiting for them only while the engine is idle), hand
  each to `Dispatch` (worker.serve.dispatch) and send its answer at once, run one `engine.step()` while there
  is work, and send the step's FANOUT (streamed chunks for every client route) and final answers. Requests are
  applied between steps, never inside one.
- A step that computes prompt tokens runs for milliseconds on a GPU (a turnover: sessions closing, opening and
  sending prompts): the loop then calls `engine.step(wait=False)`, which launches what it can and returns
  without reading until the device is done, and the loop takes the requests that come meanwhile in slices of
  PREFILL_WAIT_SLICE_S. They queue their device work behind the running steps instead of waiting for them.
- Sessions idle longer than `session_idle_timeout_s` (no request, no generation) are closed; the broker
  hears of it in the next HEARTBEAT (`expired`), and a later request gets `session_expired`.
- Sessions idle longer than `hibernate_after_s` hibernate (worker.engine.hibernation): their state goes to host
  memory or the session store and their pages are released; their next request brings them back.
- A request the link did not queue (its backlog of requests past worker.serve.link.MAX_INBOX_BYTES) comes as its
  address, config.Unqueued, in its turn: `Dispatch.unqueued` answers it `overloaded`, or as the resend of a
  request the worker has that it may be.
- A long text is tokenized on a thread of its own (worker.serve.dispatch): the loop takes the request's ids when
  they are there (`Dispatch.completed`, woken by the link), and afterwards gives the C heap's free memory back to
  the system (a 4M-character text's tokenization takes hundreds of MB for a moment).
- SIGTERM/SIGINT: drain. New sessions and generations get worker_draining (the broker stops placing
  here when the next heartbeat says so), generations in flight finish; with a session store every session is
  written there (a worker started with the same store serves them again); then DISCONNECT and exit.
  A second signal, or the drain timeout, cancels what is still running.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import structlog

from broker.common import heap
from broker.common import protocol as p
from broker.common.metrics_http import Pulse
from worker.serve.config import Unqueued, WorkerConfig, WorkerState
from worker.serve.dispatch import Active, Dispatch, EngineAPI
from worker.serve.link import BUSY_WAIT_S, Link, Received
from worker.serve.metrics import NoMetrics, WorkerMetrics, WorkerSnapshot, torch_memory
from worker.serve.moves import Moves

__all__ = ["Active", "Serve", "WorkerConfig"]

log = structlog.get_logger()

IDLE_WAIT_S = 0.05  # how long the compute loop waits for a request when the engine is idle
# While a step with prompt tokens runs, the compute loop waits for requests in slices this long, then looks whether
# the step is done: requests are taken within about this, instead of queueing behind a step of several milliseconds.
PREFILL_WAIT_SLICE_S = 1e-4
# The loop stays busy this long after its last step or request, waiting BUSY_WAIT_S at a time: 64 sessions turning over
# at once leave the engine without work for ~10 ms while their closes and creates come, and handed over by the link
# thread each of those cost the loop ~150 us (H100) against ~60 us read by the loop itself.
BUSY_LINGER_S = 0.25
SLOT_KEEP_S = 2.0  # a closed session's slot stays mapped this long for a new session, then is released
COUNT_REFRESH_S = 0.25  # how often free slots and where sessions are is read again for the heartbeat and metrics
MAX_STEP_FAILURES = 3  # consecutive failed engine steps before the worker gives up and leaves
TRIM_AFTER_CHARS = 1 << 18  # characters tokenized off the loop after which the heap is trimmed, once none is left


class Serve:
    def __init__(self, engine: EngineAPI, config: WorkerConfig, sampling: Callable[[p.Sampling], Any]) -> None:
        self.engine = engine
        self.config = config
        self.draining = False
        self._drain_deadline = float("inf")
        self._step_failures = 0
        self._busy_at = -BUSY_LINGER_S  # monotonic() when the loop last had work or requests
        self.steps = 0  # engine steps read: the progress the broker watches for
        self._next_expiry_check = float("inf") if config.session_idle_timeout_s <= 0 else 0.0
        self._next_slot_release = 0.0
        self._next_hibernation = float("inf") if config.hibernate_after_s <= 0 else 0.0
        self._residency_now = (0, 0, 0)  # sessions resident / in host memory / on disk, for the metrics thread
        self._next_count = 0.0
        self.state = WorkerState(engine.free_slots, tuple(engine.sessions()))
        self.link = Link(config, self.ready_message, lambda: self.state, lambda: self.steps)
        self.pulse = Pulse()  # /healthz: run() beats it every turn
        self.metrics: WorkerMetrics | NoMetrics = NoMetrics()
        if config.metrics:
            self.metrics = WorkerMetrics(self.metrics_snapshot, worker=config.name, model=engine.model_name,
                                         device=engine.device, max_context=engine.max_context,
                                         memory=torch_memory(engine.device))
        self.dispatch = Dispatch(engine, config, sampling, self.metrics)
        self.dispatch.on_tokenized = self.link.wake_loop
        self.dispatch.adopt_sessions()
        self.moves = Moves(engine, self.dispatch, lambda: self.link.broker_id, config.test_move_pause,
                           config.test_corrupt_moves)
        self.evacuating = False  # draining, and the broker is moving its sessions to other workers
        self._announce = False  # a heartbeat to send now (the drain began)
        if isinstance(self.metrics, WorkerMetrics) and hasattr(engine, "on_restore"):
            engine.on_restore = self.metrics.restored
        self.state = WorkerState(engine.free_slots, tuple(engine.sessions()), False,
                                 tuple(self.dispatch.owners.get(sid, "") for sid in engine.sessions()))

    def metrics_snapshot(self) -> WorkerSnapshot:
        """Read on the metrics thread: only values this loop replaces whole."""
        state = self.state
        table = getattr(self.engine, "table", None)  # the real engine's session table (not the test fakes)
        if table is None:
            return WorkerSnapshot(sessions=len(state.sessions), capacity=self.engine.capacity,
                                  free_slots=state.free_slots, running=len(self.dispatch.active),
                                  bytes_per_session=self.engine.bytes_per_session, draining=state.draining)
        resident, in_host, on_disk = self._residency
        return WorkerSnapshot(sessions=len(state.sessions), capacity=self.engine.capacity, free_slots=state.free_slots,
                              running=len(self.dispatch.active), bytes_per_session=self.engine.bytes_per_session,
                              draining=state.draining, mapped_bytes=table.backend.mapped_bytes(),
                              resident=resident, in_host=in_host, on_disk=on_disk, pages=table.backend.mapped_pages,
                              page_budget=table.page_budget, hibernated=getattr(self.engine, "hibernated", 0),
                              moves=self.moves.counts.as_dict() if self.moves.supported else None,
                              checkpoints=None if (cps := getattr(self.engine, "checkpoints", None)) is None
                              else (len(cps), cps.taken, cps.used, cps.restored))

    def ready_message(self) -> p.Ready:
        """On the link thread: the state the loop replaced last, and each session's latest client (single dict reads)."""
        state = self.state
        routes = self.dispatch.routes
        return p.Ready(
            name=self.config.name, model=self.engine.model_name, capacity=self.engine.capacity,
            free_slots=state.free_slots, max_context=self.engine.max_context, sessions=state.sessions,
            draining=state.draining, device=self.engine.device, bytes_per_session=self.engine.bytes_per_session,
            owners=state.owners, holders=tuple(routes.get(sid, b"") for sid in state.sessions),
            evacuate=state.evacuate, checkpoints=getattr(self.engine, "checkpoints", None) is not None,
            sampling_extras=getattr(self.engine, "sampling_extras", False),
            sampling_defaults=self.config.sampling_defaults, tools=True,
        )

    def drain(self) -> None:
        """Stop taking new work; a second call cancels what is still running.

        With a broker to ask, the sessions first move to the other workers of the model that have room (the
        worker serves them until they move, and takes no new session): the heartbeat says `evacuate` until the broker
        answers EVACUATED. Then (or at once, with no broker) the drain goes on as before: new generations are refused,
        those in flight finish, the sessions left are written to the store (if any)."""
        if self.draining:
            self._drain_deadline = 0.0
            return
        self.draining = True
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        if self.moves.supported and self.link.registered.is_set() and self.engine.sessions():
            self.evacuating = self.dispatch.evacuating = True
            self._refresh_state()
            self._announce = True  # the loop says so at once (a signal handler must not take the link's lock)
            log.info("worker_draining", generations=len(self.dispatch.active), sessions=len(self.state.sessions),
                     moving_sessions=True)
            return
        self.dispatch.draining = True
        self._refresh_state()
        log.info("worker_draining", generations=len(self.dispatch.active))

    def _evacuation_over(self, now: float) -> None:
        """The broker moved what it could (EVACUATED), the broker is silent, or the drain timed out: drain the rest."""
        evacuated = self.moves.evacuated
        if evacuated is None and now < self._drain_deadline and self.link.registered.is_set():
            return
        self.evacuating = self.dispatch.evacuating = False
        self.dispatch.draining = True
        self._refresh_state()
        log.info("worker_evacuation_over", moved=evacuated.moved if evacuated else 0,
                 kept=len(self.state.sessions), answered=evacuated is not None)

    def run(self) -> int:
        """Serve until drained. Returns the process exit code."""
        self.link.start()
        try:
            while not (self.draining and not self.evacuating and not self.engine.has_work()
                       and not self.dispatch.tokenizing):
                if not self.link.alive:
                    log.error("worker_link_died")
                    return 1
                self.pulse.beat()
                self._admit(self.link.receive(self._wait_s(time.monotonic())))
                if self.dispatch.tokenizing:
                    self._admit_tokenized()
                self.moves.check_broker()
                if self.moves.exports or self.moves.imports:
                    self._move_step(self.moves.poll)
                now = time.monotonic()
                if self.evacuating:
                    if self._announce:
                        self._announce = False
                        self.link.send([self.state.heartbeat(self.steps)])  # not a heartbeat interval later
                    self._evacuation_over(now)
                if self.draining and now >= self._drain_deadline:
                    self.dispatch.cancel_all()
                    self._drain_deadline = float("inf")
                if now >= self._next_expiry_check:
                    self._expire_idle(now)
                if now >= self._next_slot_release:
                    self._release_slots(now)
                if now >= self._next_hibernation:
                    self._hibernate_idle(now)
                if now >= self._next_count:
                    self._refresh_counts(now)
                if self.engine.has_work() and not self._step():
                    self.link.stop("engine failed", refuse=p.ErrorCode.SESSION_LOST)
                    return 1
        except BaseException:
            log.exception("worker_failed")
            self.link.stop("worker failed", refuse=p.ErrorCode.SESSION_LOST)
            raise
        finally:
            self.dispatch.close()
        self._persist()
        log.info("worker_drained")
        self.link.stop("drained")
        return 0

    def _wait_s(self, now: float) -> float:
        """How long the loop may wait for requests now: briefly while a step with prompt tokens runs on the device
        (reading the socket itself), not at all with other work to do, briefly within BUSY_LINGER_S of its last step
        or request, else long (the link thread hands requests over)."""
        if self.engine.has_work():
            self._busy_at = now
            return PREFILL_WAIT_SLICE_S if self.engine.prefill_running else 0.0
        return BUSY_WAIT_S if now - self._busy_at < BUSY_LINGER_S else IDLE_WAIT_S

    # -- requests --

    def _admit(self, requests: list[Received]) -> None:
        """Handle a batch of requests, each answer sent as soon as it is made: the first clients of a burst
        (64 sessions turning over at once) are not held back by the rest of it."""
        if requests:
            self._busy_at = time.monotonic()
        for request in requests:
            if isinstance(request, p.MOVE_TYPES):
                self._move_step(lambda: self.moves.handle(request))  # noqa: B023  (called now)
                continue
            answers = self.dispatch.unqueued(request) if isinstance(request, Unqueued) else self.dispatch.handle(request)
            if answers:
                self.link.send(answers)
        if self.dispatch.sessions_changed:  # once per batch: a burst of creates or closes builds it once, not once each
            self._refresh_state()

    def _admit_tokenized(self) -> None:
        """Run the requests whose long texts are tokenized now (and those their sessions held back); once no
        tokenization is left after a lot of text, give the heap's free memory back."""
        answers = self.dispatch.completed()
        if answers:
            self._busy_at = time.monotonic()
            self.link.send(answers)
        if self.dispatch.sessions_changed:
            self._refresh_state()
        if not self.dispatch.tokenizing and self.dispatch.tokenized_chars >= TRIM_AFTER_CHARS:
            self.dispatch.tokenized_chars = 0
            heap.release_free_memory()

    def _move_step(self, step: Callable[[], list[p.Message]]) -> None:
        """A move's step and what it sends. A fault in it is logged and costs that move only (the broker aborts a move
        that stalls): the worker and its other sessions go on."""
        try:
            messages = step()
        except Exception:  # noqa: BLE001  (a bug in a move must not take the worker's sessions down)
            log.exception("move_step_failed")
            return
        self._send_moves(messages)

    def _send_moves(self, messages: list[p.Message]) -> None:
        """What a move sends (a state and its chunks, reports); the heartbeat's state is refreshed after a session came
        or went."""
        if messages:
            self.link.send(messages)
            if self.dispatch.sessions_changed:
                self._refresh_state()

    # -- steps --

    def _step(self) -> bool:
        """One engine step and its answers. False once the engine has failed too often to go on."""
        t0 = time.perf_counter()
        e = self.engine
        try:
            chunks = e.step(wait=False)
        except Exception:
            self._step_failures += 1
            log.exception("step_failed", failures=self._step_failures, generations=len(self.dispatch.active))
            self.link.send(self.dispatch.fail_all("the engine step failed"))
            return self._step_failures < MAX_STEP_FAILURES
        self._step_failures = 0
        if not (e.last_read or e.last_rows or chunks):
            return True  # a step with prompt tokens is still running: nothing launched, nothing read
        self.steps += 1
        t1 = time.perf_counter()
        messages, new_tokens = self.dispatch.step_answers(chunks, t1)
        self.link.send(messages)
        self.metrics.step(t1, t1 - t0, e.last_rows, e.last_prompt_tokens, new_tokens)
        return True

    # -- timers and state --

    def _expire_idle(self, now: float) -> None:
        """Close the sessions idle longer than the timeout (not generating); tell the broker at once."""
        self._next_expiry_check = now + min(1.0, self.config.session_idle_timeout_s / 4)
        expired = self.dispatch.expire_idle(now)
        if expired:
            self._refresh_state()
            self.link.send([self.state.heartbeat(self.steps, tuple(expired))])

    def _release_slots(self, now: float) -> None:
        """Unmap the slots closed sessions left mapped that no new session took within SLOT_KEEP_S."""
        self._next_slot_release = now + SLOT_KEEP_S / 2
        released = self.engine.release_idle_slots(SLOT_KEEP_S)
        if released:
            log.debug("slots_released", slots=released)

    def _hibernate_idle(self, now: float) -> None:
        """Hibernate the sessions idle longer than hibernate_after_s (their state to host memory or disk)."""
        after = self.config.hibernate_after_s
        self._next_hibernation = now + min(1.0, after / 4)
        hibernate = getattr(self.engine, "hibernate_idle", None)
        if hibernate is not None and hibernate(after):
            self._refresh_state()

    def _persist(self) -> None:
        """A clean stop with a session store: every session is written there, for the next worker to serve."""
        persist = getattr(self.engine, "persist", None)
        if persist is None:
            return
        try:
            stored = persist()
        except Exception:
            log.exception("sessions_not_persisted")
            return
        if stored:
            log.info("sessions_persisted", sessions=stored)

    @property
    def _residency(self) -> tuple[int, int, int]:
        return self._residency_now

    def _refresh_counts(self, now: float) -> None:
        """Free slots move as sessions grow and hibernate, not only as they come and go: the heartbeat's and the
        metrics' numbers are refreshed every COUNT_REFRESH_S."""
        self._next_count = now + COUNT_REFRESH_S
        free = self.engine.free_slots
        if free != self.state.free_slots:
            self.state = dataclasses.replace(self.state, free_slots=free)
        residency = getattr(self.engine, "residency", None)
        if residency is not None:
            self._residency_now = residency()

    def _refresh_state(self) -> None:
        self.dispatch.sessions_changed = False
        sessions = tuple(self.engine.sessions())
        owners = tuple(self.dispatch.owners.get(sid, "") for sid in sessions)
        self.state = WorkerState(self.engine.free_slots, sessions, self.draining, owners, self.evacuating)
        residency = getattr(self.engine, "residency", None)
        if residency is not None:
            self._residency_now = residency()
