"""Logit bias and the repetition, frequency and presence penalties: a request's logits changed before sampling.

Their meanings and order are vLLM's (OpenAI's for logit_bias and the last two), per row of a step's logits:

    logits[t] += bias[t]                                          logit_bias (the tokens it names)
    where t is in the context or the answer so far:
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r   repetition_penalty r (1: unchanged)
    logits[t] -= frequency * count[t]                             count: t's occurrences in the answer so far
    logits[t] -= presence * (count[t] > 0)

The context is what the session held when the generation started (earlier turns and the prompt); the answer is the
generation's sampled tokens. Then min_tokens keeps the stop ids out of reach (worker.engine.core), temperature, top-k,
top-p and min-p apply (worker.engine.sampling), and greedy takes the maximum. Log-probabilities stay the model's (as
they are before temperature).

A request that asks for any of them holds a row of the pool (`Penalties`), on the logits' device: its answer's counts
(int32), whether its context holds each token (bool), its bias (float32) and its three penalties. The engine runs a
step ahead (the next step's sampling is queued before the host reads this one's tokens), so a step's sampled tokens are
counted on the device right after they are sampled, in stream order; after a failed step, whose samples are never
accepted, the rows are built again from the tokens the host accepted (`rebuild`).

Each row's numbers come from its own request only, elementwise, so a session's tokens do not depend on which other
sessions share the step. The pool grows by doubling (a row is 9 bytes a vocabulary entry: 2.2 MB for a 248k
vocabulary) and its rows are reused; it is made on the first request that asks and never shrinks. A growth that would
leave less than GROWTH_MARGIN of device memory free is refused (CapacityExhausted): the request is refused, the steps
go on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.sampling import SamplingParams, upload
from worker.errors import CapacityExhausted

FIRST_ROWS = 4
GROWTH_MARGIN = 512 << 20  # device memory a growth leaves free for the steps' own allocations


@dataclass(frozen=True)
class PenaltyRows:
    """One step's penalized rows: their rows in the step's logits and their rows of the pool, on the device."""

    at: torch.Tensor  # int64 (r,): rows of the logits
    pool: torch.Tensor  # int64 (r,): rows of the pool


class Penalties:
    """The pool of penalized requests' rows on one device (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.rows = 0
        self._free: list[int] = []
        self._last: tuple[tuple[tuple[int, ...], tuple[int, ...]], PenaltyRows] | None = None  # rows_of's last
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.context = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.bias = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self.factors = torch.zeros((0, 3), dtype=torch.float32, device=device)  # repetition, frequency, presence

    @property
    def held(self) -> int:
        """Rows held by requests."""
        return self.rows - len(self._free)

    def open(self, params: SamplingParams, context: Sequence[int]) -> int:
        """A row for a new generation with these parameters whose session holds `context`: returns its number."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.bias[row].zero_()
        if params.logit_bias:
            tokens, values = zip(*params.logit_bias, strict=True)
            self.bias[row].index_put_((upload(list(tokens), torch.long, self.device),),
                                      upload(list(values), torch.float32, self.device))
        factors = [float(params.repetition_penalty), float(params.frequency_penalty), float(params.presence_penalty)]
        self.factors[row].copy_(upload(factors, torch.float32, self.device))
        self._fill(row, context, ())
        return row

    def close(self, row: int) -> None:
        """The row is free for the next request (its numbers are set again when it is taken)."""
        self._free.append(row)

    def rebuild(self, row: int, context: Sequence[int], answer: Sequence[int]) -> None:
        """The row's counts and context again from the host's tokens (after a failed step)."""
        self._fill(row, context, answer)

    def rows_of(self, at: Sequence[int], pool: Sequence[int]) -> PenaltyRows:
        """A step's penalized rows on the device: those of the step before when they are the same (no upload)."""
        key = (tuple(at), tuple(pool))
        if self._last is None or self._last[0] != key:
            self._last = key, PenaltyRows(upload(list(at), torch.long, self.device),
                                          upload(list(pool), torch.long, self.device))
        return self._last[1]

    def apply(self, logits: torch.Tensor, rows: PenaltyRows) -> torch.Tensor:
        """`logits` (R, vocab) float32 with the penalized rows changed: a new tensor (the model's stay for
        log-probabilities). On a GPU in one launch (worker.kernels.penalties), with these torch ops' numbers."""
        if logits.shape[1] != self.vocab_size or logits.dtype != torch.float32:
            raise ValueError(f"logits must be (R, {self.vocab_size}) float32, got {tuple(logits.shape)} {logits.dtype}")
        if self.device.type == "cuda":
            from worker.kernels.penalties import apply_penalties

            return apply_penalties(logits, rows.at, rows.pool, self.bias, self.counts, self.context, self.factors)
        scores = logits.index_select(0, rows.at) + self.bias.index_select(0, rows.pool)
        counts = self.counts.index_select(0, rows.pool)
        answered = counts > 0
        factors = self.factors.index_select(0, rows.pool)
        repetition, frequency, presence = factors[:, 0:1], factors[:, 1:2], factors[:, 2:3]
        seen = self.context.index_select(0, rows.pool) | answered
        scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
        scores = scores - frequency * counts
        scores = scores - presence * answered
        return logits.index_copy(0, rows.at, scores)

    def count(self, ids: torch.Tensor, rows: PenaltyRows) -> None:
        """Count the tokens a step sampled (`ids`, (R,) int64 on the device) into their requests' rows."""
        if self.device.type == "cuda":
            from worker.kernels.penalties import count_samples

            count_samples(self.counts, ids, rows.at, rows.pool)
            return
        flat = rows.pool * self.vocab_size + ids.index_select(0, rows.at)
        self.counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, dtype=torch.int32, device=self.device))

    def _fill(self, row: int, context: Sequence[int], answer: Sequence[int]) -> None:
        self.context[row].zero_()
        if context:
            self.context[row].index_fill_(0, upload(list(context), torch.long, self.device), True)
        self.counts[row].zero_()
        if answer:
            ids = upload(list(answer), torch.long, self.device)
            self.counts[row].index_add_(0, ids, torch.ones(ids.shape, dtype=torch.int32, device=self.device))

    def _grow(self) -> None:
        rows = max(FIRST_ROWS, 2 * self.rows)
        need = rows * self._row_bytes()
        if self.device.type == "cuda":  # the steps' own allocations must still fit beside it
            free, _ = torch.cuda.mem_get_info(self.device)
            if free < need + GROWTH_MARGIN:
                raise CapacityExhausted(f"no device memory for {rows} requests' penalties and logit bias "
                                        f"({need >> 20} MiB with {free >> 20} MiB free)")
        try:
            counts = torch.zeros((rows, self.vocab_size), dtype=torch.int32, device=self.device)
            context = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
            bias = torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=self.device)
            factors = torch.zeros((rows, 3), dtype=torch.float32, device=self.device)
        except torch.OutOfMemoryError as e:
            raise CapacityExhausted(f"no device memory for {rows} requests' penalties and logit bias "
                                    f"({need >> 20} MiB)") from e
        for new, old in ((counts, self.counts), (context, self.context), (bias, self.bias), (factors, self.factors)):
            new[: self.rows].copy_(old)
        self.counts, self.context, self.bias, self.factors = counts, context, bias, factors
        self._free.extend(range(rows - 1, self.rows - 1, -1))  # the lowest first
        self.rows = rows

    def _row_bytes(self) -> int:
        return self.vocab_size * (4 + 1 + 4) + 3 * 4  # counts, context, bias; factors

