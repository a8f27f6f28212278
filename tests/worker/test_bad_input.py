"""Every bad request gets a typed error and leaves the engine and its sessions usable."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from worker.engine import Engine
from worker.engine.sampling import SamplingParams
from worker.errors import BadRequest, ContextOverflow, EngineError, SessionBusy, SessionNotFound

PROMPT = "The quick brown fox"
EXPECTED = [351, 253, 2365, 6354, 7012, 30]


def _still_works(engine: Engine, sid: str) -> None:
    assert engine.generate(sid, max_tokens=6).token_ids == EXPECTED


@pytest.fixture
def sid(engine: Engine) -> str:
    s = engine.create_session()
    engine.append(s, text=PROMPT)
    return s


CASES: list[tuple[str, type[EngineError], str, Callable[[Engine, str], object]]] = [
    ("token id too large", BadRequest, r"token id 49152 is out of range \[0, 49152\)", lambda e, s: e.append(s, token_ids=[5, 49152])),
    ("negative token id", BadRequest, "out of range", lambda e, s: e.append(s, token_ids=[-1])),
    ("non-integer token", BadRequest, "out of range", lambda e, s: e.append(s, token_ids=["a"])),  # type: ignore[list-item]
    ("empty token list", BadRequest, "at least one token", lambda e, s: e.append(s, token_ids=[])),
    ("empty text", BadRequest, "at least one token", lambda e, s: e.append(s, text="")),
    ("both text and ids", BadRequest, "exactly one", lambda e, s: e.append(s, token_ids=[1], text="x")),
    ("context overflow", ContextOverflow, "exceed max_context 2048", lambda e, s: e.append(s, token_ids=[7] * 2045)),
    ("negative max_tokens", BadRequest, "max_tokens must be a non-negative integer", lambda e, s: e.generate(s, max_tokens=-1)),
    ("too many logprobs", BadRequest, "logprobs must be", lambda e, s: e.generate(s, logprobs=21)),
    ("negative temperature", BadRequest, "temperature must be in", lambda e, s: e.generate(s, temperature=-0.5)),
    ("top_p zero", BadRequest, "top_p", lambda e, s: e.generate(s, top_p=0.0)),
    ("boolean temperature", BadRequest, "temperature must be in", lambda e, s: e.generate(s, temperature=True)),
    ("boolean top_p", BadRequest, "top_p must be in", lambda e, s: e.generate(s, top_p=True)),
    ("negative top_k", BadRequest, "top_k", lambda e, s: e.generate(s, top_k=-3)),
    ("unknown parameter", BadRequest, "unexpected keyword", lambda e, s: e.generate(s, beam_width=2)),
    ("unknown session", SessionNotFound, "no session 'nope'", lambda e, s: e.generate("nope", max_tokens=2)),
    ("unknown session append", SessionNotFound, "no session", lambda e, s: e.append("nope", text="x")),
    ("unknown session fork", SessionNotFound, "no session", lambda e, s: e.fork("nope")),
    ("unknown session close", SessionNotFound, "no session", lambda e, s: e.close("nope")),
    ("duplicate session id", BadRequest, "already exists", lambda e, s: e.create_session(s)),
    # A turn in one call (prompt + generate) is refused whole: nothing appended.
    ("turn prompt overflow", ContextOverflow, "exceed max_context",
     lambda e, s: e.start_generate(s, SamplingParams(max_tokens=2), prompt_ids=[7] * 2045)),
    ("turn prompt fills the context", ContextOverflow, "full",
     lambda e, s: e.start_generate(s, SamplingParams(max_tokens=2), prompt_ids=[7] * (2048 - 4))),
    ("turn bad prompt id", BadRequest, "out of range", lambda e, s: e.start_generate(s, SamplingParams(), prompt_ids=[49152])),
    ("turn empty prompt", BadRequest, "at least one token", lambda e, s: e.start_generate(s, SamplingParams(), prompt="")),
    ("turn both prompts", BadRequest, "exactly one", lambda e, s: e.start_generate(s, SamplingParams(), prompt_ids=[1], prompt="x")),
    ("turn bad params", BadRequest, "temperature", lambda e, s: e.start_generate(s, SamplingParams(temperature=-1), prompt="x")),
]


@pytest.mark.parametrize(("name", "error", "message", "call"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_typed_and_harmless(
    engine: Engine, sid: str, name: str, error: type[EngineError], message: str, call: Callable[[Engine, str], object]
) -> None:
    before = engine.session_tokens(sid)
    with pytest.raises(error, match=message) as info:
        call(engine, sid)
    assert info.value.code in ("bad_request", "session_not_found")
    assert engine.session_tokens(sid) == before  # nothing half-applied
    assert not engine.has_work()
    _still_works(engine, sid)


def test_closed_session_is_gone(engine: Engine, sid: str) -> None:
    engine.close(sid)
    with pytest.raises(SessionNotFound):
        engine.generate(sid, max_tokens=2)
    with pytest.raises(SessionNotFound):
        engine.close(sid)


def test_generate_on_empty_session(engine: Engine) -> None:
    s = engine.create_session()
    with pytest.raises(BadRequest, match="empty"):
        engine.generate(s, max_tokens=2)


def test_busy_session_refuses_append_fork_and_second_generate(engine: Engine, sid: str) -> None:
    rid = engine.start_generate(sid, SamplingParams(max_tokens=6))
    with pytest.raises(SessionBusy):
        engine.append(sid, text="more")
    with pytest.raises(SessionBusy):
        engine.fork(sid)
    with pytest.raises(SessionBusy):
        engine.start_generate(sid, SamplingParams(max_tokens=2))
    ids: list[int] = []
    while engine.has_work():
        for chunk in engine.step():
            assert chunk.request_id == rid
            ids += chunk.token_ids
    assert ids == EXPECTED


def test_a_turn_in_one_call_is_the_same_as_append_then_generate(engine: Engine) -> None:
    a, b = engine.create_session(), engine.create_session()
    engine.append(a, text=PROMPT)
    rid = engine.start_generate(b, SamplingParams(max_tokens=6), prompt=PROMPT)
    assert engine.session_length(b) == engine.session_length(a) == 4
    ids: list[int] = []
    while engine.has_work():
        ids += [t for chunk in engine.step() if chunk.request_id == rid for t in chunk.token_ids]
    assert ids == EXPECTED
    assert engine.session_tokens(b) == engine.session_tokens(a) + EXPECTED
    turn = engine.start_generate(b, SamplingParams(max_tokens=2), prompt_ids=[1])  # the next turn
    with pytest.raises(SessionBusy):  # a busy session refuses a turn, and keeps its tokens
        engine.start_generate(b, SamplingParams(max_tokens=2), prompt_ids=[2])
    assert engine.session_length(b) == 4 + 6 + 1
    engine.cancel(turn)
    while engine.has_work():
        engine.step()


def test_generation_stops_at_the_context_limit(engine: Engine) -> None:
    s = engine.create_session()
    engine.append(s, token_ids=[7] * 2040)
    g = engine.generate(s, max_tokens=50, ignore_eos=True)
    assert (len(g.token_ids), g.finish_reason) == (8, "length")
    assert engine.session_length(s) == 2048
    with pytest.raises(ContextOverflow, match="full"):
        engine.generate(s, max_tokens=1)
    with pytest.raises(ContextOverflow):
        engine.append(s, token_ids=[1])


def test_cancel_mid_generation_keeps_session_usable(engine: Engine, sid: str) -> None:
    stream = engine.stream(sid, max_tokens=50, ignore_eos=True)
    first = next(stream).token_ids + next(stream).token_ids
    stream.close()  # closing the iterator cancels the generation
    assert not engine.has_work()
    assert first == EXPECTED[:2]
    assert engine.session_tokens(sid)[-2:] == EXPECTED[:2]
    # The session continues from where it stopped.
    assert engine.generate(sid, max_tokens=4).token_ids == EXPECTED[2:6]
