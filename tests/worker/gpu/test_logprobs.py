"""Log-probabilities and prefill-only turns on the GPU (bf16, CUDA graphs, one step ahead): the values are the same
bits alone, batched and interleaved, close to the CPU's in fp32, and a prefill-only parent's forks decode its tokens."""

from __future__ import annotations

import pytest

from .device import needs_cuda
from .references import TOKENS, Reference, greedy, open_with

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def _with_logprobs(engine: object, refs: list[Reference], k: int) -> list[list[tuple[float, bytes, tuple[tuple[int, float, bytes], ...]]]]:
    """Every reference prompt generated at once (batched rows), with log-probabilities."""
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    sids = [open_with(engine, r.prompt) for r in refs]
    results = engine.generate_many([(sid, {**greedy(TOKENS), "logprobs": k}) for sid in sids])
    for sid in sids:
        engine.close(sid)
    out = []
    for ref, result in zip(refs, results, strict=True):
        assert result.token_ids == ref.tokens and result.logprobs is not None
        out.append(result.logprobs)
    return out


@pytest.mark.gpu
@needs_cuda
def test_gpu_logprobs_are_batch_invariant_and_close_to_the_cpu(
    gpu_engine: object, cpu_engine: object, references: list[Reference]
) -> None:
    batched = _with_logprobs(gpu_engine, references, 5)
    alone = [_with_logprobs(gpu_engine, [r], 5)[0] for r in references[:3]]
    assert alone == batched[:3]  # the same bits whatever else is in the step
    cpu = _with_logprobs(cpu_engine, references[:3], 5)
    for gpu_row, cpu_row in zip(batched[:3], cpu, strict=True):
        for (g, _, g_top), (c, _, c_top) in zip(gpu_row, cpu_row, strict=True):
            assert g_top[0][0] == c_top[0][0] and abs(g - c) < 0.1  # bf16 against fp32


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_only_parent_forks_each_decode_the_plain_turns_tokens(
    gpu_engine: object, references: list[Reference]
) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    for ref in references[:4]:
        parent = open_with(gpu_engine, ref.prompt)
        assert gpu_engine.generate(parent, max_tokens=0).finish_reason == "length"
        children = [gpu_engine.fork(parent) for _ in range(3)]
        results = gpu_engine.generate_many([(c, greedy(TOKENS)) for c in children])
        assert [r.token_ids for r in results] == [ref.tokens] * 3
        for sid in [parent, *children]:
            gpu_engine.close(sid)
