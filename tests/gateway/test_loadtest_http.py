"""`loadtest --http`: the load test's users through the gateway, their conversations resumed turn after turn, and
`--compare` against the native client in the same run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.bench.loadtest import LoadConfig, run
from client.bench.loadtest.cli import main

from .conftest import Gateways, http_get


def opened(url: str) -> dict[str, float]:
    _, text = http_get(url + "/metrics")
    return {s.labels["how"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "sessionserve:gateway_sessions_opened_total"}


def test_http_users_resume_their_sessions_every_turn(gateways: Gateways) -> None:
    url = gateways.start(extra=["--max-idle-sessions", "2"])
    for kind in ("tokens", "text"):
        before = opened(url)
        report = run(LoadConfig(broker=None, http=url, sessions=2, prompt_tokens=8, max_tokens=4, turns=3,
                                ignore_eos=True, prompt_kind=kind, timeout=60))
        assert (report.completed, report.failed, report.mode) == (6, 0, "http")
        assert report.total_output_tokens == 24 and report.ttft.count == 6
        after = opened(url)
        assert after.get("new", 0) - before.get("new", 0) == 2  # one session per conversation ...
        assert after.get("session_id", 0) - before.get("session_id", 0) == 4  # ... resumed on each later turn


def test_http_users_keep_to_the_context_the_gateway_lists(gateways: Gateways) -> None:
    """--max-context above the worker's 1,024: the users learn max_model_len from GET /v1/models and start a new
    conversation before a turn would pass it (the third 304-token turn ends at 912; a fourth would reach 1,216)."""
    url = gateways.start(extra=["--max-idle-sessions", "2"])
    report = run(LoadConfig(broker=None, http=url, sessions=1, prompt_tokens=300, max_tokens=4, turns=4,
                            max_context=4096, ignore_eos=True, timeout=60))
    assert (report.completed, report.failed) == (4, 0)
    assert report.counts["context_rollovers"] == 1 and report.counts["sessions_opened"] == 2


def finished(gateways: Gateways) -> dict[str, float]:
    """The worker's generations finished so far, by reason."""
    _, text = http_get(gateways.worker_metrics)
    return {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "sessionserve:request_success_total"}


def held(url: str) -> dict[str, float]:
    _, text = http_get(url + "/metrics")
    return {s.labels["state"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "sessionserve:gateway_sessions"}


@pytest.mark.slow
def test_http_run_stopped_drops_its_turns_and_deletes_its_sessions(gateways: Gateways) -> None:
    """Stopped once two turns are done (as Ctrl-C does): the turns in flight are cut short (their connections
    dropped: the gateway cancels their generations), every conversation is deleted (one still ending is closed when
    its turn has ended), and the gateway and the broker hold none of them afterwards."""
    url = gateways.start()
    with gateways.stack.client() as c:
        sessions_before = sum(w.sessions for w in c.status())
    before = finished(gateways)
    stop = threading.Event()

    def stop_after_two_turns() -> None:
        deadline = time.monotonic() + 180
        while finished(gateways).get("length", 0) - before.get("length", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()

    watcher = threading.Thread(target=stop_after_two_turns, daemon=True)
    watcher.start()
    report = run(LoadConfig(broker=None, http=url, sessions=2, prompt_tokens=8, max_tokens=24, turns=1000,
                            duration=300, ignore_eos=True, timeout=60), stop=stop)
    watcher.join()
    assert report.interrupted and report.completed >= 2 and (report.failed, report.request_errors) == (0, {})
    assert 1 <= report.cut_short <= 2 and report.total_output_tokens == 24 * report.completed
    assert report.ops["close"].count == report.counts["sessions_opened"] and not report.op_errors
    # The gateway cancels the generations and closes the broker sessions without waiting for their answers.
    deadline = time.monotonic() + 10
    while held(url) != {"idle": 0, "busy": 0}:
        assert time.monotonic() < deadline, f"the gateway still holds {held(url)}"
        time.sleep(0.05)
    with gateways.stack.client() as c:
        while sum(w.sessions for w in c.status()) != sessions_before:
            assert time.monotonic() < deadline, "the run's sessions are still open at the broker"
            time.sleep(0.05)
    while finished(gateways).get("cancelled", 0) == before.get("cancelled", 0):
        assert time.monotonic() < deadline, "no generation was cancelled"
        time.sleep(0.05)


def test_http_refuses_what_the_openai_api_cannot_do() -> None:
    with pytest.raises(ValueError, match="no fork"):
        LoadConfig(http="http://127.0.0.1:1", fork_every=2).validate()
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        LoadConfig(http="tcp://127.0.0.1:1").validate()


def test_compare_runs_native_then_http_and_reports_both(gateways: Gateways, tmp_path: Path) -> None:
    url = gateways.start(extra=["--max-idle-sessions", "2"])
    out = tmp_path / "compare.json"
    code = main(["--http", url, "--broker", gateways.stack.clients, "--compare", "--sessions", "2", "--prompt-tokens",
                 "8", "--max-tokens", "3", "--turns", "2", "--ignore-eos", "--no-progress", "--json", str(out)])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["native"]["completed"] == figures["http"]["completed"] == 4
    assert figures["native"]["mode"] == "full-stack" and figures["http"]["mode"] == "http"
    assert figures["comparison"]["output_throughput_ratio"] > 0 and figures["comparison"]["ttft_p50_added_ms"] is not None


def test_compare_together_runs_half_the_sessions_each_way_at_once(gateways: Gateways, tmp_path: Path) -> None:
    url = gateways.start(extra=["--max-idle-sessions", "2"])
    out = tmp_path / "together.json"
    code = main(["--http", url, "--broker", gateways.stack.clients, "--compare", "together", "--sessions", "2",
                 "--processes", "2", "--prompt-tokens", "8", "--max-tokens", "3", "--turns", "2", "--ignore-eos",
                 "--warmup", "0", "--no-progress", "--json", str(out)])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["native"]["completed"] == figures["http"]["completed"] == 2  # one conversation of 2 turns each way
    assert figures["native"]["mode"] == "full-stack" and figures["http"]["mode"] == "http"
    assert figures["native"]["total_output_tokens"] == figures["http"]["total_output_tokens"] == 6
    assert figures["comparison"]["ttft_p50_added_ms"] is not None
    # each side's second turn: its TTFT has no session opening in it on either path
    assert figures["native"]["p50_ttft_later_ms"] is not None and figures["http"]["p50_ttft_later_ms"] is not None
    assert figures["comparison"]["ttft_later_p50_added_ms"] is not None


def test_compare_together_needs_a_side_for_each() -> None:
    from client.bench.loadtest.cli import run_together

    with pytest.raises(ValueError, match="at least 2 sessions and 2 processes"):
        run_together(LoadConfig(broker="tcp://127.0.0.1:1", http="http://127.0.0.1:1", sessions=2, processes=1))
