"""Where a streamed turn's time to first token goes through the HTTP gateway, stage by stage, beside the native client.

    python -m client.bench.gateway_ttft [--model random:tiny] [--rounds 120] [--prompt-tokens 128] [--max-tokens 8]
                                        [--turns 4] [--endpoint completions|chat] [--processes 1] [--untraced]

Starts a broker, one worker and a gateway on loopback. Each round plays one turn of a conversation twice, one after
the other (the order alternates): through the native AsyncClient (GENERATE streamed, the turn's new prompt appended)
and through the gateway as `loadtest --http` sends it (POST /v1/completions, the whole conversation resent with its
session_id, streamed, `return_token_ids`, `stream_options.include_usage`; or POST /v1/chat/completions with the
messages). Conversations last --turns turns, then both are closed and new ones begin: the native session is opened
outside the timed turn (as the load test's native driver does), the gateway's inside its first turn (it has no other
way to know of it). The time to first token is from just before the request is written to the first event that
carries a token. The worker is the same for both and given the same work: its time cancels in the difference.

The gateway runs with a tracer (this module's `serve`, unless --untraced) that stamps, on the one monotonic clock the
processes of a host share, when each stage of the request ends:

    http_in        client write -> the ASGI app called (loopback, uvicorn's read and parse, the event loop's turn)
    body           the body read and json.loads
    validate       pydantic validation (schema.parse)
    ask            the request made into an Ask (history turned into a tuple, chat digests)
    session        the live session found (models.check, the store) or opened (a CREATE round trip)
    send           GENERATE built and sent
    broker         GENERATE sent -> its first chunk back (the broker, the worker: what the native client pays too)
    response       first chunk -> http.response.start sent (the response object, the handler's metrics; since
                   EventStream, the first event's encoding too: it is made before the status line goes out)
    first_body     -> the first body chunk handed to uvicorn (the headers' write; before EventStream, Starlette's task
                   group, the event generator and the SSE encoding)
    write          uvicorn's write of it
    http_out       -> the client has read and parsed the event (loopback, chunked decoding, json.loads)

Prints JSON: per turn index (1 = a new conversation), p50 of native and gateway TTFT and of their difference, and
the p50 of every stage; `--untraced` runs the gateway as `gateway start` does (the numbers to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from client.aio import AsyncClient, AsyncSession
from client.bench.gateway_overhead import gateway_model
from client.bench.loadtest.http import Connection
from client.stack import Daemon, LocalStack, free_port

TRACE_ENV = "GATEWAY_TTFT_TRACE"  # where the traced gateway appends its stamps, one JSON line a request
BENCH_HEADER = "x-bench-id"
STAGES = ("http_in", "body", "validate", "ask", "session", "send", "broker", "response", "first_body", "write", "http_out")
_MARKS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("gateway_ttft_marks", default=None)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


# -- the traced gateway (its own process) --------------------------------------------------------------------------


def _mark(name: str) -> None:
    marks = _MARKS.get()
    if marks is not None and name not in marks:
        marks[name] = time.perf_counter()


class Traced:
    """ASGI middleware: a request with the bench's header gets its stamps, written to TRACE_ENV's file at its end."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        self.state = app.state
        self.path = path

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        bench_id = next((v.decode() for k, v in scope.get("headers", ()) if k == BENCH_HEADER.encode()), None)
        if scope["type"] != "http" or bench_id is None:
            await self.app(scope, receive, send)
            return
        marks = {"app": time.perf_counter()}
        _MARKS.set(marks)

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                _mark("response")
            elif message["type"] == "http.response.body" and message.get("body") and "first_body" not in marks:
                _mark("first_body")
                await send(message)
                _mark("write")
                return
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            with open(self.path, "a") as f:
                f.write(json.dumps({"id": bench_id, **marks}) + "\n")


def _after(owner: Any, name: str, stage: str) -> None:
    fn = getattr(owner, name)

    if asyncio.iscoroutinefunction(fn):
        async def awrapped(*args: Any, **kwargs: Any) -> Any:
            out = await fn(*args, **kwargs)
            _mark(stage)
            return out
        setattr(owner, name, awrapped)
    else:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            _mark(stage)
            return out
        setattr(owner, name, wrapped)


def install() -> None:
    """The tracer, into this process's gateway modules."""
    from client.gateway import app, schema, service

    path = os.environ[TRACE_ENV]
    create_app = app.create_app

    def traced_app(config: Any) -> Any:
        return Traced(create_app(config), path)

    app.create_app = traced_app
    _after(app, "_json", "body")
    _after(schema, "parse", "validate")
    _after(app, "chat_ask", "ask")
    _after(app, "completion_ask", "ask")
    _after(service.Service, "_session_for", "session")
    _after(service.Service, "_open_stream", "send")
    _after(service.Service, "stream", "broker")


def serve(argv: list[str]) -> int:
    """`gateway start ARGV` with the tracer on (in every process of --processes N: see the end of this module)."""
    from client.gateway import cli

    install()
    return cli.main(["start", *argv])


# -- the bench ------------------------------------------------------------------------------------------------------


class HttpConversation:
    """One conversation through the gateway, resent whole each turn (as `loadtest --http` and OpenAI clients do)."""

    def __init__(self, url: str, model: str, chat: bool) -> None:
        self.conn = Connection(url, None, 60)
        self.model = model
        self.chat = chat
        self.name = uuid.uuid4().hex
        self.ids: list[int] = []
        self.messages: list[dict[str, str]] = []

    async def turn(self, prompt_ids: list[int], text: str, max_tokens: int, bench_id: str) -> tuple[float, float]:
        """(request written at, first token read at)."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}, "session_id": self.name,
                                "return_token_ids": True, "ignore_eos": True}
        if self.chat:
            body["messages"] = [*self.messages, {"role": "user", "content": text}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = self.ids + prompt_ids
            path = "/v1/completions"
        self.conn.api_key = None
        start = time.perf_counter()
        status, headers, reader = await self._request(path, body, bench_id)
        assert status == 200, (await self.conn.body(headers, reader))[:300]
        first = 0.0
        new_ids: list[int] = []
        texts: list[str] = []
        buffer = b""
        async for piece in self.conn.chunks(reader):
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: {"):
                    continue
                for choice in json.loads(event[6:]).get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids and not first:
                        first = time.perf_counter()
                    new_ids += ids
                    texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        if self.chat:
            self.messages = [*body["messages"], {"role": "assistant", "content": "".join(texts)}]
        else:
            self.ids = body["prompt"] + new_ids
        return start, first

    async def _request(self, path: str, body: dict[str, Any], bench_id: str) -> Any:
        # Connection.request with one more header: the id the tracer files the stamps under.
        reader, writer = await self.conn._open()
        data = json.dumps(body, separators=(",", ":")).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.conn.host}:{self.conn.port}\r\nContent-Length: {len(data)}\r\n"
                f"Content-Type: application/json\r\n{BENCH_HEADER}: {bench_id}\r\n\r\n").encode()
        writer.write(head + data)
        await writer.drain()
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        return status, headers, reader

    async def close(self) -> None:
        status, headers, reader = await self.conn.request("DELETE", f"/v1/sessions/{self.name}")
        await self.conn.body(headers, reader)
        await self.conn.close()


async def native_turn(session: AsyncSession, prompt_ids: list[int], text: str, max_tokens: int,
                      chat: bool) -> tuple[float, float]:
    start = time.perf_counter()
    if chat:
        stream = await session.generate(max_tokens=max_tokens, ignore_eos=True, stream=True,
                                        messages=[{"role": "user", "content": text}])
    else:
        stream = await session.generate(max_tokens=max_tokens, ignore_eos=True, stream=True, prompt_ids=prompt_ids)
    first = 0.0
    async for chunk in stream:
        if chunk.token_ids and not first:
            first = time.perf_counter()
    return start, first


async def run(address: str, url: str, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from his her they this be are".split()
    rows: list[dict[str, Any]] = []
    chat = args.endpoint == "chat"
    async with AsyncClient(address, timeout=60) as client:
        session: AsyncSession | None = None
        conv: HttpConversation | None = None
        for r in range(args.rounds + args.warmup):
            k = r % args.turns
            if k == 0:
                if session is not None and conv is not None:
                    await session.close()
                    await conv.close()
                session = await client.session(model)
                conv = HttpConversation(url, model, chat)
            assert session is not None and conv is not None
            ids = [rng.randrange(1, 500) for _ in range(args.prompt_tokens)]
            text = " ".join(rng.choice(words) for _ in range(args.prompt_tokens))
            bench_id = uuid.uuid4().hex
            if r % 2:
                n0, n1 = await native_turn(session, ids, text, args.max_tokens, chat)
                g0, g1 = await conv.turn(ids, text, args.max_tokens, bench_id)
            else:
                g0, g1 = await conv.turn(ids, text, args.max_tokens, bench_id)
                n0, n1 = await native_turn(session, ids, text, args.max_tokens, chat)
            if r >= args.warmup:
                rows.append({"id": bench_id, "turn": k + 1, "native": n1 - n0, "gateway": g1 - g0, "sent": g0,
                             "first": g1})
        if session is not None and conv is not None:
            await session.close()
            await conv.close()
    return rows


def stages(row: dict[str, Any], marks: dict[str, float]) -> dict[str, float]:
    """Each stage's duration, from the stamps: a stage missing (not on this request's path) is 0."""
    points = [row["sent"], marks["app"]]
    names = ["http_in"]
    for name in STAGES[1:-1]:
        if name in marks:
            points.append(marks[name])
            names.append(name)
    points.append(row["first"])
    names.append("http_out")
    out = dict.fromkeys(STAGES, 0.0)
    out.update({n: b - a for n, a, b in zip(names, points[:-1], points[1:], strict=True)})
    return out


def p50_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3) if values else 0.0


def summary(rows: list[dict[str, Any]], trace: dict[str, dict[str, float]]) -> dict[str, Any]:
    def part(selected: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": len(selected),
            "native_ttft_ms_p50": p50_ms([r["native"] for r in selected]),
            "gateway_ttft_ms_p50": p50_ms([r["gateway"] for r in selected]),
            "added_ms_p50": p50_ms([r["gateway"] - r["native"] for r in selected]),
            "added_ms_p90": round(sorted(r["gateway"] - r["native"] for r in selected)[int(0.9 * (len(selected) - 1))] * 1e3, 3)
            if selected else 0.0,
        }
        traced = [stages(r, trace[r["id"]]) for r in selected if r["id"] in trace]
        if traced:
            out["stage_ms_p50"] = {s: p50_ms([t[s] for t in traced]) for s in STAGES}
        return out

    result = {"all": part(rows), "first_turn": part([r for r in rows if r["turn"] == 1]),
              "later_turns": part([r for r in rows if r["turn"] > 1])}
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "start" and TRACE_ENV in os.environ:  # the traced gateway (Daemon)
        sys.exit(serve(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:tiny", help="the worker's model (chat needs one with a chat template)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="new prompt tokens each turn (chat: words)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="turns of a conversation")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--processes", type=int, default=1, help="gateway start --processes")
    ap.add_argument("--untraced", action="store_true", help="run the gateway as `gateway start` (no stamps)")
    args = ap.parse_args()
    with LocalStack(heartbeats=None) as stack:
        stack.start_broker()
        stack.start_worker("w1", model=args.model, device=args.device, max_sessions=8, max_context=4096)
        stack.wait_for_workers({"w1"}, timeout=300)
        port = free_port()
        trace_path = stack.log_dir / "gateway-ttft-trace.jsonl"
        gw_args = ["--broker", stack.clients, "--port", str(port), "--log-level", "warning",
                   "--processes", str(args.processes)]
        if args.untraced:
            gw = Daemon("client.gateway.cli", gw_args, stack.log_dir / "gateway.log", env=stack.env)
        else:
            gw = Daemon("client.bench.gateway_ttft", gw_args, stack.log_dir / "gateway.log",
                        env={**stack.env, TRACE_ENV: str(trace_path)})
        url = f"http://127.0.0.1:{port}"
        model = gateway_model(url, gw)
        rows = asyncio.run(run(stack.clients, url, model, args))
        gw.stop()
    trace: dict[str, dict[str, float]] = {}
    if trace_path.exists():
        for line in Path(trace_path).read_text().splitlines():
            entry = json.loads(line)
            trace[entry.pop("id")] = entry
    print(json.dumps({"model": args.model, "endpoint": args.endpoint, "prompt_tokens": args.prompt_tokens,
                      "max_tokens": args.max_tokens, "turns": args.turns, "gateway_processes": args.processes,
                      "traced": not args.untraced, **summary(rows, trace)}, indent=2))


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and TRACE_ENV in os.environ:  # a gateway process of several, spawned by the traced one
    install()
