"""`broker status` without a broker: its arguments, the table and JSON for a fixed list of workers."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from broker import status_cmd
from broker.common import protocol as p

WORKERS = [  # as a StatusReport lists them; the heartbeat age in ms; cpu1's broker did not say its context,
    # its model recommends no sampling
    p.WorkerStatus("gpu0", "SmolLM2-135M-Instruct", 64, 60, 4, False, "cuda:0", 250, 2048,
                   p.SamplingDefaults(temperature=0.6, top_k=20), tools=True),
    p.WorkerStatus("cpu1", "SmolLM2-135M-Instruct", 8, 8, 0, True, "", 1500),
]


def parse(*argv: str) -> argparse.Namespace:
    top = argparse.ArgumentParser(prog="broker")
    status_cmd.add_parser(top.add_subparsers(dest="command", required=True))
    return top.parse_args(["status", *argv])


def test_the_table_lists_workers_by_model_and_name_with_a_totals_row() -> None:
    assert status_cmd.render(WORKERS) == (
        "2 workers\n"
        "\n"
        "  worker   model                   device   context   capacity   sessions   free   draining   last seen\n"
        " ───────────────────────────────────────────────────────────────────────────────────────────────────────\n"
        "  cpu1     SmolLM2-135M-Instruct   -              -          8          0      8        yes        1.5s\n"
        "  gpu0     SmolLM2-135M-Instruct   cuda:0      2048         64          4     60         no        0.2s\n"
        "\n"
        "  total                                                     72          4     68          1\n"
        "\n"
    )


def test_no_workers_is_an_empty_table_with_zero_totals() -> None:
    lines = status_cmd.render([]).splitlines()
    assert lines[0] == "0 workers"
    assert lines[-2] == "  total                                      0          0      0          0"


def test_json_lists_every_field_and_the_heartbeat_age(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_cmd, "fetch", lambda args: WORKERS)
    out, err = io.StringIO(), io.StringIO()
    assert status_cmd.run(parse("--json"), out, err) == 0
    assert json.loads(out.getvalue()) == [
        {"name": "gpu0", "model": "SmolLM2-135M-Instruct", "capacity": 64, "free_slots": 60, "sessions": 4,
         "draining": False, "device": "cuda:0", "max_context": 2048, "last_seen_s": 0.25,
         "sampling_defaults": {"temperature": 0.6, "top_k": 20}, "tools": True},
        {"name": "cpu1", "model": "SmolLM2-135M-Instruct", "capacity": 8, "free_slots": 8, "sessions": 0,
         "draining": True, "device": "", "max_context": 0, "last_seen_s": 1.5, "sampling_defaults": {},
         "tools": False},
    ]
    assert err.getvalue() == ""


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BROKER_CLIENTS", "BROKER_STATUS_BROKER_KEY", "CLIENT_BROKER_KEY", "BROKER_STATUS_KEY", "CLIENT_KEY"):
        monkeypatch.delenv(name, raising=False)
    args = parse()
    assert (args.clients, args.broker_key, args.key, args.json, args.timeout) == (
        "tcp://127.0.0.1:5555", None, None, False, 5.0)
    monkeypatch.setenv("BROKER_CLIENTS", "tcp://10.0.0.1:7000")
    monkeypatch.setenv("CLIENT_BROKER_KEY", "/k/broker.key")
    monkeypatch.setenv("CLIENT_KEY", "/k/me.key_secret")
    monkeypatch.setenv("BROKER_STATUS_KEY", "/k/ops.key_secret")  # the status command's own wins
    args = parse()
    assert (args.clients, args.broker_key, args.key) == ("tcp://10.0.0.1:7000", "/k/broker.key", "/k/ops.key_secret")


@pytest.mark.parametrize("timeout", ["0", "-1", "soon"])
def test_a_bad_timeout_is_refused_by_argparse(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("--timeout", timeout)
    assert exit_info.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_one_key_without_the_other_is_a_clear_error_not_a_traceback() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert status_cmd.run(parse("--key", "/nonexistent/me.key_secret", "--timeout", "0.2"), out, err) == 1
    assert out.getvalue() == ""
    assert err.getvalue().startswith("broker status: ")
