"""A reasoning model's answers split into `reasoning` and `content` (gateway --reasoning-parser): the split itself,
whole and streamed in any pieces; the messages that bring an answer's reasoning back; and a real gateway process
(real HTTP, the openai package) in front of a scripted broker that answers with reasoning, streamed and not."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.common import protocol as p
from client.gateway import schema
from client.gateway.errors import ApiError
from client.gateway.reasoning import Reasoner
from client.gateway.service import chat_ask
from client.gateway.sessions import chain, message_of

from ..client.fake_broker import FakeBroker
from .scripted import Scripted, gateway_before

QWEN3 = Reasoner("qwen3")


@pytest.mark.parametrize(("reasoner", "text", "split"), [
    (QWEN3, "<think>\nThe capital.\n</think>\n\nParis.", ("\nThe capital.\n", "\n\nParis.")),  # Qwen3's answers
    (QWEN3, "The capital.\n</think>\n\nParis.", ("The capital.\n", "\n\nParis.")),  # Qwen3.5's: <think> in the prompt
    (QWEN3, "<think>\nThe capital", ("\nThe capital", None)),  # cut short while reasoning (max_tokens)
    (QWEN3, "The capital.</think>", ("The capital.", None)),
    (QWEN3, "</think>Paris.", ("", "Paris.")),
    (QWEN3, "A <think> mid-way</think>B", ("A <think> mid-way", "B")),  # only the answer's opening <think> goes
    (QWEN3, "", ("", None)),
    (Reasoner("qwen3", thinking=False), "Paris.</think>x", (None, "Paris.</think>x")),  # enable_thinking false
    (Reasoner("deepseek_r1"), "<think>R</think>C", ("R", "C")),
    # Qwen3.5 may call a function without closing its reasoning: the call starts the content
    (QWEN3, "Look it up.\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
     ("Look it up.\n", "<tool_call>\n<function=f>\n</function>\n</tool_call>")),
    (QWEN3, "About <tool_call> tags.</think>C", ("About <tool_call> tags.", "C")),  # not a call: text
    (QWEN3, "Wrap it: <tool_call><functions>.</think>C", ("Wrap it: <tool_call><functions>.", "C")),  # nor this
    (QWEN3, "R</think>C<tool_call>\n<function=f>", ("R", "C<tool_call>\n<function=f>")),
    (Reasoner("deepseek_r1"), "R<tool_call>\n<function=f>", ("R<tool_call>\n<function=f>", None)),
])
def test_an_answer_splits_as_vllm_s_parsers_split_it(reasoner: Reasoner, text: str,
                                                      split: tuple[str | None, str | None]) -> None:
    assert reasoner.split(text) == split


def test_enable_thinking_false_turns_the_qwen3_parser_off_and_only_it() -> None:
    assert Reasoner.for_request("qwen3", {"enable_thinking": False}) == Reasoner("qwen3", thinking=False)
    assert Reasoner.for_request("qwen3", {"enable_thinking": True}) == QWEN3 == Reasoner.for_request("qwen3", {})
    assert Reasoner.for_request("deepseek_r1", {"enable_thinking": False}) == Reasoner("deepseek_r1")
    assert Reasoner.for_request(None, {}) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        Reasoner.for_request("granite", {})


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "nk>", "think", ">", "a", "\n",
                                   " b", "é", "<thin", "k>", "<tool_call>", "<tool_", "call>", "<function=f>",
                                   "<func", "tion", " "]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 60), max_size=6), thinking=st.booleans(),
       parser=st.sampled_from(["qwen3", "deepseek_r1"]))
def test_a_streamed_answer_splits_as_the_whole_answer_does_in_any_pieces(pieces: list[str], cuts: list[int],
                                                                          thinking: bool, parser: str) -> None:
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    reasoner = Reasoner(parser, thinking)
    splitter = reasoner.splitter()
    reasoning, content = "", ""
    for a, b in itertools.pairwise(bounds):
        r, c = splitter.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    whole = reasoner.split(text)
    assert (reasoning + r, content + c) == (whole[0] or "", whole[1] or "")


def test_the_streamed_split_lets_text_go_as_soon_as_it_cannot_be_the_tag() -> None:
    splitter = QWEN3.splitter()
    assert splitter.feed("<th") == ("", "")  # maybe the opening <think>
    assert splitter.feed("ink>Pondering </th") == ("Pondering ", "")  # "</th" may be the end tag
    assert splitter.feed("e end") == ("</the end", "")
    assert splitter.feed("</think>\n\nPar") == ("", "\n\nPar")
    assert splitter.feed("is") == ("", "is")
    assert splitter.flush() == ("", "")


def chat_request(messages: list[dict[str, Any]]) -> schema.ChatRequest:
    request = schema.parse(schema.ChatRequest, {"model": "m", "messages": messages})
    assert isinstance(request, schema.ChatRequest)
    return request


def test_an_answer_s_reasoning_sent_back_goes_to_the_template_as_its_reasoning_content() -> None:
    """As vLLM passes it (Qwen3's templates render it for the answers after the last question). Only with a reasoning
    parser; only on an assistant message. A turn's digest leaves it out: the gateway keeps an answer without it."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "\n\nParis.", "reasoning": "\nThe capital.\n", "reasoning_content": None},
        {"role": "assistant", "content": None, "reasoning_content": "Cut short"},
        {"role": "user", "content": "And Spain?"}]
    request = chat_request(messages)
    turns = request.turns()
    assert [message_of(*t) for t in turns] == [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "\n\nParis.", "reasoning_content": "\nThe capital.\n"},
        {"role": "assistant", "content": "", "reasoning_content": "Cut short"}, {"role": "user", "content": "And Spain?"}]
    without = chat_request([{**m, "reasoning": None, "reasoning_content": None} for m in messages]).turns()
    assert chain(turns) == chain(without) and turns != without
    assert chat_ask(request, "", None, reasoning_parser="qwen3").reasoner == QWEN3
    with pytest.raises(ApiError, match="reasoning is taken only by a gateway started with --reasoning-parser"):
        chat_ask(request, "", None)
    for bad, why in (({"role": "user", "content": "q", "reasoning": "r"}, "only an assistant message has reasoning"),
                     ({"role": "assistant", "content": "c", "reasoning": "a", "reasoning_content": "b"},
                      "reasoning and reasoning_content differ"),
                     ({"role": "user", "content": None}, "a user message needs content")):
        with pytest.raises(ApiError, match=why):
            chat_request([bad])


# -- a gateway process in front of a scripted broker ------------------------------------------------------------------

THOUGHT = ["<th", "ink>\nThe capital", " of France.\n</th", "ink>\n\nPar", "is."]  # Qwen3's answer, streamed in pieces
CUT = ["<think>\nHmm, let me", " think"]  # reasoning cut by max_tokens


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeBroker, str]]:
    with gateway_before(Scripted([(THOUGHT, "stop"), (CUT, "length")]), tmp_path_factory.mktemp("reasoning"),
                        ["--reasoning-parser", "qwen3"]) as (fake, url):
        yield fake, url


def test_answers_carry_their_reasoning_apart_whole_and_streamed(scripted: tuple[FakeBroker, str]) -> None:
    fake, url = scripted
    question: list[Any] = [{"role": "user", "content": "Capital of France?"}]
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
        whole = client.chat.completions.create(model="m", messages=question)
        message = whole.choices[0].message
        assert (message.content, whole.choices[0].finish_reason) == ("\n\nParis.", "stop")
        assert message.model_extra == {"reasoning": "\nThe capital of France.\n",
                                       "reasoning_content": "\nThe capital of France.\n"}
        cut = client.chat.completions.create(model="m", messages=question)
        assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (None, "length")
        assert cut.choices[0].message.model_extra == {"reasoning": "\nHmm, let me think",
                                                      "reasoning_content": "\nHmm, let me think"}
        reasoning, content = [], []
        for chunk in client.chat.completions.create(model="m", messages=question, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning.append(extra.get("reasoning") or "")
            content.append(delta.content or "")
        assert "".join(reasoning) == "\nThe capital of France.\n" and "".join(content) == "\n\nParis."
        # Each piece as it comes, but for a "</th" that could be the end of the reasoning: held until the next says
        assert [r for r in reasoning if r] == ["\nThe capital", " of France.\n"]
        assert [c for c in content if c] == ["\n\nPar", "is."]
        # The next turn with the answer's content alone: the session holds the reasoning the client's text lacks,
        # so the turn is sent to it whole (from_start) and the session keeps what the two share.
        answer: dict[str, Any] = {"role": "assistant", "content": "\n\nParis."}
        spain: list[Any] = [answer, {"role": "user", "content": "And Spain?"}]
        client.chat.completions.create(model="m", messages=question + spain)
        sent = fake.of(p.Generate)[-1]
        assert sent.from_start and sent.messages is not None and sent.messages[1] == p.ChatMessage("assistant",
                                                                                                   "\n\nParis.")
        # With its reasoning sent back too (the openai package's message.model_dump() has it): the same conversation
        # (its digests leave the reasoning out), so it goes whole to a session that holds its start (a new one would
        # be sent it without from_start), the reasoning given to the template as the answer's reasoning_content.
        spain[0] = {**answer, "reasoning": "\nThe capital of France.\n", "reasoning_content": None, "refusal": None}
        client.chat.completions.create(model="m", messages=question + spain)
        sent = fake.of(p.Generate)[-1]
        assert sent.from_start
        assert sent.messages is not None and sent.messages[1] == p.ChatMessage(
            "assistant", "\n\nParis.", reasoning="\nThe capital of France.\n")
