"""Tools and function calls reach the chat template as transformers passes them: the worker's reading of a GENERATE's
`tools` and its messages' `tool_calls` / `tool_call_id` (worker.serve.dispatch), and the engine's rendering of them
with the whole conversation only (Engine.chat_text), against transformers' apply_chat_template on Qwen2.5's
template."""

from __future__ import annotations

import json

import pytest

from broker.common import protocol as p
from worker.engine import Engine
from worker.errors import BadRequest
from worker.serve.dispatch import _tools, _turns

from .test_chat_templates import MODELS, TEMPLATES, TIME, WEATHER, pair

CALL = p.ToolCall("call_1", "get_weather", '{"city": "Paris"}')
MESSAGES = (p.ChatMessage("user", "Weather in Paris?"), p.ChatMessage("assistant", "", (CALL,)),
            p.ChatMessage("tool", "21 C", tool_call_id="call_1"))


def test_messages_and_tools_are_read_as_transformers_takes_them() -> None:
    assert _turns(MESSAGES) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    assert _tools(json.dumps([WEATHER, TIME])) == [WEATHER, TIME] and _tools("") is None
    for arguments, value in (("", {}), ('["Paris"]', ["Paris"]), ('"Paris"', "Paris")):  # any JSON, as vLLM takes it
        assert _turns((p.ChatMessage("assistant", "", (p.ToolCall("c", "f", arguments),)),))[0]["tool_calls"][0][
            "function"]["arguments"] == value
    with pytest.raises(BadRequest, match="arguments are not JSON"):
        _turns((p.ChatMessage("assistant", "", (p.ToolCall("c", "f", '{"city": "Paris"'),)),))
    assert _turns((p.ChatMessage("assistant", "4", reasoning="2 + 2"),)) == [
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}]
    for bad, why in (("[", "tools is not JSON"), ('{"type": "function"}', "a JSON list of objects"),
                     ("[1]", "a JSON list of objects")):
        with pytest.raises(BadRequest, match=why):
            _tools(bad)


def test_the_engine_renders_tools_with_the_whole_conversation_only(smol_engine: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = pair((TEMPLATES / "qwen2.5-instruct.jinja").read_text(encoding="utf-8"), *MODELS["qwen2.5-instruct"])
    monkeypatch.setattr(smol_engine, "tokenizer", ours)
    turns = _turns(MESSAGES)
    expected = theirs.apply_chat_template(turns, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    sid = smol_engine.create_session()
    try:
        assert smol_engine.chat_text(sid, turns, tools=[WEATHER, TIME]) == expected
        smol_engine.append(sid, text="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
        with pytest.raises(BadRequest, match="rendered with the whole conversation only"):
            smol_engine.chat_text(sid, turns[2:], tools=[WEATHER, TIME])
        with pytest.raises(BadRequest, match="rendered with the whole conversation only"):
            smol_engine.chat_text(sid, turns[1:])  # a call, without tools
        assert smol_engine.chat_text(sid, turns, tools=[WEATHER, TIME], from_start=True) == expected
    finally:
        smol_engine.close(sid)


def test_a_generate_with_tools_needs_messages_and_a_worker_that_renders_them() -> None:
    with pytest.raises(p.ProtocolError, match="tools go with messages"):
        p.Generate(request_id="r", session_id="a" * 32, tools="[]", prompt="hi")
    assert p.Generate(request_id="r", session_id="a" * 32, messages=MESSAGES).uses_tools
    assert p.Generate(request_id="r", session_id="a" * 32, messages=MESSAGES[:1], tools="[{}]").uses_tools
    assert not p.Generate(request_id="r", session_id="a" * 32, messages=MESSAGES[:1]).uses_tools


def test_the_client_library_takes_an_answer_s_reasoning_by_either_name() -> None:
    from client.calls import chat_message

    for message, reasoning in (({"reasoning": "R"}, "R"), ({"reasoning_content": "R"}, "R"),
                               ({"reasoning": "R", "reasoning_content": None}, "R"),
                               ({"reasoning": None, "reasoning_content": "R"}, "R"), ({}, "")):
        assert chat_message({"role": "assistant", "content": "C", **message}).reasoning == reasoning
