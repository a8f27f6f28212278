"""The streamed answer's writer (client.gateway.events.EventStream) as an ASGI server drives it: each event goes out as
soon as it exists, and a client that goes away stops it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from client.gateway.events import EventStream
from client.sync import Client

from .conftest import MODEL, Gateways


def test_each_event_is_handed_to_the_server_before_the_next_exists() -> None:
    async def run() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        second_may_exist = asyncio.Event()
        never = asyncio.Event()

        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            await second_may_exist.wait()
            yield b"data: 2\n\n"

        async def send(message: Any) -> None:
            sent.append(dict(message))
            if message.get("body") == b"data: 1\n\n":
                # the status line and the first event are out while the second token does not exist yet
                assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
                second_may_exist.set()

        async def receive() -> Any:
            await never.wait()

        await EventStream(events(), {"X-Session-ID": "s1"})({"type": "http"}, receive, send)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and headers[b"x-session-id"] == b"s1"
    assert b"content-length" not in headers
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m.get("more_body") for m in sent[1:]] == [True, True, False]


def test_a_client_gone_mid_stream_closes_the_events_and_the_answer_ends_quietly() -> None:
    async def run() -> tuple[list[bytes], bool, bool]:
        sent: list[bytes] = []
        gone = asyncio.Event()
        closed = False
        waiting = asyncio.Event()

        async def events() -> AsyncIterator[bytes]:
            nonlocal closed
            try:
                yield b"data: 1\n\n"
                waiting.set()
                await asyncio.sleep(3600)  # the next token, which never comes before the client leaves
                yield b"data: 2\n\n"
            finally:
                closed = True  # the gateway's events() closes the generation here

        async def send(message: Any) -> None:
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        async def receive() -> Any:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def leave() -> None:
            await waiting.wait()
            gone.set()

        leaving = asyncio.get_running_loop().create_task(leave())
        await asyncio.wait_for(EventStream(events())({"type": "http"}, receive, send), 10)
        await leaving
        task = asyncio.current_task()
        assert task is not None
        return sent, closed, task.cancelling() == 0

    sent, closed, not_cancelled = asyncio.run(run())
    assert sent == [b"data: 1\n\n"] and closed and not_cancelled


def test_an_answer_that_ends_normally_leaves_no_task_behind() -> None:
    async def run() -> int:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: [DONE]\n\n"

        async def send(message: Any) -> None:
            pass

        async def receive() -> Any:
            await asyncio.Event().wait()

        await EventStream(events())({"type": "http"}, receive, send)
        await asyncio.sleep(0)
        return len(asyncio.all_tasks()) - 1

    assert asyncio.run(run()) == 0


def test_through_the_gateway_a_client_gone_after_the_first_token_cancels_the_generation(gateways: Gateways,
                                                                                          gateway: str) -> None:
    """Over a real connection: the first event comes at once, and closing the connection then ends the generation
    and closes its session (a generation left running would finish ~900 tokens later and its session be kept)."""
    with Client(gateways.stack.clients, timeout=60) as native:
        before = native.status()[0].sessions
        url = urlsplit(gateway)
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                           "stream": True}).encode()
        with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b"data: {" not in got:
                piece = sock.recv(65536)
                assert piece, got
                got += piece
            assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
            assert native.status()[0].sessions == before + 1
        deadline = time.monotonic() + 20
        while native.status()[0].sessions != before:
            assert time.monotonic() < deadline, "the generation went on after its client had gone"
            time.sleep(0.1)
