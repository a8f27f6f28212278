"""A hybrid model (Qwen3.5: a recurrent state that cannot be cut back) behind the gateway, with Qwen3.5's chat
template: the template renders an earlier answer without the "<think>\n" its assistant prompt opened, so each turn is
sent whole from its start (GENERATE's from_start), and the session starts from its checkpoint, its state before that
"<think>\n", instead of computing the conversation again. A regenerate (the first request again) goes to a fork,
which starts from its copy of the checkpoint and computes the "<think>\n" again. Every answer is the one a new session gives."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.stack import LocalStack, free_port

from .conftest import Gateways, http_get
from .test_openai_client import sync_client

pytest.importorskip("transformers")

TEMPLATE = Path(__file__).parents[1] / "worker" / "templates" / "qwen3.5.jinja"
THINK = len(b"<think>\n")  # tokens of "<think>\n" for the bytes-only tokenizer: one a byte


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateways, str]]:
    from tests.worker import test_qwen3_5

    folder = test_qwen3_5.write_folder(tmp_path_factory.mktemp("hybrid")).path
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    log_dir = tmp_path_factory.mktemp("hybrid-stack")
    stack = LocalStack(log_dir, heartbeats=None)
    try:
        stack.start_broker()
        metrics_port = free_port()
        stack.start_worker("h1", model=str(folder), device="cpu", max_sessions=6, max_context=512,
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


def test_turns_start_from_the_checkpoint_before_the_reasoning_prompt(hybrid: tuple[Gateways, str]) -> None:
    gateways, url = hybrid
    first_turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    first = ask(url, first_turn)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turns = [*first_turn, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And of Spain?"}]
    before = gateways.prefilled()
    second = ask(url, turns)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens - THINK
    assert gateways.prefilled() - before == second.usage.prompt_tokens - cached
    fresh = ask(url, turns, session_id="reference-turns")
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == fresh.choices[0].message.content


def test_a_regenerate_starts_from_the_forks_copy_of_the_checkpoint(hybrid: tuple[Gateways, str]) -> None:
    """By now three sessions and their checkpoints fill the worker's six slots: the fork takes the least recently used
    checkpoint's slot, and its copy of its parent's checkpoint the next one's."""
    _, url = hybrid
    asked = [{"role": "user", "content": "Name a colour."}]
    first = ask(url, asked)
    again = ask(url, asked)
    # The checkpoint is before the assistant prompt's "<think>\n" (for the next turn): those tokens run again.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - THINK
    assert again.choices[0].message.content == first.choices[0].message.content
