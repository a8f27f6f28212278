"""What Client and AsyncClient share: building requests, the resend schedule, reading answers. No I/O.

Resending: a request that has heard nothing for `resend_after` seconds is sent again with the same
request id (the broker may have restarted with it inside). The worker answers a repeated id from its
cache, or redirects the running generation to us, so nothing runs twice. CREATE is not resent: after
a broker restart a resend could be placed on another worker and leave a second session behind.

Streams (StreamState): each chunk carries its offset in the generation. A chunk is applied only at the offset the
stream has reached; a repeat is dropped; a gap (chunks lost while the broker restarted) makes the stream resend its
GENERATE with `resume`, the offset it has reached, and the worker answers with everything from there. The final
answer carries every token and the whole text, so the last chunk is exactly what the stream lacks: the streamed
text always equals the result's text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from broker.common import protocol as p
from client.errors import BadRequest, ClientError, InternalError, StreamCancelled, error_for
from client.logs import log
from client.results import Chunk, Generation, SessionInfo, WorkerInfo

DEFAULT_TIMEOUT_S = 60.0
RESEND_AFTER_S = 1.0
MAX_RESEND_S = 8.0
CONNECT_TIMEOUT_S = 5.0  # a call on a client that never reached a broker gives up after this (BrokerUnreachable)

M = TypeVar("M", bound=p.Message)
T = TypeVar("T")

# What a call's mailbox holds: a whole message, or one request's chunk split out of a CHUNKS message.
Answer = p.Message | p.StreamChunk
ANSWER_TYPES: tuple[type[p.Message], ...] = (*p.REPLY_KINDS.values(), p.Chunks, p.Error)


def new_request_id() -> str:
    return uuid.uuid4().hex


def build(make: Callable[..., T], **fields: Any) -> T:
    """A protocol message; a value the protocol refuses is a BadRequest here, before anything is sent."""
    try:
        return make(**fields)
    except p.ProtocolError as e:
        raise BadRequest(e.message) from e


def items(name: str, value: Any) -> tuple[Any, ...]:
    """A list argument as a tuple (its items are checked by the protocol); anything else is a BadRequest."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise BadRequest(f"{name} must be a list, got {type(value).__name__}")
    return tuple(value)


def generate_request(session_id: str, params: p.Sampling, stream: bool, prompt: str | None = None,
                     prompt_ids: Sequence[int] | None = None,
                     messages: Sequence[Mapping[str, Any]] | None = None,
                     boundary_check: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                     from_start: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> p.Generate:
    """The whole GENERATE, checked before anything is sent: a turn (prompt, prompt ids or chat messages) and its
    generation are one request, which the worker takes whole or refuses whole."""
    turns = None if messages is None else tuple(chat_message(m) for m in items("messages", messages))
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise BadRequest(f"chat_template_kwargs must be a map, got {type(chat_template_kwargs).__name__}")
    args = tuple(build(p.TemplateArg, name=k, value=v) for k, v in (chat_template_kwargs or {}).items())
    return build(p.Generate, request_id=new_request_id(), session_id=session_id, params=params, stream=stream,
                 prompt=prompt, prompt_ids=None if prompt_ids is None else items("prompt_ids", prompt_ids),
                 messages=turns, boundary_check=boundary_check, template_args=args, from_start=from_start,
                 tools=tools_json(tools))


def tools_json(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """OpenAI's tools list as GENERATE carries it (JSON text; "" for none)."""
    if tools is None:
        return ""
    listed = items("tools", tools)
    if not all(isinstance(t, Mapping) for t in listed):
        raise BadRequest("tools must be a list of maps (OpenAI's {\"type\": \"function\", \"function\": {...}})")
    try:
        return json.dumps([dict(t) for t in listed], ensure_ascii=False, separators=(",", ":")) if listed else ""
    except (TypeError, ValueError, RecursionError) as e:
        raise BadRequest(f"tools must be JSON: {e}") from None


def chat_message(message: Mapping[str, Any]) -> p.ChatMessage:
    """A chat message: role and content; an assistant's `tool_calls` (OpenAI's: {"id", "type": "function",
    "function": {"name", "arguments"}}, arguments as JSON text or a map) and `reasoning_content` (or `reasoning`), a
    tool message's `tool_call_id`."""
    if not isinstance(message, Mapping):
        raise BadRequest(f"a chat message is a map with role and content, got {type(message).__name__}")
    content = message.get("content")
    calls = tuple(tool_call(c) for c in items("tool_calls", message.get("tool_calls") or ()))
    if content is None and calls:
        content = ""  # (an answer that only called functions)
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return build(p.ChatMessage, role=message.get("role"), content=content, tool_calls=calls,
                 tool_call_id=message.get("tool_call_id") or "", reasoning=reasoning or "")


def tool_call(call: Any) -> p.ToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise BadRequest("a tool call is a map with id, type \"function\" and function {name, arguments}")
    arguments = function.get("arguments")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(dict(arguments), ensure_ascii=False)
    return build(p.ToolCall, id=call.get("id") or "", name=function.get("name"), arguments=arguments)


def sampling(
    max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
    stop: str | Sequence[str] | None, stop_token_ids: Sequence[int], ignore_eos: bool, logprobs: int | None = None,
    *, logit_bias: Mapping[int, float] | None = None, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0, min_p: float = 0.0, min_tokens: int = 0,
) -> p.Sampling:
    stops = (stop,) if isinstance(stop, str) else () if stop is None else items("stop", stop)
    if logit_bias is not None and not isinstance(logit_bias, Mapping):
        raise BadRequest(f"logit_bias must be a map of token ids to numbers, got {type(logit_bias).__name__}")
    bias = tuple(build(p.LogitBias, token=t, bias=b) for t, b in (logit_bias or {}).items())
    return build(
        p.Sampling, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=stops, stop_token_ids=items("stop_token_ids", stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs,
        logit_bias=bias, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, min_p=min_p, min_tokens=min_tokens,
    )


@dataclass
class Call:
    """One request on the wire: its frames, and when to send them again."""

    request_id: str
    frames: list[bytes]
    resendable: bool
    base_resend_s: float
    resend_s: float
    next_resend: float
    request: p.Message | None = None
    started: float = 0.0
    resume: int | None = None  # a stream that heard its chunks: the offset of the first token it lacks

    @classmethod
    def of(cls, request: p.Message, now: float, resend_after_s: float) -> Call:
        request_id: str = getattr(request, "request_id", "")
        resendable = not isinstance(request, (p.CreateSession, p.Cancel))
        frames = p.encode(request)
        if len(frames[2]) > p.MAX_HEADER_BYTES:  # the broker could not even answer: ZeroMQ drops such a message
            raise BadRequest(f"the request is {len(frames[2])} bytes: the limit is {p.MAX_HEADER_BYTES} bytes per message",
                             request_id=request_id)
        return cls(request_id, frames, resendable, resend_after_s, resend_after_s, now + resend_after_s, request, now)

    def resend_frames(self) -> list[bytes]:
        """What to send again: the request, and for a stream that heard chunks, where to resume it."""
        if self.resume is None or not isinstance(self.request, p.Generate):
            return self.frames
        return p.encode(dataclasses.replace(self.request, resume=self.resume))

    def cancel(self) -> p.Cancel | None:
        """What stops this call's work on the worker once nobody waits for its answer: a generation's CANCEL."""
        if not isinstance(self.request, p.Generate):
            return None
        return p.Cancel(request_id=new_request_id(), session_id=self.request.session_id, target=self.request_id)

    def makes_a_session(self) -> bool:
        """A create or a fork: should nobody wait for its answer any more, the session it makes is to be closed."""
        return isinstance(self.request, (p.CreateSession, p.Fork))

    def heard(self, now: float) -> None:
        """An answer came: the peer is alive, so start the resend clock again."""
        self.resend_s = self.base_resend_s
        self.next_resend = now + self.resend_s

    def resend_due(self, now: float) -> bool:
        return self.resendable and now >= self.next_resend

    def resent(self, now: float) -> None:
        self.resend_s = min(self.resend_s * 2, MAX_RESEND_S)
        self.next_resend = now + self.resend_s

    def wake_at(self, deadline: float) -> float:
        return min(deadline, self.next_resend) if self.resendable else deadline


def decode_answer(frames: list[bytes]) -> p.Message | None:
    """An answer from the broker, or None (logged) when it does not follow the protocol."""
    try:
        message = p.decode(frames)
    except p.ProtocolError as e:
        log.warning("answer_invalid", code=e.code.value, error=e.message, request=e.request_id)
        return None
    if not isinstance(message, ANSWER_TYPES):
        if not isinstance(message, p.Lease):  # the broker's probe of this connection: nothing to do
            log.warning("answer_unexpected", command=message.COMMAND.name)
        return None
    return message


def addressed(message: p.Message | None) -> list[tuple[str, Answer]]:
    """(request id, message) for each request an answer speaks to: a CHUNKS batch splits into its chunks."""
    if isinstance(message, p.Chunks):
        return [(chunk.request_id, chunk) for chunk in message.chunks]
    request_id = getattr(message, "request_id", None)
    if message is None or request_id is None:
        return []
    return [(request_id, message)]


MAX_ORPHANS = 1024  # creates and forks given up on, remembered so that the sessions they make are closed


class Orphans:
    """Calls a caller gave up on (timed out, cancelled), for either transport: a generation is stopped at once, and
    the session a create or fork makes is closed when its answer comes (nobody would use it)."""

    def __init__(self) -> None:
        self._ids: dict[str, None] = {}

    def given_up(self, call: Call, oneway: Callable[[p.Message], None]) -> None:
        """`oneway`: the transport's send of a message nothing answers (passed, not kept: a dropped client is freed
        without waiting for the garbage collector)."""
        cancel = call.cancel()
        if cancel is not None:
            _send(oneway, cancel)
        if call.makes_a_session():
            self._ids[call.request_id] = None
            if len(self._ids) > MAX_ORPHANS:
                del self._ids[next(iter(self._ids))]

    def answered(self, request_id: str, message: Answer, oneway: Callable[[p.Message], None]) -> None:
        """An answer no call waits for: a given-up create's or fork's closes the session it made."""
        if request_id not in self._ids:
            return
        del self._ids[request_id]
        if isinstance(message, p.Created):
            _send(oneway, p.Close(request_id=new_request_id(), session_id=message.session_id))
        elif isinstance(message, p.Forked):
            _send(oneway, p.Close(request_id=new_request_id(), session_id=message.child_id))


def _send(oneway: Callable[[p.Message], None], message: p.Message) -> None:
    with contextlib.suppress(ClientError):  # best effort: a closed or full client sends nothing
        oneway(message)


def expect(message: Answer, kind: type[M]) -> M:
    """The answer as `kind`; an ERROR is raised as its typed ClientError."""
    if isinstance(message, p.Error):
        raise error_for(message.code.value, message.message, message.request_id)
    if isinstance(message, kind):
        return message
    raise InternalError(f"expected a {kind.__name__} answer, got {type(message).__name__}")


def generation(g: p.Generated, chat: bool = False, from_start: bool = False) -> Generation:
    """The result of a GENERATE; for one that carried chat turns, checked to have appended them, and for one sent
    from_start, checked to come from a worker that knows it (an older worker ignores what it does not know: say so
    rather than hand back a continuation of the wrong history)."""
    if chat and g.appended == 0:
        raise InternalError("the worker generated without appending the chat turn: it is older than this client "
                            "(upgrade the worker)", request_id=g.request_id)
    if from_start and g.cached is None:
        raise InternalError("the worker does not know from_start (it appended the whole context after the session's "
                            "tokens): it is older than this client (upgrade the worker)", request_id=g.request_id)
    return Generation(list(g.token_ids), g.text, g.finish_reason, g.length, g.appended, list(g.logprobs), g.rewound,
                      g.cached)


def session_info(i: p.SessionInfo) -> SessionInfo:
    return SessionInfo(i.session_id, i.length, i.model, i.worker, i.max_context, i.busy)


def worker_infos(report: p.StatusReport) -> list[WorkerInfo]:
    return [
        WorkerInfo(w.name, w.model, w.capacity, w.free_slots, w.sessions, w.draining, w.device, w.last_seen_ms / 1000,
                   w.max_context, MappingProxyType(w.sampling_defaults.given()), w.tools)
        for w in report.workers
    ]


class StreamState:
    """Applies a stream's chunks at their offsets, then the final REPLY: each token is yielded once and in order, and
    the texts yielded make the final answer's text exactly (the last chunk carries whatever the others lacked)."""

    def __init__(self, call: Call | None = None, chat: bool = False, from_start: bool = False) -> None:
        self.tokens = 0  # tokens applied: the offset the next chunk must have
        self._text: list[str] = []
        self._text_len = 0
        self.result: Generation | None = None
        self.missing = False  # a chunk came from beyond `tokens`: the ones between are to be asked for
        self._cut_why: str | None = None  # closed because a read timed out or was cancelled: how
        self._call = call
        self._chat, self._from_start = chat, from_start  # what generation() checks the answer for
        self._asked_for = -1
        self._asked_at = 0.0

    @property
    def text(self) -> str:
        return "".join(self._text)

    def take(self, message: Answer) -> Chunk | None:
        """The chunk to yield for an answer; None for a repeat or a chunk past a gap (then `missing` is set)."""
        if isinstance(message, p.StreamChunk):  # per token: nothing here but bookkeeping
            ids = message.token_ids
            if message.offset == self.tokens and ids:
                self.tokens += len(ids)
                self._text.append(message.text)
                self._text_len += len(message.text)
                self.missing = False
                if self._call is not None:
                    self._call.resume = self.tokens
                if message.logprobs:
                    return Chunk(list(ids), message.text, None, list(message.logprobs))
                return Chunk(list(ids), message.text)
            if self._call is not None:
                self._call.resume = self.tokens  # the worker has started it: a resend must never run it again
            if message.offset + len(ids) > self.tokens:
                self.missing = True  # a gap (or a chunk that overlaps the end of what we have)
            return None
        final = expect(message, p.Generated)
        self.result = generation(final, self._chat, self._from_start)
        if final.text[: self._text_len] != self.text or len(final.token_ids) < self.tokens:
            raise InternalError("the final answer does not continue the streamed chunks", request_id=final.request_id)
        tail = Chunk(list(final.token_ids[self.tokens :]), final.text[self._text_len :], final.finish_reason,
                     list(final.logprobs[self.tokens :]))
        self.tokens = len(final.token_ids)
        self._text, self._text_len = [final.text], len(final.text)
        return tail

    def cut_off(self, why: str) -> None:
        """A read gave up (`why`: "timed out", "was cancelled") and the stream was closed for it: the answer is cut
        off, which later reads say (`closed_error`) instead of ending as if it were whole."""
        self._cut_why = why

    def closed_error(self, request_id: str) -> StreamCancelled | None:
        """What a read of the closed stream raises: StreamCancelled (a fresh one each time, so tracebacks do not pile
        up) when a read gave up on it; None when it ended or its caller closed it (the iteration stops quietly)."""
        if self._cut_why is None:
            return None
        tokens = f"{self.tokens} token{'' if self.tokens == 1 else 's'}"
        return StreamCancelled(f"the stream was closed and its generation cancelled when a read {self._cut_why}: its "
                               f"answer is cut off after {tokens}", request_id=request_id)

    def ask(self, now: float, every_s: float) -> bool:
        """Whether to ask the worker for the missing chunks now: at once for a new gap, again every `every_s` while
        the same one lasts (an answer lost too)."""
        if not self.missing or (self._asked_for == self.tokens and now - self._asked_at < every_s):
            return False
        self._asked_for, self._asked_at = self.tokens, now
        return True
