"""What Client and AsyncClient share: building requests, the resend schedule, reading answers. No I/O.

Resending: a request that has heard nothing for `resend_after` seconds is sent again with the same
request id (the broker may have restarted with it inside). The worker answers a repeated id from its
cache, or redirects the running generation to us, so nothing runs twice. CREATE is not resent: after
a broker restart a resend could be placed on another worker and leave a second session behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from broker.common import protocol as p
from client.errors import BadRequest, InternalError, error_for
from client.results import Chunk, Generation, SessionInfo, WorkerInfo

log = structlog.get_logger()

DEFAULT_TIMEOUT_S = 60.0
RESEND_AFTER_S = 1.0
MAX_RESEND_S = 8.0

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


def generate_request(session_id: str, params: p.Sampling, stream: bool, prompt: str | None,
                     prompt_ids: Sequence[int] | None) -> p.Generate:
    return build(p.Generate, request_id=new_request_id(), session_id=session_id, params=params, stream=stream,
                 prompt=prompt, prompt_ids=None if prompt_ids is None else tuple(prompt_ids))


def sampling(
    max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
    stop: str | Sequence[str] | None, stop_token_ids: Sequence[int], ignore_eos: bool,
) -> p.Sampling:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return build(
        p.Sampling, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=stops, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
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

    @classmethod
    def of(cls, request: p.Message, now: float, resend_after_s: float) -> Call:
        request_id: str = getattr(request, "request_id", "")
        resendable = not isinstance(request, (p.CreateSession, p.Cancel))
        frames = p.encode(request)
        if len(frames[2]) > p.MAX_HEADER_BYTES:  # the broker could not even answer: ZeroMQ drops such a message
            raise BadRequest(f"the request is {len(frames[2])} bytes: the limit is {p.MAX_HEADER_BYTES} bytes per message",
                             request_id=request_id)
        return cls(request_id, frames, resendable, resend_after_s, resend_after_s, now + resend_after_s)

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


def expect(message: Answer, kind: type[M]) -> M:
    """The answer as `kind`; an ERROR is raised as its typed ClientError."""
    if isinstance(message, p.Error):
        raise error_for(message.code.value, message.message, message.request_id)
    if isinstance(message, kind):
        return message
    raise InternalError(f"expected a {kind.__name__} answer, got {type(message).__name__}")


def generation(g: p.Generated) -> Generation:
    return Generation(list(g.token_ids), g.text, g.finish_reason, g.length, g.appended)


def session_info(i: p.SessionInfo) -> SessionInfo:
    return SessionInfo(i.session_id, i.length, i.model, i.worker, i.max_context, i.busy)


def worker_infos(report: p.StatusReport) -> list[WorkerInfo]:
    return [
        WorkerInfo(w.name, w.model, w.capacity, w.free_slots, w.sessions, w.draining, w.device, w.last_seen_ms / 1000)
        for w in report.workers
    ]


class StreamState:
    """Turns streamed chunks and the final REPLY into Chunks. The final one carries whatever the chunks missed."""

    def __init__(self) -> None:
        self.tokens = 0  # streamed so far
        self._text: list[str] = []
        self.result: Generation | None = None

    @property
    def text(self) -> str:
        return "".join(self._text)

    def take(self, message: Answer) -> Chunk:
        if isinstance(message, p.StreamChunk):  # per token: nothing here but bookkeeping
            self.tokens += len(message.token_ids)
            self._text.append(message.text)
            return Chunk(list(message.token_ids), message.text)
        final = expect(message, p.Generated)
        self.result = generation(final)
        text = self.text
        tail_ids = list(final.token_ids[self.tokens :])
        tail_text = final.text[len(text) :] if final.text.startswith(text) else ""
        self.tokens = len(final.token_ids)
        self._text = [final.text]
        return Chunk(tail_ids, tail_text, final.finish_reason)
