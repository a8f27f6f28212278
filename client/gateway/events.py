"""A streamed answer's server-sent events, written from the request's own task.

Starlette's StreamingResponse (ASGI 2.3 servers, uvicorn's included) starts a task group and a second task for every
answer, and the status line waits a turn of the event loop for it; here the status line and the first event go out at
once, one after the other, from the task that awaited the first token. A client that goes away stops the answer as
there: a task reading `receive` (started once the first event is out) cancels the writer, whose events' iterator then
closes (and with it the generation).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    """`on_done(gone)` runs once the answer ended, written whole (gone False) or its client gone (True): the request is
    in progress until then (the gateway's num_requests_running and requests_total count it there)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> None:
        self.events = events
        self.on_done: Callable[[bool], None] | None = None
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None
        state = {"writing": True, "gone": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["writing"]:
                state["gone"] = True
                writer.cancel()

        watcher: asyncio.Task[None] | None = None
        started = False
        try:
            async for event in self.events:
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    watcher = asyncio.get_running_loop().create_task(watch())
                    continue
                await send({"type": "http.response.body", "body": event, "more_body": True})
            if not started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            state["writing"] = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            uncancel = getattr(writer, "uncancel", None)  # Python >= 3.11: the cancel was ours, and is handled
            if uncancel is not None:
                uncancel()
        finally:
            state["writing"] = False
            if watcher is not None:
                watcher.cancel()
            if self.on_done is not None:
                self.on_done(state["gone"])
