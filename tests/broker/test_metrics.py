"""The broker's metrics: the collector's exposition for a known router state, the counters, the HTTP endpoints."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from broker.common import metrics_http
from broker.common import protocol as p
from broker.common.metrics import MAX_LABEL_VALUES
from broker.common.metrics_http import MetricsServer, Pulse
from broker.counters import RouterCounters, lost_reason
from broker.metrics import BrokerMetrics
from broker.router import Router, Settings

SETTINGS = Settings(heartbeat_s=0.25, liveness=3, recovery_s=1.0)
W1, W2 = b"w1-id", b"w2-id"
C1 = b"client-1"
SID = "a" * 32

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str, prefix: str = "sessionserve:") -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(metrics: BrokerMetrics) -> Samples:
    from prometheus_client import generate_latest

    return samples(generate_latest(metrics.registry).decode())


def two_workers() -> Router:
    """w1 (2 slots, cuda:0, 1 MiB per session) with a create in flight; w2 (4 slots, one session) draining."""
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    router.worker_message(W1, p.encode(p.Ready(name="w1", model="m", capacity=2, free_slots=2, max_context=64,
                                               device="cuda:0", bytes_per_session=1 << 20)), 2.0)
    router.worker_message(W2, p.encode(p.Ready(name="w2", model="m", capacity=4, free_slots=3, max_context=64,
                                               sessions=(SID,), device="cpu", draining=True)), 2.5)
    [sent] = router.client_message(C1, p.encode(p.CreateSession(request_id="r1")), 3.0)
    assert sent.identity == W1
    return router


NO_MOVE_PAUSES: Samples = {("sessionserve:session_move_pause_seconds_bucket", (("le", le),)): 0 for le in (
    "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf")}


def labels(worker: str, model: str, device: str) -> tuple[tuple[str, str], ...]:
    return (("device", device), ("model", model), ("worker", worker))


def test_the_collector_reads_the_router_state_at_scrape_time() -> None:
    counters = RouterCounters()
    metrics = BrokerMetrics(two_workers(), counters, clock=lambda: 4.0, process=False)
    w1, w2 = labels("w1", "m", "cuda:0"), labels("w2", "m", "cpu")
    assert scrape(metrics) == {
        ("sessionserve:num_workers", ()): 2,
        ("sessionserve:num_sessions", ()): 1,
        ("sessionserve:num_requests_running", ()): 1,  # the create
        ("sessionserve:num_requests_waiting", ()): 0,
        ("sessionserve:recovering", ()): 0,
        ("sessionserve:clients_gone", ()): 0,
        ("sessionserve:worker_capacity", w1): 2,
        ("sessionserve:worker_capacity", w2): 4,
        ("sessionserve:worker_sessions", w1): 0,
        ("sessionserve:worker_sessions", w2): 1,
        ("sessionserve:worker_free_slots", w1): 1,  # 2 slots, one promised to the create in flight
        ("sessionserve:worker_free_slots", w2): 3,
        ("sessionserve:worker_draining", w1): 0,
        ("sessionserve:worker_draining", w2): 1,
        ("sessionserve:worker_session_bytes", w1): 1 << 20,  # w2 did not say: no series
        ("sessionserve:worker_last_seen_seconds", w1): 2.0,
        ("sessionserve:worker_last_seen_seconds", w2): 1.5,
        ("sessionserve:workers_registered_total", ()): 0,
        ("sessionserve:worker_reregistrations_total", ()): 0,
        ("sessionserve:sessions_lost_total", ()): 0,
        ("sessionserve:broker_loop_errors_total", ()): 0,
        ("sessionserve:broker_stalls_total", ()): 0,
        ("sessionserve:creates_replaced_total", ()): 0,
        ("sessionserve:sessions_dropped_total", ()): 0,
        ("sessionserve:sessions_lease_expired_total", ()): 0,
        ("sessionserve:session_moves_running", ()): 0,
        **NO_MOVE_PAUSES,
        ("sessionserve:session_move_pause_seconds_count", ()): 0,
        ("sessionserve:session_move_pause_seconds_sum", ()): 0,
    }


def test_counters_are_exported_by_label_and_a_command_and_its_name_are_one_series() -> None:
    counters = RouterCounters()
    metrics = BrokerMetrics(two_workers(), counters, clock=lambda: 4.0, process=False)
    counters.request(p.Command.CREATE)
    counters.request("create")
    counters.request(p.Command.GENERATE)
    counters.error(p.ErrorCode.SESSION_LOST)
    counters.error("session_lost")
    counters.error(p.ErrorCode.CAPACITY_EXHAUSTED)
    counters.worker_registered()
    counters.worker_registered()
    counters.worker_registered(again=True)
    counters.worker_lost("missed heartbeats", sessions=3)
    counters.worker_lost("disconnected: drained")
    counters.worker_lost("disconnected: engine failed", sessions=2)
    counters.dropped("unregistered")
    counters.dropped("unregistered")
    counters.dropped("rate_limited")
    counters.loop_errors += 1
    counters.stalls += 5
    counters.creates_replaced += 2
    counters.sessions_dropped += 3
    counters.sessions_lease_closed += 4
    got = {k: v for k, v in scrape(metrics).items() if k[0].endswith("_total")}
    assert got == {
        ("sessionserve:requests_total", (("command", "create"),)): 2,
        ("sessionserve:requests_total", (("command", "generate"),)): 1,
        ("sessionserve:request_errors_total", (("code", "capacity_exhausted"),)): 1,
        ("sessionserve:request_errors_total", (("code", "session_lost"),)): 2,
        ("sessionserve:workers_lost_total", (("reason", "disconnected"),)): 2,
        ("sessionserve:workers_lost_total", (("reason", "missed_heartbeats"),)): 1,
        ("sessionserve:workers_registered_total", ()): 2,
        ("sessionserve:worker_reregistrations_total", ()): 1,
        ("sessionserve:sessions_lost_total", ()): 5,
        ("sessionserve:worker_messages_dropped_total", (("reason", "rate_limited"),)): 1,
        ("sessionserve:worker_messages_dropped_total", (("reason", "unregistered"),)): 2,
        ("sessionserve:broker_loop_errors_total", ()): 1,
        ("sessionserve:broker_stalls_total", ()): 5,
        ("sessionserve:creates_replaced_total", ()): 2,
        ("sessionserve:sessions_dropped_total", ()): 3,
        ("sessionserve:sessions_lease_expired_total", ()): 4,
    }


def test_a_counter_keeps_at_most_max_label_values_and_counts_the_rest_as_other() -> None:
    counters = RouterCounters()
    for i in range(MAX_LABEL_VALUES + 5):
        counters.error(f"code{i}")
    counters.error("code0")
    assert len(counters.errors) == MAX_LABEL_VALUES + 1  # and "other"
    assert counters.errors["code0"] == 2
    assert counters.errors["other"] == 5


def test_an_error_code_that_is_not_a_string_counts_as_invalid() -> None:
    counters = RouterCounters()
    counters.error(["not", "hashable"])
    counters.error(7)
    assert counters.errors == {"invalid": 2}


@pytest.mark.parametrize(("reason", "label"), [
    ("missed heartbeats", "missed_heartbeats"), ("disconnected: drained", "disconnected"),
    ("unreachable", "unreachable"), ("", "unknown"), ("  Hung  Engine : x", "hung_engine"),
])
def test_lost_reasons_become_bounded_labels(reason: str, label: str) -> None:
    assert lost_reason(reason) == label


def test_held_requests_and_recovery_are_visible_and_the_broker_is_not_ready_while_recovering() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    router.client_message(C1, p.encode(p.Info(request_id="r1", session_id=SID)), 0.5)  # unknown yet: held
    clock = [0.5]
    metrics = BrokerMetrics(router, RouterCounters(), clock=lambda: clock[0], process=False)
    got = scrape(metrics)
    assert got[("sessionserve:num_requests_waiting", ())] == 1
    assert got[("sessionserve:recovering", ())] == 1
    assert metrics.readiness() == (False, "recovering: waiting for workers to re-register")
    clock[0] = 1.5  # recovered, but no worker registered: nothing could serve the held request either
    assert metrics.readiness() == (False, "0 workers take new sessions; 1 needed")


def test_by_default_a_broker_is_ready_only_with_a_worker_that_takes_new_sessions() -> None:
    """It answered 200 with no worker at all (nothing could be served) unless told how many to wait for."""
    empty = Router(SETTINGS, now=0.0, broker_id="b1")
    assert BrokerMetrics(empty, RouterCounters(), clock=lambda: 4.0, process=False).readiness() == (
        False, "0 workers take new sessions; 1 needed")
    draining_only = Router(SETTINGS, now=0.0, broker_id="b1")
    draining_only.worker_message(W2, p.encode(p.Ready(name="w2", model="m", capacity=4, free_slots=4, max_context=64,
                                                      draining=True)), 2.0)
    assert BrokerMetrics(draining_only, RouterCounters(), clock=lambda: 4.0, process=False).readiness() == (
        False, "0 workers take new sessions; 1 needed")
    assert BrokerMetrics(two_workers(), RouterCounters(), clock=lambda: 4.0, process=False).readiness() == (
        True, "ready: 2 workers, 1 taking new sessions")


def test_readiness_can_require_more_workers_or_none() -> None:
    metrics = BrokerMetrics(two_workers(), RouterCounters(), min_workers=2, clock=lambda: 4.0, process=False)
    assert metrics.readiness() == (False, "1 workers take new sessions; 2 needed")
    empty = BrokerMetrics(Router(SETTINGS, now=0.0, broker_id="b1"), RouterCounters(), min_workers=0,
                          clock=lambda: 4.0, process=False)
    assert empty.readiness() == (True, "ready: 0 workers, 0 taking new sessions")


def test_two_workers_with_one_name_keep_separate_series() -> None:
    router = Router(SETTINGS, now=0.0, broker_id="b1")
    for identity in (b"twin-00000001", b"twin-00000002"):
        router.worker_message(identity, p.encode(p.Ready(name="twin", model="m", capacity=1, free_slots=1,
                                                         max_context=64)), 2.0)
    got = scrape(BrokerMetrics(router, RouterCounters(), clock=lambda: 2.0, process=False))
    capacity = {dict(k[1])["worker"]: v for k, v in got.items() if k[0] == "sessionserve:worker_capacity"}
    assert capacity == {"twin": 1, "twin#" + b"0002".hex(): 1}


def test_the_process_collector_is_on_by_default() -> None:
    from prometheus_client import generate_latest

    text = generate_latest(BrokerMetrics(two_workers(), RouterCounters()).registry).decode()
    assert "process_resident_memory_bytes" in text


# -- the HTTP server -------------------------------------------------------------------------------------


def get(server: MetricsServer, path: str) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read().decode()
    finally:
        conn.close()


class Failing(Collector):
    def __init__(self) -> None:
        self.fail = True

    def collect(self) -> Iterator[object]:  # type: ignore[override]
        if self.fail:
            raise RuntimeError("collector broke")
        return iter(())


@pytest.fixture
def served() -> Iterator[tuple[MetricsServer, Pulse, list[tuple[bool, str]]]]:
    clock = [100.0]
    pulse = Pulse(stale_after_s=10.0, clock=lambda: clock[0])
    readiness = [(True, "ready")]
    metrics = BrokerMetrics(two_workers(), RouterCounters(), clock=lambda: 4.0, process=False)
    server = MetricsServer(metrics.registry, "127.0.0.1", 0, alive=pulse.alive, ready=lambda: readiness[0]).start()
    server.clock = clock  # type: ignore[attr-defined]
    try:
        yield server, pulse, readiness
    finally:
        server.close()


def test_metrics_endpoint_serves_the_registry_as_prometheus_text(
    served: tuple[MetricsServer, Pulse, list[tuple[bool, str]]],
) -> None:
    server, _, _ = served
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    status, content_type, body = get(server, "/metrics")
    assert (status, content_type) == (200, "text/plain; version=0.0.4; charset=utf-8")
    assert samples(body)[("sessionserve:num_workers", ())] == 2
    assert get(server, "/metrics?x=1")[0] == 200


def test_healthz_follows_the_loop_pulse(served: tuple[MetricsServer, Pulse, list[tuple[bool, str]]]) -> None:
    server, pulse, _ = served
    clock = server.clock  # type: ignore[attr-defined]
    assert get(server, "/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
    clock[0] += 10.0  # the loop has not beaten for stale_after_s
    assert get(server, "/healthz") == (503, "text/plain; charset=utf-8", "the serving loop is stalled\n")
    pulse.beat()
    assert get(server, "/healthz")[0] == 200


def test_readyz_answers_503_with_the_reason(served: tuple[MetricsServer, Pulse, list[tuple[bool, str]]]) -> None:
    server, _, readiness = served
    assert get(server, "/readyz") == (200, "text/plain; charset=utf-8", "ready\n")
    readiness[0] = (False, "recovering: waiting for workers to re-register")
    assert get(server, "/readyz") == (503, "text/plain; charset=utf-8", "recovering: waiting for workers to re-register\n")


def test_unknown_paths_and_methods_are_refused(served: tuple[MetricsServer, Pulse, list[tuple[bool, str]]]) -> None:
    server, _, _ = served
    assert get(server, "/") == (404, "text/plain; charset=utf-8", "not found: try /metrics, /healthz or /readyz\n")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("POST", "/metrics", body=b"x")
        assert conn.getresponse().status == 501
    finally:
        conn.close()


def test_a_failing_collector_answers_500_and_the_server_keeps_serving() -> None:
    registry = CollectorRegistry()
    failing = Failing()
    registry.register(failing)
    with MetricsServer(registry) as server:
        assert get(server, "/metrics") == (500, "text/plain; charset=utf-8", "internal error\n")
        failing.fail = False
        assert get(server, "/metrics")[0] == 200
        assert get(server, "/healthz")[0] == 200


def test_a_failing_readiness_check_answers_500_not_a_crash() -> None:
    def broken() -> tuple[bool, str]:
        raise ValueError("no")

    with MetricsServer(CollectorRegistry(), ready=broken) as server:
        assert get(server, "/readyz")[0] == 500
        assert get(server, "/healthz")[0] == 200


def test_a_taken_port_is_an_os_error_and_close_frees_the_port() -> None:
    server = MetricsServer(CollectorRegistry()).start()
    port = server.port
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            MetricsServer(CollectorRegistry(), port=port)
    finally:
        server.close()
    server.close()  # twice is fine
    again = MetricsServer(CollectorRegistry(), port=port)  # the port is free again
    again.close()


def test_pulse_is_alive_until_it_goes_stale() -> None:
    clock = [0.0]
    pulse = Pulse(stale_after_s=metrics_http.DEFAULT_STALE_S, clock=lambda: clock[0])
    clock[0] = metrics_http.DEFAULT_STALE_S - 0.001
    assert pulse.alive()
    clock[0] = metrics_http.DEFAULT_STALE_S
    assert not pulse.alive()
    pulse.beat()
    assert pulse.alive()
