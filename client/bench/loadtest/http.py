"""The HTTP driver: the same users, through the gateway's OpenAI API (`loadtest --http URL`).

A conversation is a `session_id` of the gateway; each turn POSTs /v1/completions with the whole conversation so
far (as OpenAI clients resend their history: the earlier prompts and the generated tokens, then the new prompt),
streamed, with `return_token_ids` (to count tokens per chunk as the native driver does) and
`stream_options.include_usage` (the prompt tokens). The gateway resumes the named session and appends only the new
prompt, so the work on the workers is the native run's. Closing a conversation is DELETE /v1/sessions/ID.
A turn that ended on EOS leaves the session with a token the client's history lacks: its next turn starts a new
session (the whole history prefilled again), which --ignore-eos avoids. A run stopped early (interrupt.py) drops
the connections of its turns in flight, and the gateway cancels their generations; their sessions are deleted as
any other (the gateway closes one still ending once its turn has ended).

Each user holds one HTTP/1.1 connection (kept alive), so a gateway running several processes sees each
conversation on one of them. The HTTP client is a small one on asyncio streams (no dependency, little overhead
per chunk): requests with Content-Length, answers with Content-Length or chunked, server-sent events read as
they come.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
import structlog

from client.bench.loadtest.interrupt import StopFlag
from client.bench.loadtest.progress import Tally
from client.bench.loadtest.stats import INTERRUPTED, RawRun, RequestSample
from client.bench.loadtest.workload import Budget, Close, Create, Failed, Fork, Opened, Script, Turn, TurnDone, user

log = structlog.get_logger()

MAX_HEADER_BYTES = 64 << 10


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code


class Connection:
    """One kept-alive HTTP/1.1 connection to the gateway."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--http takes http://HOST:PORT, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base = parts.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout)
        assert self._reader is not None and self._writer is not None
        return self._reader, self._writer

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], asyncio.StreamReader]:
        reader, writer = await self._open()
        data = b"" if body is None else orjson.dumps(body)
        head = [f"{method} {self.base}{path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout)
        if len(raw) > MAX_HEADER_BYTES:
            raise HttpError(0, "bad_response", "response headers too large")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        return status, headers, reader

    async def body(self, headers: dict[str, str], reader: asyncio.StreamReader) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return b"".join([part async for part in self.chunks(reader)])
        return await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), self.timeout)

    async def chunks(self, reader: asyncio.StreamReader) -> Any:
        """The pieces of a chunked body as they arrive."""
        while True:
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), self.timeout)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await asyncio.wait_for(reader.readexactly(size + 2), self.timeout)
            yield data[:-2]

    def abort(self) -> None:
        """Drop the connection now (no await): a read waiting on it ends with IncompleteReadError."""
        if self._writer is not None:
            self._writer.transport.abort()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = None
            try:
                await self._writer.wait_closed()
            except OSError:
                pass


def _error(status: int, body: bytes) -> HttpError:
    try:
        error = json.loads(body)["error"]
        return HttpError(status, str(error.get("code") or error.get("type")), str(error.get("message")))
    except (ValueError, KeyError, TypeError):
        return HttpError(status, f"http_{status}", body[:200].decode(errors="replace"))


@dataclass
class Conversation:
    """The driver's handle of a session: the gateway's session_id and the history the client resends."""

    session_id: str
    ids: list[int] = field(default_factory=list)
    text: str = ""


class HttpDriver:
    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float, raw: RawRun, tally: Tally,
                 max_context: int) -> None:
        self.url = url
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.raw = raw
        self.tally = tally
        self.max_context = max_context
        self._served_context: int | None = None  # the model's max_model_len in the gateway's GET /v1/models
        self.turning: set[Connection] = set()  # the connections of the turns in flight
        self.stopping = False

    def stop(self) -> None:
        """Stop the run (interrupt.py): the turns in flight are cut short (their connections dropped: the gateway
        cancels their generations) and no action but a close is sent any more, so the users close their sessions
        and end."""
        if self.stopping:
            return
        self.stopping = self.raw.interrupted = True
        for conn in list(self.turning):
            conn.abort()

    async def run_user(self, script: Script) -> None:
        conn = Connection(self.url, self.api_key, self.timeout)
        try:
            value: Any = None
            error: Failed | None = None
            while True:
                try:
                    action = script.throw(error) if error is not None else script.send(value)
                except StopIteration:
                    return
                value, error = None, None
                if self.stopping and not isinstance(action, Close):
                    error = Failed(INTERRUPTED)  # not sent
                    continue
                try:
                    value = await self._act(conn, action)
                except Failed as e:
                    error = e
        finally:
            await conn.close()

    async def _act(self, conn: Connection, action: Any) -> Any:
        if isinstance(action, Create):  # the gateway opens the session with the conversation's first turn
            return Opened(Conversation(uuid.uuid4().hex), await self._context(conn))
        if isinstance(action, Turn):
            return await self._turn(conn, action)
        if isinstance(action, Close):
            start = time.perf_counter()
            try:
                status, headers, reader = await conn.request("DELETE", f"/v1/sessions/{action.session.session_id}")
                body = await conn.body(headers, reader)
                if status not in (200, 404):  # 404: the session was never kept (e.g. its last turn failed)
                    raise _error(status, body)
            except (HttpError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                await conn.close()
                self.raw.op_failed("close", _code(e))
                raise Failed(_code(e)) from e
            self.raw.op("close", time.perf_counter() - start)
            return None
        assert isinstance(action, Fork)
        raise Failed("fork_unsupported")

    async def _context(self, conn: Connection) -> int:
        """The tokens a conversation can hold: the gateway's `max_model_len` for the model (asked once, by the first
        user that opens one), or --max-context when the gateway does not say."""
        if self._served_context is None:
            try:
                status, headers, reader = await conn.request("GET", "/v1/models")
                body = await conn.body(headers, reader)
                if status != 200:
                    return self.max_context  # asked again by the next conversation
                self._served_context = model_context(json.loads(body)["data"], self.model)
            except (HttpError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError,
                    TypeError):
                await conn.close()
                return self.max_context
        return self._served_context or self.max_context

    async def _turn(self, conn: Connection, turn: Turn) -> TurnDone:
        conv: Conversation = turn.session
        sample = RequestSample(start=time.perf_counter(), forked=turn.forked, opened=not conv.ids and not conv.text)
        self.raw.requests.append(sample)
        p = turn.params
        prompt: Any
        if turn.prompt.token_ids is not None:
            prompt = conv.ids + turn.prompt.token_ids
        else:
            prompt = conv.text + (turn.prompt.text or "")
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": p.max_tokens,
                                "temperature": p.temperature, "stream": True, "stream_options": {"include_usage": True},
                                "session_id": conv.session_id, "return_token_ids": True, "ignore_eos": p.ignore_eos}
        if p.seed is not None:
            body["seed"] = p.seed
        new_ids: list[int] = []
        new_text: list[str] = []
        usage: dict[str, Any] = {}
        self.turning.add(conn)
        try:
            status, headers, reader = await conn.request("POST", "/v1/completions", body)
            if status != 200:
                raise _error(status, await conn.body(headers, reader))
            buffer = b""
            async for piece in conn.chunks(reader):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    data = orjson.loads(event[6:])
                    if "error" in data:
                        raise HttpError(200, str(data["error"].get("code")), str(data["error"].get("message")))
                    if data.get("usage"):
                        usage = data["usage"]
                    for choice in data.get("choices", ()):
                        ids = choice.get("token_ids") or []
                        if ids:
                            sample.chunk_times.append(time.perf_counter())
                            sample.chunk_tokens.append(len(ids))
                            self.tally.output_tokens += len(ids)
                            new_ids += ids
                        new_text.append(choice.get("text") or "")
        except (HttpError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            await conn.close()
            sample.end = time.perf_counter()
            if self.stopping:  # its connection was dropped under it
                sample.error = INTERRUPTED
                raise Failed(INTERRUPTED) from e
            sample.error = _code(e)
            self.tally.failed += 1
            raise Failed(sample.error) from e
        finally:
            self.turning.discard(conn)
        sample.end = time.perf_counter()
        self.tally.done += 1
        if turn.prompt.token_ids is not None:
            conv.ids = prompt + new_ids
        else:
            conv.text = prompt + "".join(new_text)
        prompt_tokens = int(usage.get("prompt_tokens", 0))
        sample.prompt_tokens = prompt_tokens - turn.length if prompt_tokens > turn.length else prompt_tokens
        return TurnDone(prompt_tokens + len(new_ids), sample.prompt_tokens)


def served_model(url: str, api_key: str | None, timeout: float) -> str:
    """The first model the gateway lists (GET /v1/models); LoadTestError when it does not answer."""
    from client.bench.loadtest.stack import LoadTestError

    async def ask() -> str:
        conn = Connection(url, api_key, timeout)
        try:
            status, headers, reader = await conn.request("GET", "/v1/models")
            body = await conn.body(headers, reader)
            if status != 200:
                raise _error(status, body)
            models = [m["id"] for m in json.loads(body)["data"]]
            if not models:
                raise HttpError(503, "no_worker", "the gateway lists no model")
            return str(models[0])
        finally:
            await conn.close()

    try:
        return asyncio.run(ask())
    except (HttpError, OSError, asyncio.TimeoutError, ValueError, KeyError) as e:
        raise LoadTestError(f"no gateway answers at {url}: {e}") from e


def model_context(models: list[Any], model: str | None) -> int:
    """`max_model_len` of `model` (or of the first model) in a GET /v1/models list; 0 when not there."""
    for m in models:
        if model is None or str(m["id"]).casefold() == model.casefold():
            context = m.get("max_model_len")
            return context if isinstance(context, int) and context > 0 else 0
    return 0


def _code(e: BaseException) -> str:
    if isinstance(e, HttpError):
        return e.code
    if isinstance(e, asyncio.TimeoutError):
        return "timeout"
    return "connection_error"


async def run_http_part(url: str, model: str | None, api_key: str | None, timeout: float, workload: Any, first: int,
                        count: int, requests: int | None, duration: float | None, start: float | None, tally: Tally,
                        on_progress: Any, stop: StopFlag | None = None) -> RawRun:
    """One process's users [first, first + count) against the gateway, until the budget is spent or `stop` is set."""
    from client.bench.loadtest.stack import tick

    raw = RawRun(start=time.perf_counter() if start is None else start)
    budget = Budget(requests, duration)
    budget.begin(raw.start)
    scripts = [user(i, workload, budget, raw.counts) for i in range(first, first + count)]
    driver = HttpDriver(url, model, api_key, timeout, raw, tally, workload.max_context)
    ticker = asyncio.create_task(tick(on_progress, stop, driver.stop))
    try:
        await asyncio.gather(*(driver.run_user(s) for s in scripts))
    finally:
        ticker.cancel()
    raw.finish = time.perf_counter()
    return raw
