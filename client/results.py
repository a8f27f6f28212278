"""What client calls return."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from broker.common.protocol import TokenLogprob


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string), "length", "cancelled" or "capacity" (no memory to grow)
    session_length: int  # tokens in the session afterwards
    appended: int = 0  # prompt tokens the call appended before generating (generate(prompt=...))
    # generate(logprobs=k): one per token id, (logprob, token bytes, the top k as (id, logprob, bytes))
    logprobs: list[TokenLogprob] = field(default_factory=list)
    rewound: int = 0  # generate(from_start=True): the session's tokens it dropped (held, and not in the new prompt)
    cached: int | None = None  # the prompt tokens whose state the session already held (None: an older worker)


@dataclass(frozen=True)
class Chunk:
    """Part of a streamed generation. The last chunk has finish_reason set (its tokens may be empty)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, with generate(logprobs=k)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    length: int
    model: str
    worker: str
    max_context: int
    busy: bool  # a generation is in flight


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    model: str
    capacity: int
    free_slots: int
    sessions: int
    draining: bool
    device: str
    last_seen_s: float = 0.0  # since the broker last heard from the worker
    max_context: int = 0  # the tokens a session on this worker can hold (0: the broker did not say)
    # Its model's recommended sampling (generation_config.json), by generate()'s names: temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens; only those it recommends. The OpenAI gateway's defaults.
    sampling_defaults: Mapping[str, float | int] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    tools: bool = False  # it renders tools, function calls and reasoning (False: an older worker, or an older broker)
