"""The asyncio client: the same API as Client, with coroutines.

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        async with client.session() as s:
            stream = await s.chat("Tell me a story.", max_tokens=32, stream=True)
            async for chunk in stream:
                print(chunk.text, end="")

One reader task sorts answers into a mailbox per request id (splitting CHUNKS into its streams' chunks),
so any number of sessions and streams can run concurrently on one AsyncClient (within one event loop).
"""

from __future__ import annotations

import asyncio
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Coroutine, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, cast, overload

import zmq
import zmq.asyncio

from broker.common import protocol as p
from broker.common.keys import HANDSHAKE_REFUSED, CurveClient
from client import calls
from client.calls import Answer, Call, addressed, build, decode_answer, items, new_request_id
from client.errors import BadRequest, ClientError, SessionExpired, SessionLost, SessionNotFound, Timeout, Unauthorized
from client.logs import log
from client.results import Chunk, Generation, SessionInfo, WorkerInfo
from client.transport import REFUSAL_CHECK_S, connect_client, connect_wake_at, release, send_failed, timed_out, unreachable

M = TypeVar("M", bound=p.Message)


class Mailbox:
    """One call's answers, the future its one reader waits on, and an alarm for its timeout and resend.

    Cheaper than an asyncio.Queue read with wait_for (a task and a timer per answer), which matters as a
    stream takes one answer per token: the alarm is set again only when it would ring too late, so while
    answers keep coming one alarm serves many waits (one that rings early just wakes the reader to check).
    """

    __slots__ = ("items", "waiter", "alarm", "alarm_at", "closed")

    def __init__(self) -> None:
        self.items: deque[Answer] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.alarm: asyncio.TimerHandle | None = None
        self.alarm_at = 0.0
        self.closed = False

    def put(self, item: Answer) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, loop: asyncio.AbstractEventLoop, wake_in_s: float) -> None:
        """Until an answer comes or about wake_in_s have passed (maybe sooner: the caller checks why it woke)."""
        wake_at = loop.time() + wake_in_s
        if self.alarm is None or self.alarm_at > wake_at:
            if self.alarm is not None:
                self.alarm.cancel()
            self.alarm = loop.call_at(wake_at, self._ring)
            self.alarm_at = wake_at
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        """The call is over: no alarm left behind, and a reader still waiting is woken to find that out."""
        self.closed = True
        if self.alarm is not None:
            self.alarm.cancel()
            self.alarm = None
        self._ring()

    def _ring(self) -> None:
        self.alarm = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class AsyncTransport:
    def __init__(self, address: str, resend_after_s: float, curve: CurveClient | None = None,
                 connect_timeout_s: float = calls.CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.resend_after_s = resend_after_s
        self.connect_timeout_s = connect_timeout_s
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket = self._context.socket(zmq.DEALER)
        self._watch = connect_client(self._context, self._socket, address, curve)
        self._release = weakref.finalize(self, _dropped, self._context, [self._watch.pair, self._socket], address)
        self._mail: dict[str, Mailbox] = {}
        self.orphans = calls.Orphans()
        self._reader: asyncio.Task[None] | None = None
        self._heard = False  # the broker has answered once: its handshake succeeded
        self.closed = False

    def start(self, request: p.Message) -> Call:
        if self.closed:
            raise ClientError("the client is closed")
        if self._reader is None or self._reader.done():  # (the loop it ran on ended: asyncio.run returned)
            self._reader = asyncio.get_running_loop().create_task(_read(self._socket, weakref.ref(self)))
        call = Call.of(request, time.monotonic(), self.resend_after_s)
        self._send(call.frames)
        self._mail[call.request_id] = Mailbox()  # once sent (no await between): a send that failed leaves none
        return call

    async def next(self, call: Call, timeout_s: float) -> Answer:
        """The call's next answer (one reader per call); resends on schedule; Timeout after timeout_s of silence,
        BrokerUnreachable when the client never reached a broker within connect_timeout_s."""
        box = self._mail[call.request_id]
        if not box.items:
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + timeout_s
            while not box.items:
                if box.closed:
                    raise ClientError("the client is closed" if self.closed else "the call was closed while waiting")
                now = time.monotonic()
                if now >= deadline:
                    raise timed_out(self._watch, self.address, timeout_s, call.request_id)
                error = unreachable(self._watch, self.address, call, now, self.connect_timeout_s)
                if error is not None:
                    raise error
                wait_s = min(call.wake_at(deadline), connect_wake_at(self._watch, call, self.connect_timeout_s)) - now
                if not self._heard:  # a refused handshake is said at once, not after the timeout
                    if self._watch.refused():
                        raise Unauthorized(HANDSHAKE_REFUSED, request_id=call.request_id)
                    wait_s = min(wait_s, REFUSAL_CHECK_S)
                if call.resend_due(now):
                    self.resend(call)
                    call.resent(now)
                await box.wait(loop, wait_s)
        call.heard(time.monotonic())
        return box.items.popleft()

    def resend(self, call: Call) -> None:
        """Send the call's request again (a stream's says where to resume it)."""
        log.debug("request_resent", request=call.request_id, resume=call.resume)
        self._send(call.resend_frames())

    def finish(self, call: Call) -> None:
        box = self._mail.pop(call.request_id, None)
        if box is not None:
            box.close()

    def oneway(self, request: p.Message) -> None:
        if not self.closed:
            self._send(p.encode(request))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for box in self._mail.values():
            box.close()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        if self._release.detach() is not None:  # closed, not dropped: no ResourceWarning
            release(self._context, [self._watch.pair, self._socket])

    def _send(self, frames: list[bytes]) -> None:
        # NOBLOCK sends now: the future is done already, and a full queue is its exception (zmq.Again), not a raise.
        sent = cast("asyncio.Future[Any]", self._socket.send_multipart(frames, zmq.NOBLOCK))
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.Again):
            raise send_failed(self._watch, self.address) from error
        if error is not None:
            raise error

    def _sort(self, frames: list[bytes]) -> None:
        """One message from the broker into its calls' mailboxes (an answer nobody waits for to the orphans)."""
        self._heard = True
        for request_id, item in addressed(decode_answer(frames)):
            box = self._mail.get(request_id)
            if box is not None:
                box.put(item)
            else:
                self.orphans.answered(request_id, item, self.oneway)


async def _read(sock: zmq.asyncio.Socket, owner: weakref.ref[AsyncTransport]) -> None:
    """The reader task: sorts the socket's messages into the transport's mailboxes.

    It holds the transport only while it sorts a message, never while it waits: the event loop holds this task (the
    socket's pending read), so a transport the task kept would live as long as the loop, socket and all. Dropped,
    the transport is collected, and its finalizer closes the socket, which cancels the read and ends this task."""
    while True:
        frames = await sock.recv_multipart()
        transport = owner()
        if transport is None:
            return
        transport._sort(frames)
        del transport


def _dropped(context: zmq.asyncio.Context, sockets: list[zmq.Socket[Any]], address: str) -> None:
    """The finalizer of a transport collected (or left at exit) unclosed: release it, then say so, as asyncio does
    for an unclosed transport (a ResourceWarning: silent unless warnings are enabled, e.g. `python -X dev`)."""
    release(context, sockets)
    warnings.warn(f"unclosed AsyncClient for {address}: close() it, or use `async with`", ResourceWarning,
                  stacklevel=1)


class AsyncClient:
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float = calls.DEFAULT_TIMEOUT_S,
        resend_after: float = calls.RESEND_AFTER_S,
        broker_key: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        connect_timeout: float = calls.CONNECT_TIMEOUT_S,
    ) -> None:
        """`broker_key`, `key`: with a broker that authenticates (`broker start --keys`), the broker's public key
        file and this client's key pair file (NAME.key_secret, from `broker keygen`). `connect_timeout`: a call
        raises BrokerUnreachable after this many seconds when the client has never reached a broker.

        close() (or leaving the `async with` block) releases the socket and ends the reader task. An AsyncClient
        nobody references any more, unclosed, is released when it is collected (at once in CPython, while its event
        loop runs on), with a ResourceWarning as for asyncio's unclosed transports; its streams and sessions hold
        it."""
        self.address = address
        self.timeout = timeout
        self._transport = AsyncTransport(address, resend_after, CurveClient.from_files(broker_key, key),
                                         connect_timeout)

    def session(self, model: str | None = None, *, timeout: float | None = None) -> SessionOpening:
        """A new session on the least-loaded worker serving `model` (None: any model): `await client.session()`,
        or `async with client.session() as s:`, which closes it at the end of the block."""
        return SessionOpening(self._open_session(model, timeout))

    async def _open_session(self, model: str | None, timeout: float | None) -> AsyncSession:
        request = build(p.CreateSession, request_id=new_request_id(), model=model)
        created = await self._call(request, p.Created, timeout)
        return AsyncSession(self, created.session_id, model=created.model, worker=created.worker,
                            max_context=created.max_context, takes_from_start=created.from_start)

    def attach(self, session_id: str) -> AsyncSession:
        if not p.is_session_id(session_id):
            raise BadRequest(f"not a session id: {session_id!r}")
        return AsyncSession(self, session_id)

    async def status(self, *, timeout: float | None = None) -> list[WorkerInfo]:
        report = await self._call(p.Status(request_id=new_request_id()), p.StatusReport, timeout)
        return calls.worker_infos(report)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, request: p.Message, kind: type[M], timeout: float | None) -> M:
        return await self._answer(self._transport.start(request), kind, timeout)

    async def _answer(self, call: Call, kind: type[M], timeout: float | None) -> M:
        try:
            answer = await self._transport.next(call, self._timeout(timeout))
        except BaseException:  # a Timeout, the task cancelled
            self._transport.orphans.given_up(call, self._transport.oneway)
            raise
        finally:
            self._transport.finish(call)
        return calls.expect(answer, kind)

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout


class AsyncSession:
    def __init__(
        self, client: AsyncClient, session_id: str, *, model: str = "", worker: str = "", max_context: int = 0,
        takes_from_start: bool | None = None,
    ) -> None:
        self.client = client
        self.id = session_id
        self.model = model
        self.worker = worker
        self.max_context = max_context
        self.takes_from_start = takes_from_start  # its worker takes generate(from_start=True) (None: not known)

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r}, worker={self.worker!r})"

    async def append(
        self, text: str | None = None, *, token_ids: Sequence[int] | None = None, boundary_check: bool = False,
        timeout: float | None = None,
    ) -> int:
        request = build(p.Append, request_id=new_request_id(), session_id=self.id,
                        token_ids=None if token_ids is None else items("token_ids", token_ids), text=text,
                        boundary_check=boundary_check)
        return (await self.client._call(request, p.Appended, timeout)).length

    async def append_chat(self, content: str, *, role: str = "user", timeout: float | None = None) -> int:
        request = build(p.Chat, request_id=new_request_id(), session_id=self.id, content=content, role=role)
        return (await self.client._call(request, p.Appended, timeout)).length

    @overload
    async def chat(self, content: str, *, role: str = ..., max_tokens: int = ..., temperature: float = ...,
                   top_p: float = ..., top_k: int = ..., seed: int | None = ...,
                   stop: str | Sequence[str] | None = ..., stop_token_ids: Sequence[int] = ...,
                   ignore_eos: bool = ..., stream: Literal[False] = ...,
                   chat_template_kwargs: Mapping[str, Any] | None = ..., timeout: float | None = ...) -> Generation: ...
    @overload
    async def chat(self, content: str, *, role: str = ..., max_tokens: int = ..., temperature: float = ...,
                   top_p: float = ..., top_k: int = ..., seed: int | None = ...,
                   stop: str | Sequence[str] | None = ..., stop_token_ids: Sequence[int] = ...,
                   ignore_eos: bool = ..., stream: Literal[True],
                   chat_template_kwargs: Mapping[str, Any] | None = ..., timeout: float | None = ...) -> AsyncStream: ...

    async def chat(
        self, content: str, *, role: str = "user", max_tokens: int = 256, temperature: float = 0.0,
        top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, stream: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None, timeout: float | None = None,
    ) -> Generation | AsyncStream:
        """One chat turn and the assistant's answer in one request: if any part is refused, nothing changes."""
        params = calls.sampling(max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos)
        request = calls.generate_request(self.id, params, stream, messages=[{"role": role, "content": content}],
                                         chat_template_kwargs=chat_template_kwargs)
        return await self._send_generate(request, timeout)

    @overload
    async def generate(self, max_tokens: int = ..., temperature: float = ..., top_p: float = ..., top_k: int = ...,
                       seed: int | None = ..., stop: str | Sequence[str] | None = ...,
                       stream: Literal[False] = ..., *, stop_token_ids: Sequence[int] = ...,
                       ignore_eos: bool = ..., prompt: str | None = ..., boundary_check: bool = ..., from_start: bool = ...,
                       prompt_ids: Sequence[int] | None = ..., messages: Sequence[Mapping[str, Any]] | None = ...,
                       chat_template_kwargs: Mapping[str, Any] | None = ...,
                       tools: Sequence[Mapping[str, Any]] | None = ..., logprobs: int | None = ...,
                 logit_bias: Mapping[int, float] | None = ...,
                 repetition_penalty: float = ..., frequency_penalty: float = ..., presence_penalty: float = ...,
                 min_p: float = ..., min_tokens: int = ...,
                 timeout: float | None = ...) -> Generation: ...
    @overload
    async def generate(self, max_tokens: int = ..., temperature: float = ..., top_p: float = ..., top_k: int = ...,
                       seed: int | None = ..., stop: str | Sequence[str] | None = ..., *,
                       stream: Literal[True], stop_token_ids: Sequence[int] = ...,
                       ignore_eos: bool = ..., prompt: str | None = ..., boundary_check: bool = ..., from_start: bool = ...,
                       prompt_ids: Sequence[int] | None = ..., messages: Sequence[Mapping[str, Any]] | None = ...,
                       chat_template_kwargs: Mapping[str, Any] | None = ...,
                       tools: Sequence[Mapping[str, Any]] | None = ..., logprobs: int | None = ...,
                 logit_bias: Mapping[int, float] | None = ...,
                 repetition_penalty: float = ..., frequency_penalty: float = ..., presence_penalty: float = ...,
                 min_p: float = ..., min_tokens: int = ...,
                 timeout: float | None = ...) -> AsyncStream: ...

    async def generate(
        self, max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        seed: int | None = None, stop: str | Sequence[str] | None = None, stream: bool = False, *,
        stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, prompt: str | None = None,
        boundary_check: bool = False, from_start: bool = False,
        prompt_ids: Sequence[int] | None = None, messages: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
        logprobs: int | None = None, logit_bias: Mapping[int, float] | None = None, repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0, min_p: float = 0.0, min_tokens: int = 0, timeout: float | None = None,
    ) -> Generation | AsyncStream:
        params = calls.sampling(max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, logprobs,
                                logit_bias=logit_bias, repetition_penalty=repetition_penalty,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, min_p=min_p,
                                min_tokens=min_tokens)
        request = calls.generate_request(self.id, params, stream, prompt, prompt_ids, messages, boundary_check,
                                         chat_template_kwargs, from_start, tools)
        return await self._send_generate(request, timeout)

    async def _send_generate(self, request: p.Generate, timeout: float | None) -> Generation | AsyncStream:
        chat = bool(request.messages) and not request.from_start  # (which may append nothing)
        if not request.stream:
            return calls.generation(await self.client._call(request, p.Generated, timeout), chat, request.from_start)
        transport = self.client._transport
        return AsyncStream(transport, transport.start(request), self.id, self.client._timeout(timeout), chat,
                     request.from_start)

    async def fork(self, *, timeout: float | None = None) -> AsyncSession:
        request = build(p.Fork, request_id=new_request_id(), session_id=self.id)
        forked = await self.client._call(request, p.Forked, timeout)
        return AsyncSession(self.client, forked.child_id, model=self.model, worker=forked.worker,
                            max_context=self.max_context, takes_from_start=forked.from_start)

    async def info(self, *, timeout: float | None = None) -> SessionInfo:
        request = build(p.Info, request_id=new_request_id(), session_id=self.id)
        return calls.session_info(await self.client._call(request, p.SessionInfo, timeout))

    async def close(self, *, timeout: float | None = None) -> None:
        await self._closed(self._send_close(), timeout)

    def close_soon(self, *, timeout: float | None = None) -> asyncio.Task[None]:
        """Send the close now and return without waiting for its answer: a task that ends with it (await it, or
        asyncio logs its error when it fails).

        The broker counts a session whose close is on its way as a free slot of its worker, which handles the
        close before anything sent after it: a session opened right after this call may take this one's slot,
        even on a full worker. A session already gone (not found, lost, expired) closes without an error."""
        call = self._send_close()
        return asyncio.get_running_loop().create_task(self._closed(call, timeout))

    def _send_close(self) -> Call:
        return self.client._transport.start(build(p.Close, request_id=new_request_id(), session_id=self.id))

    async def _closed(self, call: Call, timeout: float | None) -> None:
        try:
            await self.client._answer(call, p.Closed, timeout)
        except (SessionNotFound, SessionLost, SessionExpired):
            pass

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.client._transport.closed:
            return
        try:
            await self.close()
        except ClientError:
            if exc is None:
                raise  # otherwise the error that ended the block matters more than a failed close


class SessionOpening:
    """What AsyncClient.session() returns: await it for the session, or `async with` it to close the session at
    the end of the block."""

    def __init__(self, opening: Coroutine[Any, Any, AsyncSession]) -> None:
        self._opening = opening
        self._session: AsyncSession | None = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._opening.__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._opening
        return self._session

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._session is not None
        await self._session.__aexit__(exc_type, exc, tb)


class AsyncStream:
    """An async iterator of Chunks; the last has finish_reason set. Closing it early cancels the generation.

    Each token comes once and in order, and the chunks' texts add up to `result.text` exactly (see Stream). A read
    that times out (Timeout after `timeout` without a chunk) or is cancelled (asyncio.wait_for or asyncio.timeout
    around it, its task cancelled) closes the stream and cancels the generation; every later read raises
    StreamCancelled, never a quiet end. Closed by its caller (close(), aclose(), `async with`), it ends quietly. To
    look whether a chunk is there without waiting for it, use `ready`, not a read with a short timeout.

    As with Stream, an `async for` left early cancels the generation at once only when nothing else refers to the
    stream; one kept in a variable generates on until close(), or use `async with`."""

    def __init__(self, transport: AsyncTransport, call: Call, session_id: str, timeout_s: float,
                 chat: bool = False, from_start: bool = False) -> None:
        self._transport = transport
        self._call = call
        self._session_id = session_id
        self._timeout_s = timeout_s
        self._state = calls.StreamState(call, chat, from_start)
        self._open = True

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if not self._open:
            raise self._state.closed_error(self._call.request_id) or StopAsyncIteration
        while True:
            try:
                message = await self._transport.next(self._call, self._timeout_s)
            except (Timeout, asyncio.CancelledError) as e:
                # Nobody reads the rest (the gateway cancels a departed client's reads): stop the generation now.
                self.close()
                self._state.cut_off("timed out" if isinstance(e, Timeout) else "was cancelled")
                raise
            try:
                chunk = self._state.take(message)
            except ClientError:
                self._end()
                raise
            if chunk is not None:
                break
            if self._state.ask(time.monotonic(), self._transport.resend_after_s):  # a gap: ask for what is missing
                self._transport.resend(self._call)
        if chunk.finish_reason is not None:
            self._end()
        return chunk

    @property
    def result(self) -> Generation | None:
        return self._state.result

    @property
    def ready(self) -> bool:
        """Whether the next chunk has arrived already (the next read will not wait): a consumer that falls behind
        may read on and pass several chunks on as one."""
        box = self._transport._mail.get(self._call.request_id)
        return self._open and box is not None and bool(box.items)

    def close(self) -> None:
        """Stop reading; a generation still running is cancelled (CANCEL is sent at once, no await needed). Later
        reads end the iteration (StopAsyncIteration); a stream a read gave up on already stays cut off."""
        if self._open:
            self._end()
            cancel = self._call.cancel()
            if cancel is not None:
                self._transport.oneway(cancel)

    async def aclose(self) -> None:
        self.close()

    def _end(self) -> None:
        self._open = False
        self._transport.finish(self._call)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
