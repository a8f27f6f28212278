"""`loadtest --http`: the load test's users through the gateway, their conversations resumed turn after turn, and
`--compare` against the native client in the same run."""

from __future__ import annotations

import json
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
