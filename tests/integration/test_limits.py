"""Bounded inputs, per-client caps, idle expiry and hung workers, with real daemons on 127.0.0.1.

Every breached limit is a typed error whose message names the limit; nothing breaks the session.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker.common import protocol as p
from client import AsyncClient, BadRequest, Overloaded, SessionExpired, Timeout
from worker.errors import ContextOverflow
from worker.serve.link import MAX_INBOX_BYTES
from worker.serve.loop import Serve

from .cluster import Cluster
from .test_worker_daemon import FakeEngine, serving

PROMPT = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A broker capping clients at 2 sessions; one worker (context 64) expiring sessions idle for 1 s."""
    cluster = Cluster(tmp_path_factory.mktemp("limited"))
    try:
        cluster.start_broker(["--max-sessions-per-client", "2"])
        cluster.start_worker("w1", max_sessions=4, max_context=64, extra=["--session-idle-timeout", "1"])
        cluster.wait_for_workers({"w1"})
        yield cluster
    finally:
        cluster.close()


def test_each_limit_breached_is_a_bad_request_naming_it(limited: Cluster) -> None:
    with limited.client() as c, c.session() as s:
        s.append(token_ids=PROMPT)
        breaches: dict[str, Any] = {
            "max_tokens 65 exceeds the context of 64 tokens (worker --max-context)": lambda: s.generate(max_tokens=65),
            "exceed max_context 64": lambda: s.append(token_ids=[1] * 61),
            f"stop has more than {p.MAX_STOP_STRINGS} items": lambda: s.generate(stop=["x"] * (p.MAX_STOP_STRINGS + 1)),
            f"longer than {p.MAX_STOP_CHARS} characters": lambda: s.generate(stop="x" * (p.MAX_STOP_CHARS + 1)),
            f"max_tokens must be in [0, {p.MAX_TOKENS}]": lambda: s.generate(max_tokens=p.MAX_TOKENS + 1),
            f"token_ids has more than {p.MAX_TOKENS} items": lambda: s.append(token_ids=[1] * (p.MAX_TOKENS + 1)),
        }
        for limit, breach in breaches.items():
            with pytest.raises(BadRequest) as caught:
                breach()
            assert limit in str(caught.value)
        assert s.info().length == len(PROMPT)  # no breach touched the session
        assert len(s.generate(max_tokens=4, ignore_eos=True).token_ids) == 4


def test_one_client_cannot_take_more_than_its_share(limited: Cluster) -> None:
    with limited.client() as greedy, limited.client() as other:
        a, b = greedy.session(), greedy.session()
        with pytest.raises(BadRequest, match=r"holds 2 sessions: the limit is 2 per client \(--max-sessions-per-client\)"):
            greedy.session()
        with pytest.raises(BadRequest, match="the limit is 2 per client"):
            a.fork()
        with other.session() as mine:  # the worker still has room for others
            assert mine.worker == "w1"
        a.close()
        with greedy.session() as again:  # closing one frees a place
            assert again.worker == "w1"
        b.close()


def test_idle_sessions_expire_and_later_use_is_session_expired(limited: Cluster) -> None:
    with limited.client() as c:
        idle, busy = c.session(), c.session()
        idle.append(token_ids=PROMPT)
        busy.append(token_ids=PROMPT)
        started = time.monotonic()
        while time.monotonic() - started < 2.5:  # busy is used every 0.3 s, idle never
            busy.info()
            time.sleep(0.3)
        with pytest.raises(SessionExpired, match=r"idle.* \(worker --session-idle-timeout\)"):
            idle.info()
        with pytest.raises(SessionExpired):
            idle.generate(max_tokens=2)
        assert busy.info().length == len(PROMPT)
        worker = c.status()[0]
        assert (worker.sessions, worker.free_slots) == (1, 3)  # the broker freed its slot too
        idle.close()  # closing an expired session is not an error either
        busy.close()


@pytest.fixture
def hung(cluster: Cluster) -> Iterator[tuple[Cluster, FakeEngine, threading.Event]]:
    """A broker with a 1 s request deadline and an in-process worker whose engine step can be made to hang."""
    cluster.start_broker(["--request-timeout-ms", "1000"])
    release = threading.Event()
    engine = FakeEngine()
    hang = {"on": False}
    step = engine.step

    def stuck_step(wait: bool = True) -> Any:
        if hang["on"]:
            release.wait(30)
        return step(wait)

    engine.step = stuck_step  # type: ignore[method-assign]
    engine.hang = hang  # type: ignore[attr-defined]
    with serving(cluster.workers_address, engine, release):
        cluster.wait_for_workers({"fw"})
        yield cluster, engine, release


def test_a_request_on_a_hung_compute_loop_times_out_and_the_worker_s_sessions_survive(
    hung: tuple[Cluster, FakeEngine, threading.Event],
) -> None:
    cluster, engine, release = hung
    with cluster.client(timeout=10) as c:
        stuck, other = c.session(), c.session()
        for s in (stuck, other):
            s.append(token_ids=PROMPT)
        assert stuck.generate(max_tokens=2).token_ids == [5, 6]  # the fake engine's tokens are positions
        engine.hang["on"] = True  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(Timeout, match="worker fw made no progress on this request for 1 s"):
            stuck.generate(max_tokens=2)
        waited = time.monotonic() - started
        assert 1.0 <= waited <= 1.0 + 2 * cluster.heartbeat_ms / 1000 + 0.3, waited  # checked once per heartbeat
        assert [w.name for w in c.status()] == ["fw"]  # heartbeats kept it alive: not declared dead
        engine.hang["on"] = False  # type: ignore[attr-defined]
        release.set()
        assert other.info().length == len(PROMPT)  # the worker's other sessions are still there
        assert stuck.info().length >= len(PROMPT) + 2
        assert len(stuck.generate(max_tokens=3).token_ids) == 3  # and the timed-out one works again


@pytest.fixture
def stuck(cluster: Cluster) -> Iterator[tuple[Cluster, Serve, threading.Event]]:
    """A broker and an in-process worker whose engine step hangs while a generation runs, until released (its compute
    loop takes no request meanwhile); a text that cannot fit a session is refused before it is tokenized."""
    cluster.start_broker()
    release = threading.Event()
    engine = FakeEngine()
    engine.capacity = 4
    step = engine.step

    def stuck_step(wait: bool = True) -> Any:
        if engine.active:
            release.wait(60)
        return step(wait)

    def check_text_fits(session_id: str, text: str, from_start: bool = False) -> None:
        if len(text) > engine.max_context * 4:
            raise ContextOverflow(f"a text of {len(text)} characters cannot fit the session")

    engine.step = stuck_step  # type: ignore[method-assign]
    engine.check_text_fits = check_text_fits  # type: ignore[method-assign]
    with serving(cluster.workers_address, engine, release) as serve:
        cluster.wait_for_workers({"fw"})
        yield cluster, serve, release


def test_big_requests_past_a_stuck_worker_s_inbox_bound_are_answered_overloaded_and_resends_get_their_answers(
    stuck: tuple[Cluster, Serve, threading.Event],
) -> None:
    """Valid 3 MB APPENDs sent faster than the worker's compute loop takes them were all read into the worker's memory
    (1,000 of them: 3 GB). Now what waits there stays within MAX_INBOX_BYTES, the worker stays registered, and once
    its compute loop goes on it answers every request: those it queued (and their resends, which the client sent
    while it waited, from its answers) as ever, those past the bound `overloaded` (Overloaded in the client), and
    another client's small request sent behind the flood."""
    cluster, serve, release = stuck
    link = serve.link
    flood, count = "x" * 3_000_000, 30

    async def scenario() -> tuple[list[BaseException | int], int, int, int]:
        async with AsyncClient(cluster.clients, timeout=60) as ac, AsyncClient(cluster.clients, timeout=60) as oc:
            busy, flooded, other = await ac.session(), await ac.session(), await oc.session()
            await busy.append(token_ids=PROMPT)
            generation = asyncio.ensure_future(busy.generate(max_tokens=1))  # its step hangs: the loop is stuck
            await asyncio.sleep(0.3)
            appends = [asyncio.ensure_future(flooded.append(text=flood)) for _ in range(count)]
            deadline = time.monotonic() + 20
            while link.unqueued < 1 or link.inbox_bytes + 3_000_100 <= MAX_INBOX_BYTES:  # full
                assert time.monotonic() < deadline, (link.unqueued, link.inbox_bytes)
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # the client resends what has no answer after a second
            queued, unqueued = link.inbox_bytes, link.unqueued
            info = asyncio.ensure_future(other.info())  # another client's request, behind the flood
            await asyncio.sleep(0.3)
            assert not info.done() and not any(a.done() for a in appends)  # the loop answers in its turn
            assert [w.name for w in await oc.status()] == ["fw"]  # its heartbeats went on
            release.set()
            results = await asyncio.gather(*appends, return_exceptions=True)
            assert (await info).length == 0
            assert (await generation).token_ids == [len(PROMPT) + 1]
            return results, queued, unqueued, link.unqueued

    results, queued, unqueued, left = asyncio.run(scenario())
    assert queued <= MAX_INBOX_BYTES and unqueued > count - MAX_INBOX_BYTES // 3_000_000  # the resends too
    kept = [r for r in results if isinstance(r, BadRequest)]  # the requests it queued: the fake engine's answer
    overloaded = [r for r in results if isinstance(r, Overloaded)]
    assert len(kept) == MAX_INBOX_BYTES // 3_000_100 and len(kept) + len(overloaded) == count, results
    assert {str(e) for e in kept} == {"a text of 3000000 characters cannot fit the session"}
    assert {str(e) for e in overloaded} == {f"worker fw is overloaded: {(len(kept) * 3_000_100) >> 20} MiB of "
                                            f"requests were waiting for it (at most {MAX_INBOX_BYTES >> 20} MiB): "
                                            "retry later"}
    assert left == 0
