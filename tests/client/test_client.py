"""Client and AsyncClient against a scripted broker: resends, timeouts, streams, cancels, typed errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

import client as client_pkg
from broker.common import protocol as p
from client import (
    AsyncClient,
    AsyncSession,
    AsyncStream,
    BadRequest,
    CapacityExhausted,
    Chunk,
    Client,
    ClientError,
    Generation,
    ModelNotFound,
    SessionLost,
    SessionNotFound,
    StreamCancelled,
    Timeout,
    WorkerDraining,
)
from client.calls import Call, StreamState
from client.errors import error_for

from .fake_broker import FakeBroker, Reply

SID = "5" * 32


def generated(request: p.Generate, ids: tuple[int, ...], reason: str = "length") -> p.Generated:
    return p.Generated(request_id=request.request_id, session_id=request.session_id, token_ids=ids,
                       text="".join(chr(97 + i) for i in ids), finish_reason=reason, length=10 + len(ids))


def stream_chunk(request: p.Generate, ids: tuple[int, ...], offset: int = 0) -> p.StreamChunk:
    return p.StreamChunk(request.request_id, ids, "".join(chr(97 + i) for i in ids), offset)


def chunk(request: p.Generate, ids: tuple[int, ...], offset: int = 0) -> p.Chunks:
    """The CHUNKS message of one engine step that moved only this request, at `offset` in its generation."""
    return p.Chunks(chunks=(stream_chunk(request, ids, offset),))


def test_every_error_class_is_importable_from_client_with_its_code() -> None:
    codes = {cls.code for cls in vars(client_pkg).values() if isinstance(cls, type) and issubclass(cls, ClientError)}
    assert codes == {c.value for c in p.ErrorCode} | {"cancelled"}  # StreamCancelled: the client's own
    assert isinstance(error_for("session_lost", "x"), SessionLost)
    assert type(error_for("no_such_code", "x")).__name__ == "InternalError"
    assert issubclass(Timeout, TimeoutError)


def test_a_request_that_hears_nothing_is_resent_with_the_same_id() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate) and len(fake.of(p.Generate)) == 2:  # drop the first one
            reply(generated(request, (1, 2)))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5, resend_after=0.1) as c:
        result = c.attach(SID).generate(max_tokens=2)
    assert result == Generation([1, 2], "bc", "length", 12)
    first, second = fake.of(p.Generate)
    assert first == second


def test_create_is_never_resent_and_times_out() -> None:
    with FakeBroker(lambda request, reply: None) as fake, Client(fake.address, resend_after=0.05) as c:
        start = time.monotonic()
        with pytest.raises(Timeout) as e:
            c.session(timeout=0.4)
        assert 0.35 < time.monotonic() - start < 2.0
        assert e.value.code == "timeout"
    assert len(fake.of(p.CreateSession)) == 1


@pytest.mark.parametrize(
    ("code", "error"),
    [("capacity_exhausted", CapacityExhausted), ("model_not_found", ModelNotFound),
     ("worker_draining", WorkerDraining), ("bad_request", BadRequest)],
)
def test_errors_are_typed(code: str, error: type[ClientError]) -> None:
    def script(request: p.Message, reply: Reply) -> None:
        assert isinstance(request, p.CreateSession)
        reply(p.Error(request_id=request.request_id, code=p.ERROR_CODES[code], message="nope"))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5) as c:
        with pytest.raises(error) as e:
            c.session()
        assert e.value.code == code and e.value.message == "nope"


def test_bad_arguments_are_refused_before_anything_is_sent() -> None:
    with FakeBroker(lambda request, reply: None) as fake, Client(fake.address) as c:
        s = c.attach(SID)
        with pytest.raises(BadRequest, match="max_tokens"):
            s.generate(max_tokens=-1)
        with pytest.raises(BadRequest, match="top_p"):
            s.generate(top_p=1.5)
        with pytest.raises(BadRequest, match="exactly one"):
            s.append()
        with pytest.raises(BadRequest, match="not a session id"):
            c.attach("../etc/passwd")
        with pytest.raises(BadRequest, match=f"the limit is {p.MAX_HEADER_BYTES} bytes per message"):
            s.append("€" * 3_000_000)  # within the 4M-character limit, but 9 MB on the wire
    assert fake.received == []


def test_a_stream_yields_chunks_then_the_rest_from_the_final_answer() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            assert request.stream
            reply(chunk(request, (1,)))
            reply(chunk(request, (2, 3), 1))
            # the chunk with (4,) was lost: the final answer carries every token
            reply(generated(request, (1, 2, 3, 4, 5)))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5) as c:
        stream = c.attach(SID).generate(max_tokens=5, stream=True)
        chunks = list(stream)
    assert chunks == [Chunk([1], "b"), Chunk([2, 3], "cd"), Chunk([4, 5], "ef", "length")]
    assert stream.result == Generation([1, 2, 3, 4, 5], "bcdef", "length", 15)


def test_closing_a_stream_early_or_timing_out_sends_cancel() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            reply(chunk(request, (1,)))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5, resend_after=10) as c:
        s = c.attach(SID)
        with s.generate(max_tokens=50, stream=True) as stream:
            assert next(stream) == Chunk([1], "b")
        with pytest.raises(StopIteration):  # closed by its caller: the iteration ends quietly
            next(stream)
        slow = s.generate(max_tokens=50, stream=True, timeout=0.2)
        next(slow)
        with pytest.raises(Timeout):
            next(slow)
        deadline = time.monotonic() + 2
        while len(fake.of(p.Cancel)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    targets = [m.target for m in fake.of(p.Cancel)]
    assert targets == [m.request_id for m in fake.of(p.Generate)]


def test_a_loop_left_by_break_cancels_at_once_unless_a_variable_keeps_the_stream() -> None:
    """What the README and Stream's docstring promise: CPython frees a stream only the loop held as the loop ends,
    and __del__ cancels its generation (no gc needed); one kept in a variable runs on until it is closed."""
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            reply(chunk(request, (1,)))

    def cancelled() -> list[str]:
        time.sleep(0.2)  # a CANCEL sent would have arrived
        return [m.target for m in fake.of(p.Cancel)]

    async def loop_left_async(s: AsyncSession) -> None:
        async for _ in await s.generate(max_tokens=50, stream=True):
            break

    with FakeBroker(script) as fake, Client(fake.address, timeout=5, resend_after=10) as c:
        s = c.attach(SID)
        for _ in s.generate(max_tokens=50, stream=True):
            break
        assert cancelled() == [fake.of(p.Generate)[0].request_id]
        kept = s.generate(max_tokens=50, stream=True)
        for _ in kept:
            break
        assert len(cancelled()) == 1  # still generating
        kept.close()
        assert cancelled()[1:] == [fake.of(p.Generate)[1].request_id]

    async def main() -> None:
        async with AsyncClient(fake.address, timeout=5, resend_after=10) as c:
            await loop_left_async(c.attach(SID))
            await asyncio.sleep(0.2)  # let the CANCEL leave before the socket closes

    with FakeBroker(script) as fake:
        asyncio.run(main())
        assert [m.target for m in fake.of(p.Cancel)] == [fake.of(p.Generate)[0].request_id]


def test_reading_a_stream_on_after_its_read_timed_out_says_the_answer_is_cut_off() -> None:
    """The Timeout closed the stream and cancelled its generation: a caller who catches it and reads on gets
    StreamCancelled (not a Timeout, which a retrying reader would catch forever), on every read, never the quiet end
    of a finished answer; `result` stays None."""
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            reply(chunk(request, (1, 2)))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5, resend_after=10) as c:
        stream = c.attach(SID).generate(max_tokens=50, stream=True, timeout=0.2)
        assert next(stream) == Chunk([1, 2], "bc")
        with pytest.raises(Timeout):
            next(stream)
        for _ in range(2):
            with pytest.raises(StreamCancelled, match=r"^the stream was closed and its generation cancelled when a "
                               r"read timed out: its answer is cut off after 2 tokens$") as cut:
                next(stream)
            assert not isinstance(cut.value, Timeout)
            assert (cut.value.code, cut.value.request_id) == ("cancelled", fake.of(p.Generate)[0].request_id)
        stream.close()  # (leaving a `with` block): still cut off, and nothing more is sent
        with pytest.raises(StreamCancelled):
            list(stream)
        assert stream.result is None
    assert [m.target for m in fake.of(p.Cancel)] == [fake.of(p.Generate)[0].request_id]


def test_an_error_ends_a_stream_with_its_typed_exception() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            reply(chunk(request, (1,)))
            reply(p.Error(request_id=request.request_id, code=p.ErrorCode.SESSION_LOST, message="worker died"))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5) as c:
        stream = c.attach(SID).generate(max_tokens=50, stream=True)
        assert next(stream).token_ids == [1]
        with pytest.raises(SessionLost, match="worker died"):
            next(stream)
        assert list(stream) == []
    assert fake.of(p.Cancel) == []  # the server ended it: nothing to cancel


def test_session_close_tolerates_a_session_that_is_already_gone() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, (p.Close, p.Info)):
            reply(p.Error(request_id=request.request_id, code=p.ErrorCode.SESSION_NOT_FOUND, message="closed"))

    with FakeBroker(script) as fake, Client(fake.address, timeout=5) as c:
        with c.attach(SID) as s:
            with pytest.raises(SessionNotFound):
                s.info()
    assert len(fake.of(p.Close)) == 1


def test_async_client_resends_streams_and_runs_calls_concurrently() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            if request.params.max_tokens == 7 and len([g for g in fake.of(p.Generate)
                                                       if g.params.max_tokens == 7]) == 1:
                return  # drop the first attempt of this one
            if request.stream:
                reply(chunk(request, (1,)))
            reply(generated(request, (1, 2)))
        elif isinstance(request, p.CreateSession):
            reply(p.Created(request_id=request.request_id, session_id=SID, model="m", worker="w", max_context=64))

    async def main() -> tuple[Generation, list[Chunk], Generation]:
        async with AsyncClient(fake.address, timeout=5, resend_after=0.1) as c:
            s = await c.session()
            assert (s.id, s.worker, s.max_context) == (SID, "w", 64)
            resent, stream = await asyncio.gather(s.generate(max_tokens=7), s.generate(max_tokens=3, stream=True))
            chunks = [ch async for ch in stream]
            return resent, chunks, await s.generate(max_tokens=2)

    with FakeBroker(script) as fake:
        resent, chunks, plain = asyncio.run(main())
    assert resent == plain == Generation([1, 2], "bc", "length", 12)
    assert chunks == [Chunk([1], "b"), Chunk([2], "c", "length")]


def test_resend_schedule_backs_off_and_resets_when_an_answer_comes() -> None:
    call = Call.of(p.Info(request_id="i", session_id=SID), now=0.0, resend_after_s=1.0)
    assert not call.resend_due(0.9) and call.resend_due(1.0)
    call.resent(1.0)
    assert call.next_resend == 3.0
    call.resent(3.0)
    assert call.next_resend == 7.0
    call.heard(7.5)
    assert call.next_resend == 8.5
    assert not Call.of(p.CreateSession(request_id="c"), 0.0, 1.0).resend_due(100.0)


def test_stream_state_keeps_only_text_that_was_not_yielded() -> None:
    state = StreamState()
    request = p.Generate(request_id="g", session_id=SID)
    assert state.take(stream_chunk(request, (0, 1))) == Chunk([0, 1], "ab")
    assert state.take(p.StreamChunk("g", (2,), "c", 2)) == Chunk([2], "c")
    assert state.take(generated(request, (0, 1, 2, 3), reason="stop")) == Chunk([3], "d", "stop")
    assert state.text == "abcd" and state.tokens == 4
    with pytest.raises(SessionLost):
        StreamState().take(p.Error(request_id="g", code=p.ErrorCode.SESSION_LOST))


SID2 = "6" * 32


def batched_script(fake: list[FakeBroker]) -> Callable[[p.Message, Reply], None]:
    """Answers two streamed GENERATEs (once both came) with batches holding both, as a worker's steps do:
    [a1 b10], a batch that does not follow the protocol (dropped), [b11 a2 + a request nobody made], finals."""

    def script(request: p.Message, reply: Reply) -> None:
        if not isinstance(request, p.Generate):
            return
        requests = fake[0].of(p.Generate)
        if len(requests) < 2:
            return
        a, b = requests
        assert isinstance(a, p.Generate) and isinstance(b, p.Generate)

        def part(g: p.Generate, ids: tuple[int, ...], offset: int) -> p.StreamChunk:
            return p.StreamChunk(g.request_id, ids, "".join(chr(97 + i) for i in ids), offset)

        reply(p.Chunks(chunks=(part(a, (1,), 0), part(b, (10,), 0))))
        reply(p.Chunks.unchecked(chunks=(part(a, (5,), 1), p.StreamChunk(b.request_id, (-1,), "?", 1))))  # one bad
        reply(p.Chunks(chunks=(part(b, (11,), 1), part(a, (2,), 1), p.StreamChunk("nobody-asked", (9,), "j"))))
        reply(generated(a, (1, 2, 3)))
        reply(generated(b, (10, 11, 12)))

    return script


EXPECTED_A = [Chunk([1], "b"), Chunk([2], "c"), Chunk([3], "d", "length")]
EXPECTED_B = [Chunk([10], "k"), Chunk([11], "l"), Chunk([12], "m", "length")]


def test_one_batch_feeds_several_streams_of_a_client_each_in_order() -> None:
    holder: list[FakeBroker] = []
    with FakeBroker(batched_script(holder)) as fake, Client(fake.address, timeout=5) as c:
        holder.append(fake)
        a = c.attach(SID).generate(max_tokens=3, stream=True)
        b = c.attach(SID2).generate(max_tokens=3, stream=True)
        got_a, got_b = [next(a)], []
        got_b += list(b)  # reading b pumps the socket for a too
        got_a += list(a)
    assert (got_a, got_b) == (EXPECTED_A, EXPECTED_B)
    assert a.result == Generation([1, 2, 3], "bcd", "length", 13)
    assert b.result == Generation([10, 11, 12], "klm", "length", 13)
    assert fake.of(p.Cancel) == []


def test_one_batch_feeds_several_async_streams_each_in_order() -> None:
    holder: list[FakeBroker] = []

    async def main() -> tuple[list[Chunk], list[Chunk]]:
        async with AsyncClient(fake.address, timeout=5) as c:
            a = await c.attach(SID).generate(max_tokens=3, stream=True)
            b = await c.attach(SID2).generate(max_tokens=3, stream=True)

            async def read(stream: AsyncStream) -> list[Chunk]:
                return [ch async for ch in stream]

            got_a, got_b = await asyncio.gather(read(a), read(b))
            return got_a, got_b

    with FakeBroker(batched_script(holder)) as fake:
        holder.append(fake)
        assert asyncio.run(main()) == (EXPECTED_A, EXPECTED_B)
    assert fake.of(p.Cancel) == []


def test_an_async_stream_times_out_and_resends_while_waiting() -> None:
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate) and len(fake.of(p.Generate)) == 3:  # answer the second resend only
            reply(p.Chunks(chunks=(p.StreamChunk(request.request_id, (1,), "b"),)))

    async def main() -> tuple[list[Chunk], float]:
        async with AsyncClient(fake.address, timeout=5, resend_after=0.05) as c:
            stream = await c.attach(SID).generate(max_tokens=3, stream=True, timeout=0.4)
            got = [await stream.__anext__()]
            start = time.monotonic()
            with pytest.raises(Timeout):
                await stream.__anext__()
            waited = time.monotonic() - start
            await asyncio.sleep(0.2)  # let the CANCEL leave before the socket closes
            return got, waited

    with FakeBroker(script) as fake:
        got, waited = asyncio.run(main())
    assert got == [Chunk([1], "b")]
    assert 0.35 < waited < 2.0
    generates = fake.of(p.Generate)
    assert len(generates) >= 4 and generates[1] == generates[0]  # resent, same id, while waiting
    # once a chunk came, each resend also says where to resume the stream: after the one token it has
    assert all(g == replace(generates[0], resume=1) for g in generates[3:])
    assert len(fake.of(p.Cancel)) == 1  # the timeout cancelled the generation


def test_an_async_stream_whose_read_timed_out_or_was_cancelled_says_so_on_the_next_read() -> None:
    """A read cut short from outside (asyncio.wait_for timing out) or by the stream's own timeout closes the stream
    and cancels the generation; the next reads raise StreamCancelled saying which, never StopAsyncIteration. A
    stream its caller closed ends quietly."""
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Generate):
            reply(chunk(request, (1,)))

    async def read_after(stream: AsyncStream) -> str:
        with pytest.raises(StreamCancelled) as cut:
            await stream.__anext__()
        with pytest.raises(StreamCancelled):
            async for _ in stream:
                pass
        assert stream.result is None and not stream.ready
        return cut.value.message

    async def main() -> list[str]:
        async with AsyncClient(fake.address, timeout=5, resend_after=10) as c:
            s = c.attach(SID)
            waited = await s.generate(max_tokens=50, stream=True)
            assert await waited.__anext__() == Chunk([1], "b")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(waited.__anext__(), 0.05)
            timed = await s.generate(max_tokens=50, stream=True, timeout=0.1)
            with pytest.raises(Timeout):
                while True:
                    await timed.__anext__()
            closed = await s.generate(max_tokens=50, stream=True)
            await closed.__anext__()
            await closed.aclose()
            with pytest.raises(StopAsyncIteration):
                await closed.__anext__()
            messages = [await read_after(waited), await read_after(timed)]
            await asyncio.sleep(0.1)  # let the CANCELs leave before the socket closes
            return messages

    with FakeBroker(script) as fake:
        messages = asyncio.run(main())
    assert messages == [
        "the stream was closed and its generation cancelled when a read was cancelled: its answer is cut off after 1 token",
        "the stream was closed and its generation cancelled when a read timed out: its answer is cut off after 1 token",
    ]
    assert [m.target for m in fake.of(p.Cancel)] == [m.request_id for m in fake.of(p.Generate)]


def test_closing_an_async_stream_or_client_wakes_its_waiting_reader() -> None:
    async def main() -> None:
        async with AsyncClient(fake.address, timeout=30, resend_after=30) as c:
            stream = await c.attach(SID).generate(max_tokens=3, stream=True)
            reader = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            stream.close()  # from another task: the reader is not left waiting for 30 s
            with pytest.raises(ClientError, match="closed"):
                await asyncio.wait_for(reader, 2)
            other = await c.attach(SID).generate(max_tokens=3, stream=True)
            reader = asyncio.ensure_future(other.__anext__())
            await asyncio.sleep(0.05)
            await c.close()
            with pytest.raises(ClientError, match="client is closed"):
                await asyncio.wait_for(reader, 2)

    with FakeBroker(lambda request, reply: None) as fake:
        asyncio.run(main())


def test_a_close_sent_soon_is_answered_on_wait_and_its_timeout_stays_an_error() -> None:
    """Session.close_soon(): the close leaves at once; wait() takes its answer once. A close nobody answers times
    out, and waiting again raises the same Timeout (the session's fate is unknown), never a quiet return."""
    def script(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Close) and request.session_id == SID:
            reply(p.Closed(request_id=request.request_id, session_id=SID))

    other = "f" * len(SID)
    with FakeBroker(script) as fake, Client(fake.address, timeout=5, resend_after=10) as c:
        pending = c.attach(SID).close_soon()
        deadline = time.monotonic() + 2
        while not fake.of(p.Close) and time.monotonic() < deadline:  # sent before any wait
            time.sleep(0.01)
        assert [m.session_id for m in fake.of(p.Close)] == [SID]
        pending.wait()
        pending.wait()
        unanswered = c.attach(other).close_soon(timeout=0.2)
        with pytest.raises(Timeout) as first:
            unanswered.wait()
        with pytest.raises(Timeout) as again:
            unanswered.wait()
        assert again.value is first.value
        assert not c._transport._mail  # both calls' mailboxes are gone
