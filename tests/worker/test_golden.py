"""Greedy outputs of the real bundled SmolLM2-135M-Instruct on CPU.

The pinned ids were cross-checked against transformers' LlamaForCausalLM.generate (greedy) run on
the same dequantized weights: identical for every case below.
"""

from __future__ import annotations

import pytest

from worker.engine import Engine

GOLDEN = [
    (
        "chat",
        "Write a haiku about the sea.",
        [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082, 282, 260, 10393, 28, 198],
    ),
    (
        "text",
        "The quick brown fox",
        [351, 253, 2365, 6354, 7012, 30, 198, 198, 504, 2798, 6330, 314, 253, 8170, 1183, 282, 253, 4500, 26997, 34631],
    ),
    (
        "chat",
        "List three colors.",
        [33, 30, 3950, 42, 378, 768, 2378, 2380, 1486, 260, 216, 33, 33, 4683, 282, 260, 24594, 30, 198, 34],
    ),
    (
        "text",
        "def fibonacci(n):",
        [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 304, 1672, 3987, 46477, 24, 94, 731],
    ),
]


def test_capital_of_france(engine: Engine) -> None:
    sid = engine.create_session()
    engine.chat(sid, "What is the capital of France?")
    g = engine.generate(sid, max_tokens=24)
    assert "Paris" in g.text
    assert g.text == "The capital of France is Paris."
    assert g.token_ids == [504, 3575, 282, 4649, 314, 7042, 30]
    assert g.finish_reason == "stop"
    # EOS (<|im_end|>, id 2) ended the answer: not returned, but kept in the history.
    assert engine.session_tokens(sid)[-1] == 2


@pytest.mark.parametrize(("kind", "prompt", "expected"), GOLDEN, ids=[g[1] for g in GOLDEN])
def test_golden_greedy(engine: Engine, kind: str, prompt: str, expected: list[int]) -> None:
    sid = engine.create_session()
    if kind == "chat":
        engine.chat(sid, prompt)
    else:
        engine.append(sid, text=prompt)
    g = engine.generate(sid, max_tokens=20)
    assert g.token_ids == expected
    assert g.finish_reason == "length"
    assert g.text == engine.tokenizer.decode(expected, skip_special_tokens=True)


def test_conversation_continues_across_turns(engine: Engine) -> None:
    sid = engine.create_session()
    engine.chat(sid, "What is the capital of France?")
    assert engine.generate(sid, max_tokens=24).text == "The capital of France is Paris."
    engine.chat(sid, "And of Germany?")
    assert engine.generate(sid, max_tokens=24).text == "The capital of Germany is Berlin."
    assert engine.tokenizer.decode(engine.session_tokens(sid)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        "The capital of France is Paris.<|im_end|>\n"
        "<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n"
        "The capital of Germany is Berlin.<|im_end|>"
    )


def test_streaming_yields_the_same_tokens(engine: Engine) -> None:
    sid = engine.create_session()
    engine.append(sid, text="The quick brown fox")
    chunks = list(engine.stream(sid, max_tokens=20))
    assert [t for c in chunks for t in c.token_ids] == GOLDEN[1][2]
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(GOLDEN[1][2])
    assert [c.finish_reason for c in chunks] == [None] * 19 + ["length"]
