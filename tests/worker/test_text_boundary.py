"""A text appended to a session that already holds tokens, with the bundled SmolLM2 (byte-level BPE with merges): the
tokenizer's BOS only at a session's start, and with boundary_check the tokens a tokenization of the whole text gives
at the boundary, or PromptBoundary with nothing appended, in the engine and on the worker's off-loop tokenizing path."""

from __future__ import annotations

import time

import pytest

import worker.serve.dispatch as dispatch_module
from broker.common import protocol as p
from worker.engine import Engine, SamplingParams
from worker.errors import PromptBoundary
from worker.model.tokenizer import Tokenizer
from worker.serve.config import WorkerConfig
from worker.serve.dispatch import Dispatch
from worker.serve.metrics import NoMetrics

TEXTS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.\n\nQ: What is 12345 + 678?\nA:  1302 3",
    "def f(x):\n    return x  ** 2   # square\n\n\nprint(f(3))",
    "naïve café — “quoted” 日本語のテキスト 🙂🙂 end.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!",
]


def prefill(engine: Engine, sid: str, prompt: str, boundary_check: bool = False) -> None:
    """A generation of no tokens with a text prompt: the prompt appended, as a turn's GENERATE appends it."""
    engine.start_generate(sid, SamplingParams(max_tokens=0), prompt=prompt, boundary_check=boundary_check)
    while engine.has_work():
        engine.step()


def test_a_text_after_a_sequence_gets_the_whole_texts_tokens_or_is_refused(engine: Engine) -> None:
    """At every cut of every text: where the whole text's tokens start with the first part's, the ids after the
    first part's tail are exactly the rest of them; where they do not (the tokenizer merges across the cut), None."""
    tok = engine.tokenizer
    kept = refused = 0
    for text in TEXTS:
        whole = tok.encode(text, add_bos=False)
        for cut in range(1, len(text)):
            held = tok.encode(text[:cut], add_bos=False)
            ids = tok.encode_after(tok.boundary_tail(held), text[cut:])
            if whole[:len(held)] == held:
                assert ids is not None and held + ids == whole, (text[:cut], text[cut:])
                kept += 1
            else:
                assert ids is None, (text[:cut], text[cut:])
                refused += 1
    assert (kept, refused) == (92, 157)


def test_a_session_holding_any_start_of_a_texts_tokens_takes_the_rest_of_the_text_as_its_rest(engine: Engine) -> None:
    """No refusal where none is due: a session holding the whole text's first k tokens (as a generation may leave
    it, e.g. "\n" then "\n" where "\n\n" alone would be one token) gets exactly the rest of them."""
    tok = engine.tokenizer
    assert tok.token_bytes is not None
    taken = 0
    for text in [*TEXTS[:3], "word " * 60 + "end", "x" * 300 + " y", "漢字" * 100 + " done"]:
        whole = tok.encode(text, add_bos=False)
        for k in range(1, len(whole)):
            try:
                rest = b"".join(tok.token_bytes[t] for t in whole[k:]).decode("utf-8")
            except UnicodeDecodeError:
                continue  # a cut inside a character: no text is the rest
            assert tok.encode_after(tok.boundary_tail(whole[:k]), rest) == whole[k:], (text, k)
            taken += 1
    assert taken == 417


def test_the_tail_starts_a_word_and_stops_after_a_special_token(engine: Engine) -> None:
    tok = engine.tokenizer
    assert tok.token_bytes is not None
    chat = tok.encode("<|im_start|>assistant\nParis<|im_end|>\n", add_bos=False)
    assert tok.boundary_tail(chat) == tok.encode("\n", add_bos=False)  # after <|im_end|>
    assert tok.boundary_tail(chat[:-1]) == []  # it ends with one: nothing merges across it
    for text, first, size in (("The capital of France is Paris. " * 10, b" The", 129), ("word " * 100, b" word", 131),
                              ("漢字a" * 200, b"\xe6", 182), ("😀" * 100, b"\xf0\x9f", 172), ("x" * 400, b"xxxx", 400)):
        tail = tok.boundary_tail(tok.encode(text, add_bos=False))  # 128 bytes, then to a word's start if one is near
        data = b"".join(tok.token_bytes[t] for t in tail)
        assert (tok.token_bytes[tail[0]], len(data)) == (first, size) and data.decode("utf-8")
    assert Tokenizer.bytes_only().boundary_tail([104, 105, 257, 104]) == [104]  # 257: <|im_start|>


def test_an_append_with_boundary_check_takes_the_whole_texts_tokens_or_nothing(engine: Engine) -> None:
    tok = engine.tokenizer
    sid = engine.create_session()
    engine.append(sid, text="The capital of France is Par")
    held = engine.session_tokens(sid)
    with pytest.raises(PromptBoundary, match=r"\('capital of France is Par' then 'is'\)"):
        engine.append(sid, text="is", boundary_check=True)
    with pytest.raises(PromptBoundary):
        engine.start_generate(sid, SamplingParams(max_tokens=2), prompt="is.", boundary_check=True)
    assert engine.session_tokens(sid) == held and not engine.has_work()
    engine.append(sid, text="is")  # without the check: tokenized on its own
    assert engine.session_tokens(sid) == held + tok.encode("is")
    assert tok.encode("The capital of France is Paris") != held + tok.encode("is")
    engine.close(sid)

    sid = engine.create_session()
    engine.append(sid, text="The capital of France is")
    engine.append(sid, text=" Paris.\n\nThe capital", boundary_check=True)
    prefill(engine, sid, " of Japan is", boundary_check=True)
    assert engine.session_tokens(sid) == tok.encode("The capital of France is Paris.\n\nThe capital of Japan is")
    engine.close(sid)


def test_a_text_gets_the_bos_only_at_the_start_of_a_session(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer that starts a text with its BOS (Llama 3's) puts it before a session's first text, not before a
    text appended later (the worker's long texts, tokenized off its loop, in the last test)."""
    tok = engine.tokenizer
    monkeypatch.setattr(tok, "add_bos", True)
    assert tok.bos_id == 1 and tok.encode("Hello")[0] == 1
    sid = engine.create_session()
    engine.append(sid, text="Hello")
    engine.append(sid, text=" world")
    prefill(engine, sid, " again")
    engine.append(sid, text=" and", boundary_check=True)
    assert engine.session_tokens(sid) == [1, *tok.encode("Hello world again and", add_bos=False)]
    engine.close(sid)
    sid = engine.create_session()
    prefill(engine, sid, "Hello")
    assert engine.session_tokens(sid) == tok.encode("Hello")
    engine.close(sid)
    for first in (lambda s: engine.append(s, text="Hello", boundary_check=True),  # a first text: no tail to check
                  lambda s: prefill(engine, s, "Hello", boundary_check=True)):
        sid = engine.create_session()
        first(sid)
        assert engine.session_tokens(sid) == tok.encode("Hello") == [1, *tok.encode("Hello", add_bos=False)]
        engine.close(sid)


def test_the_worker_checks_a_long_text_off_its_loop_as_the_engine_does(engine: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch_module, "OFFLOAD_CHARS", 64)
    monkeypatch.setattr(engine.tokenizer, "add_bos", True)
    tok = engine.tokenizer
    d = Dispatch(engine, WorkerConfig(), lambda s: SamplingParams(max_tokens=s.max_tokens), NoMetrics())
    sid = "a" * 32
    [created] = d.handle(p.CreateSession(request_id="c", session_id=sid, route=b"c"))
    assert isinstance(created, p.Created)
    merging = "is. " + "The capital of Japan is Tokyo. " * 3
    going_on = " Paris. " + "The capital of Japan is Tokyo. " * 3

    def answer(request: p.Message) -> p.Message:
        assert d.handle(request) == []  # tokenized off the loop
        deadline = time.monotonic() + 10
        while True:
            answers = d.completed()
            if answers:
                [one] = answers
                return one
            assert time.monotonic() < deadline
            time.sleep(0.01)

    first = "The capital of France is Par" + " " * 64  # long: tokenized off the loop, a first text (its BOS, no tail)
    assert isinstance(answer(p.Append(request_id="a1", session_id=sid, text=first, boundary_check=True, route=b"c")),
                      p.Appended)
    assert engine.session_tokens(sid) == tok.encode(first)
    [closed] = d.handle(p.Close(request_id="x", session_id=sid, route=b"c"))
    assert isinstance(closed, p.Closed)
    sid = "b" * 32
    d.handle(p.CreateSession(request_id="c2", session_id=sid, route=b"c"))
    d.handle(p.Append(request_id="a1b", session_id=sid, text="The capital of France is Par", route=b"c"))
    held = engine.session_tokens(sid)
    refused = answer(p.Append(request_id="a2", session_id=sid, text=merging, boundary_check=True, route=b"c"))
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.PROMPT_BOUNDARY
    params = p.Sampling(max_tokens=0)
    refused = answer(p.Generate(request_id="g1", session_id=sid, prompt=merging, boundary_check=True, params=params,
                                route=b"c"))
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.PROMPT_BOUNDARY
    assert engine.session_tokens(sid) == held
    appended = answer(p.Append(request_id="a3", session_id=sid, text=going_on, boundary_check=True, route=b"c"))
    assert isinstance(appended, p.Appended)
    assert engine.session_tokens(sid) == tok.encode("The capital of France is Par" + going_on)  # one BOS, at the start
    answer(p.Append(request_id="a4", session_id=sid, text=merging, route=b"c"))  # unchecked: on its own, no BOS
    assert engine.session_tokens(sid) == tok.encode("The capital of France is Par" + going_on) + tok.encode(
        merging, add_bos=False)
    d.close()
    engine.close(sid)
