"""Sampling parameters, the batched sampler and the log-probabilities a request asks for.

Each request draws its randomness from its own generator (one uniform number per token, on the CPU),
and each row's token depends only on that row's logits and that number. So the same seed and inputs
give the same tokens whatever else is in the batch.

Log-probabilities (`SamplingParams.logprobs`) are computed on the logits' device right after sampling,
outside any CUDA graph: a row's log-softmax in float64 (its reductions run within the row, so the numbers do
not depend on the batch), the sampled token's value and the row's top k (a stable sort: ties in id order).
They are the model's distribution (raw logits, before temperature, top-k and top-p), as vLLM and OpenAI
report them.
"""

from __future__ import annotations

import math
import random
import secrets
from dataclasses import dataclass, field

import torch

from worker.errors import BadRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


MIN_TEMPERATURE = 1e-5  # sampling below this is greedy
MAX_TOP_K = 2**31 - 1  # as the protocol bounds it (a larger one passes no tensor of the step)
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MIN_REPETITION_PENALTY = 0.01  # a smaller one overflows a seen token's logit to infinity (then NaN probabilities)
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_LOGIT_BIAS_VALUE = 100.0  # a bias lies in [-100, 100] (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0: prefill only (compute the prompt but its last token, generate nothing)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = whole vocabulary
    seed: int | None = None  # None = fresh random seed
    stop: tuple[str, ...] = ()  # generation ends when the text contains one; it is cut from the text
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation, like EOS (not returned)
    ignore_eos: bool = False  # keep going past EOS (benchmarks that need a fixed length)
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely (k <= 20)
    # worker.engine.penalties: added to the logits (token id, bias), then the penalties (vLLM's and OpenAI's meanings)
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0  # > 1 discourages every token of the context and the answer so far
    frequency_penalty: float = 0.0  # subtracted once for each time a token is in the answer so far
    presence_penalty: float = 0.0  # subtracted once if a token is in the answer so far
    min_p: float = 0.0  # sampling keeps the tokens at least min_p times as likely as the likeliest (vLLM's); 0 = all
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not end it before this many tokens (vLLM's)

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (the request then holds a row of the penalties' pool)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 \
            or self.presence_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise BadRequest(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                0.0 <= self.temperature <= 100.0):
            raise BadRequest(f"temperature must be in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise BadRequest(f"top_k must be an integer in [0, {MAX_TOP_K}], got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise BadRequest(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise BadRequest(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} chars")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise BadRequest(f"stop_token_ids must be token ids in [0, {vocab_size}), got {t!r}")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise BadRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {lp!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise BadRequest(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise BadRequest(f"min_p must be in [0, 1], got {self.min_p!r}")
        mt = self.min_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 <= mt <= self.max_tokens:
            raise BadRequest(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got {mt!r}")
        rp = self.repetition_penalty
        if not _number(rp) or not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise BadRequest(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                             f"got {rp!r}")
        if not isinstance(self.logit_bias, tuple):
            raise BadRequest(f"logit_bias must be (token id, bias) pairs, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise BadRequest(f"logit_bias entries must be (token id, bias) pairs, got {entry!r:.80}")
            token, bias = entry
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise BadRequest(f"logit_bias keys must be token ids in [0, {vocab_size}), got {token!r}")
            if token in seen:
                raise BadRequest(f"logit_bias names token {token} twice")
            seen.add(token)
            if not _number(bias) or not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
                raise BadRequest(f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], "
                                 f"got {bias!r} for token {token}")


def _number(value: object) -> bool:
    """A finite int or float (an int too large for a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass
class RowRandom:
    """A request's private stream of uniform numbers: Python's Mersenne Twister, seeded by every bit of the seed
    (torch's CPU generator keeps 32 of them: seeds 1 and 1 + 2**32 drew the same numbers)."""

    seed: int
    # Made on the first draw: a greedy request never draws, and making one is host work for the worker's compute
    # loop at every request (64 sessions turning over start 64 requests at once).
    _generator: random.Random | None = field(default=None, init=False, repr=False)

    @property
    def generator(self) -> random.Random:
        if self._generator is None:
            self._generator = random.Random(self.seed)
        return self._generator

    @classmethod
    def for_params(cls, params: SamplingParams) -> RowRandom:
        return cls(params.seed if params.seed is not None else secrets.randbits(63))

    def uniform(self) -> float:
        return self.generator.random()


def sample(logits: torch.Tensor, params: list[SamplingParams], randoms: list[RowRandom]) -> list[int]:
    """One token per row of `logits` (R, vocab), float32, on any device."""
    return [int(t) for t in sample_ids(logits, params, randoms).tolist()]


def sample_ids(logits: torch.Tensor, params: list[SamplingParams], randoms: list[RowRandom]) -> torch.Tensor:
    """sample() without reading the result: int64 ids (R,) on the logits' device, queued, no host sync.

    Each sampled row draws its uniform number now, so the draws follow the order of the calls."""
    out = logits.argmax(dim=-1)
    # Below MIN_TEMPERATURE the distribution is a point mass at float precision (and logits / t overflow): greedy.
    sampled = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
    if sampled:
        dev = logits.device
        rows = upload(sampled, torch.long, dev)
        u = upload([randoms[i].uniform() for i in sampled], torch.float64, dev)
        temps = upload([params[i].temperature for i in sampled], torch.float32, dev)
        top_k = upload([params[i].top_k for i in sampled], torch.long, dev)
        top_p = upload([params[i].top_p for i in sampled], torch.float64, dev)
        min_p = upload([params[i].min_p for i in sampled], torch.float64, dev)
        out[rows] = _sample_rows(logits[rows] / temps[:, None], u, top_k, top_p, min_p)
    return out


def upload(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`. On a GPU through pinned memory: the copy queues behind the
    running step instead of waiting for it (a copy from pageable memory synchronises the host)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _sample_rows(scaled: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF sampling over the top-k / top-p / min-p truncated distribution of each row.

    The softmax and the running sums are float64: a float32 cumulative sum over a 49k vocabulary
    drifts by ~1e-3, far more than one token's probability, and its rounding depends on how many
    rows the scan kernel gets, so the same row could pick another token in another batch (seen on
    the H100). In float64 the drift (~1e-12) is far below any token's mass.
    """
    probs, ids = kept(scaled, top_k, top_p, min_p)
    cdf = probs.cumsum(dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # searchsorted can land on a zero-probability tail entry only through rounding: step back to the last kept one.
    last_kept = (probs > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, last_kept)
    return ids.gather(-1, pick)[:, 0]


def kept(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's distribution after top-k, top-p and min-p (float64 probabilities, not renormalized, zero where cut)
    in descending order, and the token ids in that order: what _sample_rows draws from. The kept tokens are a prefix."""
    scaled = scaled.double()
    # Stable: tied probabilities (common with bf16 logits) keep id order, so a row samples the same
    # token whatever other rows are in the batch (an unstable sort may order ties by the batch shape).
    values, ids = scaled.sort(dim=-1, descending=True, stable=True)  # (R, V)
    rank = torch.arange(values.shape[-1], device=values.device)[None, :]
    k = torch.where(top_k > 0, top_k, values.shape[-1])[:, None]
    values = values.masked_fill(rank >= k, float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((mass_before >= top_p.double()[:, None]) & (rank > 0), 0.0)  # the top token always stays
    if min_p is not None:  # after top-k and top-p, as transformers' warpers (vLLM's V1 cuts it before them)
        probs = probs.masked_fill(probs < min_p.double()[:, None] * probs[:, :1], 0.0)
    return probs, ids


@dataclass
class StepLogprobs:
    """The log-probabilities one step computed, for the sampled rows that asked (`rows`, in row order): the sampled
    token's (n,), and the top `k` ids and values (n, k) of each row, k the most any of them asked for. On the logits'
    device until `to_host` queues their copy."""

    rows: list[int]
    chosen: torch.Tensor  # float32 (n,)
    top_ids: torch.Tensor  # int64 (n, k)
    top_values: torch.Tensor  # float32 (n, k)

    def to_host(self) -> StepLogprobs:
        """Their copy in pinned host memory, queued on the current stream (valid once the stream has passed it)."""
        if self.chosen.device.type != "cuda":
            return self
        return StepLogprobs(self.rows, *(_pinned_copy(t) for t in (self.chosen, self.top_ids, self.top_values)))

    def by_row(self) -> dict[int, tuple[float, list[int], list[float]]]:
        """Host values: sampled row -> (the sampled token's log-probability, top ids, top values)."""
        chosen, ids, values = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        return {row: (chosen[i], ids[i], values[i]) for i, row in enumerate(self.rows)}


def step_logprobs(logits: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams]) -> StepLogprobs | None:
    """The log-probabilities of the rows whose request asked for them (None when none did), queued on the logits'
    device without a host sync: the sampled id's (`ids`, from sample_ids) and the top k of the row."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    k = max(params[i].logprobs or 0 for i in rows)
    picked = upload(rows, torch.long, logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, picked).double(), dim=-1)  # (n, V) float64
    chosen = logprobs.gather(1, ids.index_select(0, picked)[:, None])[:, 0].float()
    if k:
        values, top = logprobs.sort(dim=-1, descending=True, stable=True)
        top_ids, top_values = top[:, :k].contiguous(), values[:, :k].float()
    else:
        top_ids = torch.empty((len(rows), 0), dtype=torch.long, device=logits.device)
        top_values = torch.empty((len(rows), 0), dtype=torch.float32, device=logits.device)
    return StepLogprobs(rows, chosen, top_ids, top_values)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
