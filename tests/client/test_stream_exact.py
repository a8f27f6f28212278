"""Streams exact by construction: chunks applied at their offsets, repeats dropped, gaps asked for again, and the
streamed text equal to the result's text.

Unit tests of StreamState, the worker's side (Dispatch keeps each generation's tokens and text ends and answers a
GENERATE resent with `resume`), both together through a channel that drops and repeats messages, with the real
random:tiny engine (a byte vocabulary: its text is often held back for an unfinished UTF-8 character), and the
Client and AsyncClient asking a scripted broker for what they missed.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import torch

from broker.common import protocol as p
from client import AsyncClient, Chunk, Client, Generation, InternalError
from client.calls import Call, StreamState, addressed, decode_answer
from worker.engine import Engine, SamplingParams
from worker.engine.session import Chunk as EngineChunk
from worker.serve.config import WorkerConfig
from worker.serve.dispatch import Active, Dispatch
from worker.serve.metrics import NoMetrics

from .fake_broker import FakeBroker, Reply, Script

SID = "5" * 32


def piece(offset: int, ids: tuple[int, ...], text: str, rid: str = "g") -> p.StreamChunk:
    return p.StreamChunk(rid, ids, text, offset)


def final(ids: tuple[int, ...], text: str, rid: str = "g", appended: int = 0, cached: int | None = None) -> p.Generated:
    return p.Generated(request_id=rid, session_id=SID, token_ids=ids, text=text, finish_reason="length",
                       length=10 + len(ids), appended=appended, cached=cached)


# -- the client's StreamState -------------------------------------------------------------------------------


def test_chunks_apply_only_at_their_offset_and_repeats_are_dropped() -> None:
    call = Call.of(p.Generate(request_id="g", session_id=SID, stream=True), 0.0, 1.0)
    state = StreamState(call)
    assert call.resume is None  # nothing heard yet: a resend may still run the request
    assert state.take(piece(0, (1, 2), "ab")) == Chunk([1, 2], "ab")
    assert call.resume == 2
    assert state.take(piece(0, (1, 2), "ab")) is None  # a repeat
    assert state.take(piece(1, (2,), "b")) is None  # a repeat of part of what we have
    assert not state.missing
    assert state.take(piece(2, (3,), "")) == Chunk([3], "")  # a token whose text is held back (unfinished UTF-8)
    assert state.take(piece(3, (4,), "\u00e9")) == Chunk([4], "\u00e9")
    assert state.take(final((1, 2, 3, 4, 5), "ab\u00e9!")) == Chunk([5], "!", "length")
    assert state.text == "ab\u00e9!" and state.tokens == 5
    assert state.result == Generation([1, 2, 3, 4, 5], "ab\u00e9!", "length", 15)


def test_a_gap_is_noticed_asked_for_once_per_resend_interval_and_filled_by_the_resumed_range() -> None:
    call = Call.of(p.Generate(request_id="g", session_id=SID, stream=True), 0.0, 1.0)
    state = StreamState(call)
    assert state.take(piece(0, (1,), "a")) == Chunk([1], "a")
    assert not state.ask(0.0, 1.0)  # no gap: nothing to ask
    assert state.take(piece(3, (4,), "d")) is None  # tokens 1 and 2 were lost
    assert state.missing and call.resume == 1
    assert state.ask(10.0, 1.0)  # at once
    assert state.take(piece(4, (5,), "e")) is None  # the gap is still there: dropped, not asked again so soon
    assert not state.ask(10.5, 1.0)
    assert state.ask(11.0, 1.0)  # the answer may be lost too: asked again after the resend interval
    assert p.decode(call.resend_frames()) == p.Generate(request_id="g", session_id=SID, stream=True, resume=1)
    assert state.take(piece(1, (2, 3, 4, 5), "bcde")) == Chunk([2, 3, 4, 5], "bcde")  # the worker's answer
    assert not state.missing and call.resume == 5
    assert state.take(piece(5, (6,), "f")) == Chunk([6], "f")
    assert state.take(piece(1, (2, 3, 4, 5, 6, 7), "bcdefg")) is None  # a second answer overlaps: asked again
    assert state.missing and state.ask(11.1, 1.0)
    assert state.take(final((1, 2, 3, 4, 5, 6, 7, 8), "abcdefgh")) == Chunk([7, 8], "gh", "length")


def test_the_final_answer_carries_whatever_the_stream_lacks() -> None:
    state = StreamState()
    assert state.take(piece(0, (1,), "a")) == Chunk([1], "a")
    assert state.take(piece(2, (3,), "c")) is None  # a gap, then the generation ended before it was filled
    assert state.take(final((1, 2, 3), "abc")) == Chunk([2, 3], "bc", "length")


def test_a_final_answer_that_does_not_continue_the_stream_is_an_error_not_wrong_text() -> None:
    state = StreamState()
    state.take(piece(0, (1,), "a"))
    with pytest.raises(InternalError, match="does not continue the streamed chunks"):
        state.take(final((1, 2), "xb"))


def test_a_chat_turn_the_worker_did_not_append_is_an_error() -> None:
    with pytest.raises(InternalError, match="older than this client"):
        StreamState(chat=True).take(final((1,), "a", appended=0))
    assert StreamState(chat=True).take(final((1,), "a", appended=7)) == Chunk([1], "a", "length")


def test_a_from_start_answer_of_a_worker_that_does_not_know_it_is_an_error() -> None:
    """A worker older than from_start drops the field it does not know and appends the whole context after the
    session's tokens: its answer says no `cached`, and the client refuses it (the gateway then closes the session)."""
    with pytest.raises(InternalError, match="does not know from_start"):
        StreamState(from_start=True).take(final((1,), "a", appended=7))
    state = StreamState(from_start=True)
    assert state.take(final((1,), "a", appended=0, cached=9)) == Chunk([1], "a", "length")
    assert state.result is not None and state.result.cached == 9


def test_a_chunk_of_an_older_worker_without_offset_is_refused_naming_the_field() -> None:
    frames = [p.VERSION, b"CHUNKS", msgpack.packb({"chunks": [{"request_id": "g", "token_ids": [1], "text": "a"}]})]
    with pytest.raises(p.ProtocolError, match="a worker older than this client sends none"):
        p.decode(frames)
    assert decode_answer(frames) is None  # dropped by the client: the final answer brings those tokens


# -- the worker's side: Dispatch --------------------------------------------------------------------------


class OneSession:
    """What Dispatch asks of an engine for answers that are already made (no engine runs here)."""

    def session_length(self, session_id: str) -> int:
        return 40


def dispatch_streaming(route: bytes = b"c1") -> tuple[Dispatch, Active]:
    dispatch = Dispatch(OneSession(), WorkerConfig(), lambda s: s, NoMetrics())  # type: ignore[arg-type]
    active = dispatch.active["e1"] = Active("g", SID, route, True)
    dispatch._by_session[SID] = "e1"
    return dispatch, active


def fanned(messages: list[p.Message]) -> list[p.StreamChunk]:
    """The chunks a step's FANOUT carries."""
    out: list[p.StreamChunk] = []
    for message in messages:
        if isinstance(message, p.Fanout):
            for _, frames in message.sends():
                out += p.decode(frames).chunks  # type: ignore[attr-defined]
    return out


def test_each_chunk_carries_its_offset_and_held_text_goes_with_a_later_token() -> None:
    dispatch, active = dispatch_streaming()
    steps = [
        [EngineChunk("e1", SID, [10], "a")],
        [EngineChunk("e1", SID, [11], "")],  # the first byte of an unfinished character: its text is held back
        [EngineChunk("e1", SID, [], "?")],  # text with no token (no engine does that now): it waits for one
        [EngineChunk("e1", SID, [12], "\u00e9")],
    ]
    streamed = [c for step in steps for c in fanned(dispatch.step_answers(step, 0.0)[0])]
    assert streamed == [piece(0, (10,), "a"), piece(1, (11,), ""), piece(2, (12,), "?\u00e9")]
    assert active.texts == ["a", "", "?\u00e9"]
    resend = p.Generate(request_id="g", session_id=SID, stream=True, resume=1, route=b"c2")
    assert dispatch.handle(resend) == [p.Chunks(chunks=(piece(1, (11, 12), "?\u00e9"),), route=b"c2")]
    assert active.route == b"c2"  # the rest goes to the route of the resend
    assert dispatch.handle(replace(resend, resume=3)) == []  # nothing made from there yet
    assert dispatch.handle(replace(resend, resume=0)) == [p.Chunks(chunks=(piece(0, (10, 11, 12), "a?\u00e9"),),
                                                                   route=b"c2")]
    messages, _ = dispatch.step_answers([EngineChunk("e1", SID, [13], "!", "length")], 0.0)
    assert fanned(messages) == []  # a finished generation's last tokens come with its final answer
    [answer] = messages
    assert isinstance(answer, p.Generated) and (answer.token_ids, answer.text) == ((10, 11, 12, 13), "a?\u00e9!")
    assert dispatch.handle(replace(resend, resume=2)) == [answer]  # once ended, a resend gets the final answer


def test_a_resume_of_a_generation_the_worker_forgot_is_refused_never_run_again() -> None:
    dispatch, _ = dispatch_streaming()
    [error] = dispatch.handle(p.Generate(request_id="old", session_id=SID, stream=True, resume=4, route=b"c1"))
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.INTERNAL
    assert "not run again" in error.message and list(dispatch.active) == ["e1"]


# -- both sides, through a channel that loses and repeats messages, with the real random:tiny engine ---------


@pytest.fixture(scope="module")
def tiny() -> Iterator[Engine]:
    """random:tiny on one torch thread (two cores shared with other tests' daemons: docs/tuning.md#cpu-threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.load("random:tiny", device="cpu", max_sessions=STREAMS, max_context=512)
    try:
        yield engine
    finally:
        engine.unload()
        torch.set_num_threads(threads)


STREAMS = 8
TOKENS = 60


def sampling(s: p.Sampling) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed, stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos)


class LossyClient:
    """One client's streamed generation, fed through a channel that drops and repeats each message to it; it asks for
    its gaps (and, its final answer lost, resends) as a Stream does."""

    def __init__(self, dispatch: Dispatch, request: p.Generate, rng: random.Random, drop: float, repeat: float) -> None:
        self.dispatch, self.rng, self.drop, self.repeat = dispatch, rng, drop, repeat
        self.call = Call.of(request, 0.0, 1.0)
        self.state = StreamState(self.call)
        self.inbox: deque[p.Message | p.StreamChunk] = deque()
        self.yielded: list[Chunk] = []
        self.held = 0  # chunks with tokens whose text was held back
        self.resumed = 0  # ranges the worker sent again when asked

    def receive(self, frames: list[bytes]) -> None:
        if self.rng.random() < self.drop:
            return
        for _ in range(2 if self.rng.random() < self.repeat else 1):
            for rid, item in addressed(decode_answer(frames)):
                if rid == self.call.request_id:
                    self.held += isinstance(item, p.StreamChunk) and bool(item.token_ids) and not item.text
                    self.inbox.append(item)

    def resend(self) -> None:
        for answer in self.dispatch.handle(p.decode(self.call.resend_frames()).routed(self.call.request_id.encode())):
            self.resumed += isinstance(answer, p.Chunks)
            self.receive(p.encode(answer))

    def read(self, now: float, engine_done: bool) -> None:
        if engine_done and not self.inbox and self.state.result is None:
            self.resend()  # the final answer was lost: the resend is answered from the worker's cache
        while self.inbox and self.state.result is None:
            chunk = self.state.take(self.inbox.popleft())
            if chunk is not None:
                self.yielded.append(chunk)
            elif self.state.ask(now, 1.0):
                self.resend()


def lossy_streams(engine: Engine, seed: int, drop: float, repeat: float) -> list[LossyClient]:
    """STREAMS generations streamed together from one Dispatch, each to its own client (its route: its request id)
    through a lossy channel."""
    rng = random.Random(seed)
    dispatch = Dispatch(engine, WorkerConfig(), sampling, NoMetrics())
    clients: dict[bytes, LossyClient] = {}
    sids = []
    for i in range(STREAMS):
        sid = engine.create_session()
        sids.append(sid)
        engine.append(sid, token_ids=[1, 2, 3 + i])
        request = p.Generate(request_id=f"g{i}", session_id=sid, params=p.Sampling(
            max_tokens=TOKENS, temperature=1.0, seed=seed * 100 + i, ignore_eos=True), stream=True, route=b"g%d" % i)
        clients[request.route] = client = LossyClient(dispatch, request, rng, drop, repeat)
        assert dispatch.handle(request) == []
    now = 0.0
    try:
        while any(c.state.result is None for c in clients.values()):
            now += 0.25  # a step's time: a gap is asked for again every 4 steps while it lasts
            if engine.has_work():
                for message in dispatch.step_answers(engine.step(), now)[0]:
                    sends = message.sends() if isinstance(message, p.Fanout) else [(message.route, p.encode(message))]  # type: ignore[attr-defined]
                    for route, frames in sends:
                        clients[route].receive(frames)
            for client in clients.values():
                client.read(now, not engine.has_work())
    finally:
        for sid in sids:
            engine.close(sid)
    return list(clients.values())


@pytest.mark.parametrize(("drop", "repeat"), [(0.0, 0.0), (0.3, 0.0), (0.0, 0.3), (0.3, 0.3), (0.6, 0.2)])
def test_streamed_tokens_and_text_equal_the_result_whatever_the_channel_loses_or_repeats(
    tiny: Engine, drop: float, repeat: float
) -> None:
    clients = lossy_streams(tiny, 7, drop, repeat)
    for client in clients:
        result, chunks = client.state.result, client.yielded
        assert result is not None and len(result.token_ids) == TOKENS
        assert [t for c in chunks for t in c.token_ids] == result.token_ids
        assert "".join(c.text for c in chunks) == result.text
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert sum(c.held for c in clients) > 0  # some text was held back for an unfinished UTF-8 character
    assert (sum(c.resumed for c in clients) > 0) == (drop > 0)  # gaps were filled by ranges asked for again


# -- the clients: a gap makes the stream ask at once ------------------------------------------------------------


def gappy_script(fake: list[FakeBroker]) -> Script:
    """Streams 1, (2 lost), 3; answers a resend with resume=1 with [2, 3] once, and ends with the final answer."""

    def script(request: p.Message, reply: Reply) -> None:
        if not isinstance(request, p.Generate):
            return
        if request.resume is None:
            reply(p.Chunks(chunks=(piece(0, (1,), "a", request.request_id),)))
            reply(p.Chunks(chunks=(piece(2, (3,), "c", request.request_id),)))  # token 2 was lost on the way
        elif request.resume == 1:
            reply(p.Chunks(chunks=(piece(1, (2, 3), "bc", request.request_id),)))
            reply(p.Chunks(chunks=(piece(3, (4,), "d", request.request_id),)))
            reply(final((1, 2, 3, 4, 5), "abcde", request.request_id))

    return script


EXPECTED = [Chunk([1], "a"), Chunk([2, 3], "bc"), Chunk([4], "d"), Chunk([5], "e", "length")]


def test_a_stream_asks_for_its_gap_at_once_and_yields_every_token_once() -> None:
    holder: list[FakeBroker] = []
    with FakeBroker(gappy_script(holder)) as fake, Client(fake.address, timeout=5, resend_after=10) as c:
        holder.append(fake)
        stream = c.attach(SID).generate(max_tokens=5, stream=True)
        assert list(stream) == EXPECTED
        assert stream.result is not None and stream.result.text == "abcde"
    first, resumed = fake.of(p.Generate)  # asked once, without waiting for the 10 s resend schedule
    assert resumed == replace(first, resume=1)


def test_an_async_stream_asks_for_its_gap_at_once_and_yields_every_token_once() -> None:
    holder: list[FakeBroker] = []

    async def main() -> list[Chunk]:
        async with AsyncClient(fake.address, timeout=5, resend_after=10) as c:
            stream = await c.attach(SID).generate(max_tokens=5, stream=True)
            return [chunk async for chunk in stream]

    with FakeBroker(gappy_script(holder)) as fake:
        holder.append(fake)
        assert asyncio.run(main()) == EXPECTED
    first, resumed = fake.of(p.Generate)
    assert resumed == replace(first, resume=1)
