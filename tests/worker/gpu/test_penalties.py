"""Logit bias and the penalties on the GPU, where the engine runs a step ahead: each step's samples are counted on the
device before the step launched after it samples (the CPU tests check the numbers against transformers)."""

from __future__ import annotations

import pytest
import torch

from worker.engine.penalties import Penalties
from worker.engine.sampling import SamplingParams

from .device import needs_cuda
from .references import TOKENS, Reference, open_with

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")

PENALIZED: dict[str, object] = {"max_tokens": TOKENS, "ignore_eos": True, "frequency_penalty": 1.2,
                                "presence_penalty": 0.6, "repetition_penalty": 1.4}


@pytest.mark.gpu
@needs_cuda
def test_gpu_penalized_tokens_are_the_same_run_ahead_or_step_by_step_alone_or_batched(
        gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    engine = gpu_engine
    assert isinstance(engine, Engine) and engine.overlap

    def run(prompts: list[list[int]], overlap: bool) -> list[list[int]]:
        engine.overlap = overlap
        try:
            sids = [open_with(engine, prompt) for prompt in prompts]
            results = engine.generate_many([(sid, PENALIZED) for sid in sids])
            for sid in sids:
                engine.close(sid)
        finally:
            engine.overlap = True
        return [r.token_ids for r in results]

    prompts = [r.prompt for r in references[:4]]
    step_by_step = [run([prompt], False)[0] for prompt in prompts]
    assert [run([prompt], True)[0] for prompt in prompts] == step_by_step
    assert run(prompts, True) == step_by_step
    assert step_by_step != [r.tokens for r in references[:4]]  # the penalties changed the greedy answers
    assert engine.penalties is not None and engine.penalties.held == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_logit_bias_of_100_makes_a_token_every_token(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    sid = open_with(gpu_engine, references[0].prompt)
    assert gpu_engine.generate(sid, max_tokens=8, ignore_eos=True, logit_bias=((4321, 100.0),)).token_ids == [4321] * 8
    gpu_engine.close(sid)


@pytest.mark.gpu
@needs_cuda
def test_gpu_pool_gives_the_cpus_bits() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn((6, 1000), generator=gen) * 8
    answers = [torch.randint(0, 1000, (40,), generator=gen).tolist() for _ in range(6)]
    contexts = [torch.randint(0, 1000, (200,), generator=gen).tolist() for _ in range(6)]
    params = [SamplingParams(repetition_penalty=0.5 + 0.3 * i, frequency_penalty=0.4 * i - 1.0,
                             presence_penalty=1.0 - 0.3 * i, logit_bias=((7 * i, 3.5 * i - 9.0),)) for i in range(6)]
    out = []
    for device in ("cpu", "cuda"):
        pool = Penalties(1000, torch.device(device))
        rows = [pool.open(p, c) for p, c in zip(params, contexts, strict=True)]
        for row, answer in zip(rows, answers, strict=True):
            pool.rebuild(row, contexts[row], answer)
        out.append(pool.apply(logits.to(device), pool.rows_of([5, 0, 3], [rows[1], rows[4], rows[2]])).cpu())
    assert torch.equal(out[0], out[1])


@pytest.mark.gpu
@needs_cuda
def test_gpu_pool_refuses_a_growth_that_would_leave_too_little_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.engine.penalties as penalties
    from worker.errors import CapacityExhausted

    free, _ = torch.cuda.mem_get_info()
    monkeypatch.setattr(penalties, "GROWTH_MARGIN", free)  # whatever the rows take, less than this is left
    pool = Penalties(1000, torch.device("cuda"))
    with pytest.raises(CapacityExhausted, match="no device memory for 4 requests' penalties"):
        pool.open(SamplingParams(presence_penalty=1.0), [1, 2])
    assert pool.rows == 0 and pool.held == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_min_tokens_is_the_same_run_ahead_or_step_by_step(gpu_engine: object, references: list[Reference]) -> None:
    """The stop token is a token of a greedy answer not among those before it (the latest such; the tiny model often
    repeats its first token throughout): the answer ends there without min_tokens; with min_tokens 4 past it, the
    token is out of reach for that many tokens, counted with the step launched ahead as step by step."""
    from worker.engine import Engine

    engine = gpu_engine
    assert isinstance(engine, Engine)
    ref, at = max(((r, i) for r in references for i in range(len(r.tokens)) if r.tokens[i] not in r.tokens[:i]),
                  key=lambda found: found[1])
    stop = ref.tokens[at]
    asked: dict[str, object] = {"max_tokens": 16, "ignore_eos": True, "stop_token_ids": [stop]}
    sid = open_with(engine, ref.prompt)
    early = engine.generate(sid, **asked)
    engine.close(sid)
    assert (early.token_ids, early.finish_reason) == (ref.tokens[:at], "stop")
    answers = []
    for overlap in (False, True):
        engine.overlap = overlap
        try:
            sid = open_with(engine, ref.prompt)
            answers.append(engine.generate(sid, **asked, min_tokens=at + 4).token_ids)
            engine.close(sid)
        finally:
            engine.overlap = True
    assert answers[0] == answers[1] and len(answers[0]) >= at + 4 and answers[0][:at] == ref.tokens[:at]
