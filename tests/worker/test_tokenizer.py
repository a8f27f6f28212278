from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine import Engine
from worker.model.loader import bundled_gguf_path, load_gguf
from worker.model.tokenizer import Tokenizer, UnrepresentableText

SMOL_TEMPLATE_RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok(smol_engine: Engine) -> Tokenizer:
    return smol_engine.tokenizer


# SmolLM2's vocabulary has no token for these bytes: text holding them is refused, never mangled.
SMOL_MISSING_BYTES = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)])


def _encodable(c: str) -> bool:
    return not set(c.encode("utf-8", "surrogatepass")) & set(SMOL_MISSING_BYTES)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8").filter(_encodable), max_size=200))
def test_roundtrip_any_unicode(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_missing_bytes_are_exactly_the_vocab_gaps(tok: Tokenizer) -> None:
    assert tok._missing_bytes == SMOL_MISSING_BYTES


@pytest.mark.parametrize("text", ["\U00040000", "a\x04b", "\U000A1234 plane 10"])
def test_unencodable_text_is_refused(tok: Tokenizer, text: str) -> None:
    with pytest.raises(UnrepresentableText, match="cannot encode"):
        tok.encode(text)


def test_engine_refuses_unencodable_text(smol_engine: Engine) -> None:
    from worker.errors import BadRequest

    sid = smol_engine.create_session()
    with pytest.raises(BadRequest, match="0x04"):
        smol_engine.append(sid, text="a\x04b")
    assert smol_engine.session_length(sid) == 0
    smol_engine.close(sid)


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "héllo wörld", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 flags 🇫🇷",
        "tabs\tand\nnewlines\r\n", "\x00\x01\x05 control", "1234567890",
    ],
)
def test_roundtrip_examples(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_digits_split_one_by_one(tok: Tokenizer) -> None:
    # SmolLM's pre-tokenizer ("smollm" in GGUF) splits every digit: 5 digits -> 5 tokens.
    assert len(tok.encode("12345")) == 5


@pytest.mark.parametrize(("token", "expected_id"), [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2), ("<file_sep>", 5)])
def test_special_tokens_encode_to_single_ids(tok: Tokenizer, token: str, expected_id: int) -> None:
    assert tok.encode(token) == [expected_id]
    assert tok.encode(f"a{token}b") == [tok.encode("a")[0], expected_id, tok.encode("b")[0]]
    assert expected_id in tok.special_ids


def test_ids(tok: Tokenizer) -> None:
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.stop_ids == frozenset({2})


def test_known_encoding(tok: Tokenizer) -> None:
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]


def test_chat_template_is_the_models_own(tok: Tokenizer) -> None:
    fields_template = load_gguf(bundled_gguf_path()).tokenizer.chat_template
    assert tok.chat_template == fields_template
    assert "You are a helpful AI assistant named SmolLM" in tok.chat_template


def test_chat_template_renders_exactly(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == SMOL_TEMPLATE_RENDERED
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == SMOL_TEMPLATE_RENDERED[: -len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids[:1] == [1] and ids[-4:] == [1, 520, 9531, 198]


def test_chat_template_with_system_message(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_rejects_bad_messages(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_byte_tokenizer_roundtrip() -> None:
    tok = Tokenizer.bytes_only()
    text = "héllo 🎉 <|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[-1] == 258 and all(i < 256 for i in ids[:-1])
    assert tok.encode("A") == [65]
