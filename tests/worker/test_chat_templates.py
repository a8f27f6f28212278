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
