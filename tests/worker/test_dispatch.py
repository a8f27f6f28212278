"""The worker's request handling (worker.serve.dispatch and the source / target halves of a move) in process, on the
CPU engine of `random:tiny`: the interleavings a live worker sees, driven as its loop drives them."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

import worker.serve.dispatch as dispatch_module
from broker.common import protocol as p
from worker.engine import Engine, SamplingParams
from worker.serve.config import WorkerConfig
from worker.serve.dispatch import Dispatch
from worker.serve.metrics import NoMetrics
from worker.serve.moves import Moves

A, B, X = "a" * 32, "b" * 32, "e" * 32
LONG = 64  # OFFLOAD_CHARS for these tests: random:tiny's tokenizer is bytes and its context 4,096 tokens


def sampling(s: p.Sampling) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed, stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos)


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = Engine.load("random:tiny", device="cpu", max_sessions=2, max_context=256)
    yield eng


def dispatch(engine: Engine, idle_timeout_s: float = 0.0) -> Dispatch:
    return Dispatch(engine, WorkerConfig(session_idle_timeout_s=idle_timeout_s), sampling, NoMetrics())


def create(d: Dispatch, sid: str) -> None:
    [created] = d.handle(p.CreateSession(request_id=f"c-{sid[:4]}", session_id=sid, route=b"c"))
    assert isinstance(created, p.Created)


def run_steps(engine: Engine, d: Dispatch) -> list[p.Message]:
    answers: list[p.Message] = []
    while engine.has_work():
        messages, _ = d.step_answers(engine.step(wait=True), time.perf_counter())
        answers += messages
    return answers


def test_a_session_whose_text_is_being_tokenized_is_not_expired_under_it(engine: Engine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch_module, "OFFLOAD_CHARS", LONG)
    tokenize = engine.tokenize

    def slow_tokenize(text: str, add_bos: bool | None = None, after: list[int] | None = None) -> list[int]:
        time.sleep(0.5)  # longer than the idle timeout
        return tokenize(text, add_bos, after)

    monkeypatch.setattr(engine, "tokenize", slow_tokenize)
    d = dispatch(engine, idle_timeout_s=0.1)
    create(d, A)
    assert d.handle(p.Append(request_id="long", session_id=A, text="z" * (LONG + 1), route=b"c")) == []
    answers: list[p.Message] = []
    while d.tokenizing:
        assert d.expire_idle(time.monotonic()) == []
        answers += d.completed()
        time.sleep(0.02)
    [appended] = answers
    assert isinstance(appended, p.Appended) and appended.request_id == "long"
    assert engine.session_length(A) == LONG + 1


def test_a_long_text_for_a_generating_session_is_refused_as_a_short_one_is(engine: Engine,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Its chat rendering (an EOS before the turn or not) and its room would be of the session before the
    generation's tokens: it is refused at once, as the engine refuses a short one."""
    monkeypatch.setattr(dispatch_module, "OFFLOAD_CHARS", LONG)
    d = dispatch(engine)
    create(d, A)
    d.handle(p.Append(request_id="a1", session_id=A, token_ids=(65, 66, 67), route=b"c"))
    params = p.Sampling(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert d.handle(p.Generate(request_id="g1", session_id=A, params=params, route=b"c")) == []
    for request in (p.Chat(request_id="long", session_id=A, content="y" * (LONG + 1), route=b"c"),
                    p.Chat(request_id="short", session_id=A, content="y", route=b"c"),
                    p.Append(request_id="text", session_id=A, text="y" * (LONG + 1), route=b"c")):
        [refused] = d.handle(request)
        assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.BAD_REQUEST
        assert refused.message == f"session {A} is generating: append after the generation ends"
    [refused] = d.handle(p.Generate(request_id="g2", session_id=A, prompt="y" * (LONG + 1), params=params, route=b"c"))
    assert isinstance(refused, p.Error) and refused.message == f"session {A} already has a generation in flight"
    assert not d.tokenizing
    [generated] = run_steps(engine, d)
    assert isinstance(generated, p.Generated) and engine.session_length(A) == 5


def test_a_fork_into_an_expired_sessions_id_is_refused(engine: Engine) -> None:
    d = dispatch(engine, idle_timeout_s=1000.0)
    create(d, X)
    assert d.expire_idle(time.monotonic() + 5000) == [X]
    create(d, A)
    [refused] = d.handle(p.Fork(request_id="f1", session_id=A, child_id=X, route=b"c"))
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.BAD_REQUEST
    assert engine.sessions() == [A] and engine.free_slots == 1


def test_a_move_end_naming_another_session_leaves_the_move_as_it_was(engine: Engine) -> None:
    d = dispatch(engine)
    create(d, A)
    moves = Moves(engine, d, lambda: "b1")
    moves.handle(p.Move(migration="m1", session_id=A, target="w2"))
    assert moves.handle(p.MoveEnd(migration="m1", session_id=B, outcome="release")) == []
    assert list(moves.exports) == ["m1"] and A in d.moving and A in engine.sessions()
    [aborted] = moves.handle(p.MoveEnd(migration="m1", session_id=A, outcome="abort"))
    assert isinstance(aborted, p.MoveReport) and aborted.status == "aborted"
    assert moves.exports == {} and A not in d.moving and A in engine.sessions()


def test_a_release_sent_again_is_reported_again_and_closes_nothing_more(engine: Engine) -> None:
    d = dispatch(engine)
    create(d, A)
    create(d, B)
    moves = Moves(engine, d, lambda: "b1")
    moves.handle(p.Move(migration="m1", session_id=A, target="w2"))
    release = p.MoveEnd(migration="m1", session_id=A, outcome="release")
    for _ in range(2):  # the first report lost: the broker sends the release again
        [released] = moves.handle(release)
        assert isinstance(released, p.MoveReport)
        assert (released.migration, released.session_id, released.status) == ("m1", A, "released")
    assert engine.sessions() == [B] and moves.counts.released == 1


def test_a_move_in_whose_chunks_stop_coming_is_given_up_and_reported_failed(engine: Engine,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A MOVE_STATE whose chunks never came (a chunk without its payload frame is dropped unanswered) kept its state
    # buffer and one of the MAX_IMPORTS places for good: 64 of them refused every later move in.
    import worker.serve.moves as moves_module

    d = dispatch(engine)
    create(d, A)
    d.handle(p.Generate(request_id="g1", session_id=A, prompt_ids=(5, 6, 7), params=p.Sampling(max_tokens=2),
                        route=b"c"))
    run_steps(engine, d)  # its state computed: the move has chunks to send
    source = Moves(engine, d, lambda: "b1")
    state, *chunks = source.handle(p.Move(migration="m1", session_id=A, target="w2"))
    assert isinstance(state, p.MoveState) and chunks
    source.handle(p.MoveEnd(migration="m1", session_id=A, outcome="release"))
    target = Moves(engine, d, lambda: "b1")  # the same engine, now without A: it takes A back
    assert target.handle(dataclasses.replace(state, migration="m2")) == []
    assert target.poll() == [] and "m2" in target.imports  # waiting for its chunks
    monkeypatch.setattr(moves_module, "IMPORT_KEEP_S", 0.0)
    [report] = target.poll()
    assert isinstance(report, p.MoveReport)
    assert (report.migration, report.session_id, report.status, report.code) == ("m2", A, "failed", p.ErrorCode.TIMEOUT)
    assert target.imports == {} and A not in engine.sessions()
    chunk = chunks[0]
    assert isinstance(chunk, p.MoveChunk)
    assert target.handle(dataclasses.replace(chunk, migration="m2")) == []  # a late chunk: nothing to add it to
    assert A not in engine.sessions()


def test_a_moves_chunks_are_its_parts_bytes_in_order() -> None:
    """The state's and the checkpoint's bytes go out as one run of chunks: every chunk full but the last, views of the
    parts but for a chunk across two (copied), the bytes in order."""
    import random

    from worker.serve.moves import _chunked

    rng = random.Random(3)
    for _ in range(200):
        parts = [memoryview(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 30)))) for _ in range(rng.randint(0, 3))]
        size = rng.randint(1, 9)
        chunks = _chunked(parts, size)
        whole = b"".join(bytes(part) for part in parts)
        assert b"".join(bytes(chunk) for chunk in chunks) == whole
        assert len(chunks) == -(-len(whole) // size)
        assert all(len(chunk) == size for chunk in chunks[:-1])
    assert all(isinstance(c, memoryview) for c in _chunked([memoryview(b"abcdef"), memoryview(b"ghi")], 3))
