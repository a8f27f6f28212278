"""The wire protocol: frames, commands, error codes and typed messages. No I/O.

Every message is one ZeroMQ multipart message (a ROUTER adds the peer's routing id in front):

    [VERSION, command, header, *payload]

- VERSION is checked first; any other first frame is answered with `version_mismatch`.
- command is one of `Command` (ASCII).
- header is a msgpack map with string keys. Its fields are validated into the typed message of the
  command (REPLY: of its `kind`); unknown fields are ignored so that a newer peer may add some.
- payload: only MOVE_CHUNK carries one (the state bytes it moves); any other message that carries any is a
  `bad_request`.

Legs:
    client -> broker:          CREATE APPEND CHAT GENERATE FORK CLOSE INFO CANCEL STATUS SESSIONS
                               DRAIN REBALANCE (answered by the broker once their moves are done)
    broker -> worker:          the same requests plus `route` (the client's routing id), and for
                               CREATE and FORK the session id the broker made (STATUS and SESSIONS are
                               answered by the broker itself)
    worker -> broker -> client REPLY (final; `kind` names the result), CHUNKS (streamed), ERROR (final)
    worker -> broker:          FANOUT (a step's CHUNKS for several clients, sent on by the broker)
    broker -> client:          LEASE (the broker holds sessions for this client; nothing answers it)
    worker <-> broker:         READY WELCOME HEARTBEAT RECONNECT DISCONNECT DROP
    moving a session:          broker -> source MOVE; source -> broker -> target MOVE_STATE then MOVE_CHUNKs;
                               workers -> broker MOVE_REPORT; broker -> workers MOVE_END; broker -> a draining
                               worker EVACUATED (docs/architecture.md, "Moving sessions")

Streaming: each client gets ONE CHUNKS message per engine step, whose `chunks` list holds a
{request_id, token_ids, text, offset} map for every streamed request of that client that moved in the step; the
client splits it back into its streams and applies each chunk at its offset (StreamChunk says how). The
worker sends the broker ONE FANOUT message per step for all its streaming clients, holding each client's
CHUNKS header ready-made; the broker sends each its part without reading it. So a step costs the worker
one message however many clients stream (64 clients of one session each: 64 messages a step were 0.9 ms of
the worker's compute loop on an H100 host). A CHUNKS that a worker addresses to one client itself (with a
`route`) is forwarded too, after checking the route. A request's final REPLY (or ERROR) stays a message of
its own, sent after all of its chunks, and carries every token.

CANCEL is one-way: nothing answers it; the generation it cancels ends with finish_reason "cancelled".
Every request carries a client-made `request_id`; a worker answers a repeated id from its cache
instead of running it again, which is what makes resending a request safe.

Validation lives in the types: each field's `Annotated` check (broker/common/fields.py) runs when a message
is built, from a peer's header or from Python, so a bad value is a `ProtocolError` with code
`bad_request` naming the field, on either side of the wire.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from functools import partial
from typing import Annotated, Any, ClassVar, Final, NamedTuple, TypeVar

import msgpack

from broker.common.fields import (
    FieldError,
    blob,
    blob_list,
    boolean,
    build,
    clipped_text,
    field_names,
    int_list,
    integer,
    nested,
    nested_list,
    number,
    one_of,
    payload,
    plain,
    scalar,
    str_list,
    text,
    validate,
)

VERSION: Final = b"SSP1"

# Limits. A header holds at most a 1M-token append (msgpack ints take <= 5 bytes) or 4 MiB of text.
MAX_HEADER_BYTES: Final = 8 << 20
MAX_MESSAGE_BYTES: Final = MAX_HEADER_BYTES + 4096  # the sockets' MAXMSGSIZE: bigger is dropped by ZeroMQ
MAX_TOKENS: Final = 1 << 20
MAX_TEXT_CHARS: Final = 4 << 20
MAX_NAME_CHARS: Final = 256
MAX_STOP_STRINGS: Final = 16
MAX_STOP_CHARS: Final = 256
MAX_SESSIONS_LISTED: Final = 1 << 20
MAX_ROUTE_BYTES: Final = 255  # ZeroMQ routing ids are 1..255 bytes
MAX_CHUNKS: Final = 1 << 16  # requests in one CHUNKS message
MAX_LOGPROBS: Final = 20  # top log-probabilities per token (Sampling.logprobs)
MAX_LOGIT_BIAS: Final = 300  # tokens one request may bias (Sampling.logit_bias; OpenAI's limit)
_MAX_TOKEN_ID: Final = 2**31 - 1
MAX_TOKEN_BYTES: Final = 256  # bytes of one token in a log-probability entry
MAX_MESSAGES: Final = 1 << 16  # chat turns in one GENERATE
MAX_TEMPLATE_ARGS: Final = 16  # variables a GENERATE gives the chat template (e.g. Qwen3's enable_thinking)
MAX_TEMPLATE_ARG_CHARS: Final = 4096
MAX_TOOL_CALLS: Final = 128  # function calls in one assistant turn


class Command(Enum):
    # requests (client -> broker -> worker)
    CREATE = b"CREATE"
    APPEND = b"APPEND"
    CHAT = b"CHAT"
    GENERATE = b"GENERATE"
    FORK = b"FORK"
    CLOSE = b"CLOSE"
    INFO = b"INFO"
    CANCEL = b"CANCEL"
    STATUS = b"STATUS"  # answered by the broker itself
    SESSIONS = b"SESSIONS"  # answered by the broker itself: the sessions it routes to
    # answers (worker -> broker -> client, or broker -> client)
    REPLY = b"REPLY"
    CHUNKS = b"CHUNKS"
    ERROR = b"ERROR"
    FANOUT = b"FANOUT"  # worker -> broker: one step's CHUNKS for several clients
    LEASE = b"LEASE"  # broker -> client: a probe of the connection of a client that holds sessions
    # worker <-> broker control
    READY = b"READY"
    WELCOME = b"WELCOME"
    HEARTBEAT = b"HEARTBEAT"
    RECONNECT = b"RECONNECT"
    DISCONNECT = b"DISCONNECT"
    DROP = b"DROP"  # broker -> worker: sessions declared lost with it, to close
    # moving a live session between workers (broker.moves, worker.serve.moves)
    MOVE = b"MOVE"  # broker -> source: send this session's state to the target
    MOVE_STATE = b"MOVE_STATE"  # source -> broker -> target: the session (tokens, owner, layout, digest)
    MOVE_CHUNK = b"MOVE_CHUNK"  # source -> broker -> target: a range of its state bytes, as a payload frame
    MOVE_REPORT = b"MOVE_REPORT"  # worker -> broker: imported / released / aborted / failed
    MOVE_END = b"MOVE_END"  # broker -> worker: release (the source closes it) or abort (each side forgets the move)
    EVACUATED = b"EVACUATED"  # broker -> draining worker: the sessions it could move have moved
    DRAIN = b"DRAIN"  # client -> broker: move every session off a worker and place nothing more there
    REBALANCE = b"REBALANCE"  # client -> broker: move sessions from fuller to emptier workers of each model


COMMANDS: Final = {c.value: c for c in Command}


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_LOST = "session_lost"
    MODEL_NOT_FOUND = "model_not_found"
    TIMEOUT = "timeout"
    WORKER_DRAINING = "worker_draining"
    UNAUTHORIZED = "unauthorized"
    SESSION_EXPIRED = "session_expired"
    VERSION_MISMATCH = "version_mismatch"
    OVERLOADED = "overloaded"  # a worker's queue is full: retry later
    PROMPT_BOUNDARY = "prompt_boundary"  # a text sent with boundary_check would re-tokenize the session's last tokens,
    # or chat turns follow an answer the model's template would render otherwise: the whole prompt, in a new session
    INTERNAL = "internal"


ERROR_CODES: Final = {c.value: c for c in ErrorCode}

# "capacity": the worker had no memory for the session to grow (its session keeps what it generated).
FINISH_REASONS: Final = frozenset({"stop", "length", "cancelled", "capacity"})


class ProtocolError(Exception):
    """A message that does not follow this protocol. Answer it with `error_for(...)` when it can be."""

    def __init__(
        self, code: ErrorCode, message: str, *, request_id: str | None = None, route: bytes = b""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.route = route


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _checked(value: Any) -> None:
    """Run a message's field checks (from __post_init__); a bad field is a bad_request."""
    try:
        validate(value)
    except FieldError as e:
        raise _bad(str(e)) from None


def error_code(name: str, value: Any) -> Any:
    """Field check: a wire error code."""
    if isinstance(value, ErrorCode):
        return value
    if not isinstance(value, str):
        raise FieldError(f"{name} must be a string, got {type(value).__name__}")
    return ERROR_CODES.get(value, ErrorCode.INTERNAL)  # a newer peer's code still ends the request

def error_code_or_none(name: str, value: Any) -> Any:
    """Field check: a wire error code, or None."""
    return None if value is None else error_code(name, value)



ID_PATTERN: Final = r"[A-Za-z0-9._:-]{1,64}"
SESSION_PATTERN: Final = r"[0-9a-f]{32}"  # 128 random bits, made by the broker

_ID_RE = re.compile(ID_PATTERN)
_SESSION_RE = re.compile(SESSION_PATTERN)


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and _SESSION_RE.fullmatch(value) is not None


RequestId = Annotated[str, text(64, ID_PATTERN)]
SessionId = Annotated[str, text(32, SESSION_PATTERN)]
OptSessionId = Annotated[str | None, text(32, SESSION_PATTERN, optional=True)]
Name = Annotated[str, text(MAX_NAME_CHARS, r"(?s).+")]  # non-empty
OptName = Annotated[str | None, text(MAX_NAME_CHARS, r"(?s).+", optional=True)]
Label = Annotated[str, text(MAX_NAME_CHARS)]
Route = Annotated[bytes, blob(MAX_ROUTE_BYTES)]
# A frame: bytes, or a memoryview of a received message (payload frames: a MOVE_CHUNK's state is taken without a copy).
Frame = bytes | memoryview
TokenIds = Annotated[tuple[int, ...], int_list(MAX_TOKENS)]
Text = Annotated[str, text(MAX_TEXT_CHARS)]
MAX_COUNT: Final = 2**62  # the largest count (a length, a number of tokens or slots) a message may carry
Count = Annotated[int, integer(0, MAX_COUNT)]
SessionIds = Annotated[tuple[str, ...], str_list(MAX_SESSIONS_LISTED, text(32, SESSION_PATTERN))]
# Who a session belongs to: a client's CURVE public key (Z85, 40 chars) when the broker authenticates, else "".
OWNER_PATTERN: Final = r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}"
Owner = Annotated[str, text(40, f"(?:{OWNER_PATTERN})?")]
Owners = Annotated[tuple[str, ...], str_list(MAX_SESSIONS_LISTED, text(40, f"(?:{OWNER_PATTERN})?"))]


M = TypeVar("M", bound="Message")


_DEFAULTS: dict[type[Any], dict[str, Any]] = {}


def _defaults(cls: type[Any]) -> dict[str, Any]:
    """Each field of a message type and its default (MISSING where it has none), for Message.unchecked."""
    found = _DEFAULTS.get(cls)
    if found is None:
        found = _DEFAULTS[cls] = {f.name: f.default for f in fields(cls)}  # no message field has a default_factory
    return found


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every typed message. Subclasses are frozen dataclasses whose fields are checked."""

    COMMAND: ClassVar[Command]
    KIND: ClassVar[str] = ""  # REPLY messages only: names the result type

    def __post_init__(self) -> None:
        _checked(self)
        self._check()

    def _check(self) -> None:
        """Checks across fields; the per-field ones ran already."""

    @classmethod
    def unchecked(cls: type[M], **values: Any) -> M:
        """The message without the field checks, for a sender whose fields are valid by construction: the
        worker's step loop (request ids checked when the GENERATE came, token ids and text from its engine),
        which builds a CHUNKS every step and a whole answer per generation (checking 256 token ids one by one
        cost ~30 us an answer). Fields left out take their defaults. Whoever decodes the message checks
        every field, as always."""
        message = object.__new__(cls)
        for name, default in _defaults(cls).items():
            object.__setattr__(message, name, values.pop(name) if name in values else default)
        if values:
            raise TypeError(f"{cls.__name__} has no fields {sorted(values)}")
        if any(value is MISSING for value in (getattr(message, name) for name in _defaults(cls))):
            raise TypeError(f"{cls.__name__}.unchecked needs every field without a default")
        return message

    def routed(self: M, route: bytes) -> M:
        """The same message addressed to `route` (requests and answers only: control messages have no route)."""
        blob(MAX_ROUTE_BYTES)("route", route)
        # The other fields were checked already: copy them without re-validating (copy.copy of a slotted
        # dataclass goes through __reduce_ex__, several times slower; the worker routes every answer).
        cls = type(self)
        routed = object.__new__(cls)
        for name in field_names(cls):
            object.__setattr__(routed, name, getattr(self, name))
        object.__setattr__(routed, "route", route)
        return routed

    def to_header(self) -> dict[str, Any]:
        header = {name: plain(getattr(self, name)) for name in field_names(type(self))}
        if not header.get("route"):
            header.pop("route", None)
        if self.KIND:
            header["kind"] = self.KIND
        return header


# -- nested values --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogitBias:
    """A number added to one token's logit before sampling (OpenAI's logit_bias entry)."""

    token: Annotated[int, integer(0, _MAX_TOKEN_ID)]
    bias: Annotated[float, number(-100.0, 100.0)]

    def __post_init__(self) -> None:
        _checked(self)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to generate. Mirrors worker.engine.sampling.SamplingParams; the engine checks the vocabulary."""

    max_tokens: Annotated[int, integer(0, MAX_TOKENS)] = 16  # 0: prefill only (the prompt is computed, no token)
    temperature: Annotated[float, number(0.0, 100.0)] = 0.0  # 0 = greedy
    top_p: Annotated[float, number(0.0, 1.0)] = 1.0
    top_k: Annotated[int, integer(0, 2**31 - 1)] = 0  # 0 = whole vocabulary
    seed: Annotated[int | None, integer(0, 2**63 - 1, optional=True)] = None
    stop: Annotated[tuple[str, ...], str_list(MAX_STOP_STRINGS, text(MAX_STOP_CHARS, r"(?s).+"))] = ()
    stop_token_ids: Annotated[tuple[int, ...], int_list(MAX_STOP_STRINGS)] = ()
    ignore_eos: Annotated[bool, boolean] = False
    # None: no log-probabilities; k: each generated token's and the k most likely ones (answers' `logprobs`)
    logprobs: Annotated[int | None, integer(0, MAX_LOGPROBS, optional=True)] = None
    # Extras (`extended`): logit_bias and the penalties (worker.engine.penalties), min_p and min_tokens (vLLM's). A
    # worker that applies them says so in its READY (`sampling_extras`), and the broker refuses a GENERATE with them
    # for one that does not rather than have them ignored (peers ignore fields they do not know).
    logit_bias: Annotated[tuple[LogitBias, ...], nested_list(LogitBias, MAX_LOGIT_BIAS)] = ()
    repetition_penalty: Annotated[float, number(0.01, 10.0)] = 1.0  # 1 = none
    frequency_penalty: Annotated[float, number(-2.0, 2.0)] = 0.0
    presence_penalty: Annotated[float, number(-2.0, 2.0)] = 0.0
    min_p: Annotated[float, number(0.0, 1.0)] = 0.0  # keep tokens at least min_p times as likely as the likeliest
    min_tokens: Annotated[int, integer(0, MAX_TOKENS)] = 0  # EOS and stop_token_ids out of reach before this many

    def __post_init__(self) -> None:
        _checked(self)
        if self.top_p <= 0.0:
            raise _bad("top_p must be in (0, 1]")
        if len({b.token for b in self.logit_bias}) != len(self.logit_bias):
            raise _bad("logit_bias names a token twice")
        if self.min_tokens > self.max_tokens:
            raise _bad(f"min_tokens {self.min_tokens} is more than max_tokens {self.max_tokens}")

    @property
    def extended(self) -> bool:
        """Whether it asks for an extra (a worker must say it applies them: Ready.sampling_extras)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 \
            or self.presence_penalty != 0.0 or self.min_p != 0.0 or self.min_tokens != 0


class TokenLogprob(NamedTuple):
    """One generated token's log-probability (a [logprob, token, top] list on the wire): its value, the token's
    bytes (a token may hold part of a UTF-8 character) and the most likely tokens at that step as (id, value, bytes),
    the best first. Values are the model's (before temperature, top-k and top-p)."""

    logprob: float
    token: bytes
    top: tuple[tuple[int, float, bytes], ...] = ()


def _logprob_value(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value > 0.001:
        raise FieldError(f"{name} must hold log-probabilities (numbers <= 0), got {repr(value)[:40]}")
    return float(value)


def _token_bytes(name: str, value: Any) -> bytes:
    if type(value) is not bytes or len(value) > MAX_TOKEN_BYTES:
        raise FieldError(f"{name} must hold tokens as at most {MAX_TOKEN_BYTES} bytes, got {type(value).__name__}")
    return value


def token_logprobs(name: str, value: Any) -> Any:
    """Field check: a list of TokenLogprob (one per generated token)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) > MAX_TOKENS:
        raise FieldError(f"{name} must be a list of at most {MAX_TOKENS} log-probability entries")
    out = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise FieldError(f"{name} entries must be [logprob, token, top], got {repr(item)[:80]}")
        top = item[2]
        if isinstance(top, (str, bytes)) or not isinstance(top, Sequence) or len(top) > MAX_LOGPROBS:
            raise FieldError(f"{name}: top must be a list of at most {MAX_LOGPROBS} [id, logprob, token] entries")
        checked = []
        for entry in top:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise FieldError(f"{name}: top entries must be [id, logprob, token], got {repr(entry)[:80]}")
            tid = entry[0]
            if type(tid) is not int or not 0 <= tid <= _MAX_TOKEN_ID:
                raise FieldError(f"{name}: top ids must be token ids, got {repr(tid)[:40]}")
            checked.append((tid, _logprob_value(name, entry[1]), _token_bytes(name, entry[2])))
        out.append(TokenLogprob(_logprob_value(name, item[0]), _token_bytes(name, item[1]), tuple(checked)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant turn made (OpenAI's tool_calls entry): `arguments` is its JSON text."""

    id: Annotated[str, text(MAX_NAME_CHARS)]
    name: Name
    arguments: Text

    def __post_init__(self) -> None:
        _checked(self)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn of a GENERATE's `messages`, rendered with the model's chat template. An assistant turn may carry
    the function calls it made and its reasoning (the template's reasoning_content); a "tool" turn is one call's result
    (`tool_call_id`). A worker that renders these says so in its READY (`tools`)."""

    role: Annotated[str, text(64, r"[a-z_]{1,64}")]
    content: Text
    tool_calls: Annotated[tuple[ToolCall, ...], nested_list(ToolCall, MAX_TOOL_CALLS)] = ()
    tool_call_id: Annotated[str, text(MAX_NAME_CHARS)] = ""
    reasoning: Text = ""

    def __post_init__(self) -> None:
        _checked(self)

    @property
    def of_tools(self) -> bool:
        """Whether it needs a worker that renders calls, results and reasoning (Ready.tools)."""
        return bool(self.tool_calls or self.tool_call_id or self.reasoning)


@dataclass(frozen=True, slots=True)
class TemplateArg:
    """A variable a GENERATE's `messages` give the model's chat template, beside the messages (transformers'
    apply_chat_template keyword arguments, vLLM's chat_template_kwargs: Qwen3's enable_thinking)."""

    name: Annotated[str, text(64, r"[A-Za-z_][A-Za-z0-9_]{0,63}")]
    value: Annotated[bool | int | float | str | None, scalar(MAX_TEMPLATE_ARG_CHARS)]

    def __post_init__(self) -> None:
        _checked(self)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A model's recommended sampling (its generation_config.json, read as vLLM reads it): what an OpenAI request
    that leaves a parameter out is given at the gateway. None: no recommendation (the API's own default)."""

    temperature: Annotated[float | None, number(0.0, 100.0, optional=True)] = None
    top_p: Annotated[float | None, number(0.0, 1.0, optional=True)] = None
    top_k: Annotated[int | None, integer(0, 2**31 - 1, optional=True)] = None  # 0 = whole vocabulary
    min_p: Annotated[float | None, number(0.0, 1.0, optional=True)] = None
    repetition_penalty: Annotated[float | None, number(0.01, 10.0, optional=True)] = None
    max_tokens: Annotated[int | None, integer(1, MAX_TOKENS, optional=True)] = None  # its max_new_tokens

    def __post_init__(self) -> None:
        _checked(self)
        if self.top_p is not None and self.top_p <= 0.0:
            raise _bad("top_p must be in (0, 1]")

    def given(self) -> dict[str, float | int]:
        """The recommended parameters alone, by their protocol.Sampling names."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    name: Name
    model: Name
    capacity: Count
    free_slots: Count
    sessions: Count
    draining: Annotated[bool, boolean] = False
    device: Label = ""
    last_seen_ms: Count = 0  # since the broker last heard from the worker
    max_context: Count = 0  # the tokens a session on this worker can hold (0: an older broker did not say)
    sampling_defaults: Annotated[SamplingDefaults, nested(SamplingDefaults)] = SamplingDefaults()
    tools: Annotated[bool, boolean] = False  # it renders tools, calls and reasoning (False: an older worker or broker)

    def __post_init__(self) -> None:
        _checked(self)


# -- requests ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CreateSession(Message):
    COMMAND: ClassVar[Command] = Command.CREATE
    request_id: RequestId
    model: OptName = None  # None: any model
    session_id: OptSessionId = None  # made by the broker; None from clients
    owner: Owner = ""  # set by the broker: the creating client's key when it authenticates clients
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Append(Message):
    COMMAND: ClassVar[Command] = Command.APPEND
    request_id: RequestId
    session_id: SessionId
    token_ids: Annotated[tuple[int, ...] | None, int_list(MAX_TOKENS, optional=True)] = None
    text: Annotated[str | None, text(MAX_TEXT_CHARS, optional=True)] = None
    # The text continues the session's text: refused with prompt_boundary, nothing appended, where tokenizing it after
    # the session's last tokens would change theirs (the tokenizer merges across the boundary), instead of appended
    # tokenized on its own (worker.engine.Engine.append).
    boundary_check: Annotated[bool, boolean] = False
    route: Route = b""

    def _check(self) -> None:
        if (self.token_ids is None) == (self.text is None):
            raise _bad("append takes exactly one of token_ids or text")


@dataclass(frozen=True, slots=True)
class Chat(Message):
    """Append one chat turn rendered with the model's chat template (plus the assistant prompt)."""

    COMMAND: ClassVar[Command] = Command.CHAT
    request_id: RequestId
    session_id: SessionId
    content: Text
    role: Annotated[str, text(64, r"[a-z_]{1,64}")] = "user"
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Generate(Message):
    COMMAND: ClassVar[Command] = Command.GENERATE
    request_id: RequestId
    session_id: SessionId
    params: Annotated[Sampling, nested(Sampling)] = Sampling()
    stream: Annotated[bool, boolean] = False  # CHUNKS messages before the final REPLY
    # A prompt appended first, as by APPEND, in the same request (one round trip for a turn): both or neither.
    prompt_ids: Annotated[tuple[int, ...] | None, int_list(MAX_TOKENS, optional=True)] = None
    prompt: Annotated[str | None, text(MAX_TEXT_CHARS, optional=True)] = None
    # For `prompt`, as APPEND's. For `messages` on a session that holds an answer: refused with prompt_boundary where the
    # model's template renders that answer otherwise once turns follow it (Qwen3 drops its reasoning), instead of the
    # turns appended after the answer as the session holds it (worker.engine.Engine.chat_text).
    boundary_check: Annotated[bool, boolean] = False
    # Or chat turns, appended as CHAT appends one (the model's template, then the assistant prompt), in the same
    # request: a turn is done whole or refused whole. On a session that holds a conversation, an empty list appends
    # the assistant prompt alone.
    messages: Annotated[tuple[ChatMessage, ...] | None, nested_list(ChatMessage, MAX_MESSAGES, optional=True)] = None
    # Variables for the chat template, beside `messages` (and for the turns' rendering on a session that holds some).
    template_args: Annotated[tuple[TemplateArg, ...], nested_list(TemplateArg, MAX_TEMPLATE_ARGS)] = ()
    # The prompt (prompt_ids, prompt or messages) is the session's whole context from its start, not a continuation:
    # the session keeps what it held that the prompt starts with and drops the rest (worker.engine.Engine.kept), so
    # that it holds exactly what a new session given that prompt would (an edited conversation, an answer generated
    # again, a template that renders earlier turns otherwise once more follow).
    from_start: Annotated[bool, boolean] = False
    # Only on a resend of a streamed GENERATE whose chunks the client has seen: the offset of the first token it
    # lacks. The worker sends what it made from there in one CHUNKS, and never runs an id it no longer knows again.
    resume: Annotated[int | None, integer(0, MAX_TOKENS, optional=True)] = None
    # With `messages`: the functions the model may call, for its chat template (OpenAI's `tools` list, JSON text). A
    # worker renders tools only for an empty session or `from_start` (the whole conversation).
    tools: Text = ""
    route: Route = b""

    @property
    def uses_tools(self) -> bool:
        """Whether it needs a worker that renders tools (Ready.tools): tools, function calls or their results."""
        return bool(self.tools) or any(m.of_tools for m in self.messages or ())

    def _check(self) -> None:
        if self.tools and self.messages is None:
            raise _bad("tools go with messages")
        if sum(x is not None for x in (self.prompt_ids, self.prompt, self.messages)) > 1:
            raise _bad("generate takes at most one of prompt_ids, prompt or messages")
        if self.template_args and self.messages is None:
            raise _bad("template_args go with messages")
        if self.from_start and (self.boundary_check or (self.prompt_ids, self.prompt, self.messages) == (None,) * 3):
            raise _bad("from_start takes the session's whole context (prompt_ids, prompt or messages), "
                       "without boundary_check")
        names = [a.name for a in self.template_args]
        if len(set(names)) != len(names):
            raise _bad("template_args names a variable twice")


@dataclass(frozen=True, slots=True)
class Fork(Message):
    COMMAND: ClassVar[Command] = Command.FORK
    request_id: RequestId
    session_id: SessionId
    child_id: OptSessionId = None  # made by the broker
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Close(Message):
    COMMAND: ClassVar[Command] = Command.CLOSE
    request_id: RequestId
    session_id: SessionId
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Info(Message):
    COMMAND: ClassVar[Command] = Command.INFO
    request_id: RequestId
    session_id: SessionId
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """One-way: end the generation `target` early. Nothing answers it."""

    COMMAND: ClassVar[Command] = Command.CANCEL
    request_id: RequestId
    session_id: SessionId
    target: RequestId
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Status(Message):
    """The broker's view of its workers."""

    COMMAND: ClassVar[Command] = Command.STATUS
    request_id: RequestId
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Sessions(Message):
    """The sessions the broker routes to: all of them, or with keys those of the asking client's key (all of them
    for a key in the broker's admins/)."""

    COMMAND: ClassVar[Command] = Command.SESSIONS
    request_id: RequestId
    route: Route = b""


SessionRequest = Append | Chat | Generate | Fork | Close | Info | Cancel
Request = CreateSession | SessionRequest | Status | Sessions
SESSION_REQUEST_TYPES: Final = (Append, Chat, Generate, Fork, Close, Info, Cancel)
REQUEST_TYPES: Final = (CreateSession, *SESSION_REQUEST_TYPES, Status, Sessions)
SESSION_COMMANDS: Final = frozenset(
    {Command.APPEND, Command.CHAT, Command.GENERATE, Command.FORK, Command.CLOSE, Command.INFO, Command.CANCEL}
)
REQUEST_COMMANDS: Final = SESSION_COMMANDS | {Command.CREATE, Command.STATUS, Command.SESSIONS}
BROKER_COMMANDS: Final = frozenset({Command.DRAIN, Command.REBALANCE})  # client -> broker, answered by the broker


# -- answers ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Created(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "created"
    request_id: RequestId
    session_id: SessionId
    model: Name
    worker: Name
    max_context: Count
    route: Route = b""
    from_start: Annotated[bool, boolean] = False  # the worker takes GENERATE's from_start (False: an older worker)


@dataclass(frozen=True, slots=True)
class Appended(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "appended"
    request_id: RequestId
    session_id: SessionId
    length: Count  # the session's tokens after the append
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Generated(Message):
    """The whole generation (also after streaming: a client that missed chunks takes the rest from here)."""

    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "generated"
    request_id: RequestId
    session_id: SessionId
    token_ids: TokenIds
    text: Text
    finish_reason: Annotated[str, one_of(FINISH_REASONS)]
    length: Count
    appended: Count = 0  # prompt tokens the GENERATE appended before generating
    rewound: Count = 0  # from_start: the session's tokens it dropped before appending (held and not kept)
    # The prompt tokens whose state the session already held, not computed again (None: a worker older than from_start,
    # which does not know it; a client that sent from_start to such a worker must not trust the session).
    cached: Annotated[int | None, integer(0, MAX_COUNT, optional=True)] = None
    route: Route = b""
    logprobs: Annotated[tuple[TokenLogprob, ...], token_logprobs] = ()  # one per token id, when Sampling asked

    def _check(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise _bad(f"logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} tokens")


@dataclass(frozen=True, slots=True)
class Forked(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "forked"
    request_id: RequestId
    session_id: SessionId  # the parent
    child_id: SessionId
    length: Count
    worker: Name
    route: Route = b""
    from_start: Annotated[bool, boolean] = False  # as Created's


@dataclass(frozen=True, slots=True)
class Closed(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "closed"
    request_id: RequestId
    session_id: SessionId
    route: Route = b""


@dataclass(frozen=True, slots=True)
class SessionInfo(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "info"
    request_id: RequestId
    session_id: SessionId
    length: Count
    model: Name
    worker: Name
    max_context: Count
    busy: Annotated[bool, boolean] = False  # a generation is in flight
    route: Route = b""


@dataclass(frozen=True, slots=True)
class StatusReport(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "status"
    request_id: RequestId
    broker_id: RequestId
    workers: Annotated[tuple[WorkerStatus, ...], nested_list(WorkerStatus, 1 << 16)] = ()
    route: Route = b""


CLIENT_STATES: Final = frozenset({"connected", "gone"})
MAX_SESSIONS_REPORTED: Final = 10_000  # entries in one SessionList (a session is ~150 bytes of it)


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """One session as the broker knows it (for `broker sessions`)."""

    session_id: SessionId
    worker: Name
    owner: Owner = ""  # the client key it belongs to (brokers with keys), else ""
    length: Annotated[int | None, integer(0, 2**62, optional=True)] = None  # tokens as last answered; None: not yet
    idle_ms: Count = 0  # since a request last addressed it
    client: Annotated[str, one_of(CLIENT_STATES)] = "connected"  # the connection of the client that last used it
    gone_ms: Count = 0  # how long that client has been gone ("gone" only)

    def __post_init__(self) -> None:
        _checked(self)


@dataclass(frozen=True, slots=True)
class SessionList(Message):
    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "sessions"
    request_id: RequestId
    sessions: Annotated[tuple[SessionEntry, ...], nested_list(SessionEntry, MAX_SESSIONS_REPORTED)] = ()
    total: Count = 0  # sessions the asker may see: more than listed past MAX_SESSIONS_REPORTED
    route: Route = b""


class StreamChunk(NamedTuple):
    """One request's part of a CHUNKS message (a map with these keys on the wire).

    `offset` is where the chunk goes: how many of the generation's tokens come before its first. Its `text` is
    what the worker's detokenizer let out while making those tokens (text held back, an unfinished UTF-8
    character or a possible stop string, goes out with a later chunk or the final answer), so the texts of the
    chunks from offset 0 on, then the rest of the final answer's text, make the final answer's text exactly.
    A client applies a chunk only at the offset it has reached: it drops a repeat, and for a gap it resends the
    GENERATE with `resume` (Generate.resume). A plain tuple rather than a checked dataclass: one is made per token on both
    ends, so its fields are checked by the CHUNKS message's one pass over its list (`stream_chunks`).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    offset: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for them ("logprobs" key)


# StreamChunk(...) runs NamedTuple's __new__, a Python function: this builds one at C speed from a
# (request_id, token_ids, text, offset, logprobs) tuple, for the paths that make one per streamed token (checks, the
# worker's step).
new_stream_chunk: Final = partial(tuple.__new__, StreamChunk)


def stream_chunks(name: str, value: Any) -> Any:
    """Field check of CHUNKS' `chunks`: 1..MAX_CHUNKS maps (or StreamChunks), each with a valid request_id,
    token_ids, text and offset. One loop with the checks inlined: this runs for every streamed token."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise FieldError(f"{name} must be a list, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_CHUNKS:
        raise FieldError(f"{name} must hold 1 to {MAX_CHUNKS} chunks, got {len(value)}")
    out = []
    rid: Any
    ids: Any
    chunk_text: Any
    offset: Any
    logprobs: Any
    for item in value:
        if type(item) is dict:
            rid, ids, chunk_text = item.get("request_id"), item.get("token_ids"), item.get("text")
            offset, logprobs = item.get("offset"), item.get("logprobs")
        elif isinstance(item, StreamChunk):
            rid, ids, chunk_text, offset, logprobs = item
        else:
            raise FieldError(f"{name} must hold maps, got {type(item).__name__}")
        if type(rid) is not str or _ID_RE.fullmatch(rid) is None:
            raise FieldError(f"{name}.request_id is missing or malformed: {str(rid)[:80]!r}")
        if type(ids) not in (list, tuple) or len(ids) > MAX_TOKENS:
            raise FieldError(f"{name}.token_ids must be a list of at most {MAX_TOKENS} integers")
        for t in ids:
            if type(t) is not int or not 0 <= t <= _MAX_TOKEN_ID:
                raise FieldError(f"{name}.token_ids must hold integers in [0, {_MAX_TOKEN_ID}], got {t!r}")
        if type(chunk_text) is not str or len(chunk_text) > MAX_TEXT_CHARS:
            raise FieldError(f"{name}.text must be a string of at most {MAX_TEXT_CHARS} characters")
        if type(offset) is not int or not 0 <= offset <= MAX_TOKENS:
            raise FieldError(f"{name}.offset must be an integer in [0, {MAX_TOKENS}], got {str(offset)[:20]!r}"
                             + (" (a worker older than this client sends none: upgrade it)" if offset is None else ""))
        if logprobs:
            logprobs = token_logprobs(f"{name}.logprobs", logprobs)
            if len(logprobs) != len(ids):
                raise FieldError(f"{name}.logprobs has {len(logprobs)} entries for {len(ids)} tokens")
        else:
            logprobs = ()
        out.append(new_stream_chunk((rid, tuple(ids), chunk_text, offset, logprobs)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Chunks(Message):
    """Streamed tokens of one client's requests, in order per request: one message per route per engine step.

    Each request's chunk holds the tokens (and text) it made since its previous chunk, at its `offset`; the final
    REPLY (Generated) carries them all again, so a client that missed a CHUNKS message loses nothing.
    """

    COMMAND: ClassVar[Command] = Command.CHUNKS
    chunks: Annotated[tuple[StreamChunk, ...], stream_chunks]
    route: Route = b""

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"chunks": _chunk_maps(self.chunks)}
        if self.route:
            header["route"] = self.route
        return header


def _chunk_maps(chunks: Sequence[StreamChunk]) -> list[dict[str, Any]]:
    # "logprobs" only for the requests that asked: the common stream pays nothing more on the wire.
    return [{"request_id": rid, "token_ids": ids, "text": chunk_text, "offset": offset} if not lps else
            {"request_id": rid, "token_ids": ids, "text": chunk_text, "offset": offset, "logprobs": _logprob_lists(lps)}
            for rid, ids, chunk_text, offset, lps in chunks]


def _logprob_lists(logprobs: Sequence[TokenLogprob]) -> list[Any]:
    return [[lp[0], lp[1], [list(t) for t in lp[2]]] for lp in logprobs]  # plain tuples too (the worker's)


def chunks_part(chunks: Sequence[StreamChunk]) -> bytes:
    """The header of a CHUNKS message to one client (no route), packed: a part of a FANOUT."""
    return msgpack.packb({"chunks": _chunk_maps(chunks)}, use_bin_type=True)


@dataclass(frozen=True, slots=True)
class Fanout(Message):
    """Worker -> broker: one engine step's streamed tokens for several clients, in one message.

    `parts[i]` is the packed header of the CHUNKS message for the client at `routes[i]` (`chunks_part`); the
    broker sends it on as [VERSION, CHUNKS, parts[i]] without unpacking it, and the client checks it as it checks
    every CHUNKS.
    """

    COMMAND: ClassVar[Command] = Command.FANOUT
    routes: Annotated[tuple[bytes, ...], blob_list(MAX_CHUNKS, MAX_ROUTE_BYTES)]
    parts: Annotated[tuple[bytes, ...], blob_list(MAX_CHUNKS, MAX_HEADER_BYTES)]

    def _check(self) -> None:
        if not self.routes or len(self.routes) != len(self.parts):
            raise _bad(f"a FANOUT needs one part per route and at least one: {len(self.routes)} routes, "
                       f"{len(self.parts)} parts")
        if not all(self.routes):
            raise _bad("a FANOUT route is empty")

    def sends(self) -> list[tuple[bytes, list[bytes]]]:
        """(route, the frames of its CHUNKS message) for each client."""
        chunks = Command.CHUNKS.value
        return [(route, [VERSION, chunks, part]) for route, part in zip(self.routes, self.parts, strict=True)]


def chunk_request_ids(header: Mapping[str, Any]) -> list[str]:
    """The valid request ids of a CHUNKS header, whatever else is wrong with it (for failure handling)."""
    chunks = header.get("chunks")
    if not isinstance(chunks, list):
        return []
    ids = (c.get("request_id") for c in chunks if isinstance(c, dict))
    return [rid for rid in ids if isinstance(rid, str) and _ID_RE.fullmatch(rid)]


@dataclass(frozen=True, slots=True)
class Error(Message):
    COMMAND: ClassVar[Command] = Command.ERROR
    request_id: Annotated[str | None, text(64, ID_PATTERN, optional=True)]
    code: Annotated[ErrorCode, error_code]
    message: Annotated[str, clipped_text(4096)] = ""  # cut, never refused: messages quote bad input
    route: Route = b""


@dataclass(frozen=True, slots=True)
class DrainWorker(Message):
    """Move every session off the worker named `worker` (to the other workers of its model with room) and place
    nothing more on it. Answered (MovesDone) once the moves have ended. With keys, for admin keys only."""

    COMMAND: ClassVar[Command] = Command.DRAIN
    request_id: RequestId
    worker: Name
    route: Route = b""


@dataclass(frozen=True, slots=True)
class Rebalance(Message):
    """Move idle sessions from the fullest workers of each model to the emptiest, until their session counts differ by
    at most one. Answered (MovesDone) once the moves have ended. With keys, for admin keys only."""

    COMMAND: ClassVar[Command] = Command.REBALANCE
    request_id: RequestId
    route: Route = b""


@dataclass(frozen=True, slots=True)
class MovesDone(Message):
    """The answer to DRAIN and REBALANCE: sessions moved, moves that failed (those sessions stayed where they were, or
    were lost with a worker that died), and sessions left in place (no other worker had room)."""

    COMMAND: ClassVar[Command] = Command.REPLY
    KIND: ClassVar[str] = "moves"
    request_id: RequestId
    moved: Count = 0
    failed: Count = 0
    kept: Count = 0
    route: Route = b""


Reply = Created | Appended | Generated | Forked | Closed | SessionInfo | StatusReport | SessionList | MovesDone
REPLY_KINDS: Final[dict[str, type[Message]]] = {
    c.KIND: c for c in (Created, Appended, Generated, Forked, Closed, SessionInfo, StatusReport, SessionList,
                        MovesDone)
}


@dataclass(frozen=True, slots=True)
class Lease(Message):
    """Broker -> client, one-way: sent every heartbeat to each client connection that holds sessions. A client ignores
    it; the broker learns from a send that fails (the connection is gone) that the client is gone, and closes its
    sessions after a grace period (`broker start --session-grace-ms`)."""

    COMMAND: ClassVar[Command] = Command.LEASE
    broker_id: RequestId


# -- worker <-> broker control ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """A worker registers (again): what it serves and every session it holds."""

    COMMAND: ClassVar[Command] = Command.READY
    name: Name
    model: Name
    capacity: Count
    free_slots: Count
    max_context: Count
    sessions: SessionIds = ()
    draining: Annotated[bool, boolean] = False
    device: Label = ""
    bytes_per_session: Count = 0
    owners: Owners = ()  # one per session ("" = none), so that ownership survives a broker restart
    # One per session: the route of the client connection that last used it (b"" = none known), so that the broker's
    # leases on sessions (whose client is gone) survive a broker restart.
    holders: Annotated[tuple[bytes, ...], blob_list(MAX_SESSIONS_LISTED, MAX_ROUTE_BYTES)] = ()
    evacuate: Annotated[bool, boolean] = False  # it drains and asks for its sessions to be moved (as Heartbeat's)
    checkpoints: Annotated[bool, boolean] = False  # it takes a moved session's recurrent-state checkpoint (MoveState's)
    sampling_extras: Annotated[bool, boolean] = False  # it applies Sampling's extras (logit_bias ... min_tokens)
    sampling_defaults: Annotated[SamplingDefaults, nested(SamplingDefaults)] = SamplingDefaults()  # its model's
    tools: Annotated[bool, boolean] = False  # it renders GENERATE's tools, messages' tool_calls, tool_call_id, reasoning

    def _check(self) -> None:
        if self.owners and len(self.owners) != len(self.sessions):
            raise _bad(f"owners has {len(self.owners)} items for {len(self.sessions)} sessions")
        if self.holders and len(self.holders) != len(self.sessions):
            raise _bad(f"holders has {len(self.holders)} items for {len(self.sessions)} sessions")


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """The broker accepted a READY; the worker uses these liveness settings from now on."""

    COMMAND: ClassVar[Command] = Command.WELCOME
    broker_id: RequestId
    heartbeat_ms: Annotated[int, integer(1, 3_600_000)]
    liveness: Annotated[int, integer(1, 1000)]


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Both ways. From the broker: its id (a new one means it restarted). From a worker: its load, its engine steps so
    far (`steps`: for information; the broker measures a request's progress by what reaches its client, not by what a
    worker says) and the sessions it closed for idling since the last report (`expired`)."""

    COMMAND: ClassVar[Command] = Command.HEARTBEAT
    broker_id: Annotated[str | None, text(64, ID_PATTERN, optional=True)] = None
    free_slots: Annotated[int | None, integer(0, 2**62, optional=True)] = None
    sessions: Annotated[int | None, integer(0, 2**62, optional=True)] = None
    draining: Annotated[bool, boolean] = False
    steps: Annotated[int | None, integer(0, 2**62, optional=True)] = None
    expired: SessionIds = ()
    # From a draining worker: move my sessions to the other workers of my model (answered EVACUATED once done).
    evacuate: Annotated[bool, boolean] = False


@dataclass(frozen=True, slots=True)
class Reconnect(Message):
    """The broker does not know this worker (it restarted): send READY again."""

    COMMAND: ClassVar[Command] = Command.RECONNECT
    broker_id: RequestId


@dataclass(frozen=True, slots=True)
class Disconnect(Message):
    """A worker leaves (drained or dying): its sessions are gone."""

    COMMAND: ClassVar[Command] = Command.DISCONNECT
    reason: Annotated[str, text(4096)] = ""


@dataclass(frozen=True, slots=True)
class Drop(Message):
    """Broker -> worker: sessions the broker declared lost with this worker while it was gone (stopped, cut off), whose
    clients were told session_lost. The worker closes them (their generations too) and answers nothing for them."""

    COMMAND: ClassVar[Command] = Command.DROP
    sessions: SessionIds


# -- moving sessions between workers ----------------------------------------------------------------------

MOVE_CHUNK_BYTES: Final = 4 << 20  # state bytes in one MOVE_CHUNK's payload frame (the sockets take 8 MiB a frame)
MAX_STATE_BYTES: Final = 1 << 40
MAX_CHUNKS_PER_MOVE: Final = MAX_STATE_BYTES // MOVE_CHUNK_BYTES
DIGEST_BYTES: Final = 16  # XXH3-128
MAX_KEPT_ANSWERS: Final = 64  # a moved session's recent answers carried along (MoveState.answers)
MAX_ANSWERS_BYTES: Final = 1 << 20  # and their bytes at most, so that a MOVE_STATE stays far below the frame limit
MOVE_STATUSES: Final = frozenset({"imported", "released", "aborted", "failed"})
MOVE_OUTCOMES: Final = frozenset({"release", "abort"})
MoveId = Annotated[str, text(64, ID_PATTERN)]


@dataclass(frozen=True, slots=True)
class Move(Message):
    """Broker -> source worker: send session `session_id`'s state (through the broker) to worker `target`, once no
    request of it is running. The broker holds the session's new requests meanwhile."""

    COMMAND: ClassVar[Command] = Command.MOVE
    migration: MoveId
    session_id: SessionId
    target: Name
    checkpoint: Annotated[bool, boolean] = False  # the target takes the session's checkpoint (its READY said so)


@dataclass(frozen=True, slots=True)
class MoveState(Message):
    """Source -> broker -> target: the moved session, before its `chunks` MOVE_CHUNKs of `nbytes` state bytes. `layout`
    is the state's layout (cuda_state's StateSpec.fingerprint) and `model` the source's model: the target refuses
    anything but its own. `digest`: XXH3-128 of this header's session fields and the state bytes
    (worker.engine.migration.state_digest), checked by the target before it takes the session."""

    COMMAND: ClassVar[Command] = Command.MOVE_STATE
    migration: MoveId
    session_id: SessionId
    tokens: TokenIds
    computed: Count
    nbytes: Annotated[int, integer(0, MAX_STATE_BYTES)]
    chunks: Annotated[int, integer(0, MAX_CHUNKS_PER_MOVE)]
    model: Name
    layout: Annotated[str, text(4096)]
    digest: Annotated[bytes, blob(DIGEST_BYTES)]
    owner: Owner = ""
    holder: Route = b""  # the route of the client connection that last used it (its lease)
    # The source's kept answers to the session's recent requests, each the [command, header] of an answer message, so
    # that a resent request is answered on the target as on the source, never run again.
    answers: Annotated[tuple[bytes, ...], blob_list(MAX_KEPT_ANSWERS, MAX_HEADER_BYTES)] = ()
    # The session's latest recurrent-state checkpoint (worker.engine.checkpoints), where the MOVE asked for it: the
    # state of its first `checkpoint_at` tokens, whose `checkpoint_bytes` come last in the chunks (`nbytes` counts them).
    checkpoint_at: Count = 0
    checkpoint_bytes: Count = 0

    def _check(self) -> None:
        if self.computed > len(self.tokens):
            raise _bad(f"computed {self.computed} exceeds the session's {len(self.tokens)} tokens")
        if self.checkpoint_at > self.computed or (self.checkpoint_at == 0) != (self.checkpoint_bytes == 0) \
                or self.checkpoint_bytes > self.nbytes:
            raise _bad(f"a checkpoint of {self.checkpoint_bytes} bytes at {self.checkpoint_at} tokens does not fit a "
                       f"session of {self.computed} computed tokens and {self.nbytes} bytes")
        if len(self.digest) != DIGEST_BYTES:
            raise _bad(f"digest must be {DIGEST_BYTES} bytes")
        if -(-self.nbytes // MOVE_CHUNK_BYTES) != self.chunks:
            raise _bad(f"{self.nbytes} state bytes come in {-(-self.nbytes // MOVE_CHUNK_BYTES)} chunks, not {self.chunks}")


@dataclass(frozen=True, slots=True)
class MoveChunk(Message):
    """Source -> broker -> target: state bytes [index * MOVE_CHUNK_BYTES, ...) of a move, as the message's one payload
    frame (not in the header: the broker forwards it unread)."""

    COMMAND: ClassVar[Command] = Command.MOVE_CHUNK
    migration: MoveId
    index: Annotated[int, integer(0, MAX_CHUNKS_PER_MOVE)]
    data: Annotated[Frame, payload(MOVE_CHUNK_BYTES)]

    def to_header(self) -> dict[str, Any]:
        return {"migration": self.migration, "index": self.index}


@dataclass(frozen=True, slots=True)
class MoveReport(Message):
    """Worker -> broker, about a move: the target `imported` the session (digest checked, in its table), the source
    `released` it (closed), either side `aborted` it (forgot it, as MOVE_END abort asked) or it `failed` there
    (`code` and `message` say why: a checksum or layout mismatch, no room, the session gone)."""

    COMMAND: ClassVar[Command] = Command.MOVE_REPORT
    migration: MoveId
    session_id: SessionId
    status: Annotated[str, one_of(MOVE_STATUSES)]
    code: Annotated[ErrorCode | None, error_code_or_none] = None
    message: Annotated[str, clipped_text(4096)] = ""


@dataclass(frozen=True, slots=True)
class MoveEnd(Message):
    """Broker -> worker: `release` (to the source, once the target imported it: close the session and report
    `released`) or `abort` (to either: forget the move; a target closes what it imported, then reports `aborted`)."""

    COMMAND: ClassVar[Command] = Command.MOVE_END
    migration: MoveId
    session_id: SessionId
    outcome: Annotated[str, one_of(MOVE_OUTCOMES)]


@dataclass(frozen=True, slots=True)
class Evacuated(Message):
    """Broker -> draining worker: the sessions that could move have (`moved`), the rest (`kept`) stay for its drain."""

    COMMAND: ClassVar[Command] = Command.EVACUATED
    moved: Count = 0
    kept: Count = 0


def pack_answer(message: Message) -> bytes:
    """An answer message as one MoveState.answers item (its command and header, without route)."""
    frames = encode(message.routed(b"") if hasattr(message, "route") else message)
    return bytes(msgpack.packb([frames[1], frames[2]], use_bin_type=True))


def unpack_answer(data: bytes) -> Message:
    """A MoveState.answers item back as its message, every field checked. ProtocolError when it is not one."""
    try:
        command, header = msgpack.unpackb(data, raw=False)
    except Exception as e:  # the trust boundary
        raise _bad(f"a moved answer is not [command, header]: {type(e).__name__}") from e
    if not isinstance(command, bytes) or not isinstance(header, bytes) or command not in (
            Command.REPLY.value, Command.ERROR.value):
        raise _bad("a moved answer must be a REPLY or an ERROR")
    return decode([VERSION, command, header])


MOVE_TYPES: Final = (Move, MoveState, MoveChunk, MoveEnd, Evacuated)  # what the broker sends a worker about moves


_BY_COMMAND: Final[dict[Command, type[Message]]] = {
    c.COMMAND: c
    for c in (
        CreateSession, Append, Chat, Generate, Fork, Close, Info, Cancel, Status,
        Chunks, Fanout, Error, Ready, Welcome, Heartbeat, Reconnect, Disconnect,
        Sessions, Lease, Drop, Move, MoveState, MoveReport, MoveEnd, Evacuated, DrainWorker, Rebalance,
    )
}


# -- frames <-> messages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Envelope:
    """A message whose frames are well formed but whose header is not yet typed."""

    command: Command
    header: dict[str, Any]
    payload: tuple[Frame, ...] = ()


def _envelope(message: Message) -> list[bytes]:
    return [VERSION, message.COMMAND.value, msgpack.packb(message.to_header(), use_bin_type=True)]


def encode(message: Message) -> list[bytes]:
    frames = _envelope(message)
    if isinstance(message, MoveChunk):
        frames.append(bytes(message.data))  # no copy when it is bytes already
    return frames


def encode_frames(message: Message) -> list[Frame]:
    """`encode`, but a MOVE_CHUNK's payload is left as it is (a memoryview of the state: sent without a copy)."""
    frames: list[Frame] = [*_envelope(message)]
    if isinstance(message, MoveChunk):
        frames.append(message.data)
    return frames


def decode_envelope(frames: Sequence[Frame]) -> Envelope:
    """Check version, command and header encoding. Raises ProtocolError."""
    if len(frames) < 3:
        if frames and frames[0] != VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"expected protocol {VERSION!r}")
        raise _bad(f"a message has at least 3 frames [version, command, header], got {len(frames)}")
    version, command_name, raw = frames[0], frames[1], frames[2]
    if version != VERSION:
        raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"expected protocol {VERSION!r}, got {bytes(version[:16])!r}")
    command = COMMANDS.get(bytes(command_name))
    if command is None:
        raise _bad(f"unknown command {bytes(command_name[:32])!r}")
    if len(raw) > MAX_HEADER_BYTES:
        raise _bad(f"header is larger than {MAX_HEADER_BYTES} bytes")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # the trust boundary: msgpack raises many types on garbage
        raise _bad(f"header is not valid msgpack: {type(e).__name__}") from e
    if not isinstance(header, dict):
        raise _bad(f"header must be a msgpack map, got {type(header).__name__}")
    return Envelope(command, header, tuple(f if isinstance(f, (bytes, memoryview)) else bytes(f) for f in frames[3:]))


def parse(envelope: Envelope) -> Message:
    """The typed message of a well-formed envelope. Raises ProtocolError (with request_id and route when known)."""
    header = envelope.header
    try:
        if envelope.command is Command.MOVE_CHUNK:
            if len(envelope.payload) != 1:
                raise _bad(f"MOVE_CHUNK takes one payload frame, got {len(envelope.payload)}")
            return build(MoveChunk, {**header, "data": envelope.payload[0]})
        if envelope.payload:
            raise _bad(f"{envelope.command.name} takes no payload frames, got {len(envelope.payload)}")
        if envelope.command is Command.REPLY:
            kind = header.get("kind")
            cls = REPLY_KINDS.get(kind) if isinstance(kind, str) else None
            if cls is None:
                raise _bad(f"unknown reply kind {kind!r}")
        else:
            cls = _BY_COMMAND[envelope.command]
        return build(cls, header)
    except FieldError as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(e), request_id=request_id_of(header), route=route_of(header)) from None
    except ProtocolError as e:
        e.request_id, e.route = request_id_of(header), route_of(header)
        raise


def decode(frames: Sequence[Frame]) -> Message:
    return parse(decode_envelope(frames))


def request_id_of(header: Mapping[str, Any]) -> str | None:
    """The header's request id if it is a valid one (to address an error), else None."""
    value = header.get("request_id")
    if isinstance(value, str) and _ID_RE.fullmatch(value):
        return value
    return None


def route_of(header: Mapping[str, Any]) -> bytes:
    """The header's route if it is a valid routing id, else b""."""
    value = header.get("route")
    if isinstance(value, bytes) and 0 < len(value) <= MAX_ROUTE_BYTES:
        return value
    return b""


class Address(NamedTuple):
    """Where the answer to a request goes, read off its raw header by `peek_address`: "" / None / b"" where the header
    has no valid one."""

    request_id: str | None
    session_id: str
    route: bytes


_ADDRESS_FIELDS: Final = frozenset(Address._fields)


def peek_address(header: Frame) -> Address:
    """The request id, session id and route of a raw header (each as request_id_of, is_session_id and route_of check
    it), its other fields skipped without being built: what answering a request that will not be decoded takes (a
    1M-token APPEND's ids are ~1 ms to skip and ~40 to decode). An empty Address for a header that is not a msgpack
    map."""
    found: dict[str, Any] = {}
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(header), 1))
        unpacker.feed(header)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in _ADDRESS_FIELDS:
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # the trust boundary: msgpack raises many types on garbage
        return Address(None, "", b"")
    session_id = found.get("session_id")
    return Address(request_id_of(found), session_id if isinstance(session_id, str) and is_session_id(session_id) else "",
                   route_of(found))


def error_for(e: ProtocolError) -> Error:
    return Error(request_id=e.request_id, code=e.code, message=e.message, route=e.route)
