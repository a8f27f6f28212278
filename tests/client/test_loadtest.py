"""The load-test harness: its statistics with exact values, the in-process mode on random:tiny (CPU) with
exact counts, and the full stack (real broker and worker processes, two client processes) through the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.bench.loadtest import LoadConfig, LoadTestError, main, run
from client.bench.loadtest.interrupt import Stop, on_signals
from client.bench.loadtest.progress import Tally, requests_text
from client.bench.loadtest.report import build_report
from client.bench.loadtest.stack import request_shares, split
from client.bench.loadtest.stats import (
    INTERRUPTED,
    RawRun,
    RequestSample,
    Summary,
    e2e,
    itls,
    merge,
    percentile,
    timeline,
    tpot,
    ttft,
)
from client.bench.loadtest.workload import Budget, Close, Create, Failed, Fork, Opened, Turn, TurnDone, Workload, user

from ..integration.cluster import ROOT, Cluster, free_port

# -- statistics -----------------------------------------------------------------------------------


def test_percentiles_interpolate_between_closest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    values = [float(v) for v in range(1, 102)]  # 1..101
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (51.0, 91.0, 100.0)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 101.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_of_a_distribution() -> None:
    s = Summary.of([1.0, 2.0, 3.0, 4.0, 10.0])
    assert (s.count, s.mean, s.p50, s.max) == (5, 4.0, 3.0, 10.0)
    assert s.p90 == pytest.approx(7.6) and s.p99 == pytest.approx(9.76)
    assert s.std == pytest.approx(10**0.5)
    assert Summary.of([]) == Summary(0)
    assert Summary.of([2.0]).flat("ttft") == {"mean_ttft_ms": 2.0, "median_ttft_ms": 2.0, "std_ttft_ms": 0.0,
                                             "p50_ttft_ms": 2.0, "p90_ttft_ms": 2.0, "p99_ttft_ms": 2.0}


def sample(start: float, times: list[float], tokens: list[int], end: float, prompt: int = 4, error: str | None = None) -> RequestSample:
    return RequestSample(start=start, prompt_tokens=prompt, chunk_times=times, chunk_tokens=tokens, end=end, error=error)


def test_ttft_itl_tpot_e2e_from_known_timestamps() -> None:
    s = sample(10.0, [10.25, 10.5, 11.0, 11.25], [1, 2, 1, 1], end=11.5)
    assert ttft(s) == 0.25
    assert itls(s) == [0.25, 0.5, 0.25]  # one gap per chunk, whatever its token count (vLLM)
    assert s.output_tokens == 5
    assert tpot(s) == (11.5 - 10.25) / 4
    assert e2e(s) == 1.5
    one = sample(0.0, [0.5], [1], end=0.5)
    assert (ttft(one), itls(one), tpot(one)) == (0.5, [], None)
    none = sample(0.0, [], [], end=0.5)
    assert (ttft(none), tpot(none), none.output_tokens) == (None, None, 0)


def test_report_counts_throughput_and_latencies() -> None:
    raw = RawRun(start=100.0, finish=104.5)
    raw.requests = [
        replace(sample(100.0, [100.5, 101.0, 101.5], [1, 1, 2], end=101.5, prompt=8), opened=True),
        sample(101.0, [101.25, 102.25], [1, 1], end=102.25, prompt=8),
        sample(102.0, [], [], end=102.5, prompt=0, error="session_lost"),
        sample(103.0, [103.5], [3], end=104.0, prompt=8, error="timeout"),  # failed after a chunk: not counted
    ]
    raw.op("create", 0.002)
    raw.op("create", 0.004)
    raw.op_failed("create", "capacity_exhausted")
    raw.counts["forks"] = 2
    report = build_report(raw, "full-stack", {"sessions": 2})
    assert (report.completed, report.failed, report.request_errors) == (2, 2, {"session_lost": 1, "timeout": 1})
    assert report.duration_s == 4.0  # start to the end of the last request
    assert (report.total_input_tokens, report.total_output_tokens) == (16, 6)
    assert report.output_tokens_per_s == 1.5 and report.total_tokens_per_s == 5.5 and report.requests_per_s == 0.5
    assert report.ttft_ms == [500.0, 250.0]
    assert report.itl_ms == [500.0, 500.0, 1000.0]
    assert report.tpot_ms == pytest.approx([1000.0 / 3, 1000.0])
    assert report.e2el_ms == [1500.0, 1250.0]
    assert report.ttft.mean == 375.0 and report.e2el.p50 == 1375.0
    assert (report.ttft_later.count, report.ttft_later.p50) == (1, 250.0)  # the first opened its session
    assert report.ops["create"].count == 2 and report.ops["create"].mean == pytest.approx(3.0)
    d = report.to_dict()
    assert d["completed"] == 2 and d["errors"] == {"session_lost": 1, "timeout": 1}
    assert d["output_throughput"] == 1.5 and d["mean_ttft_ms"] == 375.0 and d["p99_itl_ms"] == pytest.approx(990.0)
    assert d["session_ops"]["create"]["errors"] == {"capacity_exhausted": 1} and d["counts"] == {"forks": 2}
    assert sum(r["tokens_per_s"] for r in d["output_throughput_over_time"]) * 0.1 == pytest.approx(6)
    json.dumps(d)
    text = report.render()
    assert "Output token throughput (tok/s)" in text and "session_lost 1" in text


def test_a_report_of_a_run_stopped_early_leaves_out_the_requests_it_cut_short() -> None:
    raw = RawRun(start=10.0, finish=13.0, interrupted=True)
    raw.requests = [sample(10.0, [10.5, 11.0], [1, 1], end=11.0),
                    sample(11.0, [], [], end=11.5, error="timeout"),
                    sample(11.0, [11.5, 12.0], [1, 1], end=12.5, error=INTERRUPTED)]  # its tokens count nowhere
    report = build_report(raw, "full-stack", {})
    assert (report.completed, report.failed, report.cut_short, report.request_errors) == (1, 1, 1, {"timeout": 1})
    assert report.interrupted and report.duration_s == 2.5 and report.total_output_tokens == 2
    d = report.to_dict()
    assert (d["interrupted"], d["cut_short"], d["duration"]) == (True, 1, 2.5)
    text = report.render()
    assert "Load test result (full-stack), INTERRUPTED: partial" in text
    assert "Requests cut short (interrupted)" in text and "Benchmark duration until interrupted (s)" in text
    assert merge([raw, RawRun(start=9.0)]).interrupted and not merge([RawRun(start=9.0)]).interrupted
    whole = build_report(RawRun(start=0.0, finish=1.0), "full-stack", {})
    assert not whole.interrupted and "INTERRUPTED" not in whole.render() and "cut short" not in whole.render()


def test_timeline_bins_tokens_by_chunk_time() -> None:
    samples = [sample(0.0, [0.05, 1.55, 3.95], [2, 1, 3], end=3.95)]
    bins = timeline(samples, 0.0, 4.0)  # 4 s in 40 bins of 0.1 s
    assert [t for t, _ in bins] == pytest.approx([0.05 + 0.1 * i for i in range(40)])
    rates = [r for _, r in bins]
    assert (rates[0], rates[15], rates[39]) == pytest.approx((20.0, 10.0, 30.0))
    assert sum(rates) == pytest.approx(60.0)
    long = timeline([sample(0.0, [0.5, 99.5], [7, 9], end=99.5)], 0.0, 100.0)  # 1 s bins once runs are long
    assert len(long) == 100 and long[0] == (0.5, 7.0) and long[99] == (99.5, 9.0)
    # The last bin of 40.5 s in 1 s bins is 0.5 s: its 5 tokens are 10 tokens/s (they were shown as 5, at 40.5 s).
    partial = timeline([sample(0.0, [0.5, 40.25], [3, 5], end=40.5)], 0.0, 40.5)
    assert len(partial) == 41 and partial[0] == (0.5, 3.0) and partial[40] == (40.25, 10.0)


def test_merge_joins_runs_of_several_processes() -> None:
    a, b = RawRun(start=5.0, finish=9.0), RawRun(start=4.0, finish=8.0)
    a.requests, b.requests = [sample(6.0, [6.5], [1], 7.0)], [sample(5.0, [5.5], [1], 6.0)]
    a.op("close", 0.1)
    b.op("close", 0.2)
    b.op_failed("fork", "capacity_exhausted")
    a.counts["forks"], b.counts["forks"] = 1, 2
    m = merge([a, b])
    assert (m.start, m.finish, [r.start for r in m.requests]) == (4.0, 9.0, [5.0, 6.0])
    assert m.ops["close"] == [0.1, 0.2] and m.op_errors == {"fork": Counter({"capacity_exhausted": 1})}
    assert m.counts == Counter({"forks": 3})


# -- the workload script --------------------------------------------------------------------------


def workload(**changes: object) -> Workload:
    base: dict[str, object] = dict(prompt_tokens=4, max_tokens=2, turns=3, fork_every=0, max_context=100, prompt_kind="tokens",
                                   temperature=0.0, ignore_eos=True, seed=1, vocab_size=50)
    return Workload(**{**base, **changes})  # type: ignore[arg-type]


def play(w: Workload, budget: Budget, fail_at: frozenset[int] = frozenset()) -> tuple[list[str], Counter[str]]:
    """Run one user against a fake driver; returns the actions it took (the turns at log positions `fail_at` fail)."""
    counts: Counter[str] = Counter()
    script = user(0, w, budget, counts)
    log: list[str] = []
    lengths: dict[int, int] = {}
    value: object = None
    error: Failed | None = None
    handles = iter(range(100))
    while True:
        try:
            action = script.throw(error) if error else script.send(value)
        except StopIteration:
            return log, counts
        value, error = None, None
        if isinstance(action, Create):
            h = next(handles)
            lengths[h] = 0
            log.append(f"create {h}")
            value = Opened(h, 0)
        elif isinstance(action, Fork):
            h = next(handles)
            lengths[h] = lengths[action.session]
            log.append(f"fork {action.session}->{h}")
            value = Opened(h, 0)
        elif isinstance(action, Close):
            log.append(f"close {action.session}")
        else:
            assert isinstance(action, Turn) and action.length == lengths[action.session]
            assert action.prompt.token_ids is not None and len(action.prompt.token_ids) == 4
            log.append(f"turn {action.session}")
            if len(log) in fail_at:
                error = Failed("session_lost")
                continue
            lengths[action.session] += 4 + 2
            value = TurnDone(lengths[action.session], 4)


def test_a_user_runs_conversations_of_t_turns_then_closes() -> None:
    log, counts = play(workload(turns=2), Budget(5, None))
    assert log == ["create 0", "turn 0", "turn 0", "close 0", "create 1", "turn 1", "turn 1", "close 1", "create 2", "turn 2",
                   "close 2"]
    assert counts == Counter(sessions_opened=3, conversations_completed=2)


def test_a_user_of_one_conversation_stops_after_it_whatever_the_budget_left() -> None:
    """The default length (one conversation per session): a fast user leaves the rest of the shared count to the
    others instead of opening a second session."""
    budget = Budget(6, None)
    log, counts = play(workload(turns=2, conversations=1), budget)
    assert log == ["create 0", "turn 0", "turn 0", "close 0"]
    assert counts == Counter(sessions_opened=1, conversations_completed=1) and budget.left == 4
    log, counts = play(workload(turns=100, max_context=20, conversations=1), Budget(5, None))  # a rollover is not one
    assert counts["context_rollovers"] == 1 and counts["sessions_opened"] == 2


def test_a_user_forks_every_kth_turn_and_rolls_over_before_the_context_is_full() -> None:
    # 100 tokens of context, 6 per turn: the 17th turn would pass it (16 * 6 + 4 + 2 > 100).
    log, counts = play(workload(turns=100, fork_every=8), Budget(20, None))
    assert log.count("turn 0") == 16 and log.count("turn 3") == 2  # 1 and 2 are the fork children
    assert log[8:12] == ["fork 0->1", "turn 1", "close 1", "turn 0"]  # the 8th turn forks first
    assert log[-5:] == ["close 0", "create 3", "turn 3", "turn 3", "close 3"]
    assert counts == Counter(sessions_opened=2, context_rollovers=1, forks=2)
    assert sum(entry.startswith("turn") for entry in log) == 20


def test_a_failed_turn_closes_the_session_and_opens_another() -> None:
    log, counts = play(workload(turns=5), Budget(3, None), fail_at=frozenset({3}))
    assert log == ["create 0", "turn 0", "turn 0", "close 0", "create 1", "turn 1", "close 1"]
    assert counts == Counter(sessions_opened=2, sessions_reopened_after_error=1)


def test_a_fork_that_finds_its_parent_gone_gives_back_the_parents_ticket() -> None:
    """The parent's turn is not sent when its fork answers session_lost: --requests 3 ran 2 requests (none failed)."""
    budget = Budget(3, None)
    script = user(0, workload(turns=2, fork_every=2), budget, Counter())
    log: list[str] = []
    value: object = None
    error: Failed | None = None
    sessions = iter(range(10))
    while True:
        try:
            action = script.throw(error) if error else script.send(value)
        except StopIteration:
            break
        value, error = None, None
        log.append(type(action).__name__)
        if isinstance(action, Create | Fork):
            if isinstance(action, Fork) and log.count("Fork") == 1:
                error = Failed("session_lost")
            else:
                value = Opened(next(sessions), 0)
        elif isinstance(action, Turn):
            value = TurnDone(action.length + 6, 4)
    assert log == ["Create", "Turn", "Fork", "Close", "Create", "Turn", "Turn", "Close"]
    assert log.count("Turn") == 3 and budget.left == 0


def test_prompts_are_the_same_for_the_same_seed() -> None:
    w = workload(prompt_kind="text", prompt_tokens=40)
    from client.bench.loadtest.workload import Prompts

    a, b = Prompts(w, 3), Prompts(w, 3)
    assert [a.next() for _ in range(3)] == [b.next() for _ in range(3)]
    assert Prompts(workload(), 1).next() != Prompts(workload(), 2).next()
    text = Prompts(w, 0).next().text
    assert text is not None and 40 <= len(text) < 60


def test_config_is_checked() -> None:
    LoadConfig().validate()
    for bad, message in [(dict(sessions=0), "sessions"), (dict(prompt_kind="x"), "prompt_kind"),
                         (dict(in_process=True, processes=2), "one process"), (dict(broker=None), "broker"),
                         (dict(prompt_tokens=2000, max_tokens=100), "does not fit")]:
        with pytest.raises(ValueError, match=message):
            LoadConfig(**bad).validate()  # type: ignore[arg-type]
    nan, inf = float("nan"), float("inf")
    for bad, message in [(dict(duration=nan), "duration"), (dict(duration=inf), "duration"), (dict(timeout=nan), "timeout"),
                         (dict(temperature=-0.5), "temperature"), (dict(temperature=nan), "temperature")]:
        with pytest.raises(ValueError, match=message):  # accepted before: a run without end, or every request failed
            LoadConfig(**bad).validate()  # type: ignore[arg-type]
    assert LoadConfig(sessions=3, turns=2).request_limit == 6
    assert LoadConfig(sessions=2, turns=4, fork_every=2).request_limit == 12  # each conversation's 2 forked turns too
    assert LoadConfig(duration=1.0).request_limit is None


def test_requests_are_split_over_processes_in_proportion_to_their_users() -> None:
    """3 users over 2 processes, one conversation of 2 turns each (6 requests): the process of 2 users needs 4 of them
    (an even split, 3 and 3, ran 3 + 2 = 5 requests)."""
    config = LoadConfig(sessions=3, turns=2, processes=2)
    parts = split("tcp://x:1", None, 1.0, config.workload(), 3, 2, config.request_limit, None)
    assert [(p.first, p.count, p.requests) for p in parts] == [(0, 2, 4), (2, 1, 2)]
    assert [p.requests for p in split("tcp://x:1", None, 1.0, config.workload(), 4, 3, 5, None)] == [2, 1, 2]
    assert [p.requests for p in split("tcp://x:1", None, 1.0, config.workload(), 4, 2, None, 2.0)] == [None, None]
    assert request_shares(9, [1, 2]) == [3, 6]  # --compare together: 3 sessions, the native side 1 of them


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class FakeStream:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.result = SimpleNamespace(appended=4, session_length=6)

    async def __aiter__(self) -> AsyncIterator[SimpleNamespace]:
        for _ in range(2):
            self.clock.now += 1.0  # each token a second after the last (the first a second after the send)
            yield SimpleNamespace(token_ids=[7])


class FakeSession:
    """Create, fork and close each take 0.25 s of the fake clock."""

    max_context = 0

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    async def generate(self, **_: object) -> FakeStream:
        return FakeStream(self.clock)

    async def fork(self) -> FakeSession:
        self.clock.now += 0.25
        return FakeSession(self.clock)

    def close_soon(self) -> asyncio.Task[None]:
        self.clock.now += 0.25
        return asyncio.ensure_future(asyncio.sleep(0))


class FakeClient:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    async def session(self, model: str | None) -> FakeSession:
        self.clock.now += 0.25
        return FakeSession(self.clock)


def test_full_stack_ttft_counts_from_the_create_only_for_the_turn_sent_right_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --fork-every 1 the first turn forks first: the child's turn, then the parent's. The parent's TTFT counted
    from its session's CREATE, so it took in the fork, the child's whole turn and its close (3.75 s, not 1 s)."""
    from client.bench.loadtest import stack

    clock = FakeClock()
    monkeypatch.setattr(stack, "time", clock)
    raw = RawRun(start=clock.now)
    driver = stack.StackDriver(FakeClient(clock), None, raw, Tally())  # type: ignore[arg-type]

    async def go(w: Workload, budget: Budget) -> None:
        await driver.run_user(user(0, w, budget, raw.counts))
        await driver.settle()

    asyncio.run(go(workload(turns=1, fork_every=1), Budget(2, None)))
    # create 100-100.25, fork -100.5, child turn -102.5, child close -102.75, parent turn -104.75
    assert [(r.forked, r.opened, r.start, ttft(r), e2e(r)) for r in raw.requests] == [
        (True, False, 100.5, 1.0, 2.0), (False, False, 102.75, 1.0, 2.0)]
    raw.requests.clear()
    asyncio.run(go(workload(turns=2), Budget(2, None)))  # create 105-105.25, turn -107.25, turn -109.25
    assert [(r.opened, r.start, ttft(r), e2e(r)) for r in raw.requests] == [(True, 105.0, 1.25, 2.25),
                                                                            (False, 107.25, 1.0, 2.0)]


# -- in-process on random:tiny ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[object]:
    """random:tiny on one CPU thread: on two shared cores, two threads wait on each other for ~0.2 s a step."""
    import torch

    from worker.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.load("random:tiny", device="cpu", max_sessions=8, max_context=512)
    try:
        yield engine
    finally:
        engine.table.close()
        torch.set_num_threads(threads)


def test_in_process_run_counts_exactly(tiny_engine: object) -> None:
    config = LoadConfig(in_process=True, sessions=3, prompt_tokens=16, max_tokens=8, turns=2, requests=12, fork_every=2,
                        ignore_eos=True, seed=3)
    report = run(config, engine=tiny_engine)  # type: ignore[arg-type]
    # The users run in lockstep: turn 1 (3 requests), fork + child turn (3), parent turn 2 (3), a new conversation (3).
    assert (report.completed, report.failed, report.request_errors) == (12, 0, {})
    assert (report.total_input_tokens, report.total_output_tokens) == (12 * 16, 12 * 8)
    assert report.counts == {"sessions_opened": 6, "forks": 3, "conversations_completed": 3}
    assert {k: s.count for k, s in report.ops.items()} == {"create": 6, "fork": 3, "close": 9}
    assert (report.ttft.count, report.tpot.count, report.itl.count, report.e2el.count) == (12, 12, 12 * 7, 12)
    assert report.output_tokens_per_s > 0 and report.mode == "in-process"
    assert report.to_dict()["output_tokens_per_s"] == report.output_tokens_per_s
    text = str(report.table())  # print(report.table()) shows the table
    assert "Successful requests" in text and "12" in text and "\x1b[" not in text
    assert tiny_engine.sessions() == []  # type: ignore[attr-defined]


def test_in_process_ttft_later_leaves_out_the_turns_that_opened_their_session(tiny_engine: object) -> None:
    """In-process runs never marked a turn as opening its session: "TTFT, turns after a session's first" (ttft_later)
    took in every turn, as on neither of the other paths."""
    config = LoadConfig(in_process=True, sessions=2, prompt_tokens=8, max_tokens=4, turns=3, ignore_eos=True)
    report = run(config, engine=tiny_engine)  # type: ignore[arg-type]
    assert (report.completed, report.ttft.count, report.ttft_later.count) == (6, 6, 4)
    assert "TTFT, turns after a session's first" in report.render()


def test_in_process_rolls_sessions_over_before_the_context_fills(tiny_engine: object) -> None:
    config = LoadConfig(in_process=True, sessions=1, prompt_tokens=32, max_tokens=16, turns=10, requests=5, max_context=100,
                        ignore_eos=True, temperature=0.8, warmup=3)
    report = run(config, engine=tiny_engine)  # type: ignore[arg-type]
    assert (report.completed, report.total_output_tokens) == (5, 80)  # the warm-up's 3 requests are not counted
    assert report.counts == {"sessions_opened": 3, "context_rollovers": 2}
    assert report.ops["create"].count == 3


def test_in_process_text_prompts(tiny_engine: object) -> None:
    config = LoadConfig(in_process=True, sessions=2, prompt_tokens=20, max_tokens=4, turns=2, requests=4, prompt_kind="text",
                        ignore_eos=True)
    report = run(config, engine=tiny_engine)  # type: ignore[arg-type]
    assert (report.completed, report.failed, report.total_output_tokens) == (4, 0, 16)
    assert 4 * 20 <= report.total_input_tokens < 4 * 40  # a byte vocabulary: a token per character


def test_in_process_reports_capacity_failures(tiny_engine: object) -> None:
    # 8 slots, 10 users: two cannot open a session and give up; the others run all 10 requests.
    config = LoadConfig(in_process=True, sessions=10, prompt_tokens=4, max_tokens=2, turns=1, requests=10, ignore_eos=True)
    report = run(config, engine=tiny_engine)  # type: ignore[arg-type]
    assert (report.completed, report.failed) == (10, 0)
    assert report.op_errors == {"create": {"capacity_exhausted": 2}}


# -- the full stack ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("loadtest"))
    try:
        cluster.start_broker()
        cluster.start_worker("w1", max_sessions=8)
        cluster.wait_for_workers({"w1"})
        yield cluster
    finally:
        cluster.close()


def test_full_stack_cli_with_two_client_processes(stack: Cluster, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "WORKER_THREADS": "1"}
    args = ["--broker", stack.clients, "--model", "random-tiny", "--sessions", "4", "--processes", "2", "--prompt-tokens", "16",
            "--max-tokens", "8", "--turns", "2", "--fork-every", "2", "--requests", "12", "--ignore-eos", "--no-progress",
            "--json", str(out_json), "--plot", str(out_png)]
    done = subprocess.run([sys.executable, "-m", "client.bench.loadtest", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Output token throughput" in done.stdout
    d = json.loads(out_json.read_text())
    assert (d["mode"], d["completed"], d["failed"], d["errors"]) == ("full-stack", 12, 0, {})
    assert (d["total_input_tokens"], d["total_output_tokens"]) == (12 * 16, 12 * 8)
    ops, counts = d["session_ops"], d["counts"]
    assert "append" not in ops  # a turn's prompt goes with its generate request
    assert ops["fork"]["count"] == counts["forks"] >= 2  # each process forks at least once
    assert ops["create"]["count"] == counts["sessions_opened"]
    assert ops["close"]["count"] == counts["sessions_opened"] + counts["forks"]
    assert all(not op["errors"] for op in ops.values())
    assert d["mean_ttft_ms"] > 0 and d["p99_e2el_ms"] >= d["p50_e2el_ms"] > 0 and d["output_throughput"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with stack.client() as c:
        assert c.status()[0].sessions == 0  # every session was closed


def test_full_stack_api_in_this_process(stack: Cluster) -> None:
    report = run(LoadConfig(broker=stack.clients, sessions=2, prompt_tokens=8, max_tokens=4, turns=3, ignore_eos=True))
    assert (report.completed, report.failed, report.total_output_tokens) == (6, 0, 24)
    assert report.counts == {"sessions_opened": 2, "conversations_completed": 2} and report.mode == "full-stack"


def test_full_stack_unknown_model_fails_every_create(stack: Cluster) -> None:
    report = run(LoadConfig(broker=stack.clients, model="no-such-model", sessions=2, requests=4, timeout=5))
    assert report.completed == 0 and report.op_errors == {"create": {"model_not_found": 2}}


@pytest.mark.parametrize("args", [["--duration", "nan"], ["--temperature", "-1"],
                                  ["--http", "http://127.0.0.1:9", "--compare", "together", "--sessions", "1", "--processes", "2"]])
def test_bad_values_exit_2_before_the_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--compare together with one session exited 1 after checking the broker; nan and -1 were accepted."""
    with pytest.raises(SystemExit) as exited:
        main(["--broker", f"tcp://127.0.0.1:{free_port()}", "--no-progress", *args])
    assert exited.value.code == 2 and "error:" in capsys.readouterr().err


def test_no_broker_is_a_clear_error() -> None:
    with pytest.raises(LoadTestError, match="no broker answers"):
        run(LoadConfig(broker=f"tcp://127.0.0.1:{free_port()}", requests=1, timeout=0.5))


def test_the_progress_bar_counts_requests_then_failures() -> None:
    assert requests_text(Tally(done=9, failed=3), 100) == "12/100 requests, 3 failed"
    assert requests_text(Tally(), None) == "0 requests, 0 failed"


# -- stopping a run early (Ctrl-C) ----------------------------------------------------------------------


class StopAfter:
    """A stop request that is set from its `polls`-th look on (the drivers look between engine steps, or every
    progress.REFRESH_S)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def is_set(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_the_first_signal_asks_to_stop_and_the_second_quits_at_once() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = Stop()
    with pytest.raises(KeyboardInterrupt), on_signals(stop):
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set() and (stop.signal, stop.exit_code) == (signal.SIGTERM, 143)
        signal.raise_signal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_in_process_run_stopped_cancels_its_turns_and_closes_its_sessions(tiny_engine: object) -> None:
    """Stopped in the users' second turns (32 tokens each, all three in lockstep): the first turns are its figures,
    the second ones cut short, in neither completed nor failed; no session is left in the engine."""
    config = LoadConfig(in_process=True, sessions=3, prompt_tokens=8, max_tokens=32, turns=100, duration=600,
                        ignore_eos=True)
    report = run(config, engine=tiny_engine, stop=StopAfter(50))  # type: ignore[arg-type]
    assert report.interrupted and (report.completed, report.failed, report.cut_short) == (3, 0, 3)
    assert report.total_output_tokens == 3 * 32 and report.e2el.count == 3
    assert {k: s.count for k, s in report.ops.items()} == {"create": 3, "fork": 0, "close": 3}
    assert report.counts == {"sessions_opened": 3}  # no reopening counted for a cut-short turn
    assert tiny_engine.sessions() == []  # type: ignore[attr-defined]
    assert "INTERRUPTED: partial" in report.render() and "Requests cut short (interrupted)" in report.render()
    d = report.to_dict()
    assert (d["interrupted"], d["cut_short"]) == (True, 3)
    stopped = run(config, engine=tiny_engine, stop=StopAfter(0))  # type: ignore[arg-type]
    assert stopped.interrupted and (stopped.completed, stopped.cut_short, stopped.ops["create"].count) == (0, 0, 0)


def finished(metrics_url: str) -> dict[str, float]:
    """The worker's generations finished so far, by reason (sessionserve:request_success_total)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as answer:
        text = answer.read().decode()
    return {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "sessionserve:request_success_total"}


@pytest.fixture
def smol_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    """A broker and a worker with the bundled SmolLM2 on the CPU (fast heartbeats), and the worker's metrics URL."""
    cluster = Cluster(tmp_path)
    metrics_port = free_port()
    try:
        cluster.start_broker()
        cluster.start_worker("smol", model=None, max_sessions=8, extra=["--metrics-port", str(metrics_port)])
        cluster.wait_for_workers({"smol"}, timeout=300)
        yield cluster, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        cluster.close()


@pytest.mark.slow
def test_ctrl_c_stops_the_run_closes_its_sessions_and_prints_the_partial_report(
        smol_cluster: tuple[Cluster, str], tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) in the middle of a run meant to last two
    minutes: the turns in flight are cancelled, every session the run opened is closed, and the figures measured so
    far are printed and written, marked as interrupted, with exit code 130."""
    cluster, metrics = smol_cluster
    out_json = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORKER_THREADS": "1"}
    args = ["--broker", cluster.clients, "--sessions", "4", "--processes", "2", "--prompt-tokens", "16",
            "--max-tokens", "24", "--turns", "1000", "--max-context", "2048", "--duration", "120", "--ignore-eos",
            "--no-progress", "--json", str(out_json)]
    proc = subprocess.Popen([sys.executable, "-m", "client.bench.loadtest", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while finished(metrics).get("length", 0) < 2:  # a few turns done: the run is well under way
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no turn finished within 180 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert time.monotonic() - interrupted < 30  # the turns in flight were cut short, not waited for
    assert "INTERRUPTED: partial" in stdout and "Benchmark duration until interrupted (s)" in stdout, stdout
    d = json.loads(out_json.read_text())
    assert d["interrupted"] is True and d["mode"] == "full-stack"
    assert d["completed"] >= 2 and (d["failed"], d["errors"]) == (0, {})
    assert d["total_output_tokens"] == 24 * d["completed"]  # cut-short turns are in no figure
    assert 1 <= d["cut_short"] <= 4  # at most one turn in flight per session
    assert 0 < d["duration"] < 120
    ops, counts = d["session_ops"], d["counts"]
    assert ops["create"]["count"] == counts["sessions_opened"] >= 4
    assert ops["close"]["count"] == counts["sessions_opened"]  # every session opened was closed by the run ...
    assert all(not op["errors"] for op in ops.values())
    listed = subprocess.run([sys.executable, "-m", "broker.cli", "sessions", "--json", "--clients", cluster.clients],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (listed.returncode, json.loads(listed.stdout)) == (0, [])  # ... none left to the broker's grace ...
    deadline = time.monotonic() + 10
    while not finished(metrics).get("cancelled"):  # ... and its generations in flight cancelled (the worker counts
        assert time.monotonic() < deadline, "no generation was cancelled"  # a cancel in its next step)
        time.sleep(0.05)


def test_compare_stopped_in_its_native_run_writes_the_comparisons_shape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's run is not started, and the JSON keeps --compare's shape (it was the single report's)."""
    import client.bench.loadtest.cli as cli

    runs: list[LoadConfig] = []

    def stopped(config: LoadConfig, **kwargs: object) -> object:
        runs.append(config)
        raw = RawRun(start=10.0, finish=11.0, interrupted=True)
        raw.requests = [sample(10.0, [10.5], [1], end=10.6)]
        return build_report(raw, "full-stack", {})

    monkeypatch.setattr(cli, "run", stopped)
    out = tmp_path / "compare.json"
    main(["--http", "http://127.0.0.1:1", "--broker", "tcp://127.0.0.1:1", "--compare", "--sessions", "1",
          "--no-progress", "--json", str(out)])
    assert [c.http for c in runs] == [None]  # the native run only
    figures = json.loads(out.read_text())
    assert sorted(figures) == ["comparison", "http", "native"]
    assert figures["http"] is None and figures["comparison"] is None
    assert figures["native"]["interrupted"] and figures["native"]["completed"] == 1
