"""Chat templates render exactly as Hugging Face transformers renders them.

The real templates of the models users run are kept in tests/worker/templates/ (its README.md says where each came
from). Each is put on a small byte-level tokenizer with the model's BOS and EOS (rendering is text: the vocabulary does
not matter) and our `Tokenizer.apply_chat_template` must give transformers' `apply_chat_template(..., tokenize=False)`,
text for text, or refuse where transformers raises. The clock is fixed for both: Llama 3.2 writes today's date
(`strftime_now`). Small templates show each piece of transformers' environment on its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken

import worker.model.tokenizer as tokenizer_module
from worker.engine.session import common_prefix
from worker.model.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")
chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATES = Path(__file__).parent / "templates"
LLAMA3 = ("<|begin_of_text|>", "<|eot_id|>")
QWEN = (None, "<|im_end|>")
MODELS: dict[str, tuple[str | None, str]] = {  # template file -> (bos_token, eos_token) as the model's tokenizer has them
    "llama-3.1-instruct": LLAMA3,
    "llama-3.2-instruct": LLAMA3,
    "qwen2.5-instruct": QWEN,
    "qwen3": QWEN,
    "qwen3-thinking-2507": QWEN,
    "qwen3.5": QWEN,
    "mistral-nemo-instruct-2407": ("<s>", "</s>"),
}
NOW = datetime(2025, 3, 9, 23, 59, 30)

Message = dict[str, str]


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def system(text: str) -> Message:
    return {"role": "system", "content": text}


CONVERSATIONS: dict[str, list[Message]] = {
    "user": [user("What is the capital of France?")],
    "system and user": [system("Be brief."), user("What is the capital of France?")],
    "multi-turn": [system("Be brief."), user("Capital of France?"), assistant("Paris."), user("And of Spain?"),
                   assistant("Madrid."), user("And of Italy?")],
    "developer": [{"role": "developer", "content": "Answer in French."}, user("Capital of Spain?")],
    "system later": [user("Hi"), assistant("Hello!"), system("Now answer formally."), user("Hi again")],
    "reasoning answers": [user("2+2?"), assistant("<think>\nSmall sums.\n</think>\n\n4"), user("3+3?"),
                          assistant("<think>\n\n</think>\n\n6"), user("4+4?")],
    "answers with spaces": [user("  padded question  "), assistant(" An answer.\n"), user("Next")],
    "text to escape": [user('é 中文 <b>&amp;</b> "quoted" \\ {{ not jinja }}'), assistant("ok")],
}


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both renderers read datetime.now() through their module's `datetime`: the same instant for both."""

    class Fixed(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Fixed:
            return cls.fromtimestamp(NOW.timestamp(), tz)

    monkeypatch.setattr(tokenizer_module, "datetime", Fixed, raising=False)
    monkeypatch.setattr(chat_template_utils, "datetime", Fixed)
    yield


def pair(template: str, bos: str | None, eos: str) -> tuple[Tokenizer, Any]:
    """Our tokenizer and transformers' over one byte-level vocabulary with `bos` and `eos` as special tokens."""
    raw = Tokenizer.bytes_only()._tok
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (bos, eos)
                            if t is not None and raw.token_to_id(t) is None])
    eos_id = raw.token_to_id(eos)
    assert eos_id is not None
    ours = Tokenizer(raw, bos_id=None if bos is None else raw.token_to_id(bos), eos_id=eos_id, chat_template=template)
    named = {"eos_token": eos} if bos is None else {"bos_token": bos, "eos_token": eos}
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, **named)
    theirs.chat_template = template
    return ours, theirs


def rendered(tok: Tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    return str(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))


def assert_renders_as_transformers(ours: Tokenizer, theirs: Any, messages: list[Message],
                                   add_generation_prompt: bool = True) -> str:
    """Our text, checked to be transformers'; where transformers raises, ours raises ChatTemplateError."""
    try:
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:
        with pytest.raises(ChatTemplateError, match=re.escape(str(e))):
            ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return ""
    text = rendered(ours, messages, add_generation_prompt)
    assert text == expected
    return text


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_real_templates_render_as_transformers_renders_them(model: str, conversation: str) -> None:
    ours, theirs = pair((TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8"), *MODELS[model])
    for add_generation_prompt in (True, False):
        assert_renders_as_transformers(ours, theirs, CONVERSATIONS[conversation], add_generation_prompt)


def test_llama_3_2_writes_the_day_it_renders_on() -> None:
    ours, theirs = pair((TEMPLATES / "llama-3.2-instruct.jinja").read_text(encoding="utf-8"), *LLAMA3)
    text = assert_renders_as_transformers(ours, theirs, [user("What day is it?")])
    assert "Today Date: 09 Mar 2025\n" in text  # not the template's fallback, 26 Jul 2024


def test_qwen3_drops_the_reasoning_of_answers_before_the_last_question() -> None:
    ours, theirs = pair((TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"), *QWEN)
    text = assert_renders_as_transformers(ours, theirs, CONVERSATIONS["reasoning answers"])
    assert "Small sums" not in text and "<|im_start|>assistant\n4<|im_end|>\n" in text


@pytest.mark.parametrize(("template", "messages"), [
    # loop controls ({% break %}, {% continue %}): transformers loads jinja2.ext.loopcontrols
    ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}|"
     "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}",
     [system("s"), user("a"), assistant("b"), user("c")]),
    # {% generation %}: transformers' mark of the assistant's tokens, in templates saved for fine-tuning
    ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% set x = 1 %}"
     "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ x is defined }};{% endfor %}",
     [user("a"), assistant("b")]),
    # tojson with transformers' arguments, and no HTML escaping
    ("{{ messages | tojson(separators=(',', ':'), sort_keys=true) }}{{ messages[0] | tojson(indent=2) }}"
     "{{ messages[0].content | tojson(ensure_ascii=true) }}",
     [user("é <b> & ' \"")]),
    # the variables transformers passes: tools and documents None, the special tokens the model has
    ("{{ tools is none }} {{ documents is none }} {{ bos_token is defined }} {{ eos_token }} "
     "{{ add_generation_prompt }}",
     [user("a")]),
    ("{{ strftime_now('%Y-%m-%d %H:%M:%S %A %b') }}", [user("a")]),
    ("{{ raise_exception('Conversation roles must alternate') }}", [user("a")]),
])
@pytest.mark.parametrize("bos", [None, "<|begin_of_text|>"])
def test_transformers_template_environment(template: str, messages: list[Message], bos: str | None) -> None:
    ours, theirs = pair(template, bos, "<|im_end|>")
    assert_renders_as_transformers(ours, theirs, messages)


def test_a_folder_transformers_saved_gives_its_chat_template_jinja(tmp_path: Path) -> None:
    """transformers saves the template as chat_template.jinja (and not in tokenizer_config.json); where both are there,
    the file wins."""
    template = (TEMPLATES / "llama-3.2-instruct.jinja").read_text(encoding="utf-8")
    _, theirs = pair(template, *LLAMA3)
    theirs.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert ours.chat_template == template
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert_renders_as_transformers(ours, loaded, CONVERSATIONS["multi-turn"])


# -- a resumed session: the turns after its last answer -----------------------------------------------------------------
#
# A session holds its first turns rendered with the assistant prompt, then the answer the model generated and its stop
# token; a resumed turn appends only what `Tokenizer.chat_continuation` renders. The client then holds the answer's text
# as an assistant message, and the session's tokens must be those of the whole conversation rendered at once. They are
# not where the template renders an earlier answer otherwise than the session holds it: Llama 3 trims answers; Qwen3
# drops the reasoning of answers before the last user turn; Qwen3 Thinking-2507 and Qwen3.5 open <think> in the
# assistant prompt, which no earlier answer shows (and Qwen3.5 trims). There chat_continuation gives None and the engine
# refuses the turn (PromptBoundary): the gateway sends the session the whole conversation from its start (from_start),
# and the session keeps the tokens the whole conversation's start with.

ANSWERS = {  # what the model generates after the assistant prompt (less a <think> the prompt opened)
    "plain": "Paris.",
    "spaces": " Paris.\n",
    "reasoning": "<think>\nThe capital.\n</think>\n\nParis.",
}
REWRITTEN = {  # the answers each template renders otherwise once a user turn follows them
    "llama-3.1-instruct": {"spaces"},
    "llama-3.2-instruct": {"spaces"},
    "qwen2.5-instruct": set(),
    "qwen3": {"reasoning"},
    "qwen3-thinking-2507": {"plain", "spaces", "reasoning"},
    "qwen3.5": {"plain", "spaces", "reasoning"},
    "mistral-nemo-instruct-2407": {"plain", "spaces", "reasoning"},  # its system message moves to the last user turn
}
FIRST = [system("Be brief."), user("Capital of France?")]
NEXT = [user("And of Spain?")]


def session_tokens(tok: Tokenizer, answer: str, stop: int | None) -> list[int]:
    """A session's tokens after its first turn: the prompt, the answer, its stop token (None: cut short)."""
    prompt = rendered(tok, FIRST, True)
    generated = answer.removeprefix("<think>\n") if prompt.endswith("<think>\n") else answer
    return tok.encode(prompt, add_bos=False) + tok.encode(generated, add_bos=False) + ([] if stop is None else [stop])


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("answer", sorted(ANSWERS))
@pytest.mark.parametrize("closed", [True, False])
def test_a_resumed_turn_gives_the_whole_conversations_text_or_none(model: str, answer: str, closed: bool) -> None:
    tok, _ = pair((TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8"), *MODELS[model])
    tokens = session_tokens(tok, ANSWERS[answer], tok.eos_id if closed else None)
    content = tok.decode(tokens[len(tok.encode(rendered(tok, FIRST, True), add_bos=False)):][:-1 if closed else None])
    whole = rendered(tok, [*FIRST, assistant(content), *NEXT], True)
    held = tok.decode(tokens) + ("" if closed else str(tok.token(tok.eos_id)))
    text = tok.chat_continuation(tokens, NEXT)
    if answer in REWRITTEN[model]:
        assert text is None and not whole.startswith(held)  # the session's text is not the conversation's start
    else:
        assert text is not None and tok.decode(tokens) + text == whole
        whole_ids = tok.encode(whole, add_bos=False)
        assert whole_ids[:len(tokens)] == tokens and whole_ids[len(tokens):] == tok.encode(text, add_bos=False)


# Of a rewritten first turn (the prompt's tokens, then the answer's), what the whole conversation's tokens start with:
# the session keeps that much when it is sent the conversation from its start (worker.engine.Engine.kept).
KEPT: dict[str, str | int] = {
    "llama-3.1-instruct": "prompt",
    "llama-3.2-instruct": "prompt",
    "qwen3": "prompt",
    "qwen3-thinking-2507": "prompt less <think>",  # the assistant prompt opened it; the rendered answer does not
    "qwen3.5": "prompt less <think>",
    "mistral-nemo-instruct-2407": 7,  # the system message moves into the last user turn: only [INST]'s start stays
}


@pytest.mark.parametrize("model", sorted(KEPT))
def test_a_rewritten_turn_keeps_the_first_prompt_sent_from_the_start(model: str) -> None:
    tok, _ = pair((TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8"), *MODELS[model])
    prompt = tok.encode(rendered(tok, FIRST, True), add_bos=False)
    think = tok.encode("<think>\n", add_bos=False)
    how = KEPT[model]
    expected = how if isinstance(how, int) else len(prompt) - (len(think) if how == "prompt less <think>" else 0)
    for answer in REWRITTEN[model]:
        tokens = session_tokens(tok, ANSWERS[answer], tok.eos_id)
        content = tok.decode(tokens[len(prompt):-1])
        whole = tok.encode(rendered(tok, [*FIRST, assistant(content), *NEXT], True), add_bos=False)
        assert common_prefix(tokens, whole) == expected, answer
        if how == "prompt less <think>":
            assert prompt[expected:] == think


def test_qwen3_gives_the_answer_after_the_last_question_an_empty_think_when_no_question_follows() -> None:
    """With no new turn (the client sends the conversation as it ended), Qwen3 renders the last answer with an empty
    <think></think> ahead of it, which the session does not hold: a plain answer is rewritten too."""
    tok, _ = pair((TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"), *QWEN)
    tokens = session_tokens(tok, ANSWERS["plain"], tok.eos_id)
    assert tok.chat_continuation(tokens, NEXT) == "\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_continuation(tokens, []) is None
    assert "<think>\n\n</think>\n\nParis.<|im_end|>" in rendered(tok, [*FIRST, assistant("Paris.")], True)


def test_an_answer_ended_by_another_stop_token_than_the_eos_is_not_closed_twice() -> None:
    """A Llama 3 whose EOS is <|end_of_text|> (some GGUF files) ends its answers with <|eot_id|>, one of its stop ids:
    the turn after it starts after that <|eot_id|>, not with a second one."""
    raw = Tokenizer.bytes_only()._tok
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")])
    eot = raw.token_to_id("<|eot_id|>")
    eos = raw.token_to_id("<|end_of_text|>")
    assert eot is not None and eos is not None
    tok = Tokenizer(raw, bos_id=raw.token_to_id("<|begin_of_text|>"), eos_id=eos, extra_stop_ids=[eot],
                    chat_template=(TEMPLATES / "llama-3.1-instruct.jinja").read_text(encoding="utf-8"))
    tokens = session_tokens(tok, "Paris.", eot)
    text = tok.chat_continuation(tokens, NEXT)
    assert text is not None and text.startswith("<|start_header_id|>user")
    assert tok.decode(tokens) + text == rendered(tok, [*FIRST, assistant("Paris."), *NEXT], True)


def test_turns_after_a_text_appended_by_hand_go_on_as_after_a_plain_answer() -> None:
    """A session that holds no assistant prompt (its text appended by hand, not a chat turn) has no answer of the
    template's to check: its turns follow as they follow a plain answer, after the EOS where the text has none."""
    tok, _ = pair((TEMPLATES / "qwen2.5-instruct.jinja").read_text(encoding="utf-8"), *QWEN)
    after = "\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_continuation(tok.encode("Some text.<|im_end|>", add_bos=False), NEXT) == after
    assert tok.chat_continuation(tok.encode("Some text.", add_bos=False), NEXT) == "<|im_end|>" + after


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("answer", sorted(ANSWERS))
@pytest.mark.parametrize("closed", [True, False])
def test_without_the_check_a_turn_follows_the_answer_as_the_session_holds_it(model: str, answer: str, closed: bool) -> None:
    """A session's own chat (the native API's default): the turn the template renders after any answer, after the
    answer's stop token (first, where the answer was cut short); the exact continuation wherever there is one."""
    tok, _ = pair((TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8"), *MODELS[model])
    tokens = session_tokens(tok, ANSWERS[answer], tok.eos_id if closed else None)
    kept = tok.chat_after_answer(tokens, NEXT)
    exact = tok.chat_continuation(tokens, NEXT)
    if exact is not None:
        assert kept == exact
    eos = str(tok.token(tok.eos_id))
    turn = {"llama-3.1-instruct": "<|start_header_id|>user<|end_header_id|>\n\nAnd of Spain?<|eot_id|>"
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "llama-3.2-instruct": "<|start_header_id|>user<|end_header_id|>\n\nAnd of Spain?<|eot_id|>"
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "qwen2.5-instruct": "\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n",
            "qwen3": "\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n",
            "qwen3-thinking-2507": "\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n<think>\n",
            "qwen3.5": "\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n<think>\n",
            "mistral-nemo-instruct-2407": "[INST]And of Spain?[/INST]"}[model]
    assert kept == ("" if closed else eos) + turn


def test_template_arguments_render_as_transformers_keyword_arguments() -> None:
    """Qwen3's enable_thinking=False (vLLM's chat_template_kwargs) closes an empty <think> in the assistant prompt;
    the first turn and the turns after an answer render with it, and the variables the server sets are refused."""
    ours, theirs = pair((TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"), *QWEN)
    off = {"enable_thinking": False}
    expected = theirs.apply_chat_template(FIRST, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ours.apply_chat_template(FIRST, variables=off) == expected
    assert expected.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.apply_chat_template(FIRST, variables={"enable_thinking": True}) == rendered(ours, FIRST, True)
    tokens = ours.encode(expected + "Paris.<|im_end|>", add_bos=False)
    assert ours.chat_after_answer(tokens, NEXT, off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for name in ("messages", "add_generation_prompt", "bos_token", "namespace", "range"):  # namespace: a TypeError
        with pytest.raises(ChatTemplateError, match=f"{name}: the template.s own"):
            ours.apply_chat_template(FIRST, variables={name: 1})


def test_a_template_that_fails_on_its_inputs_is_a_template_error() -> None:
    """Not an internal error: a template calling what a variable made a string raises TypeError inside jinja."""
    ours, _ = pair("{{ messages[0].content | int + none }}", None, "<|im_end|>")
    with pytest.raises(ChatTemplateError, match="chat template failed: TypeError"):
        ours.apply_chat_template([user("x")])


@pytest.mark.parametrize("model", sorted(KEPT))
def test_the_assistant_prompt_tail_a_later_turn_renders_otherwise(model: str) -> None:
    """What a recurrent state's checkpoint leaves out of a chat prompt (Engine.turn_tail): the end of the assistant
    prompt that the template does not render before an earlier answer. The checkpoint then falls within what the next
    turn keeps of the prompt (the table above), whatever the answer was."""
    tok, _ = pair((TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8"), *MODELS[model])
    prompt = tok.encode(rendered(tok, FIRST, True), add_bos=False)
    tail = tok.answer_prompt_tail()
    assert tail == {"qwen3-thinking-2507": "<think>\n", "qwen3.5": "<think>\n"}.get(model, tail)
    ids = tok.encode(tail, add_bos=False) if tail else []
    assert prompt[len(prompt) - len(ids):] == ids
    how = KEPT[model]
    if isinstance(how, int):  # Mistral moves the system message: no tail stands for that (nor is the model recurrent)
        assert tail == ""
        return
    # The checkpoint's tokens, len(prompt) - len(ids), are those the table says the next turn keeps.
    assert len(ids) == (len(tok.encode("<think>\n", add_bos=False)) if how == "prompt less <think>" else 0)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}
TOOL_CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "asked": [system("Be brief."), user("Weather in Paris?")],
    "called and answered": [user("Weather and time in Paris?"), CALLED,
                            {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"},
                            {"role": "tool", "content": "14:05", "tool_call_id": "call_2"}],
    "one call": [user("Weather in Paris?"), {"role": "assistant", "content": "", "tool_calls": CALLED["tool_calls"][:1]},
                 {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"}],
    "answered, then asked again": [user("Weather in Paris?"), CALLED,
                                   {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
                                   {"role": "tool", "content": "14:05", "tool_call_id": "call_2"},
                                   assistant("21 C at 14:05."), user("And in Rome?")],
}


@pytest.mark.parametrize("model", ["llama-3.1-instruct", "qwen2.5-instruct", "qwen3", "qwen3.5"])
@pytest.mark.parametrize("conversation", sorted(TOOL_CONVERSATIONS))
def test_tools_and_function_calls_render_as_transformers_renders_them(model: str, conversation: str) -> None:
    """The functions the model may call (OpenAI's tools list), an answer's calls (their arguments a map, as vLLM
    passes them) and the tool turns with their results, as transformers' apply_chat_template(tools=...) renders them."""
    ours, theirs = pair((TEMPLATES / f"{model}.jinja").read_text(encoding="utf-8"), *MODELS[model])
    messages = TOOL_CONVERSATIONS[conversation]
    try:
        expected = theirs.apply_chat_template(messages, tools=[WEATHER, TIME], tokenize=False,
                                              add_generation_prompt=True)
    except Exception as e:  # (Llama 3.1's template takes one call an answer)
        with pytest.raises(ChatTemplateError, match=re.escape(str(e))):
            ours.apply_chat_template(messages, tools=[WEATHER, TIME])
        return
    text = ours.apply_chat_template(messages, tools=[WEATHER, TIME])
    assert text == expected and "get_weather" in text and "The city's name" in text
    if conversation != "asked":
        assert "Paris" in text and "21" in text  # the call and its result
