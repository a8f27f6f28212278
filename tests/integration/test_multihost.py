"""The broker and two workers on three "hosts" (network namespaces on a bridge), over real TCP.

A worker's cable is pulled in the middle of a stream and plugged back in: its sessions are lost for
the broker within the heartbeat budget while the other host keeps serving, and once the link is back
the worker registers again; the sessions the broker declared lost stay lost (session_lost is final): the
worker is told to drop them, which frees their slots and stops the generation failed meanwhile. The
measured times are logged and recorded as test properties (`--junitxml`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from client import Client, Session, SessionLost

from .cluster import seconds_until_lost
from .netns import Lan, NetnsDaemon, unavailable

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow  # about 15 s each

HEARTBEAT_MS = 100
LIVENESS = 3
BUDGET_S = (LIVENESS + 1) * HEARTBEAT_MS / 1000  # the broker declares a silent worker dead within this
SLACK_S = 0.3  # scheduling on two shared cores, on top of the budget
CLIENT_PORT, WORKER_PORT = 5555, 5556  # the broker's namespace is its own: nothing else binds there
PROMPT = [7, 8, 9, 10]
LONG = 4000  # tokens: still streaming when the cable is pulled, and when it is plugged back in
MAX_CONTEXT = 4096  # random:tiny's most; room for the prompt, 8 tokens, LONG and 8 more
# Longer than the worker's ZMTP heartbeat timeout (3 x its 1 s default): its ZeroMQ gives up on the TCP
# connection and dials a new one, while the broker's end of the old one stays open (no ZMTP heartbeat there).
LONG_OUTAGE_S = 8.0


@dataclass
class MultiHost:
    lan: Lan
    clients: str  # the broker's client address, on the LAN
    broker: NetnsDaemon
    workers: dict[str, NetnsDaemon]

    def client(self, timeout: float = 20.0) -> Client:
        return Client(self.clients, timeout=timeout)

    def logs(self) -> str:
        daemons = {"broker": self.broker, **self.workers}
        return "\n".join(f"--- {name}\n{d.log_text()[-3000:]}" for name, d in daemons.items())

    def lost_reasons(self, worker: str) -> list[str]:
        """Why the broker declared `worker` dead, each time it did (its `worker_lost` log events)."""
        reasons = []
        for line in self.broker.log_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "worker_lost" and event.get("worker") == worker:
                reasons.append(str(event.get("reason")))
        return reasons


@pytest.fixture
def multihost(tmp_path: Path) -> Iterator[MultiHost]:
    """Namespaces broker, w1, w2 on one bridge, the test process on it too; a broker and two random:tiny
    workers (2 sessions each) started in theirs. Everything is stopped and deleted, pass or fail."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    lan = Lan()
    daemons: list[NetnsDaemon] = []
    try:
        broker_host = lan.add_host("broker")
        clients = f"tcp://{broker_host.address}:{CLIENT_PORT}"
        workers_address = f"tcp://{broker_host.address}:{WORKER_PORT}"
        broker = NetnsDaemon(broker_host.netns, "broker.cli", [
            "--clients", clients, "--workers", workers_address, "--heartbeat-ms", str(HEARTBEAT_MS),
            "--liveness", str(LIVENESS), "--log-level", "debug",
        ], tmp_path / "broker.log")
        daemons.append(broker)
        workers: dict[str, NetnsDaemon] = {}
        for name in ("w1", "w2"):
            host = lan.add_host(name)
            workers[name] = NetnsDaemon(host.netns, "worker.cli", [
                "--broker", workers_address, "--model", "random:tiny", "--device", "cpu", "--name", name,
                "--max-sessions", "2", "--max-context", str(MAX_CONTEXT), "--reconnect-max-ms", "200",
            ], tmp_path / f"{name}.log")
            daemons.append(workers[name])
        yield MultiHost(lan, clients, broker, workers)
    finally:
        for daemon in reversed(daemons):  # workers first: a worker outliving its broker only logs about it
            daemon.close()
        lan.close()


def test_a_pulled_cable_loses_that_hosts_sessions_in_time_and_the_host_comes_back_with_them(
    multihost: MultiHost, record_property: Callable[[str, object], None],
) -> None:
    lan = multihost.lan
    with multihost.client() as c:
        cut, kept, greedy = spread_over_both_hosts(c, multihost)

        # 2. Pull w1's cable while it streams: SessionLost within (liveness + 1) heartbeats; w2 serves on.
        stream = cut.generate(max_tokens=LONG, ignore_eos=True, stream=True)
        assert next(stream).finish_reason is None
        lan.cut("w1")
        cut_at = time.monotonic()
        lost_s = seconds_until_lost(stream, since=cut_at)
        record_property("session_lost_after_cut_s", round(lost_s, 3))
        log.info("SessionLost %.3f s after the cut (budget %.1f s + %.1f s slack)", lost_s, BUDGET_S, SLACK_S)
        assert lost_s <= BUDGET_S + SLACK_S, f"SessionLost {lost_s:.3f} s after the cut, budget {BUDGET_S} s"

        after = kept.generate(max_tokens=8, temperature=0, ignore_eos=True)
        assert (len(after.token_ids), after.session_length) == (8, 20)
        with pytest.raises(SessionLost):  # later requests too: lost, not "not found"
            cut.info()
        assert status_of(c) == {"w2": (2, 1, 1)}

        # 3. Plug it back in. w1 never noticed it was declared dead: it registers again with READY, which lists
        #    the session it still holds. The broker does not take it back (its client was told it is lost): it
        #    tells w1 to drop it, which frees its slot and stops the generation that ran on for nobody.
        lan.restore("w1")
        back_s = wait_until("w1 registered again", lambda: worker_names(c) == ["w1", "w2"], 10, multihost)
        record_property("reregistered_after_restore_s", round(back_s, 3))
        log.info("w1 registered again %.3f s after the link came back", back_s)
        assert back_s <= 5.0
        assert status_of(c) == {"w1": (2, 0, 2), "w2": (2, 1, 1)}
        wait_until("w1 drops the lost session", lambda: "sessions_dropped" in multihost.workers["w1"].log_text(), 5,
                   multihost)
        with pytest.raises(SessionLost):  # lost for good
            cut.info()

        # New sessions go to w1 again: its two free slots take the next two, w2's last one the third.
        fresh = [c.session() for _ in range(3)]
        assert sorted(s.worker for s in fresh) == ["w1", "w1", "w2"]
        assert status_of(c) == {"w1": (2, 2, 0), "w2": (2, 2, 0)}
        for on_w1 in (s for s in fresh if s.worker == "w1"):
            assert on_w1.append(token_ids=PROMPT) == len(PROMPT)
            assert on_w1.generate(max_tokens=8, temperature=0, ignore_eos=True).token_ids == greedy
        for s in (cut, kept, *fresh):
            s.close()
        assert status_of(c) == {"w1": (2, 0, 2), "w2": (2, 0, 2)}
    assert multihost.lost_reasons("w1") == ["missed heartbeats"]
    assert multihost.lost_reasons("w2") == []


def test_after_a_long_outage_the_host_comes_back_once_and_stays(
    multihost: MultiHost, record_property: Callable[[str, object], None],
) -> None:
    """The cable is out for LONG_OUTAGE_S: the worker's ZeroMQ drops the TCP connection and dials again.
    Once back, w1 is registered once, for good: a new session on it answers throughout, and the one lost with
    the outage stays lost."""
    lan = multihost.lan
    with multihost.client() as c:
        cut, _, _ = spread_over_both_hosts(c, multihost)
        lan.cut("w1")
        cut_at = time.monotonic()
        lost_s = wait_until("w1 declared dead", lambda: worker_names(c) == ["w2"], 5, multihost)
        record_property("worker_lost_after_cut_s", round(lost_s, 3))
        log.info("w1 dropped from the status %.3f s after the cut", lost_s)
        assert lost_s <= BUDGET_S + SLACK_S
        with pytest.raises(SessionLost):
            cut.info()

        time.sleep(max(0.0, LONG_OUTAGE_S - (time.monotonic() - cut_at)))
        lan.restore("w1")
        back_s = wait_until("w1 registered again", lambda: worker_names(c) == ["w1", "w2"], 15, multihost)
        record_property("reregistered_after_long_outage_s", round(back_s, 3))
        log.info("w1 registered again %.3f s after a %.0f s outage", back_s, LONG_OUTAGE_S)
        fresh = next(s for s in (c.session(), c.session()) if s.worker == "w1")  # w1's two slots are free again
        fresh.append(token_ids=PROMPT)
        watch_until = time.monotonic() + 6.0  # past the broker's next TCP retransmission of the old connection
        while time.monotonic() < watch_until:
            info = fresh.info()
            assert (info.worker, info.length) == ("w1", len(PROMPT))
            time.sleep(0.1)
        with pytest.raises(SessionLost):
            cut.info()
    assert multihost.lost_reasons("w1") == ["missed heartbeats"]


def spread_over_both_hosts(c: Client, cluster: MultiHost) -> tuple[Session, Session, list[int]]:
    """Step 1: two sessions spread over the two hosts (the most free slots wins) and both generate, the same
    greedy tokens (the same seeded model). (session on w1, session on w2, those tokens)."""
    wait_until("both workers registered", lambda: worker_names(c) == ["w1", "w2"], 60, cluster)
    sessions = {s.worker: s for s in (c.session(), c.session())}
    assert sorted(sessions) == ["w1", "w2"]
    greedy = []
    for s in (sessions["w1"], sessions["w2"]):
        assert s.append(token_ids=PROMPT) == len(PROMPT)
        greedy.append(s.generate(max_tokens=8, temperature=0, ignore_eos=True))
    assert [(len(g.token_ids), g.finish_reason, g.session_length) for g in greedy] == [(8, "length", 12)] * 2
    assert greedy[0].token_ids == greedy[1].token_ids
    assert status_of(c) == {"w1": (2, 1, 1), "w2": (2, 1, 1)}
    return sessions["w1"], sessions["w2"], greedy[0].token_ids


def wait_until(what: str, condition: Callable[[], bool], timeout: float, cluster: MultiHost) -> float:
    """Poll `condition` until true; the seconds it took. TimeoutError with the daemons' logs otherwise."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not within {timeout} s: {what}\n{cluster.logs()}")
        time.sleep(0.02)
    return time.monotonic() - start


def worker_names(c: Client) -> list[str]:
    return sorted(w.name for w in c.status())


def status_of(c: Client) -> dict[str, tuple[int, int, int]]:
    """Worker name -> (capacity, sessions, free slots), as the broker reports it."""
    return {w.name: (w.capacity, w.sessions, w.free_slots) for w in c.status()}
