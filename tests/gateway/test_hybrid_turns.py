"""A hybrid model (Qwen3.5: a recurrent state that cannot be cut back) behind the gateway, with Qwen3.5's chat
template: the template renders an earlier answer without the "<think>\n" its assistant prompt opened, so each turn is
sent whole from its start (GENERATE's from_start), and the session starts from its checkpoint, its state before that
"<think>\n", instead of computing the conversation again. A regenerate (the first request again) goes to a fork,
which starts from its share of the checkpoint and computes the "<think>\n" again; an edited last question to a fork
that starts from the turn before's checkpoint. The checkpoint goes with a session
into hibernation and through a worker's restart on its session store. Every answer is the one a new session gives."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.stack import LocalStack, free_port

from .conftest import Gateways, http_get
from .test_openai_client import sync_client

pytest.importorskip("transformers")

TEMPLATE = Path(__file__).parents[1] / "worker" / "templates" / "qwen3.5.jinja"
THINK = len(b"<think>\n")  # tokens of "<think>\n" for the bytes-only tokenizer: one a byte


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.worker import test_qwen3_5

    path = test_qwen3_5.write_folder(tmp_path_factory.mktemp("hybrid")).path
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # room for the template's tools instructions (bytes-only tokens)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hybrid(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateways, str]]:
    log_dir = tmp_path_factory.mktemp("hybrid-stack")
    stack = LocalStack(log_dir, heartbeats=None)
    try:
        stack.start_broker()
        metrics_port = free_port()
        stack.start_worker("h1", model=str(folder), device="cpu", max_sessions=12, max_context=2048,
                           extra=["--metrics-port", str(metrics_port)])
        stack.wait_for_workers({"h1"}, timeout=180)
        gateways = Gateways(stack, f"http://127.0.0.1:{metrics_port}/metrics")
        url = gateways.start()
        status, body = http_get(url + "/v1/models")
        assert status == 200
        yield gateways, url
        gateways.close()
    finally:
        stack.close()


def model_of(url: str) -> str:
    status, body = http_get(url + "/v1/models")
    assert status == 200
    name: str = json.loads(body)["data"][0]["id"]
    return name


def ask(url: str, messages: list[dict[str, str]], **extra: Any) -> Any:
    return sync_client(url).chat.completions.create(model=model_of(url), messages=messages,  # type: ignore[arg-type]
                                                    temperature=0, max_tokens=6, extra_body=extra)


def resumed(gateways: Gateways, url: str, messages: list[dict[str, str]], after: Any, reference: str) -> None:
    """Ask `messages`, a turn resumed from the checkpoint the answer `after` left: its cached tokens are that answer's
    prompt less "<think>\n", the worker computes exactly the rest, and the answer is a new session's (named
    `reference`, which caches nothing)."""
    before = gateways.prefilled()
    answer = ask(url, messages)
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached == after.usage.prompt_tokens - THINK
    assert gateways.prefilled() - before == answer.usage.prompt_tokens - cached
    fresh = ask(url, messages, session_id=reference)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert answer.choices[0].message.content == fresh.choices[0].message.content


def test_turns_start_from_the_checkpoint_before_the_reasoning_prompt(hybrid: tuple[Gateways, str]) -> None:
    gateways, url = hybrid
    first_turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    first = ask(url, first_turn)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turns = [*first_turn, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And of Spain?"}]
    resumed(gateways, url, turns, after=first, reference="reference-turns")
    # The last question edited: a fork of the session, which starts from its share of the first turn's checkpoint.
    edited = [*turns[:-1], {"role": "user", "content": "And of Italy?"}]
    resumed(gateways, url, edited, after=first, reference="reference-edited")


def test_a_regenerate_starts_from_the_forks_share_of_the_checkpoint(hybrid: tuple[Gateways, str]) -> None:
    """The fork shares its parent's checkpoint (who gives up room to whom is tests/worker/test_from_start.py's)."""
    _, url = hybrid
    asked = [{"role": "user", "content": "Name a colour."}]
    first = ask(url, asked)
    again = ask(url, asked)
    # The checkpoint is before the assistant prompt's "<think>\n" (for the next turn): those tokens run again.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - THINK
    assert again.choices[0].message.content == first.choices[0].message.content


def metric(url: str, name: str, **labels: str) -> float:
    status, text = http_get(url)
    assert status == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_the_checkpoint_follows_the_session_into_hibernation_and_a_restart(folder: Path, tmp_path: Path) -> None:
    """A worker that hibernates idle sessions (--hibernate-after) into its session store: the second turn restores the
    session with its checkpoint and computes only what follows it; the worker is then stopped (its sessions written
    to the store) and another started on the store, and the third turn starts from the checkpoint again."""
    store = tmp_path / "store"
    worker_args = ["--session-store", str(store), "--hibernate-after", "0.2"]
    with LocalStack(tmp_path) as stack:
        stack.start_broker()
        ports = [free_port(), free_port()]
        stack.start_worker("h1", model=str(folder), device="cpu", max_sessions=4, max_context=512,
                           extra=[*worker_args, "--metrics-port", str(ports[0])])
        stack.wait_for_workers({"h1"}, timeout=180)
        gateways = Gateways(stack, f"http://127.0.0.1:{ports[0]}/metrics")
        try:
            url = gateways.start()
            turns: list[dict[str, str]] = [{"role": "user", "content": "Capital of France?"}]
            answers: list[Any] = []
            for turn in range(3):
                if turn == 2:  # a clean stop writes every session to the store; the next worker serves them
                    assert stack.workers["h1"].terminate(timeout=60) == 0
                    assert any(p.suffix == ".checkpoint" for p in store.iterdir())
                    stack.start_worker("h2", model=str(folder), device="cpu", max_sessions=4, max_context=512,
                                       extra=[*worker_args, "--metrics-port", str(ports[1])])
                    stack.wait_for_workers({"h2"}, timeout=180)
                    gateways.worker_metrics = f"http://127.0.0.1:{ports[1]}/metrics"
                elif turn == 1:
                    deadline = time.monotonic() + 30
                    while metric(gateways.worker_metrics, "sessionserve:sessions_hibernated_total") < 1:
                        assert time.monotonic() < deadline, "the session did not hibernate"
                        time.sleep(0.05)
                before = gateways.prefilled()
                answer = ask(url, turns)
                cached = answer.usage.prompt_tokens_details.cached_tokens
                if answers:
                    assert cached == answers[-1].usage.prompt_tokens - THINK, turn
                    assert metric(gateways.worker_metrics, "sessionserve:state_checkpoints_total",
                                  event="restored") == 1, turn
                assert gateways.prefilled() - before == answer.usage.prompt_tokens - cached, turn
                answers.append(answer)
                turns += [{"role": "assistant", "content": answer.choices[0].message.content},
                          {"role": "user", "content": f"And of country {turn}?"}]
            for turn, answer in enumerate(answers):
                fresh = ask(url, turns[: 2 * turn + 1], session_id=f"reference-{turn}")
                assert fresh.choices[0].message.content == answer.choices[0].message.content, turn
        finally:
            gateways.close()


def test_the_checkpoint_moves_with_its_session(folder: Path, tmp_path: Path) -> None:
    """A worker stopped (SIGTERM) while another serves the model moves its sessions there, each with its checkpoint
    (the target's READY says it takes them): the conversation's next turn starts from the checkpoint on the new
    worker."""
    with LocalStack(tmp_path) as stack:
        stack.start_broker()
        ports = [free_port(), free_port()]
        stack.start_worker("h1", model=str(folder), device="cpu", max_sessions=4, max_context=512,
                           extra=["--metrics-port", str(ports[0])])
        stack.wait_for_workers({"h1"}, timeout=180)
        gateways = Gateways(stack, f"http://127.0.0.1:{ports[0]}/metrics")
        try:
            url = gateways.start()
            turns: list[dict[str, str]] = [{"role": "user", "content": "Capital of Peru?"}]
            first = ask(url, turns)
            stack.start_worker("h2", model=str(folder), device="cpu", max_sessions=4, max_context=512,
                               extra=["--metrics-port", str(ports[1])])
            stack.wait_for_workers({"h1", "h2"}, timeout=180)
            assert stack.workers["h1"].terminate(timeout=60) == 0  # its session moves to h2 first
            gateways.worker_metrics = f"http://127.0.0.1:{ports[1]}/metrics"
            assert metric(gateways.worker_metrics, "sessionserve:session_moves_total", event="imported") == 1
            assert metric(gateways.worker_metrics, "sessionserve:state_checkpoints_total", event="restored") == 1
            turns += [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And of Chile?"}]
            resumed(gateways, url, turns, after=first, reference="reference-moved")
        finally:
            gateways.close()


def test_tools_and_function_calls_reach_the_model_as_transformers_renders_them(hybrid: tuple[Gateways, str],
                                                                               folder: Path) -> None:
    """Through the real worker, with Qwen3.5's template: a request's prompt tokens are those of transformers'
    rendering with the tools, then with the calls and their results sent back; its answer is split into reasoning
    and content (the model's own text: random weights make no call)."""
    gateways, url = hybrid
    tools_url = gateways.start(extra=["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    try:
        asked_with_tools(url, tools_url, folder)
    finally:
        gateways.daemons.pop().close()  # its idle sessions closed with it: the slots go back to the other tests


def asked_with_tools(url: str, tools_url: str, folder: Path) -> None:
    from transformers import AutoTokenizer

    from tests.gateway.test_tool_calls import WEATHER

    theirs = AutoTokenizer.from_pretrained(folder)

    def tokens(messages: list[dict[str, Any]]) -> int:
        text = theirs.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        return len(theirs.encode(text, add_special_tokens=False))

    question: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    client = sync_client(tools_url)
    first = client.chat.completions.create(model=model_of(url), messages=question, tools=[WEATHER],  # type: ignore[arg-type,list-item]
                                           temperature=0, max_tokens=6)
    assert first.usage is not None and first.usage.prompt_tokens == tokens(question)
    message = first.choices[0].message
    assert message.content is None and (message.model_extra or {}).get("reasoning")  # cut short while reasoning
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    answered = [*question, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    second = client.chat.completions.create(model=model_of(url), messages=answered, tools=[WEATHER],  # type: ignore[arg-type,list-item]
                                            temperature=0, max_tokens=6)
    rendered = [*question, {**answered[1], "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                                "arguments": {"city": "Paris"}}}]},
                answered[2]]
    assert second.usage is not None and second.usage.prompt_tokens == tokens(rendered)
