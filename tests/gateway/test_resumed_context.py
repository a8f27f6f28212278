"""A resumed session must hold exactly the context a fresh session would compute from the request: every answer after
a resume equals the answer the same request gets on a new session (the reference, opened under a new session_id).
A session whose answer's text does not stand for its tokens is resumed with the whole conversation from its start
(from_start): it keeps the tokens that match, at least the first turn's prompt."""

from __future__ import annotations

import itertools
from typing import Any

import openai

from .conftest import MODEL, Gateways
from .test_openai_client import sync_client

QUESTION = "What is the capital of France?"
_names = itertools.count()


def ask(client: openai.OpenAI, messages: list[dict[str, str]], fresh: bool = False, **kw: Any) -> Any:
    extra = dict(kw.pop("extra_body", {}))
    if fresh:
        extra["session_id"] = f"reference-{next(_names)}"  # a name not used yet: a new session, computed from scratch
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,  # type: ignore[arg-type]
                                          extra_body=extra, **kw)


def then(answer: Any, question: str) -> list[dict[str, str]]:
    """The assistant turn an answer gives, and the user's next question."""
    return [{"role": "assistant", "content": answer.choices[0].message.content}, {"role": "user", "content": question}]


def same_as_fresh(client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[Any, Any]:
    resumed = ask(client, messages, max_tokens=12)
    fresh = ask(client, messages, fresh=True, max_tokens=12)
    assert resumed.usage.prompt_tokens == fresh.usage.prompt_tokens
    assert resumed.choices[0].message.content == fresh.choices[0].message.content
    return resumed, fresh


def test_an_answer_that_ended_on_a_stop_token_id_is_resumed_from_its_start(gateway: str) -> None:
    client = sync_client(gateway)
    plain = ask(client, [{"role": "user", "content": QUESTION}], max_tokens=12, extra_body={"return_token_ids": True})
    stop_id = plain.choices[0].model_extra["token_ids"][4]  # " is" in "The capital of France is Paris."
    first = ask(client, [{"role": "user", "content": QUESTION}], max_tokens=12, extra_body={"stop_token_ids": [stop_id]})
    assert first.choices[0].message.content == "The capital of France" and first.choices[0].finish_reason == "stop"
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital of France"},
               {"role": "user", "content": "And of Spain?"}]
    resumed, _ = same_as_fresh(client, history)  # the session held " is" after the answer: dropped, not followed
    assert first.usage.prompt_tokens <= resumed.usage.prompt_tokens_details.cached_tokens < resumed.usage.prompt_tokens


def test_an_answer_past_eos_with_ignore_eos_is_resumed_from_its_start(gateway: str) -> None:
    client = sync_client(gateway)
    first = ask(client, [{"role": "user", "content": "Say hi."}], max_tokens=30, extra_body={"ignore_eos": True})
    text = first.choices[0].message.content
    assert "\nuser\n" in text  # the model went on past its <|im_end|>, which the text leaves out
    history = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": text},
               {"role": "user", "content": "Say bye."}]
    resumed, _ = same_as_fresh(client, history)  # the session held the special tokens: the text's instead
    assert first.usage.prompt_tokens <= resumed.usage.prompt_tokens_details.cached_tokens < resumed.usage.prompt_tokens


def test_an_answer_cut_inside_a_utf8_character_is_resumed_from_its_start(gateway: str) -> None:
    client = sync_client(gateway)
    question = "Write the Japanese word for cat in kanji, then an emoji of a cat."
    first = ask(client, [{"role": "user", "content": question}], max_tokens=1)
    assert first.choices[0].message.content == "\ufffd"  # the first byte of a character, replaced
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": "\ufffd"},
               {"role": "user", "content": "Thanks"}]
    resumed, _ = same_as_fresh(client, history)  # the session held the character's first byte: U+FFFD's instead
    assert first.usage.prompt_tokens <= resumed.usage.prompt_tokens_details.cached_tokens < resumed.usage.prompt_tokens


def test_a_plain_answer_is_still_resumed_and_matches_a_fresh_session(gateway: str) -> None:
    client = sync_client(gateway)
    first = ask(client, [{"role": "user", "content": QUESTION}], max_tokens=24)
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And of Spain?"}]
    resumed, fresh = same_as_fresh(client, history)
    assert resumed.usage.prompt_tokens_details.cached_tokens > 0 and fresh.usage.prompt_tokens_details.cached_tokens == 0


def test_an_answer_asked_again_computes_one_token_and_matches_a_fresh_session(gateway: str, gateways: Gateways) -> None:
    """A "regenerate": the conversation less its last answer, sent again without a name, takes the session that gave
    that answer; it keeps everything but the answer (the last prompt token runs again to sample from) and gives the
    same answer as a new session."""
    client = sync_client(gateway)
    history = [{"role": "user", "content": "Name a colour of the rainbow."}]
    first = ask(client, history, max_tokens=10)
    history += then(first, "And a fruit?")
    second = ask(client, history, max_tokens=10)
    before = gateways.prefilled()
    again, fresh = same_as_fresh(client, history)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    # The fresh session's prompt, and the token run again (in a decode row).
    assert gateways.prefilled() - before == fresh.usage.prompt_tokens + 1
    assert again.choices[0].message.content == second.choices[0].message.content[:len(again.choices[0].message.content)]


def test_an_edited_earlier_message_without_a_name_keeps_the_turns_before_it(gateway: str, gateways: Gateways) -> None:
    """A conversation of three turns without a name; then the second question edited (a chat UI's "edit"): a fork
    of the session keeps the first turn, prompt and answer, computes the rest and answers as a new session; the
    session itself still takes the conversation it holds going on."""
    client = sync_client(gateway)
    history = [{"role": "user", "content": "Name a planet."}]
    first = ask(client, history, max_tokens=8)
    history += then(first, "Name a star.")
    second = ask(client, history, max_tokens=8)
    history += then(second, "Name a moon.")
    third = ask(client, history, max_tokens=8)
    edited = [*history[:2], {"role": "user", "content": "Name a comet."}]
    before = gateways.prefilled()
    branch, fresh = same_as_fresh(client, edited)
    cached = branch.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens + first.usage.completion_tokens <= cached < branch.usage.prompt_tokens
    assert gateways.prefilled() - before == branch.usage.prompt_tokens - cached + fresh.usage.prompt_tokens
    history += then(third, "Name a river.")
    resumed = ask(client, history, max_tokens=8)
    assert resumed.usage.prompt_tokens_details.cached_tokens >= third.usage.prompt_tokens


def test_an_edited_named_conversation_keeps_what_it_shares(gateway: str, gateways: Gateways) -> None:
    """The client edits the second question of a named conversation: the session keeps the first turn (its prompt and
    answer) and computes the rest; the answer is a new session's."""
    client = sync_client(gateway)
    name = {"session_id": "edited-conversation"}
    history = [{"role": "user", "content": QUESTION}]
    first = ask(client, history, max_tokens=8, extra_body=name)
    history += then(first, "And of Spain?")
    ask(client, history, max_tokens=8, extra_body=name)
    history[-1] = {"role": "user", "content": "And of Italy?"}
    before = gateways.prefilled()
    edited = ask(client, history, max_tokens=12, extra_body=name)
    fresh = ask(client, history, fresh=True, max_tokens=12)
    assert edited.choices[0].message.content == fresh.choices[0].message.content
    cached = edited.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens + first.usage.completion_tokens <= cached < edited.usage.prompt_tokens
    assert gateways.prefilled() - before == edited.usage.prompt_tokens - cached + fresh.usage.prompt_tokens
