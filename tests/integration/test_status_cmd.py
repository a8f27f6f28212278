"""`broker status` against real brokers, and a scrape of a live broker loop's metrics over HTTP."""

from __future__ import annotations

import http.client
import io
import json
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from broker import status_cmd
from broker.common import protocol as p
from broker.common.metrics_http import MetricsServer, Pulse
from broker.counters import RouterCounters
from broker.metrics import BrokerMetrics
from broker.server import BrokerConfig, BrokerServer

from .cluster import Cluster, free_port


def run_status(*argv: str) -> tuple[int, str, str]:
    import argparse

    top = argparse.ArgumentParser(prog="broker")
    status_cmd.add_parser(top.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    code = status_cmd.run(top.parse_args(["status", *argv]), out, err)
    return code, out.getvalue(), err.getvalue()


def test_status_lists_the_live_worker_and_follows_its_sessions(one_worker: Cluster) -> None:
    code, out, err = run_status("--clients", one_worker.clients)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "1 worker"
    row = lines[4].split()
    assert (row[0], row[3:8]) == ("w1", ["2048", "4", "0", "4", "no"])  # context, capacity, sessions, free, draining
    with one_worker.client() as c, c.session():
        code, out, _ = run_status("--clients", one_worker.clients, "--json")
        assert code == 0
        [worker] = json.loads(out)
        assert (worker["name"], worker["capacity"], worker["sessions"], worker["free_slots"]) == ("w1", 4, 1, 3)
        assert worker["device"] == "cpu" and worker["draining"] is False and worker["max_context"] == 2048


def test_status_without_a_broker_exits_1_after_the_timeout() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    code, out, err = run_status("--clients", address, "--timeout", "0.5")
    took = time.monotonic() - start
    assert (code, out) == (1, "")
    assert err == (f"broker status: no answer from the broker at {address} within 0.5 s "
                   "(is it running, and is this its client address?)\n")
    assert 0.5 <= took < 3.0


# -- a live broker loop, scraped --------------------------------------------------------------------------


@pytest.fixture
def live_broker() -> Iterator[tuple[BrokerConfig, MetricsServer, Pulse]]:
    """A broker loop in a thread (as `broker start --metrics-port 0` would run it), its metrics served."""
    config = BrokerConfig(clients=f"tcp://127.0.0.1:{free_port()}", workers=f"tcp://127.0.0.1:{free_port()}",
                          heartbeat_ms=100, recovery_ms=200)
    server = BrokerServer(config)
    metrics = BrokerMetrics(server.router, RouterCounters())
    pulse = Pulse(stale_after_s=5.0)
    stop = threading.Event()

    def should_stop() -> bool:
        pulse.beat()  # what the lead's loop does once per turn
        return stop.is_set()

    loop = threading.Thread(target=server.serve, args=(should_stop,), daemon=True)
    http_server = MetricsServer(metrics.registry, alive=pulse.alive, ready=metrics.readiness)
    try:
        loop.start()
        http_server.start()
        yield config, http_server, pulse
    finally:
        http_server.close()
        stop.set()
        loop.join(timeout=5)
        server.close()


def scrape(server: MetricsServer, path: str = "/metrics") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def gauge(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_a_scrape_of_a_live_broker_sees_a_worker_register(live_broker: tuple[BrokerConfig, MetricsServer, Pulse]) -> None:
    config, server, _ = live_broker
    assert scrape(server, "/healthz") == (200, "ok\n")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, b"fake-worker")
        dealer.connect(config.workers)
        dealer.send_multipart(p.encode(p.Ready(name="fake", model="m", capacity=3, free_slots=3, max_context=64,
                                               device="cpu", bytes_per_session=4096)))
        deadline = time.monotonic() + 10
        while True:
            status, text = scrape(server)
            assert status == 200
            if gauge(text, "sessionserve:num_workers") == 1:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
        assert gauge(text, "sessionserve:worker_capacity", worker="fake", model="m", device="cpu") == 3
        assert gauge(text, "sessionserve:worker_session_bytes", worker="fake", model="m", device="cpu") == 4096
        deadline = time.monotonic() + 10
        while scrape(server, "/readyz")[0] != 200:  # recovery (200 ms) over
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert scrape(server, "/readyz") == (200, "ready: 1 workers, 1 taking new sessions\n")
        code, out, err = run_status("--clients", config.clients, "--json")
        assert (code, err) == (0, "")
        assert [(w["name"], w["capacity"], w["free_slots"]) for w in json.loads(out)] == [("fake", 3, 3)]
    finally:
        dealer.close(linger=0)
        context.term()
