"""The gateway's parts without processes: sessions and their prefix index, request validation, API keys, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker.common import protocol as p
from client.aio import AsyncClient, AsyncSession
from client.errors import (
    BadRequest,
    CapacityExhausted,
    InternalError,
    ModelNotFound,
    Overloaded,
    PromptBoundary,
    SessionExpired,
    SessionLost,
    Timeout,
    Unauthorized,
    WorkerDraining,
)
from client.gateway import schema
from client.gateway.auth import ApiKeys, KeyFileError
from client.gateway.errors import ApiError, from_client_error
from client.gateway.models import Served
from client.gateway.sessions import Entry, SessionStore, chain
from client.results import WorkerInfo

SID = "0123456789abcdef0123456789abcdef"


def session(i: int = 0) -> AsyncSession:
    return AsyncSession(AsyncClient.__new__(AsyncClient), f"{i:032x}")


def chat_entry(turns: tuple[tuple[str, str], ...], owner: str = "", model: str = "m", name: str | None = None,
               i: int = 0) -> Entry:
    return Entry(session(i), owner, model, "chat", 1024, turns, chain(turns)[-1], 10, name)


def test_chain_digests_every_prefix_and_tells_roles_apart() -> None:
    turns = [("user", "a"), ("assistant", "b"), ("user", "c")]
    digests = chain(turns)
    assert len(digests) == 3 and len(set(digests)) == 3
    assert chain(turns[:2]) == digests[:2]
    assert chain([("user", "ab")]) != chain([("user", "a"), ("user", "b")])[-1:]
    assert chain([turns[2]], digests[1]) == digests[2:]


def test_find_chat_takes_the_longest_idle_prefix_of_the_same_key_and_model() -> None:
    store = SessionStore()
    history = (("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
    short, long_ = chat_entry(history[:2], i=1), chat_entry(history, i=2)
    other_owner, other_model = chat_entry(history, owner="bob", i=3), chat_entry(history, model="x", i=4)
    for e in (short, long_, other_owner, other_model):
        store.put(e)
    request = (*history, ("user", "q3"))
    digests = chain(request)
    assert store.find_chat("", "m", request, digests) is long_
    store.take(long_)
    assert store.find_chat("", "m", request, digests) is short  # the longer one is busy
    assert store.find_chat("", "m", (("user", "q1"), ("assistant", "other")), chain((("user", "q1"), ("assistant", "other")))) is None
    assert (store.idle, store.busy) == (3, 1)


def test_completion_sessions_match_by_text_or_ids_start() -> None:
    store = SessionStore()
    text = Entry(session(1), "", "m", "text", 1024, "Once upon a time, there", b"", 6)
    ids = Entry(session(2), "", "m", "ids", 1024, (1, 2, 3), b"", 3)
    store.put(text)
    store.put(ids)
    assert store.find_completion("", "m", "Once upon a time, there was") is text
    assert store.find_completion("", "m", "Once upon a time, there") is None  # nothing new to append
    assert store.find_completion("", "m", (1, 2, 3, 4)) is ids
    assert store.find_completion("", "m", (1, 2, 4, 4)) is None


def test_eviction_is_least_recently_used_of_the_model_and_max_idle_closes_the_oldest() -> None:
    store = SessionStore(max_idle=2)
    a, b, c = (chat_entry((("user", str(i)), ("assistant", "x")), i=i) for i in range(3))
    assert store.put(a) == [] and store.put(b) == []
    assert store.put(c) == [a]  # over the cap: the oldest goes
    assert store.evict("other-model") is None
    assert store.evict("m") is b and store.idle == 1


def test_a_named_session_stays_under_its_name_while_busy_and_a_new_one_replaces_it() -> None:
    store = SessionStore()
    first = chat_entry((("user", "q"), ("assistant", "a")), name="conv", i=1)
    store.put(first)
    store.take(first)
    assert store.named("", "conv") is first and first.busy
    assert store.named("bob", "conv") is None
    store.put(first)
    second = chat_entry((("user", "other"), ("assistant", "b")), name="conv", i=2)
    assert store.put(second) == [first]
    assert store.named("", "conv") is second
    turns = (("user", "other"), ("assistant", "b"))
    assert store.find_chat("", "m", turns, chain(turns)) is None  # named: not in the prefix index


def test_a_session_is_found_by_an_earlier_answer_its_conversation_went_on_from() -> None:
    """A request that shares a session's conversation up to an earlier answer and goes on otherwise (a message after
    it edited) finds the session by that answer's digest: the longest such prefix first, the owner's and the model's
    only, while idle; not by its whole history (that is find_chat's), and not once released."""
    turns = (("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"), ("user", "q3"),
             ("assistant", "a3"))
    digests = chain(turns)
    short = chat_entry(turns[:4], i=1)
    short.branches = (digests[1],)
    long = chat_entry(turns, i=2)
    long.branches = (digests[1], digests[3])
    store = SessionStore()
    store.put(short)
    store.put(long)
    edited = (*turns[:4], ("user", "q3 edited"))
    assert store.find_branch("", "m", edited, chain(edited)) is long  # shares a2 with it, a1 only with short
    assert store.find_chat("", "m", edited, chain(edited)) is short  # (which the request extends: resumed first)
    other = (*turns[:2], ("user", "q2 edited"))
    assert store.find_branch("", "m", other, chain(other)) in (short, long)
    assert store.find_branch("bob", "m", edited, chain(edited)) is None
    assert store.find_branch("", "m2", edited, chain(edited)) is None
    assert store.find_branch("", "m", turns, digests) is long  # (an earlier answer of its own: a2)
    store.take(long)
    assert store.find_branch("", "m", edited, chain(edited)) is short  # long busy: the next longest, a1
    store.put(long)
    store.release(long)
    store.release(short)
    assert not store._branches


def test_a_session_is_found_by_its_history_less_its_last_answer_while_idle_only() -> None:
    turns = (("user", "q"), ("assistant", "a"))
    entry = chat_entry(turns)
    entry.asked = chain(turns)[0]
    store = SessionStore()
    store.put(entry)
    assert store.find_asked("", "m", chain(turns[:1])[-1]) is entry
    assert store.find_asked("bob", "m", entry.asked) is None and store.find_asked("", "m2", entry.asked) is None
    store.take(entry)
    assert store.find_asked("", "m", entry.asked) is None  # busy
    store.put(entry)
    store.release(entry)
    assert store.find_asked("", "m", entry.asked) is None and not store._asked


def test_entry_extended_by() -> None:
    e = chat_entry((("user", "q"), ("assistant", "a")))
    longer = (("user", "q"), ("assistant", "a"), ("user", "q2"))
    assert e.extended_by(longer, chain(longer))
    assert not e.extended_by(longer[:1], chain(longer[:1]))
    assert Entry(session(), "", "m", "chat", 10).extended_by(longer, chain(longer))  # a new session holds nothing


def parse_chat(**body: Any) -> schema.ChatRequest:
    request = schema.parse(schema.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    assert isinstance(request, schema.ChatRequest)
    return request


def test_chat_parameters_map_to_sampling() -> None:
    s = schema.sampling(parse_chat(max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, stop=["x"], logprobs=True,
                                   top_logprobs=4, top_k=5, ignore_eos=True, stop_token_ids=[9], n=2, user="u",
                                   tool_choice="none", response_format={"type": "text"}, presence_penalty=0))
    plain = {"logit_bias": {}, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
             "min_p": 0.0, "min_tokens": 0}
    assert s == schema.Sampling(7, 0.0, 0.5, 5, 3, ("x",), (9,), True, 4, plain)
    assert s.params(100, 1).seed == 4 and s.params(100).max_tokens == 7 and not s.params(100).extended
    penalized = schema.sampling(parse_chat(presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                           logit_bias={"5": 2, "17": -100}, min_p=0.05, min_tokens=3)).params(100, 1)
    assert (penalized.min_p, penalized.min_tokens) == (0.05, 3)
    assert (penalized.presence_penalty, penalized.frequency_penalty, penalized.repetition_penalty) == (1.5, -0.5, 1.2)
    assert penalized.logit_bias == (p.LogitBias(5, 2.0), p.LogitBias(17, -100.0))
    assert schema.sampling(parse_chat()).params(100).max_tokens == 100  # no limit: the session's context
    turns = parse_chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "user", "content": "c"}]).turns()
    assert turns == (("system", "ab"), ("user", "c"))


QWEN25 = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}  # Qwen2.5-7B-Instruct's


def test_a_parameter_left_out_is_the_model_s_recommended_one_and_one_given_wins() -> None:
    """vLLM's server gives a request the model's generation_config.json sampling where it leaves a parameter out
    (OpenAI's own default where the model recommends none); what the request sets, even to OpenAI's default, stays."""
    left_out = schema.sampling(parse_chat(), QWEN25).params(100)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty, left_out.min_p,
            left_out.max_tokens) == (0.7, 0.8, 20, 1.05, 0.0, 100)
    assert left_out.extended  # repetition_penalty: only a worker that applies it may take the request
    given = schema.sampling(parse_chat(temperature=1, top_p=1, top_k=0, repetition_penalty=1, min_p=0.1,
                                       max_tokens=9), {**QWEN25, "min_p": 0.05, "max_tokens": 3}).params(100)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty, given.min_p, given.max_tokens) == (
        1.0, 1.0, 0, 1.0, 0.1, 9)
    capped = schema.sampling(parse_chat(), {"max_tokens": 3}).params(100)
    assert (capped.max_tokens, capped.temperature, capped.top_p, capped.top_k) == (3, 1.0, 1.0, 0)
    assert schema.sampling(parse_chat(), {"max_tokens": 4096}).params(100).max_tokens == 100  # the session's room
    assert schema.sampling(parse_chat(min_tokens=5), {"max_tokens": 3}).params(100).max_tokens == 5
    plain = schema.sampling(parse_chat()).params(100)  # no recommendation: OpenAI's defaults
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens, plain.extended) == (1.0, 1.0, 0, 100, False)
    text = schema.parse(schema.CompletionRequest, {"model": "m", "prompt": "a", "temperature": 0.2})
    assert isinstance(text, schema.CompletionRequest)
    both = schema.sampling(text, QWEN25).params(100)
    assert (both.temperature, both.top_p, both.top_k) == (0.2, 0.8, 20)


def test_a_model_s_recommended_sampling_is_used_only_when_its_workers_agree() -> None:
    def worker(name: str, model: str, defaults: dict[str, float | int]) -> WorkerInfo:
        return WorkerInfo(name, model, 4, 4, 0, False, "cpu", sampling_defaults=defaults)

    served = Served((worker("a", "qwen", QWEN25), worker("b", "qwen", dict(reversed(QWEN25.items()))),
                     worker("c", "llama", {"temperature": 0.6, "top_p": 0.9}), worker("d", "llama", {})), 0.0)
    assert served.sampling_defaults("qwen") == QWEN25  # the same recommendation, in any order
    assert served.sampling_defaults("llama") == {}  # a worker recommends none: no agreement, the API's defaults
    assert served.sampling_defaults("other") == {}
    old, new = WorkerInfo("o", "qwen", 4, 4, 0, False, ""), WorkerInfo("n", "qwen", 4, 4, 0, False, "", tools=True)
    assert Served((new,), 0.0).renders_tools("qwen") and not Served((old, new), 0.0).renders_tools("qwen")
    draining_old = WorkerInfo("o", "qwen", 4, 4, 0, True, "")
    assert Served((draining_old, new), 0.0).renders_tools("qwen")  # it takes no new session
    assert not Served((draining_old,), 0.0).renders_tools("qwen") and not Served((), 0.0).renders_tools("qwen")
    assert len({WorkerInfo("a", "m", 1, 1, 0, False, ""), WorkerInfo("a", "m", 1, 1, 0, False, "")}) == 1  # hashable


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": "1"}, "temperature", "valid number"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
    ({"presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias", "token 5 is named twice"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids, got 'x'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "values must be in [-100, 100], got 101.0 for token 5"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "a tool message, and only a tool message, has a "
                                                                      "tool_call_id"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role", "role must be one of"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name", "None"),
    ({"messages": []}, "messages", "at least 1"),
    ({"session_id": "a b"}, "session_id", "must match"),
    ({"stop": ["x"] * 17}, "stop", "at most 16"),
    ({"top_p": 0}, "top_p", "greater than 0"),
])
def test_bad_chat_parameters_are_400_naming_the_field(body: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat(**body)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message


@pytest.mark.parametrize(("body", "needle"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "strict is not supported"),
    ({"tool_choice": "auto"}, "tool_choice is only allowed with tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "only \"auto\""),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "differ"),
    ({"stream_options": {"include_usage": True}}, "only allowed when stream"),
])
def test_unsupported_features_are_refused_not_ignored(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiError) as e:
        schema.sampling(parse_chat(**body))
    assert e.value.status == 400 and needle in e.value.message


def test_completion_prompts() -> None:
    def prompt(value: Any, **extra: Any) -> Any:
        request = schema.parse(schema.CompletionRequest, {"model": "m", "prompt": value, **extra})
        assert isinstance(request, schema.CompletionRequest)
        return request.prompt_value()

    assert prompt("hi") == "hi" and prompt([1, 2]) == (1, 2) and prompt(["hi"]) == "hi" and prompt([[3]]) == (3,)
    for bad, needle in (([], "empty"), (["a", "b"], "batch"), ("", "empty")):
        with pytest.raises(ApiError, match=needle):
            prompt(bad)
    for extra, needle in (({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")):
        with pytest.raises(ApiError, match=needle):
            prompt("hi", **extra)


def test_api_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# owners\nalice  alice-key-0000000001\nbob-key-00000000000002\n\n")
    keys = ApiKeys.from_file(path)
    assert keys.owner("Bearer alice-key-0000000001") == "alice"
    assert keys.owner("bearer bob-key-00000000000002").startswith("key-")
    for header in (None, "", "Bearer", "Basic alice-key-0000000001", "Bearer alice-key-0000000002"):
        with pytest.raises(ApiError) as e:
            keys.owner(header)
        assert e.value.status == 401 and e.value.kind == "authentication_error"
    assert ApiKeys.open().owner(None) == ""
    for text, needle in (("alice short\n", "expected"), ("a b c\n", "expected"), ("# none\n", "no key"),
                         ("k-0000000000000001\nk-0000000000000001\n", "twice")):
        path.write_text(text)
        with pytest.raises(KeyFileError, match=needle):
            ApiKeys.from_file(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "missing")


@pytest.mark.parametrize(("error", "status", "retry_after"), [
    (BadRequest("x"), 400, None), (CapacityExhausted("x"), 429, "1"), (WorkerDraining("x"), 503, "1"),
    (ModelNotFound("x"), 503, "1"), (SessionLost("x"), 503, "1"), (SessionExpired("x"), 503, "1"), (Timeout("x"), 504, None),
    (InternalError("x"), 500, None), (Unauthorized("x"), 500, None), (Overloaded("x"), 503, "1"),
    (PromptBoundary("x"), 400, None),
])
def test_broker_errors_map_to_http(error: Exception, status: int, retry_after: str | None) -> None:
    assert isinstance(error, (BadRequest, CapacityExhausted, WorkerDraining, ModelNotFound, SessionLost, SessionExpired,
                              Timeout, InternalError, Unauthorized, Overloaded))
    api = from_client_error(error)
    assert api.status == status and api.headers().get("Retry-After") == retry_after
    assert set(api.body()["error"]) == {"message", "type", "param", "code"}
