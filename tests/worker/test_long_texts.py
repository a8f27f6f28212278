"""Long texts cost the worker bounded time and memory: one that cannot fit the session is refused before it is
tokenized (a lower bound on its tokens, known from its length), a long one is tokenized with the GIL released, and
the chat turn's text (what the worker tokenizes off its loop) gives exactly the tokens `chat` appends."""

from __future__ import annotations

import threading
import time

import pytest

from worker.engine import Engine
from worker.engine.sampling import SamplingParams
from worker.errors import ContextOverflow
from worker.model.tokenizer import RELEASE_GIL_CHARS, Tokenizer

HUGE = ("Once upon a time, there was a dragon named Zorath. " * 90_000)[:4_200_000]  # the 4.2M characters
TEXTS = [
    "plain words and numbers 12345 " * 40, " " * 700, "\n\n\t  " * 300, "é\U0001d54f漢字😀 " * 300,
    "<|im_start|>user\nhi<|im_end|>" * 100, "a" * 5000, "".join(chr(c) for c in range(32, 2000)) * 3,
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_min_tokens_is_a_lower_bound_and_a_long_text_encodes_as_a_short_one_would(engine: Engine, text: str) -> None:
    for tokenizer in (engine.tokenizer, Tokenizer.bytes_only()):
        ids = tokenizer.encode(text)
        assert tokenizer.min_tokens(text) <= len(ids)
        if len(text) > RELEASE_GIL_CHARS:  # the batch call: the same ids as the single-text call
            assert ids == tokenizer._tok.encode(text, add_special_tokens=False).ids


def test_smollm2_tokens_are_at_most_81_bytes(engine: Engine) -> None:
    assert engine.tokenizer.max_token_bytes == 81  # its longest token: a run of spaces
    assert engine.tokenizer.min_tokens(HUGE) == 51_852


def test_a_text_that_cannot_fit_is_refused_at_once_without_tokenizing_it(engine: Engine) -> None:
    """The issue's 4.2M-character append took ~3.5 s of tokenizing (the GIL held all along) before its refusal;
    now no call reaches the tokenizer at all."""
    sid = engine.create_session()
    engine.append(sid, text="The quick brown fox")
    for call in (lambda: engine.append(sid, text=HUGE), lambda: engine.chat(sid, HUGE),
                 lambda: engine.start_generate(sid, SamplingParams(max_tokens=2), prompt=HUGE),
                 lambda: engine.check_text_fits(sid, HUGE)):
        started = time.perf_counter()
        with pytest.raises(ContextOverflow, match=r"a text of \d+ characters is at least \d+ tokens .* exceed max_context 2048"):
            call()
        assert time.perf_counter() - started < 0.2
    assert engine.session_length(sid) == 4 and not engine.has_work()
    fits = "word " * 300  # can fit: checked, not refused
    engine.check_text_fits(sid, fits)
    assert engine.append(sid, text=fits) == 4 + len(engine.tokenize(fits))


def test_a_long_text_is_encoded_with_the_gil_released(engine: Engine) -> None:
    def encode_beside_a_ticker(text: str) -> tuple[float, list[float]]:
        ticks: list[float] = []
        stop = threading.Event()

        def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0.005)

        thread = threading.Thread(target=ticker)
        thread.start()
        started = time.perf_counter()
        try:
            engine.tokenize(text)
        finally:
            elapsed = time.perf_counter() - started
            stop.set()
            thread.join()
        during = [t for t in ticks if started <= t <= started + elapsed]
        return elapsed, [b - a for a, b in zip([started, *during], [*during, started + elapsed], strict=False)]

    for size in (400_000, 1_000_000, 2_000_000, len(HUGE)):  # long enough to take over 0.2 s on this CPU
        elapsed, gaps = encode_beside_a_ticker(HUGE[:size])
        if elapsed > 0.2:
            break
    assert elapsed > 0.2 and max(gaps) < elapsed / 2, (elapsed, max(gaps))  # another thread ran all along


def test_the_chat_text_tokenized_is_what_chat_appends(engine: Engine) -> None:
    a, b = engine.create_session(), engine.create_session()
    for turn in ("What is the capital of France?", "And of Italy?"):
        expected = engine.tokenize(engine.chat_text(a, [{"role": "user", "content": turn}]), add_bos=False)
        before = engine.session_length(a)
        engine.chat(a, turn)
        assert engine.session_tokens(a)[before:] == expected
        engine.append(b, token_ids=expected)
        generated = engine.generate(a, max_tokens=4, ignore_eos=True).token_ids
        assert engine.generate(b, max_tokens=4, ignore_eos=True).token_ids == generated
    assert engine.session_tokens(a) == engine.session_tokens(b)
