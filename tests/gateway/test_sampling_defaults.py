"""A model's recommended sampling (its generation_config.json, `worker start --generation-config`) end to end: the
worker announces it, the broker's status lists it, and the gateway gives it to requests that leave parameters out.
Broker, a CPU worker with the bundled SmolLM2 and a gateway as processes on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from client.stack import LocalStack
from worker.cli import EXIT_STARTUP_FAILED

from .conftest import MODEL, Gateways

# top_k 1 samples the likeliest token whatever the temperature: the answers are the greedy ones, so exact.
RECOMMENDED = {"do_sample": True, "temperature": 0.9, "top_k": 1, "max_new_tokens": 3, "eos_token_id": 2}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def recommending(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, str, Path]]:
    """The stack (its worker given RECOMMENDED), a gateway's URL, and the folder of the configs."""
    folder = tmp_path_factory.mktemp("configs")
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    (folder / "bad.json").write_text(json.dumps({"temperature": 0.7, "top_p": 1.5}))
    stack = LocalStack(tmp_path_factory.mktemp("defaults"), heartbeats=None)
    gateways = Gateways(stack, "")
    try:
        stack.start_broker()
        stack.start_worker("w1", device="cpu", max_sessions=4, max_context=256,
                           extra=["--generation-config", str(folder)])
        stack.wait_for_workers({"w1"}, timeout=180)
        yield stack, gateways.start(), folder
    finally:
        gateways.close()
        stack.close()


def chat(url: str, **params: Any) -> Any:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        return client.chat.completions.create(model=MODEL, messages=QUESTION, **params)  # type: ignore[arg-type]


def test_the_status_lists_the_worker_s_recommended_sampling(recommending: tuple[LocalStack, str, Path]) -> None:
    stack, _, _ = recommending
    with stack.client() as client:
        assert [w.sampling_defaults for w in client.status()] == [{"temperature": 0.9, "top_k": 1, "max_tokens": 3}]


def test_a_request_that_leaves_parameters_out_gets_the_model_s(recommending: tuple[LocalStack, str, Path]) -> None:
    _, url, _ = recommending
    left_out = chat(url)
    greedy = chat(url, temperature=0, max_tokens=3)
    assert left_out.usage.completion_tokens == 3 and left_out.choices[0].finish_reason == "length"
    assert left_out.choices[0].message.content == greedy.choices[0].message.content
    longer = chat(url, max_tokens=6, temperature=0)  # what the request gives wins
    assert longer.usage.completion_tokens == 6
    assert longer.choices[0].message.content.startswith(greedy.choices[0].message.content)
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        text = client.completions.create(model=MODEL, prompt="The capital of France is")
    assert text.usage is not None and text.usage.completion_tokens == 3


def test_a_worker_given_a_bad_config_does_not_start_and_says_which_key(
        recommending: tuple[LocalStack, str, Path]) -> None:
    stack, _, folder = recommending
    bad = stack.start_worker("bad", device="cpu", extra=["--generation-config", str(folder / "bad.json")])
    assert bad.proc.wait(timeout=120) == EXIT_STARTUP_FAILED
    assert "top_p must be in [0.0, 1.0], got 1.5" in bad.log_text()
