"""The OpenAI request bodies the gateway takes, validated: what it can honour, and a 400 for anything else.

Every field OpenAI defines is listed. Those the gateway honours are checked for type and range; the others are
accepted only at the value that means "not used" (functions empty, response_format text, ...), so a
request is never answered as if a parameter it set had been applied. A field OpenAI does not define is refused
too, except the extensions below.

Extensions (the openai package sends them with `extra_body`, or as a header):
    session_id        (or the X-Session-ID header) binds the conversation to one live session
    return_token_ids  each choice carries its `token_ids`
    top_k, ignore_eos, stop_token_ids  as vLLM takes them
    chat_template_kwargs  (chat) variables for the model's chat template, as vLLM takes them: Qwen3's enable_thinking

An assistant message sent back may carry its `reasoning` (or `reasoning_content`) where the gateway splits answers
(--reasoning-parser: client.gateway.reasoning).

A sampling parameter a request leaves out is the model's recommended one where its workers announce one (their
generation_config.json, as vLLM's server reads it), else OpenAI's default: see `sampling`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from broker.common import protocol as p
from client.gateway.errors import ApiError, bad_request
from client.gateway.sessions import marked_turn

NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})  # no recommended sampling
MAX_TOOLS = 128  # functions a request may offer
MAX_N = 16  # choices per request: each is a session (a fork of the prompt's)
TemplateValue = bool | int | float | str | None  # a chat_template_kwargs value (the wire's TemplateArg checks it)
MAX_STOP = p.MAX_STOP_STRINGS
SESSION_ID_PATTERN = r"[A-Za-z0-9._:-]{1,128}"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Fields OpenAI marks nullable whose null means their default here (the openai package sends some of them back as
    # it received them: an assistant message's refusal, say). Each class lists its own.
    _NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls._NULL_IS_DEFAULT:
            return {k: v for k, v in data.items() if not (v is None and k in cls._NULL_IS_DEFAULT)}
        return data


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=p.MAX_NAME_CHARS)
    arguments: str  # JSON text


class ToolCall(_Strict):
    """A function call of an assistant message sent back (OpenAI's tool_calls entry)."""

    id: str = Field(max_length=p.MAX_NAME_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class Function(_Strict):
    """A function the model may call (OpenAI's tools entry's)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # (needs constrained decoding: only false or absent)

    @field_validator("strict")
    @classmethod
    def _strict(cls, value: bool | None) -> bool | None:
        _unused("strict", value, (False,))
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None  # None: an assistant's answer that had no content (reasoning only)
    name: None = None  # the chat templates here have no place for a name: refused rather than dropped
    # An assistant message as the API answered it (sent back with the next turn): no refusal; its function calls;
    # its reasoning (a gateway with --reasoning-parser), by vLLM's name or the older one.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=p.MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=p.MAX_NAME_CHARS)  # a tool message's: the call it answers
    refusal: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("refusal", "function_call", "audio", "annotations")
    @classmethod
    def _answered_here(cls, value: Any, info: ValidationInfo) -> Any:
        _unused(str(info.field_name), value, ([],) if info.field_name == "annotations" else ())
        return value

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        return role

    def model_post_init(self, context: Any) -> None:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.reasoning is not None or self.reasoning_content is not None:
            if self.role != "assistant":
                raise ValueError("only an assistant message has reasoning")
            if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
                raise ValueError("reasoning and reasoning_content differ: give one")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, has a tool_call_id (the call it answers)")

    def turn(self) -> tuple[str, str]:
        """(role as the template takes it, text): developer is OpenAI's newer name for system. Function calls, a tool
        message's call id and an answer's reasoning (the template's reasoning_content) are kept in the text
        (sessions.marked_turn)."""
        if self.content is None:
            text = ""
        else:
            text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        calls = [(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()]
        return marked_turn(ROLES[self.role], text, calls, self.tool_call_id, reasoning)


class StreamOptions(_Strict):
    include_usage: bool = False


def _unused(name: str, value: Any, allowed: Sequence[Any] = ()) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{name} is not supported by this server (got {str(value)[:80]})")


class _Common(_Strict):
    """What both endpoints take."""

    model: str = Field(min_length=1, max_length=p.MAX_NAME_CHARS)
    max_tokens: int | None = Field(default=None, ge=1, le=p.MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: Int64 | None = None  # OpenAI's range; each choice samples with (seed + its index) mod 2**63
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=p.MAX_LOGIT_BIAS)
    user: str | None = Field(default=None, max_length=256)
    # extensions
    session_id: str | None = None
    return_token_ids: bool = False
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)  # vLLM's (smaller overflows a logit)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's
    min_tokens: int | None = Field(default=None, ge=0, le=p.MAX_TOKENS)  # vLLM's
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=p.MAX_STOP_STRINGS)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > 2**31 - 1:
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
            if int(key) in seen:
                raise ValueError(f"token {int(key)} is named twice")
            seen.add(int(key))
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    def extras(self, defaults: Mapping[str, float | int] = NO_DEFAULTS) -> dict[str, Any]:
        """logit_bias, the penalties, min_p and min_tokens, by the protocol's names (protocol.Sampling's extras); the
        model's recommended repetition_penalty and min_p (`defaults`) where the request leaves them out."""
        return {"logit_bias": {int(k): float(v) for k, v in (self.logit_bias or {}).items()},
                "repetition_penalty": _given(self.repetition_penalty, defaults, "repetition_penalty", 1.0),
                "frequency_penalty": self.frequency_penalty or 0.0, "presence_penalty": self.presence_penalty or 0.0,
                "min_p": _given(self.min_p, defaults, "min_p", 0.0), "min_tokens": self.min_tokens or 0}

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP or not all(0 < len(s) <= p.MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings of at most {p.MAX_STOP_CHARS} characters")
        return value

    @field_validator("session_id")
    @classmethod
    def _session_id(cls, value: str | None) -> str | None:
        if value is not None and not _SESSION_ID.fullmatch(value):
            raise ValueError(f"session_id must match {SESSION_ID_PATTERN}")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")


class ChatRequest(_Common):
    _NULL_IS_DEFAULT = frozenset({"n", "stream", "logprobs", "return_token_ids", "ignore_eos"})
    messages: list[Message] = Field(min_length=1, max_length=p.MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=p.MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=p.MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "auto" (the default with tools) or "none"
    parallel_tool_calls: bool | None = None  # the model may always make several calls: true only
    functions: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: Any = None
    service_tier: str | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(default=None, max_length=p.MAX_TEMPLATE_ARGS)

    def model_post_init(self, context: Any) -> None:
        for key, value in (self.chat_template_kwargs or {}).items():
            try:
                p.TemplateArg(key, value)
            except p.ProtocolError as e:
                raise ValueError(f"chat_template_kwargs: {e.message}") from e
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice {str(self.tool_choice)[:80]} is not supported by this server: only \"auto\" "
                             "and \"none\" (a call it must make needs constrained decoding)")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice is only allowed with tools")
        if self.parallel_tool_calls is False:
            raise ValueError("parallel_tool_calls false is not supported by this server: the model may make several "
                             "calls")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools names a function twice")
        for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort",
                     "web_search_options", "metadata"):
            _unused(name, getattr(self, name))
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format is not supported by this server: only {\"type\": \"text\"}")
        if self.modalities not in (None, ["text"]):
            raise ValueError("modalities: only [\"text\"] is supported")
        _unused("store", self.store, (False,))
        _unused("service_tier", self.service_tier, ("auto", "default"))

    def turns(self) -> tuple[tuple[str, str], ...]:
        return tuple(m.turn() for m in self.messages)

    def tools_json(self) -> str:
        """The tools the template is given (JSON text, the client's order), "" for none: with tool_choice "none" the
        model is not told of them."""
        if not self.tools or self.tool_choice == "none":
            return ""
        try:
            return json.dumps([t.model_dump(exclude_none=True) for t in self.tools], ensure_ascii=False,
                              separators=(",", ":"))
        except RecursionError:
            raise bad_request("tools are nested too deep", "tools") from None

    def tool_schemas(self) -> tuple[tuple[str, Any], ...]:
        """Each tool's (function name, parameters' JSON schema)."""
        return tuple((t.function.name, t.function.parameters or {}) for t in self.tools or ())

    def has_reasoning(self) -> bool:
        """Whether an assistant message carries its reasoning (taken only with a reasoning parser)."""
        return any(m.reasoning is not None or m.reasoning_content is not None for m in self.messages)

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ: give one", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    _NULL_IS_DEFAULT = frozenset({"n", "stream", "echo", "return_token_ids", "ignore_eos"})
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=p.MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def model_post_init(self, context: Any) -> None:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        _unused("suffix", self.suffix)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server (only equal to n)")

    def prompt_value(self) -> str | tuple[int, ...]:
        """The one prompt: text or token ids (a batch of several prompts is refused)."""
        prompt = self.prompt
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        # Validated already: a string, or a list whose items are all ints, all strings or all lists of ints (the
        # first item says which). Checked with builtins, not a loop in Python: a conversation resent whole is long.
        if isinstance(prompt, str):
            value: str | tuple[int, ...] = prompt
        elif isinstance(prompt[0], int):
            value = tuple(prompt)
        elif len(prompt) == 1:
            one = prompt[0]
            value = one if isinstance(one, str) else tuple(one)
        else:
            raise bad_request("a batch of several prompts is not supported: send one prompt a request", "prompt")
        if not value:
            raise bad_request("prompt is empty", "prompt")
        if isinstance(value, tuple) and (min(value) < 0 or max(value) > 2**31 - 1):
            raise bad_request("prompt token ids must be non-negative integers", "prompt")
        return value


@dataclass(frozen=True)
class Sampling:
    """What both endpoints turn into the protocol's sampling parameters (max_tokens None: the session's room)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    extras: dict[str, Any]  # logit_bias ({id: bias}), the three penalties, min_p and min_tokens, by their names
    recommended_max: int | None = None  # max_tokens None: the model's recommended most (its max_new_tokens), if any

    def params(self, max_context: int, index: int = 0) -> p.Sampling:
        """Choice `index` of n: its own seed (seed + index), so that n seeded choices differ. With no max_tokens, up to
        the session's room (`max_context`), or the model's recommended most where it is less (as vLLM caps it), but
        never below the request's own min_tokens."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        limit = self.max_tokens
        if limit is None:
            limit = max_context if self.recommended_max is None else max(min(self.recommended_max, max_context),
                                                                         self.extras["min_tokens"])
        try:
            extras = {**self.extras, "logit_bias": tuple(p.LogitBias(t, b) for t, b in self.extras["logit_bias"].items())}
            return p.Sampling(max_tokens=limit, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=self.logprobs, **extras)
        except p.ProtocolError as e:
            raise bad_request(e.message) from e


def sampling(request: ChatRequest | CompletionRequest, defaults: Mapping[str, float | int] = NO_DEFAULTS) -> Sampling:
    """The request's sampling; a parameter it leaves out is the model's recommended one (`defaults`, from its
    generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens), else OpenAI's."""
    if isinstance(request, ChatRequest):
        limit, logprobs = request.token_limit(), request.logprob_count()
    else:
        limit, logprobs = request.max_tokens, request.logprobs
    request.check_stream_options()
    return Sampling(limit, _given(request.temperature, defaults, "temperature", 1.0),
                    _given(request.top_p, defaults, "top_p", 1.0), int(_given(request.top_k, defaults, "top_k", 0)),
                    request.seed, request.stops(), tuple(request.stop_token_ids or ()), request.ignore_eos, logprobs,
                    request.extras(defaults), None if "max_tokens" not in defaults else int(defaults["max_tokens"]))


def _given(value: float | None, defaults: Mapping[str, float | int], name: str, otherwise: float) -> float:
    """The request's value; where it has none, the model's recommended one, else the API's default."""
    return value if value is not None else float(defaults.get(name, otherwise))


def parse(kind: type[ChatRequest] | type[CompletionRequest], body: Any) -> Any:
    """The validated request, or ApiError 400 naming the first bad field (OpenAI's wording for unknown ones)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise _first_error(e) from None
    except ValueError as e:  # model_post_init's refusals
        raise bad_request(str(e)) from None


def _first_error(e: ValidationError) -> ApiError:
    error = e.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in error["loc"] if not str(x).startswith("function-"))
    if error["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {loc}", loc)
    message = str(error["msg"]).removeprefix("Value error, ")
    return bad_request(f"{loc}: {message}" if loc else message, loc or None)
