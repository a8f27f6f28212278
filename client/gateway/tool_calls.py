"""The function calls in a chat answer, read as vLLM's tool parsers read them (`gateway --tool-call-parser`), for a
request that gives `tools` (tool_choice "auto", OpenAI's default with tools):

    hermes       Qwen2.5, Qwen3 (Hermes' format): each call is <tool_call>{"name": ..., "arguments": {...}}
                 </tool_call> (the last may be cut short of its closing tag); the text before the first is the content.
    qwen3_coder  Qwen3.5, Qwen3-Coder: each call is <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
                 </function></tool_call>, one line each; a value is read as the tool's parameter schema types it
                 (a string as it is; integer, number, boolean; object and array as JSON; null), as vLLM does (but a
                 number that JSON cannot hold stays text); the text before the first call is the content.
    llama3_json  Llama 3.1 and 3.2: the answer is the call, {"name": ..., "parameters": {...}} ("arguments" first
                 where it has both; after <|python_tag|>, where the answer keeps it), or several separated by ";"; no
                 content.

An answer whose calls do not read as JSON objects with a name and arguments (any JSON value, as vLLM takes them) is
content, as vLLM leaves it. A call gets an id (the answer's prefix, chatcmpl-tool-..., and its number) and its
arguments as JSON text, OpenAI's shape. Streamed, content goes out as it comes until what could be the start of a
call; the rest is held to the answer's end and read whole there, so that a streamed answer's content and calls are the
whole answer's.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from client.gateway.reasoning import tag_start

PARSERS = ("hermes", "qwen3_coder", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def id_prefix() -> str:
    """The start of one answer's call ids (each call adds its number: the same ids however often it is read)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}-"


@dataclass(frozen=True)
class ToolParser:
    name: str
    tools: tuple[tuple[str, Any], ...] = ()  # (function name, its parameters' JSON schema): qwen3_coder reads by them

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"unknown tool call parser {self.name!r}: one of {', '.join(PARSERS)}")

    def parse(self, text: str, ids: str) -> tuple[str, list[Call]]:
        """(content, calls) of a whole answer, the calls numbered after `ids` (id_prefix): no calls, and the whole
        text as content, where it makes none."""
        try:
            if self.name == "hermes":
                found = _hermes(text)
            elif self.name == "qwen3_coder":
                found = _qwen3_coder(text, dict(self.tools))
            else:
                found = _llama3(text)
        except (ValueError, TypeError, AttributeError, RecursionError):  # (unforeseen: content, never an error)
            found = None
        if found is None:
            return text, []
        content, calls = found
        return content, [Call(f"{ids}{k}", name, arguments) for k, (name, arguments) in enumerate(calls)]

    def holds_from(self, text: str, sent: int) -> int | None:
        """Where, in an answer's text so far of which `sent` characters went out as content, what could be a call
        starts (held back from streaming); None: nowhere."""
        if self.name in ("hermes", "qwen3_coder"):
            at = text.find(HERMES_START, sent)
            if at >= 0:
                return at
            partial = tag_start(text[sent:], HERMES_START)
            return len(text) - partial if partial else None
        if sent:  # a Llama 3 call is the whole answer
            return None
        lead = text.lstrip()
        return 0 if not lead or lead.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(lead) else None


Found = tuple[str, list[tuple[str, str]]]  # (content, [(name, JSON arguments)])


def _hermes(text: str) -> Found | None:
    if HERMES_START not in text:
        return None
    calls = []
    for closed, open_ended in _HERMES.findall(text):
        call = _call(closed or open_ended, ("arguments",))
        if call is None:
            return None
        calls.append(call)
    return text[:text.find(HERMES_START)], calls


_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _qwen3_coder(text: str, schemas: dict[str, Any]) -> Found | None:
    if HERMES_START not in text:
        return None
    calls = []
    for closed, open_ended in _HERMES.findall(text):
        functions = list(_FUNCTION.finditer(closed or open_ended))  # (several in one <tool_call>: each a call)
        if not functions:
            return None
        for found in functions:
            name = found.group(1).strip()
            if not name:
                return None
            schema = schemas.get(name)
            properties = schema.get("properties") if isinstance(schema, dict) else None
            arguments = {}
            for key, raw in _PARAMETER.findall(found.group(2)):
                value = raw[1:] if raw.startswith("\n") else raw
                value = value[:-1] if value.endswith("\n") else value
                typed = properties.get(key.strip()) if isinstance(properties, dict) else None
                arguments[key.strip()] = _typed(value, typed.get("type") if isinstance(typed, dict) else None)
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return text[:text.find(HERMES_START)], calls


def _typed(value: str, kind: Any) -> Any:
    """A qwen3_coder parameter's value as its schema types it (vLLM's conversion); a string where it does not read."""
    if value.lower() == "null":
        return None
    if isinstance(kind, list):  # ["null", "integer"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), "string")
    if not isinstance(kind, str):
        return value
    kind = kind.strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float", "double")):
            number = float(value)
            if not math.isfinite(number):  # (no JSON number: the text as it is)
                return value
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
        if kind in ("object", "array", "arr", "dict", "list") or kind.startswith(("dict", "list")):
            return json.loads(value, parse_constant=_no_constant)
    except (ValueError, OverflowError, RecursionError):
        return value
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # (NaN, Infinity: json reads them, JSON has none)


def _llama3(text: str) -> Found | None:
    rest = text.strip()
    rest = rest.removeprefix(PYTHON_TAG).strip()
    if not rest.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls = []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except (ValueError, RecursionError):
            return None
        call = _named(value, ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest:
            if not rest.startswith(";"):
                return None
            rest = rest[1:].strip()
    return "", calls


def _call(body: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    try:
        value = json.loads(body.strip())
    except (ValueError, RecursionError):
        return None
    return _named(value, keys)


def _named(value: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """A call from {"name": ..., KEY: arguments}, the first of `keys` it has (its value any JSON, as vLLM takes it);
    None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in keys if k in value), None)
    if key is None:
        return None
    return value["name"], json.dumps(value[key], ensure_ascii=False)


@dataclass
class CallStream:
    """A streamed answer's content as it may go out (`feed` each piece), and at its end (`finish`, with the whole
    text) the rest of the content and the calls, read whole."""

    parser: ToolParser
    ids: str  # the answer's id_prefix
    _text: str = ""
    _sent: int = 0  # characters of the text gone out as content

    def feed(self, piece: str) -> str:
        self._text += piece
        held = self.parser.holds_from(self._text, self._sent)
        upto = len(self._text) if held is None else held
        out = self._text[self._sent:upto]
        self._sent = upto
        return out

    def finish(self) -> tuple[str, list[Call]]:
        # What went out is the start of the content: the text before a call (never held past), or all of it.
        content, calls = self.parser.parse(self._text, self.ids)
        rest = content[self._sent:]
        self._sent = len(self._text)
        return rest, calls
