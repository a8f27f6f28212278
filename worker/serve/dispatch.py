"""Requests to engine calls, and engine chunks to answers: the worker's request handling, without sockets.

The compute loop (worker.serve.loop) hands every decoded request to `Dispatch.handle` and every step's chunks
to `Dispatch.step_answers`, and sends what they return. Every request id is remembered with its final answer,
so a resent request is answered again, never run twice; a resent generation that is still running moves the
rest of its stream to the new route.

Streams: each streamed chunk carries its offset (the generation's tokens before it) and the text the engine let
out with its tokens. A generation keeps every token and the text let out with each until it ends; then its final
answer, which carries them all, is kept with the other answers. So a client that saw a gap resends the GENERATE
with `resume` and gets everything from there in one CHUNKS, or the final answer.

Long texts are tokenized off the compute loop: an APPEND, CHAT or GENERATE whose text is longer than OFFLOAD_CHARS is
checked at once (the session, and whether the text can fit at all: `Engine.check_text_fits`), then tokenized on a
thread of its own (`Engine.tokenize`, which releases the GIL), and run with the ids once they are there
(`Dispatch.completed`): other sessions' steps and requests, and the link's heartbeats, go on meanwhile. Requests for
the same session that come meanwhile wait behind it, in order.

A DROP from the broker (sessions it declared lost while this worker was cut off, whose clients were told
session_lost) closes those sessions, their generations too, and nothing is answered for them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from broker.common import protocol as p
from worker.errors import BadRequest, SessionBusy
from worker.serve.config import Unqueued, WorkerConfig
from worker.serve.metrics import NoMetrics, WorkerMetrics

log = structlog.get_logger()

MAX_EXPIRED_REMEMBERED = 1 << 16  # expired session ids answered with session_expired (oldest forgotten first)
# A text longer than this is tokenized off the compute loop (SmolLM2's tokenizer: ~1.5 us a character, so this is
# ~12 ms of the loop's time at most when done on it).
OFFLOAD_CHARS = 8192


class EngineAPI(Protocol):
    """The part of worker.engine.Engine the daemon drives (see that module for the semantics)."""

    model_name: str
    max_context: int
    last_rows: int  # requests in the step the last step() launched
    last_prefill_tokens: int  # prompt tokens that step computes in prefill chunks
    last_prompt_tokens: int  # prompt tokens it computes, those in decode rows too
    last_read: bool  # whether the last step() read a step's tokens

    @property
    def capacity(self) -> int: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def bytes_per_session(self) -> int: ...
    @property
    def prefill_running(self) -> bool: ...
    def create_session(self, session_id: str | None = None, owner: str = "") -> str: ...
    def session_owner(self, session_id: str) -> str: ...
    def fork(self, session_id: str, child_id: str | None = None) -> str: ...
    def close(self, session_id: str) -> None: ...
    def append(self, session_id: str, token_ids: Sequence[int] | None = None, text: str | None = None, *,
               boundary_check: bool = False) -> int: ...
    def chat(self, session_id: str, content: str, role: str = "user") -> int: ...
    def kept(self, session_id: str, ids: Sequence[int]) -> int: ...
    def prompt_ids(self, session_id: str, token_ids: Sequence[int] | None = None, text: str | None = None, *,
                   boundary_check: bool = False, from_start: bool = False) -> list[int]: ...
    def session_computed(self, session_id: str) -> int: ...
    def chat_ids(self, session_id: str, messages: Sequence[dict[str, Any]], boundary_check: bool = False,
                 template_args: Mapping[str, Any] | None = None, from_start: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]: ...
    def chat_text(self, session_id: str, messages: Sequence[dict[str, Any]], boundary_check: bool = False,
                  template_args: Mapping[str, Any] | None = None, from_start: bool = False,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str: ...
    def check_text_fits(self, session_id: str, text: str, from_start: bool = False) -> None: ...
    def tokenize(self, text: str, add_bos: bool | None = None, after: Sequence[int] | None = None) -> list[int]: ...
    def text_context(self, session_id: str, boundary_check: bool = False,
                     from_start: bool = False) -> tuple[bool | None, list[int] | None]: ...
    def sessions(self) -> list[str]: ...
    def session_length(self, session_id: str) -> int: ...
    def start_generate(self, session_id: str, params: Any, request_id: str | None = None, *,
                       prompt_ids: Sequence[int] | None = None, prompt: str | None = None,
                       boundary_check: bool = False, from_start: bool = False, turn_tail: int = 0) -> str: ...
    def turn_tail(self, prompt_ids: Sequence[int], template_args: Mapping[str, Any] | None = None) -> int: ...
    def cancel(self, request_id: str) -> None: ...
    def release_idle_slots(self, older_than_s: float) -> int: ...
    def has_work(self) -> bool: ...
    def step(self, wait: bool = True) -> Sequence[Any]: ...


class SessionExpired(Exception):
    code = "session_expired"


class Draining(Exception):
    code = "worker_draining"


def error_code(exc: BaseException) -> p.ErrorCode:
    """The wire code of an exception: its `code` attribute when that is one (engine, cuda_state, protocol)."""
    code = getattr(exc, "code", None)
    if isinstance(code, p.ErrorCode):
        return code
    if isinstance(code, str) and code in p.ERROR_CODES:
        return p.ERROR_CODES[code]
    return p.ErrorCode.INTERNAL


class GenerationForgotten(Exception):
    """A resent GENERATE resumes a generation this worker no longer knows (it ended, and its answer left the
    cache of answers): it is not run again."""

    code = "internal"


@dataclass
class Tokenizing:
    """A request whose long text is being tokenized off the loop, and the requests for its session behind it."""

    request: p.Message
    route: bytes
    future: Future[list[int]]
    waiting: list[p.Message] = field(default_factory=list)


@dataclass(slots=True)
class Active:
    """A generation in flight."""

    request_id: str  # the client's
    session_id: str
    route: bytes
    stream: bool
    appended: int = 0  # prompt tokens the request appended first
    rewound: int = 0  # from_start: the session's tokens it dropped first
    cached: int = 0  # the prompt tokens whose state the session held already
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # per token, the text let out with it ("" while held back)
    held: str = ""  # text let out by a step that made no token: it goes with the next token (no engine does that now)
    logprobs: list[Any] | None = None  # one entry per token, when the request asked for them

    def add(self, ids: list[int], text: str) -> None:
        """Keep a step's tokens (at least one) and text, the text with the last of them (Dispatch.step_answers
        does the same, inlined, for the usual step of one token)."""
        self.token_ids += ids
        self.texts += [""] * (len(ids) - 1)
        self.texts.append(text)

    def since(self, offset: int) -> p.Chunks | None:
        """What the generation made from token `offset` on, as one CHUNKS to its route (None: nothing)."""
        ids = self.token_ids[offset:]
        if not ids:
            return None
        lps = tuple(self.logprobs[offset:]) if self.logprobs is not None else ()
        chunk = p.StreamChunk(self.request_id, tuple(ids), "".join(self.texts[offset:]), offset, lps)
        return p.Chunks(chunks=(chunk,), route=self.route)


class Dispatch:
    """The worker's request handling: owns the generations in flight, the answers kept for resends, and each
    session's owner and last use. One thread (the compute loop) calls it."""

    def __init__(self, engine: EngineAPI, config: WorkerConfig, sampling: Callable[[p.Sampling], Any],
                 metrics: WorkerMetrics | NoMetrics) -> None:
        self.engine = engine
        self.config = config
        self._sampling = sampling  # protocol Sampling -> the engine's SamplingParams
        self.metrics = metrics
        self.draining = False
        self.active: dict[str, Active] = {}  # engine request id -> generation
        self._by_session: dict[str, str] = {}  # session id -> engine request id
        self._done: OrderedDict[tuple[str, str], p.Message] = OrderedDict()  # (session, request id) -> answer
        self.owners: dict[str, str] = {}  # session id -> the client key it belongs to ("" = none)
        self._last_used: dict[str, float] = {}  # session id -> when a request or generation last touched it
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.sessions_changed = False  # sessions were created or closed since the loop last looked
        self.routes: dict[str, bytes] = {}  # session id -> the route of the client that last used it (its lease)
        self.tokenizing: dict[str, Tokenizing] = {}  # session id -> its request waiting for its text's ids
        self.on_tokenized: Callable[[], None] = lambda: None  # called on the tokenizer's thread when ids are ready
        self.tokenized_chars = 0  # characters tokenized off the loop since the loop last looked (it trims the heap)
        self._tokenizer: ThreadPoolExecutor | None = None
        self.moving: set[str] = set()  # sessions being moved to another worker (worker.serve.moves): not expired
        self.evacuating = False  # draining, its sessions moving off: new sessions are refused, the rest is served

    def adopt_sessions(self) -> None:
        """Take on the sessions the engine already holds (brought back from its session store after a restart):
        their owners, and now as their last use."""
        now = time.monotonic()
        for sid in self.engine.sessions():
            self.owners[sid] = self.engine.session_owner(sid)
            self._last_used[sid] = now

    # -- moving sessions (worker.serve.moves) --

    def busy(self, session_id: str) -> bool:
        """Whether a request of the session runs (a generation, a text being tokenized, requests behind it)."""
        return session_id in self._by_session or session_id in self.tokenizing

    def adopt(self, session_id: str, owner: str, route: bytes, answers: Sequence[bytes] = ()) -> None:
        """Take on a session moved here: its owner, its client's route, and its kept answers (for resends)."""
        self.owners[session_id] = owner
        if route:
            self.routes[session_id] = route
        self._last_used[session_id] = time.monotonic()
        self._expired.pop(session_id, None)
        for packed in answers:
            try:
                answer = p.unpack_answer(packed)
            except p.ProtocolError as e:
                log.info("moved_answer_invalid", session=session_id, error=e.message)
                continue
            rid = getattr(answer, "request_id", None)
            if isinstance(rid, str):
                self._remember((session_id, rid), answer)
        self.sessions_changed = True

    def release(self, session_id: str) -> None:
        """The session moved away (or a move into here was aborted): closed here, nothing answered."""
        try:
            self.engine.close(session_id)
        except Exception as e:
            log.info("release_failed", session=session_id, error=str(e))
        self.owners.pop(session_id, None)
        self.routes.pop(session_id, None)
        self._last_used.pop(session_id, None)
        self.sessions_changed = True

    def answers_of(self, session_id: str) -> tuple[bytes, ...]:
        """The answers kept for the session's requests, newest first, packed (at most MAX_KEPT_ANSWERS, within
        MAX_ANSWERS_BYTES): they go with it when it moves."""
        packed: list[bytes] = []
        size = 0
        for (sid, _), answer in reversed(self._done.items()):
            if sid != session_id:
                continue
            data = p.pack_answer(answer)
            if size + len(data) > p.MAX_ANSWERS_BYTES:
                continue
            packed.append(data)
            size += len(data)
            if len(packed) == p.MAX_KEPT_ANSWERS:
                break
        return tuple(reversed(packed))

    # -- requests --

    def handle(self, request: p.Message, ids: list[int] | None = None) -> list[p.Message]:
        """Run one request; its answers to send now (none for a generation, answered when it finishes, nor for a
        request whose text is being tokenized). `ids`: the tokens of the request's text, tokenized off the loop."""
        if isinstance(request, p.Drop):
            self.drop(request.sessions)
            return []
        sid: str = getattr(request, "session_id", None) or ""
        waiting = self.tokenizing.get(sid) if sid else None
        if waiting is not None and ids is None and not self._resent_while_tokenizing(waiting, request):
            waiting.waiting.append(request)  # behind the session's request being tokenized, in order
            return []
        if ids is None:
            self.metrics.request(request.COMMAND)
        if isinstance(request, p.Cancel):
            engine_id = self._by_session.get(request.session_id)
            active = self.active.get(engine_id) if engine_id else None
            if active is not None and active.request_id == request.target:
                self.engine.cancel(engine_id)  # type: ignore[arg-type]
            return []
        rid: str = getattr(request, "request_id", "")
        route: bytes = getattr(request, "route", b"")
        key = (sid, rid)
        if ids is None:
            if waiting is not None:  # a resend of the request being tokenized: its answer goes to the new route
                waiting.route = route
                return []
            resent = self._resent(key, route, request)
            if resent is not None:
                return resent
        try:
            if sid in self._expired:
                raise SessionExpired(f"session {sid} was closed after idling more than "
                                     f"{self.config.session_idle_timeout_s:g} s (worker --session-idle-timeout)")
            if sid in self._last_used:
                self._last_used[sid] = time.monotonic()
                if route:
                    self.routes[sid] = route
            text = None if ids is not None else _long_text(request)
            if text is not None:
                self._tokenize_later(request, sid, route, text)
                return []
            answer = self._execute(request, ids)
        except Exception as e:
            return self._refused(request, sid, e)
        if answer is None:
            return []
        answer = answer.routed(route)
        self._remember(key, answer)
        return [answer]

    def _refused(self, request: p.Message, sid: str, e: BaseException) -> list[p.Message]:
        """The error answer of a request that raised (remembered for a resend)."""
        rid: str = getattr(request, "request_id", "")
        code = error_code(e)
        if code is p.ErrorCode.INTERNAL and not isinstance(e, GenerationForgotten):  # a bug: its traceback
            log.error("request_failed", command=request.COMMAND.name, request=rid, session=sid or None, exc_info=e)
        else:
            log.info("request_refused", command=request.COMMAND.name, code=code.value, error=str(e)[:512], request=rid,
                     session=sid or None)
        self.metrics.error(code)
        if code is p.ErrorCode.SESSION_LOST and sid and sid in self.owners:  # its stored state was lost: not ours now
            self.owners.pop(sid, None)
            self._last_used.pop(sid, None)
            self.sessions_changed = True
        answer = p.Error(request_id=rid, code=code, message=str(e) or type(e).__name__).routed(
            getattr(request, "route", b""))
        self._remember((sid, rid), answer)
        return [answer]

    def unqueued(self, request: Unqueued) -> list[p.Message]:
        """A request the link did not queue (worker.serve.link.MAX_INBOX_BYTES), in its turn: a resend of a request this
        worker has (answered, generating, being tokenized or waiting behind that) is answered as such a resend is; any
        other gets `overloaded`, not remembered (sent again later, it runs)."""
        sid, rid, route = request.session_id, request.request_id, request.route
        self.metrics.request(p.COMMANDS.get(request.command, request.command.decode(errors="replace")))
        waiting = self.tokenizing.get(sid) if sid else None
        if waiting is not None:
            if getattr(waiting.request, "request_id", None) == rid:
                waiting.route = route
                return []
            if any(getattr(later, "request_id", None) == rid for later in waiting.waiting):
                return []  # its first copy waits behind the tokenization, and will answer
        resent = self._resent((sid, rid), route, None)
        if resent is not None:
            return resent
        self.metrics.error(p.ErrorCode.OVERLOADED)
        return [p.Error(request_id=rid, code=p.ErrorCode.OVERLOADED, message=request.message, route=route)]

    def _resent_while_tokenizing(self, waiting: Tokenizing, request: p.Message) -> bool:
        return getattr(request, "request_id", None) == getattr(waiting.request, "request_id", "")

    def _tokenize_later(self, request: p.Message, sid: str, route: bytes, text: str) -> None:
        """Check what can be checked now (the session, whether the text can fit at all), then tokenize the text on
        the tokenizer's thread; `completed` runs the request once its ids are there."""
        e = self.engine
        if isinstance(request, p.Generate):
            self._refuse_if_draining("new generations")
        if sid in self._by_session:  # refused as the engine refuses a short one: the turn would be rendered, and its
            # room checked, against the session before its generation's tokens
            raise SessionBusy(f"session {sid} already has a generation in flight" if isinstance(request, p.Generate)
                              else f"session {sid} is generating: append after the generation ends")
        after: list[int] | None = None
        from_start = isinstance(request, p.Generate) and request.from_start
        if isinstance(request, p.Chat):
            text = e.chat_text(sid, [{"role": request.role, "content": text}])
            add_bos: bool | None = False
        elif isinstance(request, p.Generate) and request.messages is not None:
            text = e.chat_text(sid, _turns(request.messages), request.boundary_check, _args(request.template_args),
                               from_start, _tools(request.tools))
            add_bos = False
        else:  # (the session cannot change while its text is tokenized: its requests wait behind it)
            add_bos, after = e.text_context(sid, getattr(request, "boundary_check", False), from_start)
        e.check_text_fits(sid, text, from_start)
        if self._tokenizer is None:
            self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="worker-tokenize")
        future = self._tokenizer.submit(e.tokenize, text, add_bos, after)
        self.tokenizing[sid] = Tokenizing(request, route, future)
        self.tokenized_chars += len(text)
        future.add_done_callback(lambda _: self.on_tokenized())
        log.debug("tokenizing_off_loop", session=sid, characters=len(text), request=getattr(request, "request_id", ""))

    def completed(self) -> list[p.Message]:
        """Run the requests whose texts are tokenized now, then the requests their sessions held back: their answers."""
        answers: list[p.Message] = []
        for sid, waiting in list(self.tokenizing.items()):
            if not waiting.future.done():
                continue
            del self.tokenizing[sid]
            request = waiting.request.routed(waiting.route)
            error = waiting.future.exception()
            if error is None:
                answers += self.handle(request, waiting.future.result())
            else:
                answers += self._refused(request, sid, error)
            for later in waiting.waiting:
                answers += self.handle(later)
        return answers

    def close(self) -> None:
        """Stop the tokenizer's thread (the loop is done)."""
        if self._tokenizer is not None:
            self._tokenizer.shutdown(wait=False, cancel_futures=True)

    def _resent(self, key: tuple[str, str], route: bytes, request: p.Message | None) -> list[p.Message] | None:
        """A request id seen before: its cached answer, or (a generation still running) the rest of its stream and its
        answer going to the new route, and with `resume` what it made from there now. None for a request not seen
        before. Never a re-run."""
        done = self._done.get(key)
        if done is not None:
            return [done.routed(route)]
        engine_id = self._by_session.get(key[0])
        active = self.active.get(engine_id) if engine_id else None
        if active is not None and active.request_id == key[1]:
            active.route = route
            resume = request.resume if isinstance(request, p.Generate) else None
            missing = None if resume is None else active.since(resume)
            if missing is None:
                return []
            log.debug("stream_resumed", request=key[1], offset=resume, tokens=len(active.token_ids) - (resume or 0))
            return [missing]
        return None

    def _execute(self, request: p.Message, ids: list[int] | None = None) -> p.Message | None:
        e = self.engine
        name = self.config.name
        if isinstance(request, p.CreateSession):
            self._refuse_if_draining("new sessions", sessions=True)
            if request.session_id is None:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "CREATE needs the broker's session_id")
            sid = e.create_session(request.session_id, owner=request.owner)
            self.owners[sid] = request.owner
            self.routes[sid] = request.route
            self._last_used[sid] = time.monotonic()
            self.sessions_changed = True
            # Per-session lines are debug: at info, rendering one cost ~20 us of the compute loop's time, which a burst
            # of creates and closes spends while the GPU waits (the metrics count sessions; --log-level debug shows them).
            log.debug("session_created", session=sid, request=request.request_id)
            return p.Created(request_id=request.request_id, session_id=sid, model=e.model_name, worker=name,
                             max_context=e.max_context, from_start=True)
        if isinstance(request, p.Append):
            if ids is not None:
                length = e.append(request.session_id, token_ids=ids)
            else:
                token_ids = list(request.token_ids) if request.token_ids is not None else None
                length = e.append(request.session_id, token_ids=token_ids, text=request.text,
                                  boundary_check=request.boundary_check)
            return p.Appended(request_id=request.request_id, session_id=request.session_id, length=length)
        if isinstance(request, p.Chat):
            if ids is not None:
                length = e.append(request.session_id, token_ids=ids)
            else:
                length = e.chat(request.session_id, request.content, role=request.role)
            return p.Appended(request_id=request.request_id, session_id=request.session_id, length=length)
        if isinstance(request, p.Generate):
            if request.resume is not None:
                raise GenerationForgotten(f"generation {request.request_id} ended and its answer is no longer kept "
                                          f"(this worker keeps the last {self.config.request_cache}): not run again")
            self._refuse_if_draining("new generations")
            sid = request.session_id
            before = e.session_length(sid)
            prompt_ids: Sequence[int] | None = request.prompt_ids if ids is None else ids
            prompt = None if ids is not None else request.prompt
            if request.messages is not None and ids is None:
                prompt_ids = e.chat_ids(sid, _turns(request.messages), request.boundary_check,
                                        _args(request.template_args), request.from_start, _tools(request.tools))
            kept = before
            if request.from_start:
                if prompt is not None:  # tokenized here, to count what the session keeps of its tokens
                    prompt_ids, prompt = e.prompt_ids(sid, text=prompt, from_start=True), None
                assert prompt_ids is not None  # (the message's check: from_start comes with a prompt)
                kept = e.kept(sid, prompt_ids)
            # A chat prompt's end that the next turn renders otherwise: a recurrent state's checkpoint goes before it.
            tail = 0 if request.messages is None or prompt_ids is None else e.turn_tail(prompt_ids,
                                                                                        _args(request.template_args))
            engine_id = e.start_generate(sid, self._sampling(request.params), prompt_ids=prompt_ids, prompt=prompt,
                                         boundary_check=request.boundary_check and ids is None,
                                         from_start=request.from_start, turn_tail=tail)
            self.active[engine_id] = Active(request.request_id, sid, request.route, request.stream,
                                            e.session_length(sid) - kept, before - kept, e.session_computed(sid),
                                            logprobs=None if request.params.logprobs is None else [])
            self._by_session[request.session_id] = engine_id
            self.metrics.generation_started(engine_id, time.perf_counter())
            return None  # answered when the generation finishes
        if isinstance(request, p.Fork):
            self._refuse_if_draining("new sessions", sessions=True)
            if request.child_id is None:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "FORK needs the broker's child_id")
            if request.child_id in self._expired:  # (ids are the broker's fresh random ones: a broken broker)
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"FORK's child_id {request.child_id} is an expired "
                                      "session's")
            child = e.fork(request.session_id, request.child_id)
            self.owners[child] = self.owners.get(request.session_id, "")
            self.routes[child] = request.route
            self._last_used[child] = time.monotonic()
            self.sessions_changed = True
            log.debug("session_forked", session=child, parent=request.session_id, request=request.request_id)
            return p.Forked(request_id=request.request_id, session_id=request.session_id, child_id=child,
                            length=e.session_length(child), worker=name, from_start=True)
        if isinstance(request, p.Close):
            e.close(request.session_id)  # a generation on it ends "cancelled" in the next step
            self.owners.pop(request.session_id, None)
            self.routes.pop(request.session_id, None)
            self._last_used.pop(request.session_id, None)
            self.sessions_changed = True
            log.debug("session_closed", session=request.session_id, request=request.request_id)
            return p.Closed(request_id=request.request_id, session_id=request.session_id)
        if isinstance(request, p.Info):
            return p.SessionInfo(request_id=request.request_id, session_id=request.session_id,
                                 length=e.session_length(request.session_id), model=e.model_name, worker=name,
                                 max_context=e.max_context, busy=request.session_id in self._by_session)
        raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"a worker does not serve {request.COMMAND.name}")

    def _refuse_if_draining(self, what: str, sessions: bool = False) -> None:
        if self.draining or (sessions and self.evacuating):
            raise Draining(f"worker {self.config.name} is draining: it takes no {what}")

    def _remember(self, key: tuple[str, str], answer: p.Message) -> None:
        self._done[key] = answer
        if len(self._done) > self.config.request_cache:
            self._done.popitem(last=False)

    # -- step output --

    def step_answers(self, chunks: Sequence[Any], end: float) -> tuple[list[p.Message], int]:
        """One step's chunks as messages: one FANOUT for the streamed requests that moved, by client route, then the
        final answer of each request that finished. Also the new tokens the step made."""
        new_tokens = 0
        batches: dict[bytes, list[p.StreamChunk]] = {}
        finals: list[p.Message] = []
        for chunk in chunks:
            active = self.active.get(chunk.request_id)
            if active is None:
                continue
            ids = chunk.token_ids
            lps = getattr(chunk, "logprobs", None) or ()  # engines without log-probabilities have no such field
            if ids:
                offset = len(active.token_ids)
                if not offset:
                    self.metrics.first_token(chunk.request_id, end)
                text = chunk.text
                if active.held:
                    text, active.held = active.held + text, ""
                if len(ids) == 1:  # the usual step, inlined: this runs for every token
                    active.token_ids.append(ids[0])
                    active.texts.append(text)
                else:
                    active.add(ids, text)
                new_tokens += len(ids)
                if active.logprobs is not None:
                    active.logprobs += lps
                if chunk.finish_reason is None and active.stream and active.route:  # no route (a broken broker): nowhere
                    batch = batches.get(active.route)
                    if batch is None:
                        batch = batches[active.route] = []
                    batch.append(p.new_stream_chunk((active.request_id, tuple(ids), text, offset, lps)))
            elif chunk.text:
                active.held += chunk.text
            if chunk.finish_reason is not None:
                finals.append(self._finish(chunk.request_id, active, chunk.finish_reason, end))
        # Valid by construction (see Message.unchecked): no per-token checks here; the client checks them all.
        out: list[p.Message] = []
        if batches:
            out.append(p.Fanout.unchecked(routes=tuple(batches), parts=tuple(map(p.chunks_part, batches.values()))))
        return out + finals, new_tokens

    def _finish(self, engine_id: str, active: Active, finish_reason: str, end: float) -> p.Message:
        """A generation ended: its whole answer, remembered for a resend."""
        self._retire(engine_id, active)
        self.metrics.generation_finished(engine_id, end, len(active.token_ids), finish_reason)
        try:
            length = self.engine.session_length(active.session_id)
        except Exception:  # closed while generating
            length = 0
        answer = p.Generated.unchecked(request_id=active.request_id, session_id=active.session_id,
                                       token_ids=tuple(active.token_ids), text="".join(active.texts) + active.held,
                                       finish_reason=finish_reason, length=length, appended=active.appended,
                                       rewound=active.rewound, cached=active.cached, route=active.route,
                                       logprobs=tuple(active.logprobs or ()))
        self._remember((active.session_id, active.request_id), answer)
        return answer

    def _retire(self, engine_id: str, active: Active) -> None:
        if active.session_id in self._last_used:
            self._last_used[active.session_id] = time.monotonic()
        del self.active[engine_id]
        if self._by_session.get(active.session_id) == engine_id:
            del self._by_session[active.session_id]

    # -- failures, drain, expiry --

    def fail_all(self, why: str) -> list[p.Message]:
        """End every generation in flight with an internal error (the engine step failed): the errors to send."""
        errors: list[p.Message] = []
        for engine_id, active in list(self.active.items()):
            self._retire(engine_id, active)
            self.metrics.generation_finished(engine_id, time.perf_counter(), len(active.token_ids), "error")
            self.metrics.error(p.ErrorCode.INTERNAL)
            try:
                self.engine.cancel(engine_id)
            except Exception:
                log.exception("cancel_failed", request=active.request_id)
            errors.append(p.Error(request_id=active.request_id, code=p.ErrorCode.INTERNAL, message=why,
                                  route=active.route))
        return errors

    def drop(self, sessions: Sequence[str]) -> None:
        """Close sessions the broker declared lost (DROP): their generations end without an answer (their clients
        were told session_lost), requests waiting on them are forgotten, and later requests for them find no session."""
        dropped = 0
        for sid in sessions:
            self.tokenizing.pop(sid, None)  # its ids are not waited for
            engine_id = self._by_session.get(sid)
            active = self.active.get(engine_id) if engine_id else None
            if engine_id is not None and active is not None:
                self._retire(engine_id, active)  # its "cancelled" end is not answered
                self.metrics.generation_finished(engine_id, time.perf_counter(), len(active.token_ids), "cancelled")
            if sid not in self.owners and sid not in self._last_used:
                continue
            try:
                self.engine.close(sid)
            except Exception as e:
                log.info("drop_failed", session=sid, error=str(e))
            self.owners.pop(sid, None)
            self.routes.pop(sid, None)
            self._last_used.pop(sid, None)
            dropped += 1
        if dropped:
            self.sessions_changed = True
        log.warning("sessions_dropped", sessions=dropped, listed=len(sessions),
                    detail="the broker declared them lost while this worker was cut off")

    def cancel_all(self) -> None:
        for engine_id in list(self.active):
            self.engine.cancel(engine_id)

    def expire_idle(self, now: float) -> list[str]:
        """Close the sessions idle longer than the timeout (not generating, moving or tokenizing a request's text); their
        ids, for the broker."""
        timeout = self.config.session_idle_timeout_s
        idle = [sid for sid, t in self._last_used.items()
                if now - t > timeout and sid not in self._by_session and sid not in self.moving
                and sid not in self.tokenizing]
        for sid in idle:
            try:
                self.engine.close(sid)
            except Exception:
                log.exception("expire_failed", session=sid)
            del self._last_used[sid]
            self.owners.pop(sid, None)
            self.routes.pop(sid, None)
            self._expired[sid] = None
            if len(self._expired) > MAX_EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)
        if idle:
            self.sessions_changed = True
            log.info("sessions_expired", sessions=len(idle), idle_timeout_s=timeout)
        return idle


def _long_text(request: p.Message) -> str | None:
    """The text of an APPEND, CHAT or GENERATE when it is long enough to be tokenized off the loop."""
    text: str | None = None
    if isinstance(request, p.Append):
        text = request.text
    elif isinstance(request, p.Chat):
        text = request.content
    elif isinstance(request, p.Generate):
        text = request.prompt if request.messages is None else "".join(m.content for m in request.messages)
    return text if text is not None and len(text) > OFFLOAD_CHARS else None


def _args(args: Sequence[p.TemplateArg]) -> dict[str, Any]:
    return {a.name: a.value for a in args}


def _turns(messages: Sequence[p.ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them (transformers'): a function call's arguments a map (vLLM's way),
    a tool turn's tool_call_id."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": _arguments(c)}} for c in m.tool_calls]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.reasoning:
            turn["reasoning_content"] = m.reasoning
        turns.append(turn)
    return turns


def _arguments(call: p.ToolCall) -> Any:
    """A call's arguments as JSON values (none: {})."""
    if not call.arguments.strip():
        return {}
    try:
        return json.loads(call.arguments)
    except (ValueError, RecursionError):
        raise BadRequest(f"function call {call.id or call.name}: its arguments are not JSON") from None


def _tools(tools: str) -> list[dict[str, Any]] | None:
    """A GENERATE's tools (OpenAI's list, JSON text): None for none."""
    if not tools:
        return None
    try:
        value = json.loads(tools)
    except (ValueError, RecursionError):
        raise BadRequest("tools is not JSON (or nested too deep)") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRequest("tools must be a JSON list of objects")
    return value
