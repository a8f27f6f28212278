"""The scheduler: which rows the next step runs.

A step holds a decode row for every generating session, then whole prompt chunks in arrival order while
they fit the step's token budget (worker.engine.budget); a chunk never runs past a request's checkpoint position
(a recurrent model's, worker.engine.checkpoints). A prefill-only request (max_tokens 0) takes chunks of
its prompt up to, not including, its last token, and samples nothing. When the step before has been launched but not
read (the GPU runs one step ahead), its generating sessions decode the ids it samples, read on the device,
and its prompt chunks count as computed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from worker.engine.executor import StepRows
from worker.engine.session import Launched, Request


class StepPlan:
    """One step's rows as the executor takes them, built in one pass over the requests.

    The batch holds, in this order: the decode rows whose token the last step samples on the device
    (`decode_ahead`: not yet in the session), the decode rows whose token the host knows, then the prompt
    chunks, each part in the order added. Plain lists appended to in place: this runs for every row of every
    step, and the worker's compute loop is the slower side of a step at 64 sessions."""

    def __init__(self, samples: torch.Tensor | None = None) -> None:
        self.samples = samples  # the last step's sampled ids, on the device
        self._picks: list[int] = []  # decode_ahead row i takes samples[picks[i]]
        self._ahead: list[Request] = []  # decode_ahead rows: the requests, their positions and slots
        self._ahead_positions: list[int] = []
        self._ahead_slots: list[int] = []
        self._decode: list[Request] = []  # decode rows whose token the host knows
        self._decode_positions: list[int] = []
        self._decode_slots: list[int] = []
        self._decode_tokens: list[int] = []
        self._tokens: list[int] = []  # the prompt chunks' rows
        self._positions: list[int] = []
        self._slots: list[int] = []
        self._logits_at: list[int] = []  # the chunk rows that sample, counted from the first chunk row
        self._sampled: list[Request] = []
        self._sampled_positions: list[int] = []
        self.partial: list[tuple[Request, int, int]] = []  # prompt chunks that sample nothing
        self.prefill_tokens = 0  # prompt tokens in the chunks
        self.decode_prompt_tokens = 0  # prompt tokens in decode rows (a lone pending token: a hybrid's last, always)
        self.reach: list[tuple[Request, int]] = []  # per request: the positions its slot must back (one past its last)

    def __len__(self) -> int:
        """Requests in the step."""
        return self.decode_rows + len(self._sampled) + len(self.partial)

    @property
    def decode_rows(self) -> int:
        return len(self._ahead) + len(self._decode)

    def decode_ahead(self, request: Request, position: int, pick: int) -> None:
        """A decode row reading its token from the last step's samples."""
        self._ahead.append(request)
        self._ahead_positions.append(position)
        self._ahead_slots.append(request.session.slot)
        self._picks.append(pick)
        self.reach.append((request, position + 1))

    def add(self, request: Request, start: int, n: int) -> None:
        """`n` of the session's tokens from position `start`; the request samples if they end its tokens
        (a decode row always does)."""
        s = request.session
        self.reach.append((request, start + n))
        if n == 1 and start + 1 == len(s.tokens):  # a 1-token chunk mid-prompt (step_tokens 1) samples nothing
            self._decode.append(request)
            self._decode_positions.append(start)
            self._decode_slots.append(s.slot)
            self._decode_tokens.append(s.tokens[start])
            self.decode_prompt_tokens += not request.generated  # (after the first sample, the last sample's row)
            return
        self._tokens += s.tokens[start : start + n]
        self._positions += range(start, start + n)
        self._slots += [s.slot] * n
        self.prefill_tokens += n
        if start + n == len(s.tokens):  # the whole prompt is in: its last row gives the next token
            self._logits_at.append(len(self._tokens) - 1)
            self._sampled.append(request)
            self._sampled_positions.append(start + n - 1)
        else:
            self.partial.append((request, start, n))

    def prefill(self, request: Request, start: int, n: int) -> None:
        """`n` prompt tokens from position `start` that sample nothing, even one alone (a prefill-only request)."""
        s = request.session
        self.reach.append((request, start + n))
        self._tokens += s.tokens[start : start + n]
        self._positions += range(start, start + n)
        self._slots += [s.slot] * n
        self.prefill_tokens += n
        self.partial.append((request, start, n))

    def rows(self) -> StepRows:
        """The step as the executor takes it."""
        d = self.decode_rows
        logits_at = list(range(d)) + [d + r for r in self._logits_at]
        source = (self.samples, self._picks) if self._picks and self.samples is not None else None
        return StepRows([0] * len(self._picks) + self._decode_tokens + self._tokens,
                        self._ahead_positions + self._decode_positions + self._positions,
                        self._ahead_slots + self._decode_slots + self._slots, logits_at, source)

    def sampled(self) -> tuple[list[Request], list[int]]:
        """The requests whose next token the step samples, in the order of their logits, and those rows' positions."""
        return (self._ahead + self._decode + self._sampled,
                self._ahead_positions + self._decode_positions + self._sampled_positions)


def schedule(active: Iterable[Request], last: Launched | None, budget: int, prefill_chunk: int,
             max_context: int) -> StepPlan:
    """The next step: a decode row for every generating session, then whole prompt chunks of at most `prefill_chunk`
    tokens in arrival order while they fit `budget` tokens. With `last` (launched, not read yet), its generating
    sessions decode the ids it samples, read on the device, unless it ends them by length; its prompt chunks count
    as computed. A request whose session could not get the pages for its next rows (`starved`) gets no more rows.

    No chunk runs past a request's `checkpoint_at` (a recurrent model's generations: their prompt but its last token,
    or but its turn tail): the state between two steps then holds the tokens before it, what worker.engine.checkpoints
    keeps (a prompt's last token then runs alone, as a decode row, in the next step). Whether a checkpoint is taken
    or not: a generation computes the same rows whether or not another session left a slot free."""
    sampled = {} if last is None else {id(r): i for i, r in enumerate(last.sampled)}
    computed = {} if last is None else {id(r): p + n for r, p, n in last.partial}
    plan = StepPlan(None if last is None else last.ids)
    limit = max_context - 1
    for request in active:
        if request.starved:
            continue
        i = sampled.get(id(request))
        if i is not None:
            assert last is not None
            position = last.positions[i] + 1
            if request.generated + 1 < request.params.max_tokens and position < limit:
                plan.decode_ahead(request, position, i)
            continue
        start = computed.get(id(request), request.session.computed)
        pending = len(request.session.tokens) - start
        if request.params.max_tokens == 0:  # prefill only: every prompt token but the last, never sampling
            n = min(_chunk_end(request, start, len(request.session.tokens) - 1) - start, prefill_chunk)
            if n > 0 and budget > 0:
                if n > budget:
                    budget = 0
                    continue
                plan.prefill(request, start, n)
                budget -= n
            continue
        if pending == 1:
            plan.add(request, start, 1)
        elif budget > 0:
            n = min(_chunk_end(request, start, len(request.session.tokens)) - start, prefill_chunk)
            if n > budget:
                budget = 0  # the step is full (the first chunk always fits): this one goes first next step
                continue
            plan.add(request, start, n)
            budget -= n
    return plan


def _chunk_end(request: Request, start: int, end: int) -> int:
    """Where a prompt chunk from `start` may end: at `end`, or at the request's checkpoint position before it."""
    at = request.checkpoint_at
    return at if at is not None and start < at < end else end
