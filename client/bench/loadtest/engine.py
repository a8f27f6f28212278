"""The in-process driver: the same users, run against `worker.engine.Engine` directly (no broker, no sockets).

One loop: advance every user that is ready (create, fork and close are synchronous engine calls; a
turn, prompt and generation, is queued with one `start_generate`), then run one batched `step()` for
all of them and stamp its chunks with the time `step()` returned. So the numbers are the engine's own, and
a full-stack run of the same workload over them is the stack's overhead. As on the full stack, the turn that
opens its session counts its TTFT (and end-to-end latency) from the session's create. A run stopped early
(interrupt.py) cancels its generations in flight and closes its sessions; it looks at the stop request between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from client.bench.loadtest.interrupt import StopFlag
from client.bench.loadtest.progress import REFRESH_S, Tally
from client.bench.loadtest.stats import INTERRUPTED, RawRun, RequestSample
from client.bench.loadtest.workload import (
    Budget,
    Close,
    Create,
    Failed,
    Fork,
    Opened,
    Script,
    Turn,
    TurnDone,
    Workload,
    session_opened_at,
    user,
)

if TYPE_CHECKING:
    from worker.engine import Engine

log = structlog.get_logger()


@dataclass
class _Waiting:
    """A user whose turn is generating."""

    script: Script
    sample: RequestSample
    session: str


def _code(e: Exception) -> str:
    return str(getattr(e, "code", "internal"))


class EngineDriver:
    def __init__(self, engine: Engine, raw: RawRun, tally: Tally) -> None:
        from cuda_state.errors import StateError
        from worker.engine.sampling import SamplingParams
        from worker.errors import EngineError

        self.engine = engine
        self.raw = raw
        self.tally = tally
        self._errors: tuple[type[Exception], ...] = (EngineError, StateError)
        self._params = SamplingParams
        self._waiting: dict[str, _Waiting] = {}  # request id -> user
        self._ready: list[tuple[Script, Any, Failed | None]] = []  # users to advance, with what to send them
        self.stopping = False

    def run(self, scripts: list[Script], on_progress: Callable[[], None], stop: StopFlag | None = None) -> None:
        self._ready = [(s, None, None) for s in scripts]
        next_report = time.perf_counter()
        while self._ready or self._waiting:
            if stop is not None and not self.stopping and stop.is_set():
                self.stop()
            ready, self._ready = self._ready, []
            for script, value, error in ready:
                self._advance(script, value, error)
            if self._waiting:
                self._step()
            if time.perf_counter() >= next_report:
                on_progress()
                next_report = time.perf_counter() + REFRESH_S

    def stop(self) -> None:
        """Stop the run (interrupt.py): the generations in flight are cancelled (their final chunks, "cancelled", come
        from the next step) and no action but a close runs any more, so the users close their sessions and end."""
        self.stopping = self.raw.interrupted = True
        for request_id in self._waiting:
            self.engine.cancel(request_id)

    def _step(self) -> None:
        chunks = self.engine.step()
        now = time.perf_counter()
        for chunk in chunks:
            waiting = self._waiting.get(chunk.request_id)
            if waiting is None:
                continue
            sample = waiting.sample
            if chunk.token_ids:
                n = len(chunk.token_ids)
                sample.chunk_times.append(now)
                sample.chunk_tokens.append(n)
                self.tally.output_tokens += n
            if chunk.finish_reason is not None:
                sample.end = now
                del self._waiting[chunk.request_id]
                if chunk.finish_reason == "cancelled":  # only stop() cancels
                    sample.error = INTERRUPTED
                    self._ready.append((waiting.script, None, Failed(INTERRUPTED)))
                    continue
                self.tally.done += 1
                done = TurnDone(self.engine.session_length(waiting.session), sample.prompt_tokens)
                self._ready.append((waiting.script, done, None))

    def _advance(self, script: Script, value: Any, error: Failed | None) -> None:
        """Run the user's synchronous actions until it waits on a generation or ends."""
        created: tuple[str, float] | None = None  # the session just created, and when (workload.session_opened_at)
        while True:
            try:
                action = script.throw(error) if error is not None else script.send(value)
            except StopIteration:
                return
            value, error = None, None
            opened, created = session_opened_at(created, action), None
            if self.stopping and not isinstance(action, Close):
                error = Failed(INTERRUPTED)  # not run
                continue
            try:
                if isinstance(action, Turn):
                    self._start_turn(script, action, opened)
                    return
                start = time.perf_counter()
                value = self._op(action, start)
                if isinstance(action, Create):
                    created = (value.session, start)
            except Failed as e:
                error = e

    def _start_turn(self, script: Script, turn: Turn, opened_at: float | None = None) -> None:
        """`opened_at`: the turn opened its session, whose create began then: its TTFT counts from there."""
        sample = RequestSample.begun(time.perf_counter(), turn.forked, opened_at)
        self.raw.requests.append(sample)
        session: str = turn.session
        try:
            before = self.engine.session_length(session)
            p = turn.params
            params = self._params(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=p.ignore_eos)
            request_id = self.engine.start_generate(session, params, prompt_ids=turn.prompt.token_ids,
                                                    prompt=turn.prompt.text)
            sample.prompt_tokens = self.engine.session_length(session) - before
        except self._errors as e:
            sample.end = time.perf_counter()
            sample.error = _code(e)
            self.tally.failed += 1
            raise Failed(sample.error) from e
        self._waiting[request_id] = _Waiting(script, sample, session)

    def _op(self, action: Create | Fork | Close, start: float) -> Any:
        kind = type(action).__name__.lower()
        try:
            result: Any
            if isinstance(action, Create):
                result = Opened(self.engine.create_session(), self.engine.max_context)
            elif isinstance(action, Fork):
                result = Opened(self.engine.fork(action.session), self.engine.max_context)
            else:
                self.engine.close(action.session)
                result = None
        except self._errors as e:
            self.raw.op_failed(kind, _code(e))
            raise Failed(_code(e)) from e
        self.raw.op(kind, time.perf_counter() - start)
        return result


def load_engine(model: str | None, device: str, max_sessions: int, max_context: int) -> Engine:
    from worker.engine import Engine

    return Engine.load(model=model, device=device, max_sessions=max_sessions, max_context=max_context)


def run_in_process(
    engine: Engine, workload: Workload, sessions: int, budget: Budget, tally: Tally, on_progress: Callable[[], None],
    stop: StopFlag | None = None,
) -> RawRun:
    """Drive `sessions` users against the engine until the budget is spent (or `stop` is set) and every session is
    closed."""
    raw = RawRun(start=time.perf_counter())
    budget.begin(raw.start)
    scripts = [user(i, workload, budget, raw.counts) for i in range(sessions)]
    EngineDriver(engine, raw, tally).run(scripts, on_progress, stop)
    raw.finish = time.perf_counter()
    log.debug("in_process_run_done", requests=len(raw.requests), steps=engine.steps)
    return raw
