"""Faults beyond test_failures.py, measured: a frozen worker (SIGSTOP/SIGCONT), a kill -9 of the broker with
sessions on two workers, a client that vanishes mid-stream, and a burst of creates past capacity.

Each test records what it measured (the test's `user_properties`, and a `measured NAME=VALUE` line on stdout:
`pytest -rP` or `-s` shows them) and asserts a bound on it.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from client import AsyncClient, AsyncSession, CapacityExhausted, Client, ClientError, Generation, SessionInfo, SessionLost

from .cluster import ROOT, Cluster, Measure, one_session_on_each, seconds_until_lost

PROMPT = [7, 8, 9, 10]
SCHEDULING_SLACK_S = 0.3  # a loaded 2-core machine: the broker's poll, the test's own wake-up


def prompt(i: int) -> list[int]:
    """A distinct short history per index (ids well inside random:tiny's vocabulary)."""
    return [10 + i, 20 + i, 30 + i, 40 + i]


def wait_for(what: str, check: Callable[[], bool], timeout: float, every: float = 0.02) -> float:
    """Poll until `check()` holds; returns the seconds it took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(every)
    return time.monotonic() - start


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: skip past it
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, seconds: float) -> float:
    """The fraction of one core the process used over the next `seconds`."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


# -- 1. a frozen worker ---------------------------------------------------------------------------------


def test_a_stopped_worker_is_declared_dead_and_its_sessions_stay_lost_when_it_comes_back(
    cluster: Cluster, measure: Measure
) -> None:
    """SIGSTOP freezes w1 mid-stream with its TCP connection open, so only heartbeats can tell: its libzmq answers the
    broker's ZMTP pings no more, the broker's ZeroMQ closes the connection after `liveness` heartbeats, and its next
    send to w1 fails: the stream fails with SessionLost, w2 keeps serving, and w1's session answers session_lost.

    session_lost is final. On SIGCONT, w1 reconnects and registers again listing the session it still holds; the
    broker does not take it back but tells w1 to drop it (DROP), which frees its slot and stops the generation that
    was failed with session_lost (it used to run on, ~100 tokens its client never saw). The client's session stays
    lost, and w1 is empty and whole again."""
    w1, _ = cluster.start_two_workers(max_sessions=2, max_context=4096)
    with cluster.client() as c:
        frozen, survivor = one_session_on_each(c, PROMPT)
        stream = frozen.generate(max_tokens=3000, ignore_eos=True, stream=True)
        assert next(stream).finish_reason is None

        w1.proc.send_signal(signal.SIGSTOP)
        try:
            lost_after = seconds_until_lost(stream, since=time.monotonic())
            measure("sigstop_to_session_lost_s", round(lost_after, 3))
            limit = cluster.loss_limit_s
            assert lost_after <= limit + SCHEDULING_SLACK_S, f"SessionLost after {lost_after:.3f} s, limit {limit} s"

            assert len(survivor.generate(max_tokens=8, ignore_eos=True).token_ids) == 8
            assert [(w.name, w.sessions) for w in c.status()] == [("w2", 1)]
            with pytest.raises(SessionLost):
                frozen.info()
        finally:
            w1.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()

        cluster.wait_for_workers({"w1", "w2"}, timeout=10)
        measure("sigcont_to_reregistered_s", round(time.monotonic() - resumed, 3))
        assert sorted((w.name, w.sessions, w.free_slots) for w in c.status()) == [("w1", 0, 2), ("w2", 1, 1)]
        for attempt in (frozen.info, lambda: frozen.generate(max_tokens=2)):
            with pytest.raises(SessionLost):
                attempt()
        wait_for("w1 drops the lost session", lambda: "sessions_dropped" in w1.log_text(), timeout=10)
        busy_share = cpu_share(w1.proc.pid, 1.0)
        measure("worker_cpu_share_after_drop", round(busy_share, 3))
        assert busy_share < 0.2, f"w1 still computes ({busy_share:.2f} of a core): the lost generation runs on"
        # Its two slots are free again: two new sessions fit on w1 beside w2's.
        fresh = [c.session() for _ in range(3)]
        assert sorted(s.worker for s in fresh) == ["w1", "w1", "w2"]
        for s in (*fresh, survivor):
            s.close()
        frozen.close()  # closing a lost session is not an error
        assert sorted((w.name, w.sessions) for w in c.status()) == [("w1", 0), ("w2", 0)]


def test_a_broker_stopped_longer_than_the_heartbeat_window_loses_no_worker_and_no_stream(
    cluster: Cluster, measure: Measure
) -> None:
    """SIGSTOP of the broker for 1 s (a paused VM, a starved host), with heartbeats of 100 ms and 3 missed: on
    SIGCONT libzmq's timers fire before anything is read, and close the workers' and clients' connections though
    they answered all along. The broker notices its own stall, gives the workers a heartbeat window to come back
    (they reconnect and say READY), and keeps the clients' generations: the stream goes on, exact, and no session is
    lost."""
    cluster.start_two_workers(max_sessions=2, max_context=4096)
    with cluster.client() as c:
        on_w1, on_w2 = one_session_on_each(c, PROMPT)
        with on_w2.fork() as probe:  # this machine's speed: the stream must outlast the broker's 1 s stop
            started = time.monotonic()
            probe.generate(max_tokens=200, ignore_eos=True)
            rate = 200 / (time.monotonic() - started)
        n = min(4000, max(1200, int(rate * 3)))  # ~3 s of tokens, within the context
        with on_w2.fork() as twin:
            expected = twin.generate(max_tokens=n, ignore_eos=True).token_ids
        stream = on_w2.generate(max_tokens=n, ignore_eos=True, stream=True)
        tokens = next(stream).token_ids
        assert cluster.broker is not None
        cluster.broker.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        cluster.broker.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        tokens += [t for chunk in stream for t in chunk.token_ids]
        measure("broker_sigcont_to_stream_end_s", round(time.monotonic() - resumed, 3))
        assert time.monotonic() - resumed > 0.1  # the stream was still running when the broker came back
        assert stream.result is not None and stream.result.token_ids == expected and tokens == expected
        assert on_w1.info().length == len(PROMPT)
        assert sorted((w.name, w.sessions) for w in c.status()) == [("w1", 1), ("w2", 1)]
    log = cluster.broker.log_text()
    assert "broker_stalled" in log and "worker_lost" not in log


# -- 2. kill -9 of the broker ---------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", [{"recovery_ms": 3000}], indirect=True)  # room for a slow re-registration
def test_every_session_on_two_workers_survives_a_kill_9_of_the_broker(
    cluster: Cluster, measure: Measure
) -> None:
    """Six sessions with distinct histories on two workers; a fork of each, made before the kill, says what its
    next greedy generation must be. After kill -9 and a restart on the same addresses, every session generates
    exactly that (counted), and the broker's tables hold the same three sessions per worker."""
    cluster.start_two_workers(max_sessions=4)
    with cluster.client() as c:
        sessions = [c.session() for _ in range(6)]
        assert Counter(s.worker for s in sessions) == {"w1": 3, "w2": 3}
        expected: dict[str, Generation] = {}
        for i, s in enumerate(sessions):
            s.append(token_ids=prompt(i))
            s.generate(max_tokens=2 + i, ignore_eos=True)  # histories of different lengths too
            with s.fork() as twin:
                expected[s.id] = twin.generate(max_tokens=8, ignore_eos=True)
        assert len({tuple(g.token_ids) for g in expected.values()}) == 6  # distinct: a mix-up would show

        assert cluster.broker is not None
        cluster.broker.kill()
        killed = time.monotonic()
        cluster.start_broker()  # same addresses, new broker id, empty tables
        restarted = time.monotonic()
        first = sessions[0].info()  # held by the new broker until its worker re-registers
        first_ok = time.monotonic()
        measure("broker_restart_to_first_success_s", round(first_ok - restarted, 3))
        measure("broker_kill_to_first_success_s", round(first_ok - killed, 3))
        assert first.length == len(prompt(0)) + 2
        assert first_ok - restarted < 5.0, f"first request answered {first_ok - restarted:.2f} s after the restart"

        survived = sum(s.generate(max_tokens=8, ignore_eos=True) == expected[s.id] for s in sessions)
        measure("sessions_survived", survived)
        assert survived == 6
        assert sorted((w.name, w.sessions) for w in c.status()) == [("w1", 3), ("w2", 3)]  # nothing new created
        for s in sessions:
            s.close()


# -- 3. a client that vanishes --------------------------------------------------------------------------

ORPHAN_CLIENT = """
import sys
from client import Client
client = Client(sys.argv[1], timeout=30)
session = client.session()
session.append(token_ids=[7, 8, 9, 10])
stream = session.generate(max_tokens=int(sys.argv[2]), ignore_eos=True, stream=True)
next(stream)
print(session.id, flush=True)
for _ in stream:
    pass
"""
ORPHAN_TOKENS = 4000  # ~4 s on random:tiny (context 4096): still running long after the client is killed


def test_a_vanished_client_gets_its_generation_cancelled(
    cluster: Cluster, measure: Measure
) -> None:
    """A client process streaming a long generation is killed -9. Its TCP connection closes, the broker's next
    CHUNKS to it fails with EHOSTUNREACH (ROUTER_MANDATORY), and once the client has not come back within its grace
    (--client-grace-ms, 1 s here) the broker sends CANCEL for that generation:
    the session stops being busy within a bounded time, short of its max_tokens, and the worker goes idle.
    The session itself stays (nobody closed it); another client attaches to it by id and closes it."""
    cluster.start_broker(["--client-grace-ms", "1000"])
    worker = cluster.start_worker("w1", max_sessions=2, max_context=4096)
    cluster.wait_for_workers({"w1"})
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    errors = cluster.tmp / "orphan-client.log"
    with errors.open("wb") as stderr:
        orphan = subprocess.Popen(
            [sys.executable, "-c", ORPHAN_CLIENT, cluster.clients, str(ORPHAN_TOKENS)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
        )
    try:
        assert orphan.stdout is not None
        readable, _, _ = select.select([orphan.stdout], [], [], 30)
        session_id = orphan.stdout.readline().decode().strip() if readable else ""
        assert session_id, f"the client process did not start its stream:\n{errors.read_text(errors='replace')}"
        busy_share = cpu_share(worker.proc.pid, 0.3)
        orphan.kill()
        killed = time.monotonic()
        orphan.wait(timeout=10)
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait(timeout=10)
        if orphan.stdout is not None:
            orphan.stdout.close()

    with cluster.client() as c:
        s = c.attach(session_id)
        infos: list[SessionInfo] = []

        def idle() -> bool:
            infos.append(s.info())
            return not infos[-1].busy

        wait_for("the session is no longer busy", idle, timeout=20)
        cancelled_after = time.monotonic() - killed
        measure("client_kill_to_session_idle_s", round(cancelled_after, 3))
        # The broker gives a client it cannot reach 1 s here (--client-grace-ms) to come back, as a paused one would.
        assert 1.0 <= cancelled_after < 3.0, f"still generating {cancelled_after:.2f} s after the client died"
        length = infos[-1].length
        assert len(PROMPT) < length < len(PROMPT) + ORPHAN_TOKENS  # cancelled part way, not run to its end

        idle_share = cpu_share(worker.proc.pid, 1.0)
        measure("worker_cpu_share_streaming", round(busy_share, 3))
        measure("worker_cpu_share_after_cancel", round(idle_share, 3))
        assert idle_share < 0.2 < busy_share, f"worker CPU: {busy_share:.2f} streaming, {idle_share:.2f} after"
        assert s.info().length == length  # nothing more was generated
        assert cluster.broker is not None and "client_send_failed" in cluster.broker.log_text()
        s.close()
        assert [(w.name, w.sessions) for w in c.status()] == [("w1", 0)]


# -- 4. overload ----------------------------------------------------------------------------------------


def start_workers(cluster: Cluster, workers: int, capacity: int) -> list[str]:
    names = [f"w{i + 1}" for i in range(workers)]
    cluster.start_broker()
    for name in names:
        cluster.start_worker(name, max_sessions=capacity)
    cluster.wait_for_workers(set(names))
    return names


def solo_references(cluster: Cluster, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's 8 greedy tokens in a session of its own, one at a time: also proves closed slots are free."""
    out = []
    with cluster.client() as c:
        for ids in prompts:
            with c.session() as s:
                s.append(token_ids=ids)
                out.append(s.generate(max_tokens=8, ignore_eos=True).token_ids)
    return out


def check_refusals(refused: list[BaseException], n: int) -> None:
    assert len(refused) == n and all(isinstance(e, CapacityExhausted) for e in refused), refused
    assert {(e.code, "session slots are taken" in e.message) for e in refused if isinstance(e, ClientError)} == {
        ("capacity_exhausted", True)
    }


def test_an_async_burst_of_twice_the_capacity_admits_exactly_the_capacity(cluster: Cluster) -> None:
    """One worker with 4 slots, 8 creates at once on one AsyncClient: 4 sessions, 4 clean CapacityExhausted
    (the broker counts creates in flight, so none slips past). The 4 then generate 8 tokens together, exactly
    as each does alone; once they are closed their slots serve new sessions."""
    names = start_workers(cluster, workers=1, capacity=4)

    async def burst() -> tuple[list[str], list[BaseException], list[list[int]]]:
        async with AsyncClient(cluster.clients, timeout=20) as ac:
            results = await asyncio.gather(*(ac.session() for _ in range(8)), return_exceptions=True)
            admitted = [r for r in results if isinstance(r, AsyncSession)]
            refused = [r for r in results if not isinstance(r, AsyncSession)]
            for i, s in enumerate(admitted):
                await s.append(token_ids=prompt(i))
            generations = await asyncio.gather(*(s.generate(max_tokens=8, ignore_eos=True) for s in admitted))
            for s in admitted:
                await s.close()
            return [s.worker for s in admitted], refused, [g.token_ids for g in generations]

    workers, refused, tokens = asyncio.run(burst())
    assert Counter(workers) == {names[0]: 4}
    check_refusals(refused, 4)
    assert tokens == solo_references(cluster, [prompt(i) for i in range(4)])
    with cluster.client() as c:
        assert [(w.name, w.sessions, w.free_slots) for w in c.status()] == [("w1", 0, 4)]


def test_a_full_worker_takes_a_new_session_sent_right_behind_a_close_that_is_not_answered_yet(cluster: Cluster) -> None:
    """4 slots, all taken: three times over, each session is closed with close_soon() and the next one opened at
    once, before the close is answered. None is refused (the broker counts closes on their way as free slots, and
    the worker handles each close before the create behind it), the closes all succeed, and the worker is full."""
    names = start_workers(cluster, workers=1, capacity=4)

    async def churn() -> tuple[list[str], BaseException | None]:
        async with AsyncClient(cluster.clients, timeout=20) as ac:
            sessions = [await ac.session() for _ in range(4)]
            closes = []
            for _ in range(3):
                for i, s in enumerate(sessions):
                    closes.append(s.close_soon())
                    sessions[i] = await ac.session()
                    await sessions[i].append(token_ids=prompt(i))
            await asyncio.gather(*closes)
            try:
                await ac.session()
                refused = None
            except CapacityExhausted as e:
                refused = e
            return [s.worker for s in sessions], refused

    workers, refused = asyncio.run(churn())
    assert workers == [names[0]] * 4 and isinstance(refused, CapacityExhausted)
    with cluster.client() as c:
        assert [(w.name, w.sessions, w.free_slots) for w in c.status()] == [("w1", 4, 0)]


def test_the_blocking_client_opens_a_session_behind_a_close_it_has_not_waited_for(cluster: Cluster) -> None:
    """The same with the blocking client: Session.close_soon() on a full worker, the next create at once, the
    close's answer waited for after it; a close whose result is dropped unwaited still closes."""
    names = start_workers(cluster, workers=1, capacity=2)
    with cluster.client() as c:
        sessions = [c.session() for _ in range(2)]
        for round_ in range(3):
            pending = sessions[0].close_soon()
            sessions[0] = c.session()
            assert sessions[0].worker == names[0]
            sessions[0].append(token_ids=prompt(round_))
            pending.wait()
            pending.wait()  # once answered, at once
        sessions[1].close_soon()  # dropped: nobody reads its answer
        replacement = c.session()
        assert not c._transport._mail  # the dropped close's mailbox went with it
        replacement.append(token_ids=prompt(9))
        tokens = replacement.generate(max_tokens=8, ignore_eos=True).token_ids
        with pytest.raises(CapacityExhausted):
            c.session()
        assert [(w.name, w.sessions, w.free_slots) for w in c.status()] == [("w1", 2, 0)]
        for s in (sessions[0], replacement):
            s.close()
    assert solo_references(cluster, [prompt(9)]) == [tokens]  # the dropped close's slot served a clean session


def test_a_threaded_burst_over_two_workers_admits_exactly_their_capacity(cluster: Cluster) -> None:
    """Two workers with 2 slots each, 8 threads with a Client each create at the same moment: 4 sessions (2 per
    worker), 4 CapacityExhausted. No session is closed before every create has been answered (a barrier), so
    the count is exact; the admitted ones then generate 8 tokens concurrently, as each does alone."""
    names = start_workers(cluster, workers=2, capacity=2)
    users = 8
    go, decided = threading.Barrier(users), threading.Barrier(users)
    outcomes: list[tuple[str, list[int]] | BaseException | None] = [None] * users

    def user(i: int) -> None:
        try:
            with Client(cluster.clients, timeout=20) as c:
                go.wait(timeout=30)
                try:
                    s = c.session()
                except CapacityExhausted as e:
                    outcomes[i] = e
                    decided.wait(timeout=30)
                    return
                decided.wait(timeout=30)
                with s:
                    s.append(token_ids=prompt(i))
                    outcomes[i] = (s.worker, s.generate(max_tokens=8, ignore_eos=True).token_ids)
        except BaseException as e:  # reported by the assertions below
            outcomes[i] = e

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    admitted = {i: o for i, o in enumerate(outcomes) if isinstance(o, tuple)}
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert Counter(worker for worker, _ in admitted.values()) == {names[0]: 2, names[1]: 2}
    check_refusals(refused, 4)
    references = solo_references(cluster, [prompt(i) for i in admitted])
    assert [tokens for _, tokens in admitted.values()] == references
    with cluster.client() as c:
        assert sorted((w.name, w.sessions, w.free_slots) for w in c.status()) == [("w1", 0, 2), ("w2", 0, 2)]
