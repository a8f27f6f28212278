"""`--metrics-port` on the real daemons: /healthz, /readyz and /metrics that count what was done."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .cluster import Cluster, free_port

PROMPT = [7, 8, 9, 10]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[str, float]:
    """name{labels} -> value, labels sorted, for exact lookups."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("worker", "model", "device"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_both_daemons_serve_health_readiness_and_exact_counts(cluster: Cluster) -> None:
    bport, wport = free_port(), free_port()
    cluster.start_broker(["--metrics-port", str(bport)])
    cluster.start_worker("w1", extra=["--metrics-port", str(wport)])
    cluster.wait_for_workers({"w1"})
    broker, worker = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{wport}"
    deadline = time.monotonic() + 10
    while get(f"{worker}/readyz")[0] != 200:  # registered with the broker
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert get(f"{broker}/healthz") == (200, "ok\n") and get(f"{worker}/healthz") == (200, "ok\n")
    # A new broker is not ready until its recovery window (--recovery-ms) has passed, however soon workers register.
    while (ready := get(f"{broker}/readyz"))[0] != 200:
        assert ready == (503, "recovering: waiting for workers to re-register\n")
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert get(f"{worker}/nope")[0] == 404
    with cluster.client() as c, c.session() as s:
        s.append(token_ids=PROMPT)
        assert len(s.generate(max_tokens=5, ignore_eos=True).token_ids) == 5
        assert len(list(s.generate(max_tokens=3, ignore_eos=True, stream=True))) >= 1
    # The worker answers a close at once and republishes its session table after the batch of requests it came in
    # (a burst of closes rebuilds it once): the gauge follows within that batch, so wait for it.
    deadline = time.monotonic() + 10
    while (w := samples(get(f"{worker}/metrics")[1]))["sessionserve:num_sessions{}"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert w["sessionserve:generation_tokens_total{}"] == 8
    # The prompt, and the second generation's first row: the first answer's last token, pending until then.
    assert w["sessionserve:prompt_tokens_total{}"] == len(PROMPT) + 1
    assert w["sessionserve:request_success_total{finished_reason=length}"] == 2
    assert w["sessionserve:time_to_first_token_seconds_count{}"] == 2
    assert w["sessionserve:inter_token_latency_seconds_count{}"] == 8 - 2
    assert w["sessionserve:session_capacity{}"] == 4
    assert w["sessionserve:requests_total{command=generate}"] == 2
    assert w["sessionserve:session_moves_total{event=sent}"] == w["sessionserve:session_moves_total{event=failed}"] == 0
    b = samples(get(f"{broker}/metrics")[1])
    assert b["sessionserve:num_workers{}"] == 1
    assert b["sessionserve:requests_total{command=generate}"] == 2
    assert b["sessionserve:requests_total{command=create}"] == 1


def wait_for(url: str, wanted: tuple[int, str], passing: tuple[tuple[int, str], ...], timeout_s: float = 10) -> None:
    """Poll `url` until it answers `wanted`; meanwhile it may answer only one of `passing` (or not be up yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = get(url)
        except urllib.error.URLError:
            got = (0, "not listening yet")
        if got == wanted:
            return
        assert got in (*passing, (0, "not listening yet")), got
        assert time.monotonic() < deadline, got
        time.sleep(0.05)


def test_a_broker_is_ready_only_once_a_worker_takes_new_sessions(cluster: Cluster) -> None:
    """A broker without a worker cannot serve anything: its /readyz said 200 all the same (--min-workers was 0)."""
    port = free_port()
    cluster.start_broker(["--metrics-port", str(port)])
    readyz = f"http://127.0.0.1:{port}/readyz"
    recovering = (503, "recovering: waiting for workers to re-register\n")
    no_worker = (503, "0 workers take new sessions; 1 needed\n")
    wait_for(readyz, no_worker, passing=(recovering,))
    time.sleep(3 * cluster.heartbeat_ms / 1000)
    assert get(readyz) == no_worker  # for good, not for a moment
    cluster.start_worker("w1")
    cluster.wait_for_workers({"w1"})
    assert get(readyz) == (200, "ready: 1 workers, 1 taking new sessions\n")


def test_min_workers_0_makes_a_broker_without_workers_ready(cluster: Cluster) -> None:
    port = free_port()
    cluster.start_broker(["--metrics-port", str(port), "--min-workers", "0"])
    recovering = (503, "recovering: waiting for workers to re-register\n")
    wait_for(f"http://127.0.0.1:{port}/readyz", (200, "ready: 0 workers, 0 taking new sessions\n"),
             passing=(recovering,))
