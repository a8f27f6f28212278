"""The HTTP routes (Starlette): OpenAI's API on top of the broker, and the daemons' health endpoints.

    GET    /v1/models                 the models the broker's live workers serve
    GET    /v1/models/{model}         one of them
    POST   /v1/chat/completions       chat, streamed or not, n choices, log-probabilities, sessions
    POST   /v1/completions            the same for a text or token-id prompt
    DELETE /v1/sessions/{session_id}  close a named session now
    GET    /metrics /healthz /readyz  as the broker's and the workers' (no API key needed)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import structlog
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from broker.common.keys import CurveClient
from client.aio import AsyncClient
from client.errors import ClientError
from client.gateway import responses, schema
from client.gateway.auth import ApiKeys
from client.gateway.errors import ApiError, bad_request, from_client_error, model_not_found, no_worker
from client.gateway.events import EventStream
from client.gateway.metrics import GatewayMetrics
from client.gateway.models import Models, Served
from client.gateway.service import Ask, Service, chat_ask, completion_ask
from client.gateway.sessions import SessionStore

log = structlog.get_logger()

JSON = "application/json"
MAX_BODY_BYTES = 16 << 20
SHUTDOWN_CLOSE_S = 5.0
T = TypeVar("T")
CLIENT_GONE = 499  # the status counted for a request whose client went away before its answer (nginx's number)


class ClientGone(Exception):
    """The HTTP client closed its connection before the answer was ready: the work for it was stopped."""


@dataclass
class GatewayConfig:
    broker: str = "tcp://127.0.0.1:5555"
    timeout: float = 60.0  # seconds to wait for each answer or streamed chunk from the broker
    broker_key: str | None = None
    key: str | None = None
    api_keys: ApiKeys | None = None
    max_idle_sessions: int = 0
    reasoning_parser: str | None = None  # qwen3, deepseek_r1 (client.gateway.reasoning): chat answers' reasoning apart
    tool_call_parser: str | None = None  # hermes, qwen3_coder, llama3_json (client.gateway.tool_calls): answers' calls


class Gateway:
    """What the routes share: the broker client, the sessions, the models, the keys, the metrics."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.keys = config.api_keys or ApiKeys.open()
        self.store = SessionStore(config.max_idle_sessions)
        self.metrics = GatewayMetrics(lambda: (self.store.idle, self.store.busy))
        self.client: AsyncClient | None = None
        self.service: Service | None = None
        self.models: Models | None = None
        self.loop_beat = time.monotonic()

    async def start(self) -> None:
        CurveClient.from_files(self.config.broker_key, self.config.key)  # a bad key file fails here, not per request
        self.client = AsyncClient(self.config.broker, timeout=self.config.timeout, broker_key=self.config.broker_key,
                                  key=self.config.key)
        self.models = Models(self.client)
        self.service = Service(self.client, self.store, self.models, self.metrics)
        served = await self.models.served(fresh=True)
        log.info("gateway_connected", broker=self.config.broker, ready=served.ready()[1])

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.shutdown(SHUTDOWN_CLOSE_S)
        if self.client is not None:
            await self.client.close()
        log.info("gateway_stopped")


def create_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        yield
        await gw.stop()

    def handler(endpoint: str, fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            start = time.perf_counter()
            gw.metrics.running.inc()
            try:
                response = await fn(request)
            except (ClientGone, ClientDisconnect):
                log.info("client_gone", endpoint=endpoint)
                response = Response(b"", CLIENT_GONE)  # nobody reads it: for the metrics
            except ApiError as e:
                if e.status >= 500:
                    log.warning("request_failed", endpoint=endpoint, status=e.status, error=e.message)
                response = Response(e.json(), e.status, headers=e.headers(), media_type=JSON)
            except Exception:
                log.exception("request_crashed", endpoint=endpoint)
                response = Response(ApiError(500, "internal error (see the gateway's log)", kind="server_error").json(),
                                    500, media_type=JSON)
            except BaseException:
                gw.metrics.running.dec()
                raise
            if isinstance(response, EventStream):  # in progress until its last event went out, or its client left
                response.on_done = lambda gone: ended(CLIENT_GONE if gone else response.status_code)
                return response
            ended(response.status_code)
            gw.metrics.duration.labels(endpoint).observe(time.perf_counter() - start)
            return response

        def ended(status: int) -> None:
            gw.metrics.running.dec()
            gw.metrics.requests.labels(endpoint, str(status)).inc()
            gw.metrics.sync_sessions()

        return handle

    async def served_models(request: Request) -> Served:
        """The live workers and their models, for a request with a valid key (503 when the broker does not answer)."""
        gw.keys.owner(request.headers.get("authorization"))
        assert gw.models is not None
        served = await gw.models.served()
        if served.error:
            raise no_worker(f"the broker does not answer: {served.error}")
        return served

    async def models(request: Request) -> Response:
        served = await served_models(request)
        data = [_model_object(m, served.max_context(m)) for m in served.models]
        return Response(responses.dumps({"object": "list", "data": data}), media_type=JSON)

    async def model(request: Request) -> Response:
        served, name = await served_models(request), request.path_params["model"]
        found = next((m for m in served.models if m.casefold() == name.casefold()), None)
        if found is None:
            raise model_not_found(name, served.models)
        return Response(responses.dumps(_model_object(found, served.max_context(found))), media_type=JSON)

    async def recommended(ask: Ask, body: schema.ChatRequest | schema.CompletionRequest) -> Ask:
        """The checked request's ask with the model's recommended sampling for the parameters it leaves out, once the
        broker is known to serve the model (404 or 503 here otherwise, as the service would answer)."""
        assert gw.models is not None
        defaults = await gw.models.sampling_defaults(body.model)
        return dataclasses.replace(ask, sampling=schema.sampling(body, defaults)) if defaults else ask

    async def chat(request: Request) -> Response:
        owner = gw.keys.owner(request.headers.get("authorization"))
        body = schema.parse(schema.ChatRequest, await _json(request))
        assert isinstance(body, schema.ChatRequest)
        name = _session_name(request, body)
        ask = await recommended(chat_ask(body, owner, name, config.reasoning_parser, config.tool_call_parser), body)
        assert gw.models is not None
        if ask.of_tools and not gw.models.last.renders_tools(body.model) and \
                not (await gw.models.served(fresh=True)).renders_tools(body.model):  # (upgraded since the last status?)
            raise bad_request(f"the workers of {body.model} (or the broker before them) do not render tools, function "
                              "calls or reasoning: they are older than this gateway, upgrade them", "messages")
        if ask.stream:
            return await _streamed(ask, True, body.logprobs, body.return_token_ids, body.include_usage(), "chat")
        assert gw.service is not None
        live = await _unless_gone(request, gw.service.complete(ask))
        out = responses.chat_completion(responses.new_id("chatcmpl"), ask.model, live.answers(), live.usage(),
                                        body.logprobs, body.return_token_ids, name, ask.reasoner is not None)
        return Response(responses.dumps(out), media_type=JSON)

    async def completions(request: Request) -> Response:
        owner = gw.keys.owner(request.headers.get("authorization"))
        body = schema.parse(schema.CompletionRequest, await _json(request))
        assert isinstance(body, schema.CompletionRequest)
        name = _session_name(request, body)
        ask = await recommended(completion_ask(body, owner, name), body)
        want_logprobs = body.logprobs is not None
        if ask.stream:
            return await _streamed(ask, False, want_logprobs, body.return_token_ids, body.include_usage(), "completions")
        assert gw.service is not None
        live = await _unless_gone(request, gw.service.complete(ask))
        out = responses.completion(responses.new_id("cmpl"), ask.model, live.answers(), live.usage(), want_logprobs,
                                   body.return_token_ids, name)
        return Response(responses.dumps(out), media_type=JSON)

    async def _streamed(ask: Any, chat: bool, want_logprobs: bool, token_ids: bool, include_usage: bool,
                        endpoint: str) -> Response:
        assert gw.service is not None
        start = time.perf_counter()
        live, deltas = await gw.service.stream(ask)
        writer = responses.ChunkWriter(chat, ask.model, want_logprobs, token_ids, include_usage)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for d in deltas:
                    c = d.chunk
                    finish = None if c.finish_reason is None else ("length" if c.finish_reason in ("length", "capacity") else "stop")
                    if ask.reasoner is None and ask.tool_parser is None:
                        yield writer.delta(d.index, c.token_ids, c.text, c.logprobs, finish)
                        continue
                    reasoning, content, made = live.split_stream(d.index).feed(c.text, finish is not None)
                    finish = "tool_calls" if made else finish
                    yield writer.delta(d.index, c.token_ids, content, c.logprobs, finish, reasoning, made)
                if include_usage:
                    yield writer.usage(live.usage())
                yield responses.DONE
            except ApiError as e:
                yield writer.error(e.body())
            except Exception as e:  # after the status went out, an error can only be an event
                if isinstance(e, ClientError):
                    yield writer.error(from_client_error(e).body())
                else:
                    log.exception("stream_crashed")
                    yield writer.error(ApiError(500, "internal error (see the gateway's log)", kind="server_error").body())
            finally:
                await deltas.aclose()  # a client gone mid-stream: the generation is cancelled, its sessions closed
                gw.metrics.duration.labels(endpoint).observe(time.perf_counter() - start)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if ask.name is not None:
            headers["X-Session-ID"] = ask.name
        return EventStream(events(), headers)

    async def close_session(request: Request) -> Response:
        owner = gw.keys.owner(request.headers.get("authorization"))
        name = request.path_params["session_id"]
        assert gw.service is not None
        if not await gw.service.close_named(owner, name):
            raise ApiError(404, f"no session {name!r}", param="session_id", code="session_not_found")
        return Response(responses.dumps({"id": name, "object": "session", "deleted": True}), media_type=JSON)

    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.scrape(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    async def healthz(request: Request) -> Response:
        return Response(b"ok\n", media_type="text/plain; charset=utf-8")  # answering at all means the loop turns

    async def readyz(request: Request) -> Response:
        if gw.models is None:
            return Response(b"starting\n", 503, media_type="text/plain; charset=utf-8")
        try:  # a probe's own timeout is short (Kubernetes': 1 s): answer within it (the question goes on, shared)
            served = await asyncio.wait_for(gw.models.served(), READYZ_WAIT_S)
        except asyncio.TimeoutError:
            why = f"the broker does not answer within {READYZ_WAIT_S} s"
            return Response(f"{why}\n".encode(), 503, media_type="text/plain; charset=utf-8")
        ready, why = served.ready()
        return Response(f"{why}\n".encode(), 200 if ready else 503, media_type="text/plain; charset=utf-8")

    routes = [
        Route("/v1/models", handler("models", models), methods=["GET"]),
        Route("/v1/models/{model:path}", handler("models", model), methods=["GET"]),
        Route("/v1/chat/completions", handler("chat", chat), methods=["POST"]),
        Route("/v1/completions", handler("completions", completions), methods=["POST"]),
        Route("/v1/sessions/{session_id}", handler("sessions", close_session), methods=["DELETE"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]

    async def http_error(request: Request, e: Exception) -> Response:  # no route, or not this method: OpenAI's shape
        assert isinstance(e, HTTPException)
        error = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                         code="not_found" if e.status_code == 404 else "method_not_allowed")
        return Response(error.json(), e.status_code, headers=dict(e.headers or {}), media_type=JSON)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.gateway = gw
    return app


READYZ_WAIT_S = 0.8  # /readyz answers 503 when the broker's STATUS takes longer


def _model_object(name: str, max_context: int) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's `max_model_len` (a conversation's tokens, prompt and answers) when known."""
    model: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "sessionserve"}
    if max_context:
        model["max_model_len"] = max_context
    return model


async def _body(request: Request) -> bytes:
    """The request's body, refused (413) past MAX_BODY_BYTES: by its Content-Length before anything is read, else
    as soon as what came is more."""
    too_large = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise too_large
        parts.append(part)
    return b"".join(parts)


async def _json(request: Request) -> Any:
    body = await _body(request)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass  # json says why, and takes what orjson alone refuses (a lone surrogate's escape, an integer beyond 64 bits)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (nested deeper than the interpreter's stack)
        raise bad_request(f"the request body is not valid JSON: {str(e) or type(e).__name__}") from None


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; should the HTTP client close its connection first, `work` is cancelled (a generation nobody
    will read stops, its sessions are closed) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the ASGI server says the client disconnected (the body was read before: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _session_name(request: Request, body: schema.ChatRequest | schema.CompletionRequest) -> str | None:
    header = request.headers.get("x-session-id")
    if header is not None and body.session_id is not None and header != body.session_id:
        raise bad_request("X-Session-ID and session_id differ", "session_id")
    name = body.session_id if body.session_id is not None else header
    if name is not None and not schema._SESSION_ID.fullmatch(name):
        raise bad_request(f"session_id must match {schema.SESSION_ID_PATTERN}", "session_id")
    return name

