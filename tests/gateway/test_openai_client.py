"""The real `openai` package (sync, async, streaming, errors) against gateway + broker + a CPU worker with the
bundled SmolLM2, all processes on loopback."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.errors import CapacityExhausted
from client.sync import Client, Session

from .conftest import API_KEYS, MODEL, SLOTS, Gateways, http_get

QUESTION = "What is the capital of France?"
FOLLOW_UPS = ["And of Spain?", "And of Italy?", "Which of the three is the largest city?"]


_CLIENTS: list[openai.OpenAI] = []  # kept until the module ends: an unclosed client's sockets warn when collected


def sync_client(url: str, key: str = "none") -> openai.OpenAI:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=180)
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True, scope="module")
def _close_clients() -> Iterator[None]:
    yield
    for client in _CLIENTS:
        client.close()
    _CLIENTS.clear()


def test_models_lists_the_workers_model_and_its_context(gateway: str) -> None:
    models = sync_client(gateway).models.list().data
    assert [(m.id, getattr(m, "max_model_len", None)) for m in models] == [(MODEL, 1024)]  # the worker's --max-context
    assert getattr(sync_client(gateway).models.retrieve(MODEL), "max_model_len", None) == 1024


def test_chat_answers_sensible_text_with_usage(gateway: str) -> None:
    r = sync_client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert "Paris" in (choice.message.content or "") and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and r.object == "chat.completion" and r.model == MODEL
    assert r.usage is not None and r.usage.prompt_tokens > 20 and 0 < r.usage.completion_tokens < 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 0


def test_four_turns_with_a_session_id_send_only_new_tokens_and_match_the_native_client(
    gateway: str, gateways: Gateways
) -> None:
    c = sync_client(gateway)
    messages: list[dict[str, str]] = []
    gateway_tokens: list[list[int]] = []
    last_length = 0
    for turn, content in enumerate([QUESTION, *FOLLOW_UPS]):
        messages.append({"role": "user", "content": content})
        before = gateways.prefilled()
        r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,  # type: ignore[arg-type]
                                      extra_body={"session_id": "four-turns", "return_token_ids": True})
        computed = gateways.prefilled() - before
        usage = r.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        # The worker computed exactly the tokens the session did not hold: the new turn and the last answer's end.
        assert computed == usage.prompt_tokens - cached
        if turn == 0:
            assert cached == 0
        else:
            assert cached == last_length - 1 and cached > 0  # everything held but the last answer's pending token
        ids: list[int] = r.choices[0].model_extra["token_ids"]  # type: ignore[index]
        stop_token = 1 if r.choices[0].finish_reason == "stop" else 0
        last_length = usage.prompt_tokens + len(ids) + stop_token
        assert usage.completion_tokens == len(ids)
        gateway_tokens.append(ids)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    assert [len(t) for t in gateway_tokens] and all(gateway_tokens)
    with Client(gateways.stack.clients, timeout=120) as native, native.session(MODEL) as s:
        native_tokens = [s.chat(content, max_tokens=12).token_ids for content in [QUESTION, *FOLLOW_UPS]]
    assert native_tokens == gateway_tokens


def test_a_resent_history_resumes_its_session_without_a_session_id(gateway: str, gateways: Gateways) -> None:
    c = sync_client(gateway)
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    first = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Name one more."}]
    before = gateways.prefilled()
    second = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)  # type: ignore[arg-type]
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert gateways.prefilled() - before == second.usage.prompt_tokens - cached


def test_n_choices_come_from_one_prefill(gateway: str, gateways: Gateways) -> None:
    before = gateways.prefilled()
    r = sync_client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a word that rhymes with cat."}], n=3,
        temperature=1.0, seed=5, max_tokens=6, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content for c in r.choices)
    assert r.usage is not None
    # One prefill of the prompt but its last token; each of the three forks computes that one token (a decode row).
    assert gateways.prefilled() - before == r.usage.prompt_tokens - 1 + 3
    token_ids: list[list[int]] = [c.model_extra["token_ids"] for c in r.choices]  # type: ignore[index]
    assert r.usage.completion_tokens == sum(len(ids) for ids in token_ids)


def test_penalties_logit_bias_and_min_tokens_go_to_the_worker(gateway: str, gateways: Gateways) -> None:
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty change the greedy answer, which equals
    the native client's with the same values; a logit bias of 100 on one token makes it every token; min_tokens keeps
    the answer going past its end of turn."""
    c = sync_client(gateway)
    messages = [{"role": "user", "content": "Repeat after me: the cat, the cat, the cat, the cat."}]
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5}

    def answer(**extra: Any) -> list[int]:
        r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                      **extra)
        return r.choices[0].model_extra["token_ids"]  # type: ignore[index]

    plain = answer(extra_body={"return_token_ids": True})
    penalized = answer(**penalties, extra_body={"return_token_ids": True, "repetition_penalty": 1.3})
    assert penalized != plain
    with Client(gateways.stack.clients, timeout=120) as native, native.session(MODEL) as s:
        assert s.generate(messages=messages, max_tokens=16, repetition_penalty=1.3, presence_penalty=1.5,
                          frequency_penalty=0.5).token_ids == penalized
    comp = c.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                logit_bias={"29": 100}, extra_body={"return_token_ids": True})
    assert comp.choices[0].model_extra["token_ids"] == [29] * 5  # type: ignore[index]
    # vLLM's min_tokens: the end of turn stays out of reach until then (the same answer up to where it ended)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    short = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,  # type: ignore[arg-type]
                                      extra_body={"return_token_ids": True})
    ids: list[int] = short.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert short.choices[0].finish_reason == "stop" and len(ids) < 30
    longer = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,  # type: ignore[arg-type]
                                       extra_body={"return_token_ids": True, "min_tokens": len(ids) + 3})
    more: list[int] = longer.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert more[:len(ids)] == ids and len(more) >= len(ids) + 3
    both = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, n=2,  # type: ignore[arg-type]
                                     extra_body={"return_token_ids": True, "min_tokens": len(ids) + 3})
    assert [choice.model_extra["token_ids"] for choice in both.choices] == [more, more]  # type: ignore[index]


def _sse(url: str, body: dict[str, Any]) -> list[str]:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [block for block in text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


def test_streaming_chunk_format(gateway: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 24,
            "stream": True, "stream_options": {"include_usage": True}}
    events = _sse(gateway, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *with_choices, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in with_choices)
    assert [c["choices"][0]["finish_reason"] for c in with_choices] == [None] * (len(with_choices) - 1) + ["stop"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    whole = sync_client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24)
    assert text == whole.choices[0].message.content and "Paris" in text
    # Without include_usage: no usage key at all in the chunks.
    plain = [json.loads(e) for e in _sse(gateway, {**body, "stream_options": None})[:-1]]
    assert all("usage" not in c for c in plain)


def test_streaming_through_the_openai_client_with_logprobs_and_n(gateway: str) -> None:
    stream = sync_client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=8, n=2,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})
    texts = ["", ""]
    finishes: list[str | None] = [None, None]
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
            if choice.delta.content:
                assert choice.logprobs is not None and choice.logprobs.content
                entry = choice.logprobs.content[0]
                assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
    assert texts[0] and texts[0] == texts[1]  # greedy: both choices alike
    assert finishes[0] in ("stop", "length") and finishes[1] in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0


def test_chat_and_completion_logprobs(gateway: str) -> None:
    c = sync_client(gateway)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                  max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
        assert bytes(e.bytes or []).decode() == e.token
    comp = c.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens and "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 for top in lp.top_logprobs or [])


def test_completions_with_token_ids_resume_by_prefix(gateway: str, gateways: Gateways) -> None:
    c = sync_client(gateway)
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    first = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5,
                                 extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = first.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert first.choices[0].finish_reason == "length" and len(ids) == 5
    before = gateways.prefilled()
    second = c.completions.create(model=MODEL, prompt=[*prompt, *ids, 30], temperature=0, max_tokens=3)
    assert second.usage is not None and second.usage.prompt_tokens == len(prompt) + 6
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) + 4
    assert gateways.prefilled() - before == 2  # the last generated token and the new one


def test_a_resumed_text_prompt_that_merges_across_the_boundary_gets_the_whole_prompts_tokens(
        gateway: str, gateways: Gateways) -> None:
    """The answer ends in "\n" and the next prompt goes on with "\n\n": SmolLM2 tokenizes ".\n\n\nThe" as ".", "\n\n",
    "\n", "The", so the new part tokenized on its own would leave the session with 15 tokens where the whole prompt
    has 14. The worker refuses it (prompt_boundary) and the session is given the whole prompt from its start: it keeps
    the 7 tokens the whole prompt starts with and computes the other 7, and the answer is, token for token, that of
    a request that no session held. A continuation that does not merge resumes the session."""
    c = sync_client(gateway)
    prompt = "The capital of France is"
    first = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3)
    assert first.choices[0].text == " Paris.\n" and first.choices[0].finish_reason == "length"
    whole = prompt + first.choices[0].text + "\n\nThe capital of Japan is"
    replaced = _closed(gateway, "replaced")
    before = gateways.prefilled()
    second = c.completions.create(model=MODEL, prompt=whole, temperature=0, max_tokens=4,
                                  extra_body={"return_token_ids": True})
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 7 and _closed(gateway, "replaced") == replaced
    assert gateways.prefilled() - before == second.usage.prompt_tokens - 7
    alone = c.completions.create(model=MODEL, prompt=whole, temperature=0, max_tokens=4,
                                 extra_body={"return_token_ids": True, "session_id": "no-session-held-it"})
    assert alone.usage is not None and second.usage.prompt_tokens == alone.usage.prompt_tokens == 14
    assert second.choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert second.choices[0].text == " Tokyo.\n\n"  # "\n", "\n": before a letter, as the whole text has them
    third = c.completions.create(model=MODEL, prompt=whole + second.choices[0].text + "Q: And Italy?", temperature=0,
                                 max_tokens=2)
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    assert third.usage.prompt_tokens_details.cached_tokens == second.usage.total_tokens - 1  # resumed


def _closed(url: str, why: str) -> float:
    """The gateway's sessions_closed_total{why}."""
    status, text = http_get(url + "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sessionserve:gateway_sessions_closed_total" and sample.labels == {"why": why}:
                return sample.value
    return 0.0


def test_chat_template_kwargs_go_to_the_template_and_part_conversations(gateway: str) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) are the template's variables: SmolLM2's template uses
    none of them, so the answer is the same; a conversation with other ones is another conversation (not resumed);
    the server's own variables and values that are not scalars are 400s."""
    c = sync_client(gateway)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    first = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_body=off)
    plain = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    assert first.choices[0].message.content == plain.choices[0].message.content
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    same = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2, extra_body=off)
    other = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert same.usage is not None and same.usage.prompt_tokens_details is not None
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert (same.usage.prompt_tokens_details.cached_tokens or 0) > 0  # resumed: the same variables
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # not the session of another conversation
    for bad, needle in (({"messages": 1}, "messages: the template.s own"), ({"x": {"a": 1}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError, match=needle):
            c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                      extra_body={"chat_template_kwargs": bad})


def test_async_client_runs_conversations_concurrently(gateway: str) -> None:
    async def main() -> tuple[str, str, str]:
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            async def ask(q: str) -> str:
                stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                         temperature=0, max_tokens=12, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

            return await asyncio.gather(ask(QUESTION), ask("What is 2 + 2?"), ask("Name a fruit."))

    answers = asyncio.run(main())
    assert "Paris" in answers[0] and all(answers)


def test_errors_in_openais_shape(gateway: str) -> None:
    c = sync_client(gateway)
    messages = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"1000000": 5}}, "logit_bias"),  # past the vocabulary: the worker's refusal
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"temperature": 5}, "temperature"),
        ({"extra_body": {"best_guess": 1}}, "best_guess"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ]
    for extra, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **extra)  # type: ignore[arg-type]
        assert e.value.status_code == 400 and needle in e.value.message
        assert isinstance(e.value.body, dict) and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="max_context|exceed"):  # a worker's own refusal: too long
        c.completions.create(model=MODEL, prompt="word " * 1100, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert nf.value.status_code == 404 and isinstance(nf.value.body, dict) and nf.value.body["code"] == "model_not_found"


def test_capacity_is_429_with_retry_after(gateways: Gateways) -> None:
    fresh = gateways.start()  # a gateway holding no idle session it could close to make room
    with Client(gateways.stack.clients, timeout=60) as native:
        held: list[Session] = []
        try:
            while len(held) < SLOTS:  # every slot the other gateways' idle sessions leave
                try:
                    held.append(native.session(MODEL))
                except CapacityExhausted:
                    break
            with pytest.raises(openai.RateLimitError) as e:
                sync_client(fresh).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "A new conversation."}], max_tokens=2)
        finally:
            for s in held:
                s.close()
    assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "capacity_exhausted"


def test_readyz_answers_within_a_probes_timeout_when_no_broker_does(gateways: Gateways) -> None:
    """No broker at the address: /readyz is a 503 with the reason within a second (it waited for the 5 s STATUS,
    so a probe with Kubernetes' 1 s timeout failed by timing out instead)."""
    from client.stack import free_address

    url = gateways.start(broker=free_address(), ready=False)
    for _ in range(2):
        started = time.monotonic()
        status, why = http_get(url + "/readyz")
        assert (status, why) == (503, "the broker does not answer within 0.8 s\n")
        assert time.monotonic() - started < 1.5


def test_no_worker_is_503(gateways: Gateways) -> None:
    from client.stack import Daemon, free_address

    address = free_address()
    broker = Daemon("broker.cli", ["--clients", address, "--workers", free_address()],
                    gateways.stack.log_dir / "empty-broker.log", env=gateways.stack.env)
    gateways.daemons.append(broker)
    url = gateways.start(broker=address, ready=False)
    assert http_get(url + "/readyz")[0] == 503
    with pytest.raises(openai.InternalServerError) as e:
        sync_client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"


def test_api_keys_are_required_and_own_their_sessions(keyed_gateway: str) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        sync_client(keyed_gateway, "wrong-key-wrong-key").models.list()
    assert e.value.status_code == 401
    status, _ = http_get(keyed_gateway + "/v1/models")
    assert status == 401
    alice, bob = sync_client(keyed_gateway, API_KEYS["alice"]), sync_client(keyed_gateway, API_KEYS["bob"])
    messages = [{"role": "user", "content": "Count to three."}]
    first = alice.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,  # type: ignore[arg-type]
                                          extra_body={"session_id": "shared-name"})
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Again."}]
    mine = alice.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,  # type: ignore[arg-type]
                                         extra_headers={"X-Session-ID": "shared-name"})
    theirs = bob.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,  # type: ignore[arg-type]
                                         extra_headers={"X-Session-ID": "shared-name"})
    assert mine.usage is not None and mine.usage.prompt_tokens_details is not None
    assert theirs.usage is not None and theirs.usage.prompt_tokens_details is not None
    assert (mine.usage.prompt_tokens_details.cached_tokens or 0) > 0
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0  # bob's "shared-name" is his own session
    assert mine.choices[0].message.content == theirs.choices[0].message.content


def test_a_named_session_closes_on_delete_and_metrics_count(gateway: str) -> None:
    c = sync_client(gateway)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                              extra_body={"session_id": "to-delete"})
    request = urllib.request.Request(gateway + "/v1/sessions/to-delete", method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as r:
        assert json.loads(r.read()) == {"id": "to-delete", "object": "session", "deleted": True}
    status, _ = http_get(gateway + "/healthz")
    assert status == 200
    status, text = http_get(gateway + "/metrics")
    assert status == 200 and 'sessionserve:gateway_requests_total{endpoint="chat",status="200"}' in text
    assert "sessionserve:gateway_cached_tokens_total" in text and "sessionserve:gateway_time_to_first_token_seconds" in text


def test_a_named_session_deleted_while_it_answers_finishes_that_answer_then_closes(gateway: str) -> None:
    """DELETE frees the name at once (a request naming it gets a new session) and closes the session when the turn it
    is answering ends; that turn's stream is answered whole."""
    c = sync_client(gateway)
    closed = _closed(gateway, "ended")
    stream = c.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=24,
                                  stream=True, extra_body={"session_id": "deleted-busy", "ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    request = urllib.request.Request(gateway + "/v1/sessions/deleted-busy", method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as r:
        assert json.loads(r.read()) == {"id": "deleted-busy", "object": "session", "deleted": True}
    text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert _closed(gateway, "ended") == closed + 1
    again = c.completions.create(model=MODEL, prompt="The capital of France is" + text + " And", temperature=0,
                                 max_tokens=1, extra_body={"session_id": "deleted-busy"})
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # a new session: the deleted one was not kept


def test_sigterm_closes_the_sessions_it_keeps_and_exits_0(gateways: Gateways) -> None:
    url = gateways.start()
    daemon = gateways.daemons[-1]
    with Client(gateways.stack.clients, timeout=60) as native:
        before = native.status()[0].sessions
        sync_client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Bye."}], max_tokens=2,
                                                 extra_body={"session_id": "kept"})
        assert native.status()[0].sessions == before + 1
        assert daemon.stop() == 0
        assert native.status()[0].sessions == before


def test_processes_share_the_port_and_sum_their_metrics(gateways: Gateways) -> None:
    url = gateways.start(extra=["--processes", "2"])
    c = sync_client(url)
    for i in range(4):
        c.completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=1, temperature=0)
    _, text = http_get(url + "/metrics")
    assert 'sessionserve:gateway_requests_total{endpoint="completions",status="200"} 4.0' in text
    assert gateways.daemons[-1].stop() == 0


def post(url: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_answer_sent_back_as_the_client_got_it_and_nulls_for_nullable_fields_are_taken(gateway: str) -> None:
    c = sync_client(gateway)
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    first = c.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=4, seed=-3)
    history.append(first.choices[0].message.model_dump())  # refusal, tool_calls, audio ... as null
    history.append({"role": "user", "content": "And of Spain?"})
    second = c.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=4,
                                       extra_body={"n": None, "stream": None, "logprobs": None})
    assert second.choices[0].message.content and second.usage is not None
    status, body = post(gateway + "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": 1, "echo": None, "stream": None, "n": None}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    function_call = {"name": "f", "arguments": "{}"}  # the deprecated form of tool_calls: refused, not dropped
    status, body = post(gateway + "/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "assistant", "content": "x", "function_call": function_call}]}).encode())
    assert status == 400 and body["error"]["param"] == "messages.0.function_call"


def test_bad_http_is_answered_in_openais_shape(gateway: str) -> None:
    status, body = post(gateway + "/v1/chat/completions", b"[" * 5000 + b"]" * 5000)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(gateway + "/v1/chat/completions", b"{}", headers={"Content-Length": str(17 << 20)})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = post(gateway + "/v1/nope", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = post(gateway + "/v1/chat/completions", b"", method="PUT")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert sync_client(gateway).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sync_client(gateway).models.retrieve("no-such-model")


def test_a_named_sessions_first_turn_refuses_a_concurrent_one(gateway: str) -> None:
    async def turns() -> list[int]:
        c = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=120)
        async def turn() -> int:
            try:
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, extra_body={"session_id": "raced", "ignore_eos": True})
                return 200
            except openai.APIStatusError as e:
                return e.status_code
        try:
            return sorted(await asyncio.gather(turn(), turn()))
        finally:
            await c.close()

    assert asyncio.run(turns()) == [200, 409]


def test_a_whole_answer_longer_than_the_timeout_is_not_a_timeout(gateways: Gateways) -> None:
    """--timeout bounds the wait for each token, streamed or not."""
    url = gateways.start(extra=["--timeout", "6"])  # (a loaded 2-core machine has taken over 4 s for a step)
    start = time.monotonic()
    r = sync_client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=250, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 250
    assert time.monotonic() - start > 6  # (~18 tokens/s on a 2-core machine)


def gateway_samples(url: str) -> dict[str, float]:
    """The gateway's /metrics: name{label=value,...} -> value (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = http_get(url + "/metrics")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_a_stream_is_running_until_it_ends_and_a_client_gone_mid_stream_counts_499(gateways: Gateways) -> None:
    import http.client

    url = gateways.start()
    running, gone = "sessionserve:gateway_num_requests_running{}", "sessionserve:gateway_requests_total{endpoint=completions,status=499}"
    ok = "sessionserve:gateway_requests_total{endpoint=completions,status=200}"
    connection = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    body = json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 500, "stream": True, "ignore_eos": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.status == 200
    assert answer.readline().startswith(b"data: ")  # the stream is under way
    during = gateway_samples(url)
    assert during[running] == 1
    assert ok not in during and gone not in during
    connection.close()  # gone mid-stream
    deadline = time.monotonic() + 30
    while (after := gateway_samples(url)).get(gone) != 1:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after[running] == 0 and ok not in after
    tokens = "sessionserve:gateway_generation_tokens_total{}"
    cut = after.get(tokens, 0)
    assert cut >= 1  # the tokens the cut stream sent count as generated (they counted only at a whole answer's end)
    assert len(list(sync_client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                                        extra_body={"ignore_eos": True}))) >= 1
    while (whole := gateway_samples(url)).get(ok) != 1:  # counted as its last byte went out
        assert time.monotonic() < deadline, whole
        time.sleep(0.05)
    assert whole[gone] == 1 and whole[running] == 0 and whole[tokens] == cut + 2
