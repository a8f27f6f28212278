"""A client's life outside the happy path: no broker at its address, a malformed address, dropped without close()
in a thread or left open at exit, library logging that prints nothing unless asked, arguments checked as a whole
before anything is sent, and `async with client.session()`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.common import protocol as p
from client import AsyncClient, BadRequest, BrokerUnreachable, Client, ClientError, Generation, Timeout
from client.stack import free_address

from .fake_broker import FakeBroker, Reply

ROOT = Path(__file__).resolve().parents[2]
SID = "5" * 32


def answer_everything(request: p.Message, reply: Reply) -> None:
    """A broker stand-in that creates, generates (two tokens) and closes."""
    if isinstance(request, p.CreateSession):
        reply(p.Created(request_id=request.request_id, session_id=SID, model="m", worker="w", max_context=64))
    elif isinstance(request, p.Generate):
        if request.stream:
            reply(p.Chunks(chunks=(p.StreamChunk(request.request_id, (1,), "b", 0),)))
        reply(p.Generated(request_id=request.request_id, session_id=SID, token_ids=(1, 2), text="bc",
                          finish_reason="length", length=12))
    elif isinstance(request, p.Close):
        reply(p.Closed(request_id=request.request_id, session_id=SID))


# -- no broker, a bad address ----------------------------------------------------------------------------


def test_a_client_with_no_broker_at_its_address_says_so_within_its_connect_timeout() -> None:
    with Client(free_address(), timeout=60, connect_timeout=1.0) as c:
        start = time.monotonic()
        with pytest.raises(BrokerUnreachable, match=r"no broker at tcp://127\.0\.0\.1:\d+: nothing accepted a conn"):
            c.session()
        assert 1.0 <= time.monotonic() - start < 3.0  # not the 60 s timeout
        with pytest.raises(Timeout):  # a BrokerUnreachable is a Timeout: existing handlers keep working
            c.status()


def test_an_async_client_with_no_broker_at_its_address_says_so_within_its_connect_timeout() -> None:
    async def main() -> float:
        async with AsyncClient(free_address(), timeout=60, connect_timeout=1.0) as c:
            start = time.monotonic()
            with pytest.raises(BrokerUnreachable):
                await c.session()
            return time.monotonic() - start

    assert 1.0 <= asyncio.run(main()) < 3.0


def test_a_client_that_reached_its_broker_is_not_hurried_by_the_connect_timeout() -> None:
    def slow(request: p.Message, reply: Reply) -> None:
        time.sleep(1.5)  # longer than connect_timeout: the broker is there, the answer is just slow
        answer_everything(request, reply)

    with FakeBroker(slow) as fake, Client(fake.address, timeout=5, connect_timeout=0.5, resend_after=10) as c:
        assert c.attach(SID).generate(max_tokens=2) == Generation([1, 2], "bc", "length", 12)


@pytest.mark.parametrize("address", ["localhost:5555", "127.0.0.1:5555"])
def test_an_address_without_its_scheme_is_a_bad_request_that_says_what_was_meant(address: str) -> None:
    with pytest.raises(BadRequest, match=f"did you mean tcp://{address}"):
        Client(address)
    with pytest.raises(BadRequest, match="expected tcp://HOST:PORT"):
        AsyncClient("tcp://127.0.0.1")


# -- dropped, garbage-collected, left open at exit ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore:unclosed AsyncClient:ResourceWarning")  # dropped unclosed on purpose
def test_a_client_dropped_without_close_in_a_thread_lets_the_thread_end() -> None:
    """A thread makes a Client, opens a session, generates (streamed too) and returns without closing anything."""
    errors: list[BaseException] = []

    def use_and_drop(fake: FakeBroker) -> None:
        try:
            c = Client(fake.address, timeout=5)
            s = c.session()
            assert s.generate(max_tokens=2).token_ids == [1, 2]
            stream = s.generate(max_tokens=2, stream=True)
            assert next(stream).token_ids == [1]  # left half read
            a = AsyncClient(fake.address, timeout=5)

            async def use() -> None:
                s = await a.session()
                assert (await s.generate(max_tokens=2)).token_ids == [1, 2]

            asyncio.run(use())
        except BaseException as e:
            errors.append(e)

    with FakeBroker(answer_everything) as fake:
        thread = threading.Thread(target=use_and_drop, args=(fake,))
        start = time.monotonic()
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the thread hung releasing a client it dropped"
    assert errors == []
    assert time.monotonic() - start < 5


def test_an_async_client_dropped_unclosed_is_released_while_its_loop_runs_on() -> None:
    """The reader task waits on the socket for as long as the loop runs: it must not keep the client alive. Dropped
    after a call, the AsyncClient's socket is closed and its reader task ends at once (no gc.collect()), with a
    ResourceWarning as asyncio gives for an unclosed transport; one closed gives none."""
    async def main(address: str) -> None:
        c = AsyncClient(address, timeout=5)
        await (await c.session()).generate(max_tokens=2)
        sock, reader = c._transport._socket, c._transport._reader
        assert reader is not None
        with pytest.warns(ResourceWarning, match=r"^unclosed AsyncClient for tcp://127\.0\.0\.1:\d+: close\(\) it"):
            del c
        assert sock.closed
        for _ in range(3):  # the close cancelled its read: the task ends on the loop's next turns
            await asyncio.sleep(0)
        assert reader.cancelled()

        closed = AsyncClient(address, timeout=5)
        await closed.session()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            await closed.close()
            del closed

    with FakeBroker(answer_everything) as fake:
        asyncio.run(main(fake.address))


def test_a_client_left_open_at_exit_does_not_hold_the_process() -> None:
    with FakeBroker(answer_everything) as fake:
        script = textwrap.dedent(f"""
            from client import Client, AsyncClient
            import asyncio
            kept = Client({fake.address!r}, timeout=5)
            kept.session().generate(max_tokens=2)
            async def main():
                global akept
                akept = AsyncClient({fake.address!r}, timeout=5)
                await (await akept.session()).generate(max_tokens=2)
            asyncio.run(main())
            print("done")
        """)
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout, out.stderr) == (0, "done\n", "")
    assert time.monotonic() - start < 15


# -- logging ------------------------------------------------------------------------------------------


def test_library_use_prints_nothing_unless_the_application_configures_logging() -> None:
    """A request resent (the broker stand-in drops the first one) logs `request_resent` at debug: not printed by
    default; printed once the application turns the standard library's logging on."""
    script = textwrap.dedent("""
        import logging, sys
        from broker.common import protocol as p
        from client import Client
        from tests.client.fake_broker import FakeBroker
        if sys.argv[1] == "debug":
            logging.basicConfig(level=logging.DEBUG)
        def script(request, reply):
            if isinstance(request, p.Generate) and len(fake.of(p.Generate)) == 2:
                reply(p.Generated(request_id=request.request_id, session_id=request.session_id, token_ids=(1,),
                                  text="b", finish_reason="length", length=3))
        with FakeBroker(script) as fake, Client(fake.address, timeout=5, resend_after=0.1) as c:
            print(c.attach("5" * 32).generate(max_tokens=1).text)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    quiet = subprocess.run([sys.executable, "-c", script, "default"], env=env, capture_output=True, text=True, timeout=60)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "b\n", "")
    loud = subprocess.run([sys.executable, "-c", script, "debug"], env=env, capture_output=True, text=True, timeout=60)
    assert loud.returncode == 0 and "DEBUG:client:request_resent request=" in loud.stderr


# -- whole requests, async with ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "complaint"),
    [
        (lambda s: s.chat("hi", max_tokens=-1), "max_tokens must be in"),
        (lambda s: s.chat("hi", stop=5), "stop must be a list, got int"),
        (lambda s: s.generate(stop_token_ids=3), "stop_token_ids must be a list, got int"),
        (lambda s: s.generate(prompt_ids="abc"), "prompt_ids must be a list, got str"),
        (lambda s: s.append(token_ids=7), "token_ids must be a list, got int"),
        (lambda s: s.chat("hi", role="User!"), "role is malformed"),
        (lambda s: s.chat("hi", stop=["ok", 5]), "stop must be a string, got int"),
    ],
)
def test_a_call_with_any_bad_argument_sends_nothing(call: object, complaint: str) -> None:
    with FakeBroker(answer_everything) as fake, Client(fake.address, timeout=5) as c:
        with pytest.raises(BadRequest, match=complaint):
            call(c.attach(SID))  # type: ignore[operator]
        time.sleep(0.05)
    assert fake.received == []


def test_a_chat_turn_and_its_generation_are_one_request() -> None:
    with FakeBroker(answer_everything) as fake, Client(fake.address, timeout=5) as c:
        with pytest.raises(Exception, match="older than this client"):  # this stand-in appends nothing, like an old worker
            c.attach(SID).chat("hi", max_tokens=3, stop_token_ids=[7], ignore_eos=True)
    [request] = fake.received
    assert isinstance(request, p.Generate) and request.messages == (p.ChatMessage(role="user", content="hi"),)
    assert (request.params.max_tokens, request.params.stop_token_ids, request.params.ignore_eos) == (3, (7,), True)


def test_async_with_client_session_opens_and_closes_the_session() -> None:
    async def main() -> list[int]:
        async with AsyncClient(fake.address, timeout=5) as c:
            async with c.session() as s:
                ids = (await s.generate(max_tokens=2)).token_ids
            async with await c.session() as s:  # the older spelling still works
                pass
            return ids

    with FakeBroker(answer_everything) as fake:
        assert asyncio.run(main()) == [1, 2]
    assert [type(m).__name__ for m in fake.received] == ["CreateSession", "Generate", "Close", "CreateSession", "Close"]


def silent_generations(request: p.Message, reply: Reply) -> None:
    """Creates and closes, and leaves every non-streamed generation unanswered (a worker busy for long)."""
    if isinstance(request, p.Generate) and not request.stream:
        return
    answer_everything(request, reply)


def cancels(fake: FakeBroker) -> list[tuple[str, str]]:
    return [(m.session_id, m.target) for m in fake.received if isinstance(m, p.Cancel)]


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_generation_whose_call_timed_out_or_was_cancelled_is_cancelled_so_a_retry_can_run() -> None:
    with FakeBroker(silent_generations) as fake, Client(fake.address, timeout=5) as c:
        s = c.attach(SID)
        with pytest.raises(Timeout):
            s.generate(max_tokens=3, timeout=0.2)
        [generate] = [m for m in fake.received if isinstance(m, p.Generate)]
        wait_for(lambda: cancels(fake) == [(SID, generate.request_id)])

    async def main() -> None:
        async with AsyncClient(fake.address, timeout=5) as c:
            s = c.attach(SID)
            with pytest.raises(Timeout):
                await s.generate(max_tokens=3, timeout=0.2)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(s.generate(max_tokens=3), 0.2)
            await asyncio.sleep(0.1)

    with FakeBroker(silent_generations) as fake:
        asyncio.run(main())
        generates = [m.request_id for m in fake.received if isinstance(m, p.Generate)]
        wait_for(lambda: cancels(fake) == [(SID, g) for g in generates] and len(generates) == 2)


def test_a_stream_read_after_its_client_closed_is_a_client_error() -> None:
    with FakeBroker(silent_generations) as fake:
        c = Client(fake.address, timeout=5)
        stream = c.attach(SID).generate(max_tokens=3, stream=True)
        c.close()
        with pytest.raises(ClientError, match="the client is closed"):
            list(stream)


def test_a_session_whose_create_was_given_up_on_is_closed_when_its_answer_comes() -> None:
    """A create that timed out or was cancelled made its session on a worker all the same: nobody can use it, so the
    client closes it when the late answer comes (it held a slot until the broker's grace ran out)."""
    def late_creates(request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.CreateSession):
            fake.later(0.3, lambda: answer_everything(request, reply))
        else:
            answer_everything(request, reply)

    async def main() -> None:
        async with AsyncClient(fake.address, timeout=5) as c:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.session(), 0.05)
            with pytest.raises(Timeout):
                await c.session(timeout=0.1)
            await asyncio.sleep(0.6)  # both answers come

    with FakeBroker(late_creates) as fake:
        asyncio.run(main())
        wait_for(lambda: [m.session_id for m in fake.received if isinstance(m, p.Close)] == [SID, SID])


def test_an_async_client_serves_a_second_event_loop_after_the_first_ended() -> None:
    async def use(client: AsyncClient) -> list[int]:
        async with client.session() as s:
            return (await s.generate(max_tokens=2)).token_ids

    with FakeBroker(answer_everything) as fake:
        client = AsyncClient(fake.address, timeout=5)
        assert asyncio.run(use(client)) == [1, 2]
        assert asyncio.run(use(client)) == [1, 2]  # its reader ended with the first loop: a new one reads
        asyncio.run(client.close())
