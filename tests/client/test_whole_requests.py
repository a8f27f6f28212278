"""A request is checked as a whole before anything changes: a chat turn the client or the worker refuses leaves the
session as it was (the turn is not appended), with Client and AsyncClient, streamed or not. Against a worker with the
bundled SmolLM2 (a chat template) on the CPU."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, BadRequest, Client, PromptBoundary
from client.stack import LocalStack

TOO_LONG = 5000  # max_tokens past the worker's --max-context 2048: only the worker can refuse it


def test_a_refused_chat_turn_leaves_the_session_as_it_was(smol_stack: LocalStack) -> None:
    with Client(smol_stack.clients, timeout=120) as c, c.session() as s:
        with pytest.raises(BadRequest, match="max_tokens must be in"):
            s.chat("What is the capital of France?", max_tokens=-1)  # refused by the client
        with pytest.raises(BadRequest, match="exceeds the context of 2048 tokens"):
            s.chat("What is the capital of France?", max_tokens=TOO_LONG)  # refused by the worker
        with pytest.raises(BadRequest, match="exceeds the context"):
            list(s.chat("What is the capital of France?", max_tokens=TOO_LONG, stream=True))
        assert s.info().length == 0
        first = s.chat("What is the capital of France?", max_tokens=16)
        assert first.text == "The capital of France is Paris." and first.appended > 0
        assert first.session_length == s.info().length
        with pytest.raises(BadRequest, match="exceed max_context"):
            s.chat("more " * 3000, max_tokens=16)  # the turn itself does not fit
        with pytest.raises(BadRequest, match="stop must be a list"):
            s.chat("And of Italy?", stop=5)  # type: ignore[call-overload]
        assert s.info().length == first.session_length
        again = s.chat("And of Italy?", max_tokens=16, stop_token_ids=[], ignore_eos=False)
        assert again.text == "The capital of Italy is Rome."


def test_a_refused_async_chat_turn_leaves_the_session_as_it_was(smol_stack: LocalStack) -> None:
    async def main() -> tuple[int, int]:
        async with AsyncClient(smol_stack.clients, timeout=120) as c, c.session() as s:
            with pytest.raises(BadRequest):
                await s.chat("What is the capital of France?", max_tokens=-1)
            with pytest.raises(BadRequest, match="exceeds the context"):
                await s.chat("What is the capital of France?", max_tokens=TOO_LONG)
            stream = await s.chat("What is the capital of France?", max_tokens=TOO_LONG, stream=True)
            with pytest.raises(BadRequest, match="exceeds the context"):
                await stream.__anext__()
            before = (await s.info()).length
            return before, (await s.chat("What is the capital of France?", max_tokens=16)).appended

    before, appended = asyncio.run(main())
    assert before == 0 and appended > 0


def test_a_text_sent_with_boundary_check_that_would_retokenize_the_session_is_refused_whole(
        smol_stack: LocalStack) -> None:
    """SmolLM2 tokenizes "Paris" as one token: "is" after a session ending in "Par" is PromptBoundary (a BadRequest),
    appended or as a turn's prompt, streamed or not, and the session keeps its tokens; " Paris" goes on."""
    with Client(smol_stack.clients, timeout=120) as c, c.session() as s:
        held = s.append("The capital of France is Par")
        with pytest.raises(PromptBoundary, match="changes how the session's last tokens tokenize"):
            s.append("is", boundary_check=True)
        with pytest.raises(PromptBoundary):
            s.generate(prompt="is", boundary_check=True, max_tokens=2)
        with pytest.raises(BadRequest) as refused:
            list(s.generate(prompt="is", boundary_check=True, max_tokens=2, stream=True))
        assert refused.value.code == "prompt_boundary" and s.info().length == held
        assert s.append("is") == held + 1  # unchecked: tokenized on its own

    async def main() -> tuple[int, int]:
        async with AsyncClient(smol_stack.clients, timeout=120) as c, c.session() as s:
            held = await s.append("The capital of France is")
            with pytest.raises(PromptBoundary):
                await s.append("n't", boundary_check=True)  # " isn't" is one token
            return held, (await s.generate(prompt=" Paris", boundary_check=True, max_tokens=0)).appended

    assert asyncio.run(main()) == (5, 1)


def test_chat_template_kwargs_reach_the_template_and_a_bad_one_is_refused_whole(smol_stack: LocalStack) -> None:
    with Client(smol_stack.clients, timeout=120) as c, c.session() as s:
        with pytest.raises(BadRequest, match="messages: the template.s own"):
            s.chat("What is the capital of France?", max_tokens=4, chat_template_kwargs={"messages": 1})
        with pytest.raises(BadRequest, match="must be null, a boolean, a number or a string"):
            s.chat("What is the capital of France?", chat_template_kwargs={"x": [1]})  # refused by the client
        assert s.info().length == 0
        answer = s.chat("What is the capital of France?", max_tokens=16, chat_template_kwargs={"enable_thinking": False})
        assert answer.text == "The capital of France is Paris."  # SmolLM2's template has no such variable
