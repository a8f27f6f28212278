"""Function calls (gateway --tool-call-parser): the answers' calls read as vLLM's hermes and llama3_json parsers read
them, whole and streamed in any pieces; the requests' tools and the messages that carry calls and their results; and a
real gateway process (real HTTP, the openai package) in front of a scripted broker: the calls answered, streamed and
not, and the next turn's messages as the worker gets them."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.common import protocol as p
from client.gateway import responses, schema
from client.gateway.errors import ApiError
from client.gateway.service import chat_ask
from client.gateway.sessions import TOOL_MARK, message_of
from client.gateway.tool_calls import Call, CallStream, ToolParser

from ..client.fake_broker import FakeBroker
from .scripted import Scripted, gateway_before

HERMES, LLAMA3 = ToolParser("hermes"), ToolParser("llama3_json")
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def calls(*named: tuple[str, str]) -> list[Call]:
    return [Call(f"id-{k}", name, arguments) for k, (name, arguments) in enumerate(named)]


@pytest.mark.parametrize(("parser", "text", "content", "made"), [
    (HERMES, f"<tool_call>\n{PARIS}\n</tool_call>", "", calls(("get_weather", '{"city": "Paris"}'))),
    (HERMES, f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n"
             '{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.\n",
     calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
    (HERMES, f"<tool_call>\n{PARIS}", "", calls(("get_weather", '{"city": "Paris"}'))),  # its closing tag cut off
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),  # cut inside: content
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
    (HERMES, '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', "", calls(("f", '"x"'))),  # any JSON value
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', None, []),  # no arguments
    (HERMES, "Paris is sunny.", None, []),
    (HERMES, '<tool_call>{"name": "é", "arguments": {"q": "中文"}}</tool_call>', "", calls(("é", '{"q": "中文"}'))),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", calls(("get_weather", '{"city": "Paris"}'))),
    (LLAMA3, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', "",
     calls(("a", "{}"), ("b", '{"x": 1}'))),
    (LLAMA3, '{"name": "a", "parameters": {}} and then', None, []),
    (LLAMA3, 'It is {"name": "a"}', None, []),
    (LLAMA3, '{"city": "Paris"}', None, []),
])
def test_calls_are_read_as_vllm_s_parsers_read_them(parser: ToolParser, text: str, content: str | None,
                                                    made: list[Call]) -> None:
    """None: no call, the whole text is the content."""
    assert parser.parse(text, "id-") == (text if content is None else content, made)


SCHEMA = (("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"}, "at": {"type": "number"},
    "where": {"type": "object"}, "tags": {"type": "array"}, "zip": {"type": ["string", "null"]}}}),)
QWEN3_CODER = ToolParser("qwen3_coder", SCHEMA)


@pytest.mark.parametrize(("text", "content", "made"), [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "",
     calls(("get_weather", '{"city": "Paris"}'))),
    # each value read as the schema types it; "null" is null; a value that does not read stays a string
    ("I will look.\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=hot>\n"
     "True\n</parameter>\n<parameter=at>\n2.5\n</parameter>\n<parameter=where>\n{\"lat\": 48}\n</parameter>\n"
     "<parameter=tags>\n[1, 2]\n</parameter>\n<parameter=zip>\nnull\n</parameter>\n<parameter=city>\n"
     "New\nYork\n</parameter>\n</function>\n</tool_call>", "I will look.\n\n",
     calls(("get_weather", '{"days": 3, "hot": true, "at": 2.5, "where": {"lat": 48}, "tags": [1, 2], "zip": null, '
                           '"city": "New\\nYork"}'))),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=other>\n<parameter=x>\n1\n</parameter>\n</function>", "",
     calls(("get_weather", '{"days": "three"}'), ("other", '{"x": "1"}'))),  # no schema: a string
    ("<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", None, []),  # not its format: content
    # a number JSON cannot hold stays text; "yes" is not true (vLLM's reading); a type list's first type not null
    ("<tool_call>\n<function=get_weather>\n<parameter=at>\ninf\n</parameter>\n<parameter=hot>\nyes\n</parameter>\n"
     "<parameter=zip>\n5\n</parameter>\n</function>\n</tool_call>", "",
     calls(("get_weather", '{"at": "inf", "hot": false, "zip": "5"}'))),
    # two functions in one <tool_call>: two calls
    ("<tool_call>\n<function=a>\n</function>\n<function=b>\n</function>\n</tool_call>", "", calls(("a", "{}"),
                                                                                                    ("b", "{}"))),
])
def test_qwen3_coder_calls_are_read_by_the_tools_schema_as_vllm_reads_them(text: str, content: str | None,
                                                                          made: list[Call]) -> None:
    assert QWEN3_CODER.parse(text, "id-") == (text if content is None else content, made)


def test_odd_schemas_and_values_never_make_the_reading_fail() -> None:
    """A property schema that is not a map (JSON Schema allows true), properties that are a list, a value nested past
    what json reads: the calls are read, their values as text."""
    deep = "[" * 2000 + "]" * 2000
    text = (f"<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n{deep}\n</parameter>\n"
            "</function>\n</tool_call>")
    for odd in ({"properties": {"x": True, "y": {"type": "array"}}}, {"properties": ["x"]}, True):
        content, made = ToolParser("qwen3_coder", (("f", odd),)).parse(text, "id-")
        assert content == "" and [c.name for c in made] == ["f"]
        assert json.loads(made[0].arguments) == {"x": "1", "y": deep}


PIECES = st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "<", "{", "}", PARIS, " ", "\n",
                                   "a", ";", "<|python_tag|>", '{"name": "f", "parameters": {}}', "é", "<function=get_weather>",
                                   "<parameter=days>\n4\n</parameter>", "</function>"]), max_size=10)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 200), max_size=6),
       parser=st.sampled_from([HERMES, LLAMA3, QWEN3_CODER]))
def test_a_streamed_answer_s_content_and_calls_are_the_whole_answer_s(pieces: list[str], cuts: list[int],
                                                                       parser: ToolParser) -> None:
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    stream = CallStream(parser, "id-")
    content = "".join(stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    rest, made = stream.finish()
    assert (content + rest, made) == parser.parse(text, "id-")


def test_streamed_content_goes_out_until_what_could_start_a_call() -> None:
    stream = CallStream(HERMES, "id-")
    assert stream.feed("Let me look.<to") == "Let me look."
    assert stream.feed("p>") == "<top>"
    assert stream.feed(f"<tool_call>{PARIS}") == ""
    assert stream.finish() == ("", calls(("get_weather", '{"city": "Paris"}')))


WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_request(**body: Any) -> schema.ChatRequest:
    request = schema.parse(schema.ChatRequest, {"model": "m", **body})
    assert isinstance(request, schema.ChatRequest)
    return request


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = [{"role": "user", "content": "Weather in Paris?"}, CALLED,
            {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]


def test_tools_and_the_messages_of_calls_are_taken_and_kept() -> None:
    request = chat_request(messages=ANSWERED, tools=[WEATHER])
    assert json.loads(request.tools_json()) == [WEATHER]
    assert chat_request(messages=ANSWERED, tools=[WEATHER], tool_choice="none").tools_json() == ""
    turns = request.turns()
    assert [message_of(*t) for t in turns] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    ask = chat_ask(request, "", None, tool_call_parser="hermes")
    assert ask.tools == request.tools_json() and ask.of_tools
    assert ask.tool_parser == ToolParser("hermes", (("get_weather", WEATHER["function"]["parameters"]),))
    assert ask.digests != chat_ask(chat_request(messages=ANSWERED), "", None).digests  # other tools: other digests
    plain = chat_ask(chat_request(messages=ANSWERED[:1]), "", None)
    assert not plain.of_tools and plain.tool_parser is None
    with pytest.raises(ApiError, match="tools are taken only by a gateway started with --tool-call-parser"):
        chat_ask(request, "", None)
    # A text that happens to start as a kept turn with calls does is kept apart from one
    odd = schema.Message(role="user", content=TOOL_MARK + "{}").turn()
    assert message_of(*odd) == {"role": "user", "content": TOOL_MARK + "{}"}


@pytest.mark.parametrize(("body", "why"), [
    ({"tool_choice": "required"}, 'only \\"auto\\" and \\"none\\"'),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "constrained decoding"),
    ({"parallel_tool_calls": False}, "the model may make several calls"),
    ({"tools": [WEATHER, WEATHER]}, "tools names a function twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "strict is not supported"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "has a tool_call_id"),
    ({"messages": [{"role": "user", "content": "q", "tool_call_id": "c"}]}, "has a tool_call_id"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": CALLED["tool_calls"]}]}, "only an assistant"),
])
def test_what_cannot_be_honoured_is_refused(body: dict[str, Any], why: str) -> None:
    with pytest.raises(ApiError, match=why):
        chat_request(**{"messages": [{"role": "user", "content": "q"}], "tools": [WEATHER], **body})


# -- a gateway process in front of a scripted broker ------------------------------------------------------------------

CALL = ["<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n</tool_call>"]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeBroker, Scripted, str]]:
    script = Scripted([(CALL, "stop")])
    with gateway_before(script, tmp_path_factory.mktemp("tools"), ["--tool-call-parser", "hermes"]) as (fake, url):
        yield fake, script, url


@pytest.fixture
def scripted(stand_in: tuple[FakeBroker, Scripted, str]) -> tuple[FakeBroker, str]:
    return stand_in[0], stand_in[2]


def test_calls_are_answered_whole_and_streamed_and_sent_back_whole(scripted: tuple[FakeBroker, str]) -> None:
    fake, url = scripted
    question: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    tools: list[Any] = [WEATHER]
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
        whole = client.chat.completions.create(model="m", messages=question, tools=tools)
        choice = whole.choices[0]
        assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call: Any = choice.message.tool_calls[0]
        assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather",
                                                                            '{"city": "Paris"}')
        sent = fake.of(p.Generate)[-1]
        assert json.loads(sent.tools) == [WEATHER] and sent.messages == (p.ChatMessage("user", "Weather in Paris?"),)
        # Streamed: no content delta, the call whole in one delta at the end, then finish_reason tool_calls
        chunks = client.chat.completions.create(model="m", messages=question, tools=tools, stream=True)
        deltas = [c.choices[0] for c in chunks if c.choices]
        made = [tc for d in deltas for tc in d.delta.tool_calls or ()]
        assert [d.delta.content for d in deltas if d.delta.content] == []
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in made if tc.function] == [
            (0, "get_weather", '{"city": "Paris"}')]
        assert made[0].id and deltas[-1].finish_reason == "tool_calls"
        # The call's result, sent back with the call: the whole conversation goes to the session that made the call,
        # its calls and results as the worker renders them
        answered: list[Any] = [*question, choice.message.model_dump(exclude_none=True),
                               {"role": "tool", "content": "21 C", "tool_call_id": call.id}]
        client.chat.completions.create(model="m", messages=answered, tools=tools)
        sent = fake.of(p.Generate)[-1]
        assert sent.from_start and sent.session_id == fake.of(p.Generate)[0].session_id
        assert sent.messages == (p.ChatMessage("user", "Weather in Paris?"),
                                 p.ChatMessage("assistant", "", (p.ToolCall(call.id, "get_weather", '{"city": "Paris"}'),)),
                                 p.ChatMessage("tool", "21 C", tool_call_id=call.id))
        assert json.loads(sent.tools) == [WEATHER]
        with pytest.raises(openai.BadRequestError, match="only"):
            client.chat.completions.create(model="m", messages=question, tools=tools,
                                           tool_choice="required")


def test_calls_in_the_history_of_a_plain_session_send_it_whole(scripted: tuple[FakeBroker, str]) -> None:
    """A plain answer (no tools: the session's tokens are its history's), then the conversation goes on with a call's
    result and no tools: rendered whole only, so sent whole to that session (it was a 400 from the worker)."""
    fake, url = scripted
    question: list[Any] = [{"role": "user", "content": "Weather in Rome?"}]
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
        plain = client.chat.completions.create(model="m", messages=question)
        first = fake.of(p.Generate)[-1]
        assert plain.choices[0].message.content == "".join(CALL) and not first.tools  # no parser without tools
        answered: list[Any] = [*question, {"role": "assistant", "content": plain.choices[0].message.content},
                               {"role": "tool", "content": "25 C", "tool_call_id": "call_9"}]
        tools: list[Any] = [WEATHER]
        client.chat.completions.create(model="m", messages=answered, tool_choice="none", tools=tools)
        sent = fake.of(p.Generate)[-1]
        assert sent.session_id == first.session_id and sent.from_start and not sent.tools
        assert sent.messages is not None and sent.messages[-1] == p.ChatMessage("tool", "25 C", tool_call_id="call_9")


def test_tools_are_refused_where_the_model_s_workers_do_not_render_them(
        stand_in: tuple[FakeBroker, Scripted, str]) -> None:
    """An older worker, or any behind an older broker (which drops the fields), would render the conversation without
    its tools and calls: the gateway refuses the request rather than have them ignored."""
    fake, script, url = stand_in
    script.tools = False
    plain: list[Any] = ANSWERED[:1]
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
            time.sleep(1.1)  # the gateway's status is a second old: a request has it asked again, in the background
            assert client.chat.completions.create(model="m", messages=plain).choices  # plain chat still goes
            time.sleep(0.3)
            for body in ({"messages": plain, "tools": [WEATHER]}, {"messages": ANSWERED}):
                with pytest.raises(openai.BadRequestError, match="do not render tools, function calls or reasoning"):
                    client.chat.completions.create(model="m", **body)
    finally:
        script.tools = True


def test_hostile_tools_are_a_clear_refusal_and_odd_text_a_clean_answer() -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(990):  # within what the body parser takes, past what json.dumps can write
        inner["a"] = {}
        inner = inner["a"]
    request = chat_request(messages=ANSWERED[:1], tools=[{"type": "function", "function": {"name": "f",
                                                                                          "parameters": deep}}])
    with pytest.raises(ApiError, match="tools are nested too deep"):
        chat_ask(request, "", None, tool_call_parser="hermes")
    # A lone surrogate (a JSON escape a model or a client may write) is answered as an escape, not a 500
    assert json.loads(responses.dumps({"arguments": "\ud83d"})) == {"arguments": "\ud83d"}
