"""One broker, one random:tiny worker: the client API end to end."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import zmq

from broker.common import protocol as p
from client import AsyncClient, BadRequest, Chunk, SessionNotFound, StreamCancelled
from worker.model.tokenizer import Tokenizer

from .cluster import Cluster

PROMPT = [5, 17, 99, 3, 250, 41]


def test_streaming_gives_the_same_tokens_as_not_streaming(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as a, c.session() as b:
        a.append(token_ids=PROMPT)
        b.append(token_ids=PROMPT)
        whole = a.generate(max_tokens=24, ignore_eos=True)
        stream = b.generate(max_tokens=24, ignore_eos=True, stream=True)
        chunks = list(stream)
    assert whole.finish_reason == "length" and len(whole.token_ids) == 24
    assert [t for ch in chunks for t in ch.token_ids] == whole.token_ids
    assert "".join(ch.text for ch in chunks) == whole.text
    assert [ch.finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert stream.result == whole


def test_a_conversation_continues_across_turns(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as s:
        assert s.append(token_ids=PROMPT) == len(PROMPT)
        first = s.generate(max_tokens=5, ignore_eos=True)
        assert first.session_length == len(PROMPT) + 5
        assert s.append(text="more") == first.session_length + 4  # the tiny model's tokenizer is bytes
        assert s.info().length == first.session_length + 4


def test_a_turn_in_one_request_equals_append_then_generate(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as a, c.session() as b:
        a.append(token_ids=PROMPT)
        two_calls = a.generate(max_tokens=8, ignore_eos=True)
        one_call = b.generate(max_tokens=8, ignore_eos=True, prompt_ids=PROMPT)
        assert one_call.token_ids == two_calls.token_ids and len(one_call.token_ids) == 8
        assert (one_call.appended, one_call.session_length) == (len(PROMPT), len(PROMPT) + 8)
        assert two_calls.appended == 0
        stream = b.generate(max_tokens=3, ignore_eos=True, stream=True, prompt="hi")  # text: bytes, 2 tokens
        assert sum(len(ch.token_ids) for ch in stream) == 3
        assert stream.result is not None and stream.result.appended == 2
        assert stream.result.session_length == len(PROMPT) + 8 + 2 + 3
        with pytest.raises(BadRequest, match="out of range"):  # refused whole: nothing appended
            b.generate(max_tokens=2, prompt_ids=[1, 10**6])
        with pytest.raises(BadRequest, match="at most one"):  # refused by the client before sending
            b.generate(max_tokens=2, prompt_ids=[1], prompt="x")
        assert b.info().length == len(PROMPT) + 8 + 2 + 3


def test_fork_continues_exactly_like_its_parent(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as parent:
        parent.append(token_ids=PROMPT)
        parent.generate(max_tokens=4, ignore_eos=True)
        with parent.fork() as child:
            assert child.id != parent.id and child.worker == "w1"
            assert child.info().length == parent.info().length
            assert child.generate(max_tokens=12, ignore_eos=True) == parent.generate(max_tokens=12, ignore_eos=True)


def test_close_ends_the_session(one_worker: Cluster) -> None:
    with one_worker.client() as c:
        s = c.session()
        s.append(token_ids=PROMPT)
        s.close()
        with pytest.raises(SessionNotFound):
            s.generate(max_tokens=2)
        s.close()  # closing again is not an error
        assert all(w.sessions == 0 for w in c.status())


def test_a_session_id_that_was_never_issued_is_not_found(one_worker: Cluster) -> None:
    with one_worker.client() as c:
        ghost = c.attach(secrets.token_hex(16))
        with pytest.raises(SessionNotFound) as e:
            ghost.generate(max_tokens=2)
        assert e.value.code == "session_not_found"
        with pytest.raises(SessionNotFound):
            ghost.append(token_ids=[1])
        with pytest.raises(BadRequest):
            c.attach("not-a-session-id")


def test_bad_input_gets_typed_errors_and_the_session_stays_usable(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as s:
        with pytest.raises(BadRequest):
            s.generate(max_tokens=2)  # empty session: nothing to continue
        with pytest.raises(BadRequest):
            s.append(token_ids=[10**6])  # out of the vocabulary
        with pytest.raises(BadRequest):
            s.append(token_ids=[])
        with pytest.raises(BadRequest):
            s.generate(max_tokens=-1)  # refused before it is sent
        with pytest.raises(BadRequest):
            s.generate(max_tokens=2, temperature=-0.5)
        with pytest.raises(BadRequest):
            s.append(text="x", token_ids=[1])
        s.append(token_ids=PROMPT)
        assert len(s.generate(max_tokens=3, ignore_eos=True).token_ids) == 3


def test_chat_renders_the_template_on_the_worker(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as s:
        length = s.append_chat("hello")
        expected = Tokenizer.bytes_only().apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
        assert length == len(expected)
        reply = s.chat("again", max_tokens=4)
        assert reply.finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible_through_the_stack(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as a, c.session() as b:
        a.append(token_ids=PROMPT)
        b.append(token_ids=PROMPT)
        first = a.generate(max_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
        second = b.generate(max_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
        assert first.token_ids == second.token_ids


def test_interleaved_streams_on_one_client(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as a, c.session() as b:
        a.append(token_ids=PROMPT)
        b.append(token_ids=PROMPT[::-1])
        with a.fork() as fa, b.fork() as fb:
            expect_a = fa.generate(max_tokens=10, ignore_eos=True).token_ids
            expect_b = fb.generate(max_tokens=10, ignore_eos=True).token_ids
        sa = a.generate(max_tokens=10, ignore_eos=True, stream=True)
        sb = b.generate(max_tokens=10, ignore_eos=True, stream=True)
        got: dict[str, list[int]] = {"a": [], "b": []}
        live = {"a": sa, "b": sb}
        while live:  # read the two streams turn about
            for name, stream in list(live.items()):
                chunk = next(stream)
                got[name] += chunk.token_ids
                if chunk.finish_reason is not None:
                    del live[name]
        assert (got["a"], got["b"]) == (expect_a, expect_b)


def test_closing_a_stream_early_cancels_the_generation(one_worker: Cluster) -> None:
    with one_worker.client() as c, c.session() as s:
        s.append(token_ids=PROMPT)
        stream = s.generate(max_tokens=1500, ignore_eos=True, stream=True)
        first = next(stream)
        assert isinstance(first, Chunk) and first.finish_reason is None
        stream.close()
        # The session is free again (a generation in flight would make this a SessionBusy BadRequest).
        for _ in range(100):
            if not s.info().busy:
                break
        assert not s.info().busy
        assert len(s.generate(max_tokens=2, ignore_eos=True).token_ids) == 2


def test_a_stream_whose_read_was_cancelled_is_cut_off_and_its_generation_stopped(one_worker: Cluster) -> None:
    """asyncio.wait_for around a read timing out (the gateway's way when its HTTP client goes): the generation is
    cancelled on the worker, so the session is free for the next turn, and reading the stream on raises
    StreamCancelled rather than ending as a whole answer would."""
    async def main() -> None:
        async with AsyncClient(one_worker.clients, timeout=20) as c, c.session() as s:
            await s.append(token_ids=PROMPT)
            stream = await s.generate(max_tokens=1500, ignore_eos=True, stream=True)
            for _ in range(1500):  # reads that find a chunk waiting return at once: one of them will wait
                try:
                    await asyncio.wait_for(stream.__anext__(), 0.0005)
                except asyncio.TimeoutError:
                    break
            with pytest.raises(StreamCancelled, match="when a read was cancelled: its answer is cut off after"):
                await stream.__anext__()
            assert stream.result is None
            for _ in range(100):  # the CANCEL is on its way
                if not (await s.info()).busy:
                    break
            assert len((await s.generate(max_tokens=2, ignore_eos=True)).token_ids) == 2

    asyncio.run(main())


def test_async_client(one_worker: Cluster) -> None:
    async def main() -> tuple[list[int], list[int], list[int]]:
        async with AsyncClient(one_worker.clients, timeout=20) as c:
            async with await c.session() as a, await c.session() as b:
                await a.append(token_ids=PROMPT)
                whole, stream = await asyncio.gather(
                    a.generate(max_tokens=12, ignore_eos=True),
                    b.generate(max_tokens=12, ignore_eos=True, stream=True, prompt_ids=PROMPT),
                )
                streamed = [t async for ch in stream for t in ch.token_ids]
                child = await a.fork()
                forked = (await child.generate(max_tokens=4, ignore_eos=True)).token_ids
                await child.close()
                with pytest.raises(SessionNotFound):
                    await child.info()
                return whole.token_ids, streamed, forked

    whole, streamed, forked = asyncio.run(main())
    assert whole == streamed and len(forked) == 4


def test_a_resent_request_is_answered_again_not_run_again(one_worker: Cluster) -> None:
    """What the client's resend relies on: the worker answers a repeated request id from its cache."""
    with one_worker.client() as c, c.session() as s:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(one_worker.clients)
        try:

            def answer() -> p.Message:
                while True:  # the broker's lease notices come on the same socket, whenever they are due
                    assert sock.poll(10_000)
                    message = p.decode(sock.recv_multipart())
                    if not isinstance(message, p.Lease):
                        return message

            def twice(request: p.Message) -> list[p.Message]:
                answers = []
                for _ in range(2):
                    sock.send_multipart(p.encode(request))
                    answers.append(answer())
                return answers

            first, again = twice(p.Append(request_id="append-1", session_id=s.id, token_ids=tuple(PROMPT)))
            assert first == again and isinstance(first, p.Appended) and first.length == len(PROMPT)
            gen = p.Generate(request_id="gen-1", session_id=s.id, params=p.Sampling(max_tokens=5, ignore_eos=True))
            first, again = twice(gen)
            assert first == again and isinstance(first, p.Generated) and first.length == len(PROMPT) + 5
            assert s.info().length == len(PROMPT) + 5  # each ran once
        finally:
            sock.close()
            context.term()
