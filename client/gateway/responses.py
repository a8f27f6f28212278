"""OpenAI's response objects: chat completions and completions, whole or as server-sent-event chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from broker.common.protocol import TokenLogprob
from client.gateway.service import Answer, Usage
from client.gateway.tool_calls import Call

MIN_LOGPROB = -9999.0  # JSON has no -inf: OpenAI reports this instead
DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON. orjson (several times faster than json on the token ids a streamed chunk or an answer
    carries); json for what orjson refuses (an integer beyond 64 bits, a lone surrogate), the same JSON otherwise."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # (ASCII escapes: a lone surrogate, which a client may send, has no UTF-8)
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _value(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def _token(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": _token(b), "logprob": _value(v), "bytes": list(b),
                         "top_logprobs": [{"token": _token(tb), "logprob": _value(tv), "bytes": list(tb)} for _, tv, tb in top]}
                        for v, b, top in logprobs],
            "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`offset`: characters of the completion before these tokens (for text_offset)."""
    offsets = []
    for _, b, _ in logprobs:
        offsets.append(offset)
        offset += len(_token(b))
    return {"tokens": [_token(b) for _, b, _ in logprobs], "token_logprobs": [_value(v) for v, _, _ in logprobs],
            "top_logprobs": [{_token(tb): _value(tv) for _, tv, tb in top} for _, _, top in logprobs],
            "text_offset": offsets}


def chat_completion(rid: str, model: str, answers: Sequence[Answer], usage: Usage, want_logprobs: bool,
                    token_ids: bool, session_id: str | None, reasoning: bool = False) -> dict[str, Any]:
    """`reasoning`: the gateway splits answers (--reasoning-parser): each message has `reasoning` and
    `reasoning_content` (null where there is none), and a null content where the answer is all reasoning."""
    choices = []
    for a in answers:
        message: dict[str, Any] = {"role": "assistant", "content": a.text, "refusal": None}
        if reasoning:
            message["content"] = None if a.reasoning is not None and not a.text else a.text
            message["reasoning"] = message["reasoning_content"] = a.reasoning
        if a.tool_calls:
            message["content"] = a.text or None
            message["tool_calls"] = [c.to_dict() for c in a.tool_calls]
        choice: dict[str, Any] = {"index": a.index, "message": message,
                                  "logprobs": chat_logprobs(a.logprobs) if want_logprobs else None,
                                  "finish_reason": a.finish_reason}
        if token_ids:
            choice["token_ids"] = a.token_ids
        choices.append(choice)
    return _response(rid, "chat.completion", model, choices, usage, session_id)


def completion(rid: str, model: str, answers: Sequence[Answer], usage: Usage, want_logprobs: bool, token_ids: bool,
               session_id: str | None) -> dict[str, Any]:
    choices = []
    for a in answers:
        choice: dict[str, Any] = {"index": a.index, "text": a.text,
                                  "logprobs": completion_logprobs(a.logprobs) if want_logprobs else None,
                                  "finish_reason": a.finish_reason}
        if token_ids:
            choice["token_ids"] = a.token_ids
        choices.append(choice)
    return _response(rid, "text_completion", model, choices, usage, session_id)


def _response(rid: str, kind: str, model: str, choices: list[dict[str, Any]], usage: Usage,
              session_id: str | None) -> dict[str, Any]:
    """The body around a non-streamed answer's choices (both endpoints'), with our session_id when there is one."""
    body: dict[str, Any] = {"id": rid, "object": kind, "created": now(), "model": model, "choices": choices,
                            "usage": usage.to_dict(), "system_fingerprint": None}
    if session_id is not None:
        body["session_id"] = session_id
    return body


class ChunkWriter:
    """The server-sent events of one streamed answer, in OpenAI's chunk format: chat's first delta of each choice
    carries the role, a choice's last chunk its finish_reason, `usage` null in every chunk and, with
    stream_options.include_usage, a last chunk with no choices and the usage; then `data: [DONE]`."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, token_ids: bool, include_usage: bool) -> None:
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.model = model
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.want_logprobs = want_logprobs
        self.token_ids = token_ids
        self.include_usage = include_usage
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._head = (f'{{"id":"{self.id}","object":"{self.object}","created":{self.created},'
                      f'"model":{json.dumps(self.model)},"system_fingerprint":null,"choices":').encode()
        self._tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def _event(self, choices: list[dict[str, Any]]) -> bytes:
        return b"data: " + self._head + dumps(choices) + self._tail

    def delta(self, index: int, token_ids: Sequence[int], text: str, logprobs: Sequence[TokenLogprob],
              finish_reason: str | None, reasoning: str = "", tool_calls: Sequence[Call] = ()) -> bytes:
        """One chunk of choice `index` (chat: preceded by its role delta the first time; its reasoning, split off
        with --reasoning-parser, as `reasoning` and `reasoning_content`; the function calls read at its end, each
        whole, with --tool-call-parser)."""
        out = b""
        choice: dict[str, Any]
        if self.chat:
            if index not in self._started:
                self._started.add(index)
                out += self._event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}])
            if text or token_ids or reasoning or tool_calls:
                delta: dict[str, Any] = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
                if text or not (reasoning or tool_calls):
                    delta["content"] = text
                if tool_calls:
                    delta["tool_calls"] = [{"index": k, **c.to_dict()} for k, c in enumerate(tool_calls)]
                choice = {"index": index, "delta": delta,
                          "logprobs": chat_logprobs(logprobs) if self.want_logprobs else None, "finish_reason": None}
                if self.token_ids:
                    choice["token_ids"] = list(token_ids)
                out += self._event([choice])
            if finish_reason is not None:
                out += self._event([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
            return out
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        choice = {"index": index, "text": text,
                  "logprobs": completion_logprobs(logprobs, offset) if self.want_logprobs else None,
                  "finish_reason": finish_reason}
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
        return self._event([choice])

    def usage(self, usage: Usage) -> bytes:
        return sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "system_fingerprint": None, "choices": [], "usage": usage.to_dict()})

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return sse(body)
