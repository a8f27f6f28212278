"""The full-stack driver: users run as asyncio tasks on one AsyncClient, in one or several client processes.

One Python process cannot consume tens of thousands of streamed tokens/s, so `processes > 1` splits the
users over that many processes (multiprocessing, spawn). They start on one signal and one clock
(`time.perf_counter()` is CLOCK_MONOTONIC, shared by every process on the host); each sends its running
totals for the progress bar while it runs and its raw samples at the end, merged by the parent. A run stopped
early (interrupt.py) cuts its turns in flight short, closes its sessions and sends its samples all the same.
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing as mp
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

import structlog

from client.aio import AsyncClient, AsyncSession, AsyncStream
from client.bench.loadtest.interrupt import StopFlag, sigint_ignored
from client.bench.loadtest.progress import REFRESH_S, Tally
from client.bench.loadtest.stats import INTERRUPTED, RawRun, RequestSample, merge
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
from client.errors import ClientError

log = structlog.get_logger()

START_TIMEOUT_S = 120.0  # for a client process to start (import) and say it is ready
JOIN_TIMEOUT_S = 30.0


class LoadTestError(RuntimeError):
    """The run could not be carried out (no broker, a client process failed, the model did not load): see the message."""


@dataclass(frozen=True)
class Part:
    """What one client process runs: users [first, first + count) of the whole run, and its share of requests."""

    address: str
    model: str | None
    timeout: float
    workload: Workload
    first: int
    count: int
    requests: int | None
    duration: float | None
    broker_key: str | None = None  # CURVE: the broker's public key file and this client's key pair file
    key: str | None = None
    http: str | None = None  # the gateway's URL: the users go through its OpenAI API instead (client.bench.loadtest.http)
    api_key: str | None = None  # the gateway's API key


def request_shares(requests: int, users: Sequence[int]) -> list[int]:
    """`requests` shared in proportion to each part's users, exactly (a part of 2 users of 3 gets 2/3 of them: an
    even split would leave the default length, each user's one conversation, short by the part with more users)."""
    total = sum(users)
    shares, first = [], 0
    for count in users:
        shares.append(requests * (first + count) // total - requests * first // total)
        first += count
    return shares


def split(address: str, model: str | None, timeout: float, workload: Workload, sessions: int, processes: int,
          requests: int | None, duration: float | None, broker_key: str | None = None,
          key: str | None = None, http: str | None = None, api_key: str | None = None) -> list[Part]:
    """Users shared as evenly as possible (the first parts get the remainders), requests in proportion to them."""
    processes = max(1, min(processes, sessions))
    counts = [sessions // processes + (i < sessions % processes) for i in range(processes)]
    shares: list[int | None] = [None] * processes if requests is None else list(request_shares(requests, counts))
    parts = []
    first = 0
    for count, share in zip(counts, shares, strict=True):
        parts.append(Part(address, model, timeout, workload, first, count, share, duration, broker_key, key, http, api_key))
        first += count
    return parts


# -- one process --------------------------------------------------------------------------------


class StackDriver:
    """Executes users' actions through the client library and times them."""

    def __init__(self, client: AsyncClient, model: str | None, raw: RawRun, tally: Tally) -> None:
        self.client = client
        self.model = model
        self.raw = raw
        self.tally = tally
        self.closing: set[asyncio.Task[None]] = set()  # closes sent and not answered yet
        self.streams: set[AsyncStream] = set()  # the turns in flight
        self.stopping = False

    def stop(self) -> None:
        """Stop the run (interrupt.py): the turns in flight are cut short (their streams closed, which cancels their
        generations) and no action but a close is sent any more, so the users close their sessions and end."""
        if self.stopping:
            return
        self.stopping = self.raw.interrupted = True
        for stream in list(self.streams):
            stream.close()

    async def settle(self) -> None:
        """Wait for the closes still on their way (before the client goes)."""
        while self.closing:
            await asyncio.wait(list(self.closing))

    async def run_user(self, script: Script) -> None:
        value: Any = None
        error: Failed | None = None
        created: tuple[AsyncSession, float] | None = None  # the session just created, and when (workload.session_opened_at)
        while True:
            try:
                action = script.throw(error) if error is not None else script.send(value)
            except StopIteration:
                return
            value, error = None, None
            opened, created = session_opened_at(created, action), None
            if self.stopping and not isinstance(action, Close):
                error = Failed(INTERRUPTED)  # not sent
                continue
            try:
                if isinstance(action, Turn):
                    value = await self._turn(action, opened)
                else:
                    start = time.perf_counter()
                    value = await self._op(action, start)
                    if isinstance(action, Create) and value is not None:
                        created = (value.session, start)
            except Failed as e:
                error = e

    async def _turn(self, turn: Turn, opened_at: float | None = None) -> TurnDone:
        session: AsyncSession = turn.session
        sample = RequestSample.begun(time.perf_counter(), turn.forked, opened_at)
        self.raw.requests.append(sample)
        p = turn.params
        stream: AsyncStream | None = None
        try:
            stream = await session.generate(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                                            ignore_eos=p.ignore_eos, stream=True, prompt=turn.prompt.text,
                                            prompt_ids=turn.prompt.token_ids)
            self.streams.add(stream)
            async for chunk in stream:
                if chunk.token_ids:
                    n = len(chunk.token_ids)
                    sample.chunk_times.append(time.perf_counter())
                    sample.chunk_tokens.append(n)
                    self.tally.output_tokens += n
        except ClientError as e:
            sample.end = time.perf_counter()
            if self.stopping:  # its stream was closed under it
                sample.error = INTERRUPTED
                raise Failed(INTERRUPTED) from e
            sample.error = e.code
            self.tally.failed += 1
            raise Failed(e.code) from e
        finally:
            if stream is not None:
                self.streams.discard(stream)
        sample.end = time.perf_counter()
        assert stream is not None
        result = stream.result
        if result is None and self.stopping:  # closed between two chunks: the iteration ended without its answer
            sample.error = INTERRUPTED
            raise Failed(INTERRUPTED)
        self.tally.done += 1
        if result is None:  # a stream always ends with its final answer; keep going without it
            return TurnDone(turn.length + sample.output_tokens, 0)
        sample.prompt_tokens = result.appended
        return TurnDone(result.session_length, result.appended)

    async def _op(self, action: Create | Fork | Close, start: float) -> Opened | None:
        kind = type(action).__name__.lower()
        try:
            result: Opened | None = None
            if isinstance(action, Create):
                session = await self.client.session(self.model)
                result = Opened(session, session.max_context)
            elif isinstance(action, Fork):
                child = await action.session.fork()
                result = Opened(child, child.max_context)
            else:
                # A user does not wait for a close to open its next session (see AsyncSession.close_soon); the
                # close is timed when its answer comes.
                task = action.session.close_soon()
                self.closing.add(task)
                task.add_done_callback(lambda done: self._closed(done, start))
                return None
        except ClientError as e:
            self.raw.op_failed(kind, e.code)
            raise Failed(e.code) from e
        self.raw.op(kind, time.perf_counter() - start)
        return result

    def _closed(self, task: asyncio.Task[None], start: float) -> None:
        self.closing.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            self.raw.op("close", time.perf_counter() - start)
        elif isinstance(error, ClientError):
            self.raw.op_failed("close", error.code)
        else:
            log.error("close_failed", error=repr(error))


async def run_part(part: Part, start: float | None, tally: Tally, on_progress: Callable[[], None],
                   stop: StopFlag | None = None) -> RawRun:
    """Run one part's users to the end of the budget, or until `stop` is set; `start` is the shared start (None:
    now)."""
    if part.http is not None:
        from client.bench.loadtest.http import run_http_part

        return await run_http_part(part.http, part.model, part.api_key, part.timeout, part.workload, part.first,
                                   part.count, part.requests, part.duration, start, tally, on_progress, stop)
    raw = RawRun(start=time.perf_counter() if start is None else start)
    budget = Budget(part.requests, part.duration)
    budget.begin(raw.start)
    scripts = [user(i, part.workload, budget, raw.counts) for i in range(part.first, part.first + part.count)]
    async with AsyncClient(part.address, timeout=part.timeout, broker_key=part.broker_key, key=part.key) as client:
        driver = StackDriver(client, part.model, raw, tally)
        ticker = asyncio.create_task(tick(on_progress, stop, driver.stop))
        try:
            await asyncio.gather(*(driver.run_user(s) for s in scripts))
            await driver.settle()
        finally:
            ticker.cancel()
    raw.finish = time.perf_counter()
    return raw


async def tick(on_progress: Callable[[], None], stop: StopFlag | None, on_stop: Callable[[], None]) -> None:
    """Every REFRESH_S: `on_stop()` once `stop` is set (at once when it is set already), and `on_progress()`."""
    while True:
        if stop is not None and stop.is_set():
            on_stop()
            stop = None
        await asyncio.sleep(REFRESH_S)
        on_progress()


# -- several processes --------------------------------------------------------------------------


def run_processes(parts: list[Part], tally: Tally, on_start: Callable[[], None], on_progress: Callable[[], None],
                  log_level: str = "warning", stop: StopFlag | None = None) -> RawRun:
    """Run each part in its own client process (one part: in this one); `tally` is kept as the sum of theirs.
    `stop`: set, the run stops early (interrupt.py)."""
    if len(parts) == 1:
        on_start()
        return asyncio.run(run_part(parts[0], None, tally, on_progress, stop))
    return merge(run_each(parts, tally, on_start, on_progress, log_level, stop))


def run_each(parts: list[Part], tally: Tally, on_start: Callable[[], None], on_progress: Callable[[], None],
             log_level: str = "warning", stop: StopFlag | None = None) -> list[RawRun]:
    """Run each part in its own client process, all starting on one signal: each part's run, in order. The
    processes ignore SIGINT: once `stop` is set, they are told to stop through a shared Event, and send their
    figures as at the end of a run."""
    ctx = mp.get_context("spawn")
    messages: Queue[tuple[str, int, Any]] = ctx.Queue()
    go, halt = ctx.Event(), ctx.Event()
    start = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_child, args=(i, part, messages, go, halt, start, log_level), name=f"loadtest-{i}",
                         daemon=True)
             for i, part in enumerate(parts)]
    with sigint_ignored():  # from their first instruction (a Ctrl-C while they import would end them)
        for proc in procs:
            proc.start()
    try:
        return _collect(procs, messages, go, halt, start, tally, on_start, on_progress, stop)
    except BaseException:
        for proc in procs:  # the run is over: stop the others now
            if proc.is_alive():
                proc.terminate()
        raise
    finally:
        for proc in procs:
            proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _collect(procs: Sequence[BaseProcess], messages: Queue[tuple[str, int, Any]], go: Event, halt: Event,
             start: Synchronized[float], tally: Tally, on_start: Callable[[], None], on_progress: Callable[[], None],
             stop: StopFlag | None) -> list[RawRun]:
    ready: set[int] = set()
    tallies: dict[int, Tally] = {}
    runs: dict[int, RawRun] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(runs) < len(procs):
        if stop is not None and not halt.is_set() and stop.is_set():
            halt.set()
            if not go.is_set():  # not all started yet: they start stopped, and end at once
                start.value = time.perf_counter()
                go.set()
        try:
            kind, index, payload = messages.get(timeout=REFRESH_S)
        except queue.Empty:
            _check_alive(procs, runs)
            if len(ready) < len(procs) and time.monotonic() > deadline:
                raise LoadTestError(f"client processes did not start within {START_TIMEOUT_S:g} s") from None
            continue
        if kind == "failed":
            raise LoadTestError(f"client process {index} failed:\n{payload}")
        if kind == "ready":
            ready.add(index)
            if len(ready) == len(procs) and not go.is_set():
                start.value = time.perf_counter()
                go.set()
                on_start()
        elif kind == "progress":
            tallies[index] = payload
        elif kind == "done":
            runs[index], tallies[index] = payload
        _sum(tally, tallies.values())
        on_progress()
    return [runs[i] for i in sorted(runs)]


def _sum(tally: Tally, parts: Iterable[Tally]) -> None:
    tally.done = tally.failed = tally.output_tokens = 0
    for part in parts:
        tally.add(part)


def _check_alive(procs: Sequence[BaseProcess], runs: dict[int, RawRun]) -> None:
    for i, proc in enumerate(procs):
        if i not in runs and proc.exitcode is not None:
            raise LoadTestError(f"client process {i} exited with code {proc.exitcode} before sending its results")


def _child(index: int, part: Part, messages: Queue[tuple[str, int, Any]], go: Event, halt: Event,
           start: Synchronized[float], log_level: str) -> None:
    """A client process: its own structlog set-up, then its part of the run on the parent's signal, until its end or
    until the parent sets `halt`. SIGINT is ignored (the parent started it so); SIGTERM ends it at once."""
    from broker.common import heap, logs

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (ignored already when the parent ran in its main thread)
    logs.configure(log_level, role="loadtest", process=index)
    heap.settle()  # imports done: no full collection walks them again during the run
    try:
        messages.put(("ready", index, None))
        if not go.wait(timeout=START_TIMEOUT_S):
            return
        tally = Tally()
        raw = asyncio.run(run_part(part, start.value, tally, lambda: messages.put(("progress", index, copy.copy(tally))),
                                   halt))
        messages.put(("done", index, (raw, tally)))
    except BaseException:
        messages.put(("failed", index, traceback.format_exc()))
        raise
