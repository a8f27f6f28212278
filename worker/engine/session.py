"""The engine's host-side record of each session, each generation and each launched step, and what a step hands back."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.engine.checkpoints import Checkpoint
from worker.engine.detokenizer import Detokenizer
from worker.engine.sampling import RowRandom, SamplingParams, StepLogprobs

# One returned token's log-probability: (its value, the token's bytes, the top candidates as (id, value, bytes)),
# for requests with SamplingParams.logprobs set. Bytes, not text: a token may hold part of a UTF-8 character.
TokenLogprob = tuple[float, bytes, tuple[tuple[int, float, bytes], ...]]


@dataclass(slots=True)
class Chunk:
    """What one step produced for one request. finish_reason: None, "stop", "length", "cancelled"
    or "capacity" (its session could not get the pages to grow)."""

    request_id: str
    session_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass
class Generation:
    """A whole generation, for the synchronous helpers (Engine.generate)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Request:
    """A generation in flight on one session."""

    id: str
    session: Session
    params: SamplingParams
    random: RowRandom
    detok: Detokenizer
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)  # returned tokens (no EOS / stop ids)
    generated: int = 0  # sampled tokens, EOS included
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    starved: bool = False  # its session could not get the pages for its next rows: it ends "capacity"
    # A recurrent state's checkpoint (worker.engine.checkpoints): the position its prompt's chunks stop at (a step
    # boundary whether a checkpoint is taken or not), and the slot the state there is copied into (None: no room).
    checkpoint_at: int | None = None
    checkpoint: Checkpoint | None = None
    penalty_row: int | None = None  # its row of the engine's Penalties, where its parameters change the logits


NO_SLOT = -1  # a hibernated session's slot


@dataclass
class Session:
    """A conversation: its slot in the session table and its whole token history.

    `computed` counts the tokens whose state (K/V, and a hybrid model's recurrent state) is in the slot; the rest
    are pending and get prefilled when the session next generates. The last sampled token of a generation stays
    pending, so the next turn starts exactly where the last one ended (with a recurrent state, unless a step the
    engine ran ahead has already taken it in: then computed counts it, see Engine._state_after)."""

    id: str
    slot: int  # NO_SLOT while hibernated (its state in host memory or on disk)
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    request: Request | None = None
    owner: str = ""  # the client it belongs to, kept with its state when it hibernates
    used_at: float = field(default_factory=time.monotonic)  # when a request last touched it

    @property
    def resident(self) -> bool:
        return self.slot != NO_SLOT

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` start with alike."""
    a, b = (x if isinstance(x, list) else list(x) for x in (a, b))  # (a list never equals a tuple)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a conversation that goes on), at list-compare speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Launched:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    partial: list[tuple[Request, int, int]]  # (request, first position, tokens) of the prompt chunks that sample nothing
    sampled: list[Request]  # the requests whose next token this step samples, in row order
    positions: list[int]  # the position of each sampled row (its token's K/V are written there)
    ids: torch.Tensor  # the sampled ids on the device (len(sampled),)
    host: torch.Tensor  # their copy in host memory: valid once `copied` has passed
    copied: torch.cuda.Event | None  # None: `host` is already valid (no device)
    prefill_tokens: int = 0  # prompt tokens the step computes
    logprobs: StepLogprobs | None = None  # of the sampled rows that asked, in host memory once `copied` has passed

    def done(self) -> bool:
        """Whether the device has made the ids (reading them will not wait)."""
        return self.copied is None or self.copied.query()

    def read(self) -> list[int]:
        """The sampled ids, waiting for the device if it has not made them yet."""
        if self.copied is not None:
            self.copied.synchronize()
        ids: list[int] = self.host.tolist()
        return ids

    def read_logprobs(self) -> dict[int, tuple[float, list[int], list[float]]]:
        """Sampled row -> (its token's log-probability, top ids, top values), for the rows that asked; after read()."""
        return {} if self.logprobs is None else self.logprobs.by_row()
