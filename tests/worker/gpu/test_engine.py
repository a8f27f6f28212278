"""The engine on the GPU (bf16, VMM slab, CUDA graphs) against the CPU in fp32, and isolation: every GPU
configuration (solo, batched, interleaved, forked, with requests taken mid-step) gives the CPU's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.executor import StepRows

from .device import needs_cuda
from .references import TOKENS, Reference, greedy, open_with, relative_error

# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_runs_bf16_on_the_vmm_slab_with_graphs(gpu_engine: object) -> None:
    from cuda_state.vmm import VmmBackend
    from worker.engine import Engine
    from worker.engine.graphs import GraphExecutor

    assert isinstance(gpu_engine, Engine)
    assert gpu_engine.model.dtype == torch.bfloat16 and gpu_engine.model.kernels.decode_attention is not None
    assert isinstance(gpu_engine.table.backend, VmmBackend)
    assert isinstance(gpu_engine.executor, GraphExecutor)
    assert gpu_engine.executor.buckets == [1, 4, 8] and gpu_engine.capacity == 8  # every bucket row-invariant
    # A 1-row step's 3 (row, KV head) programs leave the SMs idle: keys split, at most PINNED_SPLITS_MAX, in every bucket
    assert gpu_engine.executor.attention_splits == 2
    # ... in the split graphs, which steps with a row of 512 keys or more replay (the others: one program a row)
    assert gpu_engine.executor.long_rows_from == 512 and sorted(gpu_engine.executor._long_graphs) == [1, 4, 8]
    assert gpu_engine.executor.row_products and gpu_engine.model.norms_folded  # decode products: worker.kernels.matmul
    assert gpu_engine.executor.prefill_buckets == [128, 256, 512, 1024, 2048]  # every prefill bucket row-invariant
    assert gpu_engine.executor.prefill_splits == 1  # 2048 rows x 3 KV heads fill the SMs
    model = gpu_engine.model
    weights = [model.lm_head.weight, model.norm, *(lin.weight for layer in model.layers for lin in layer.linears())]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1  # one allocation (Llama.pack_weights)


@pytest.mark.gpu
@needs_cuda
def test_gpu_greedy_tokens_match_the_cpu(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    for ref in references:
        sid = open_with(gpu_engine, ref.prompt)
        assert gpu_engine.generate(sid, **greedy(TOKENS)).token_ids == ref.tokens
        gpu_engine.close(sid)


@pytest.mark.gpu
@needs_cuda
def test_gpu_logits_match_the_cpu_within_bf16_tolerance(
    gpu_engine: object, cpu_engine: object, references: list[Reference]
) -> None:
    """Teacher-forced: both see the same tokens; the prefill (eager) and every decode step (graph)."""
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine) and isinstance(cpu_engine, Engine)
    for ref in references[:3]:
        seq = ref.prompt + ref.tokens
        n = len(ref.prompt)
        cpu_slot = cpu_engine.table.create(cpu_engine.max_context)
        cpu = cpu_engine.executor.execute(StepRows(seq, list(range(len(seq))), [cpu_slot] * len(seq), list(range(n - 1, len(seq)))))
        cpu_engine.table.free(cpu_slot)
        slot = gpu_engine.table.create(gpu_engine.max_context)
        try:
            rows = [gpu_engine.executor.execute(StepRows(ref.prompt, list(range(n)), [slot] * n, [n - 1]))]
            for i, token in enumerate(ref.tokens):
                rows.append(gpu_engine.executor.execute(StepRows([token], [n + i], [slot], [0])))
            gpu = torch.cat(rows).cpu()
        finally:
            gpu_engine.table.free(slot)
        for step in range(len(seq) - n + 1):
            err = relative_error(gpu[step], cpu[step])
            assert err < 4e-2, f"step {step}: relative error {err:.4f}"
        assert gpu[:-1].argmax(-1).tolist() == ref.tokens


@pytest.mark.gpu
@needs_cuda
def test_no_bleed_solo_interleaved_and_batched_agree(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine
    from worker.engine.graphs import GraphExecutor

    assert isinstance(gpu_engine, Engine) and isinstance(gpu_engine.executor, GraphExecutor)
    lengths = [8, 5, 7, 6, 8, 4, 8, 3]  # sessions leave the batch at different steps: buckets shrink and pad
    expected = [ref.tokens[:n] for ref, n in zip(references, lengths, strict=True)]
    replays = gpu_engine.executor.replays

    solo = []
    for ref, n in zip(references, lengths, strict=True):
        sid = open_with(gpu_engine, ref.prompt)
        solo.append(gpu_engine.generate(sid, **greedy(n)).token_ids)
        gpu_engine.close(sid)
    assert solo == expected

    sids = [open_with(gpu_engine, ref.prompt) for ref in references]
    batched = gpu_engine.generate_many([(sid, greedy(n)) for sid, n in zip(sids, lengths, strict=True)])
    assert [g.token_ids for g in batched] == expected
    for sid in sids:
        gpu_engine.close(sid)

    # Interleaved: half start, run a few steps, the rest join mid-way (mixed prefill + decode steps).
    sids = [open_with(gpu_engine, ref.prompt) for ref in references]
    streams = {i: gpu_engine.stream(sids[i], **greedy(lengths[i])) for i in (0, 2, 4, 6)}
    got: dict[int, list[int]] = {i: [] for i in range(8)}
    for _ in range(2):
        for i in (0, 2, 4, 6):
            got[i] += next(streams[i]).token_ids
    for i in (1, 3, 5, 7):
        streams[i] = gpu_engine.stream(sids[i], **greedy(lengths[i]))
    while streams:
        for i in list(streams):
            try:
                got[i] += next(streams[i]).token_ids
            except StopIteration:
                del streams[i]
    assert [got[i] for i in range(8)] == expected
    assert gpu_engine.executor.replays > replays  # decode steps did run from graphs


@pytest.mark.gpu
@needs_cuda
def test_batch_invariant_tokens_for_any_prompt(gpu_engine: object) -> None:
    """No margin selection: arbitrary prompts give bitwise the same greedy and seeded tokens alone,
    batched and interleaved with other sessions' prefill chunks (decode rows always run in the
    same 8-row bucket, prefill chunks packed into one fixed-shape forward with attention per chunk)."""
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    rng = random.Random(99)
    prompts = [[rng.randrange(300, 49000) for _ in range(n)] for n in (5, 17, 33, 9, 600, 2, 41, 12)]
    params = [greedy(12) if i % 2 else {**greedy(12), "temperature": 0.9, "top_p": 0.9, "seed": i} for i in range(8)]
    solo = []
    for p, kw in zip(prompts, params, strict=True):
        sid = open_with(gpu_engine, p)
        solo.append(gpu_engine.generate(sid, **kw).token_ids)
        gpu_engine.close(sid)
    sids = [open_with(gpu_engine, p) for p in prompts]
    batched = gpu_engine.generate_many(list(zip(sids, params, strict=True)))
    assert [g.token_ids for g in batched] == solo
    for sid in sids:
        gpu_engine.close(sid)
    # Interleaved: the long prompt (600 tokens: chunks 512 + 88) prefills while others decode.
    sids = [open_with(gpu_engine, p) for p in prompts]
    streams = {i: gpu_engine.stream(sids[i], **params[i]) for i in (0, 1, 2, 3)}
    got: dict[int, list[int]] = {i: [] for i in range(8)}
    for i in (0, 1, 2, 3):
        got[i] += next(streams[i]).token_ids
    for i in (4, 5, 6, 7):
        streams[i] = gpu_engine.stream(sids[i], **params[i])
    while streams:
        for i in list(streams):
            try:
                got[i] += next(streams[i]).token_ids
            except StopIteration:
                del streams[i]
    assert [got[i] for i in range(8)] == solo
    for sid in sids:
        gpu_engine.close(sid)


@pytest.mark.gpu
@needs_cuda
def test_requests_taken_while_a_prefill_step_runs_change_no_tokens(gpu_engine: object) -> None:
    """The worker takes requests while a step with prompt tokens runs (step(wait=False) returns without reading it,
    Engine.prefill_running): sessions opened, generations started and a generating session closed between those
    calls leave every session's tokens exactly as when each runs alone."""
    from worker.engine import Engine
    from worker.engine.sampling import SamplingParams

    assert isinstance(gpu_engine, Engine)
    rng = random.Random(7)
    # Long prompts fill the first steps with up to 2048 prompt rows (~3 ms each on an H100): the host waits. The
    # 513-token one runs a 512-token chunk, then a decode row whose token the host knows, in the step where the
    # 9-token one (arrived after it) decodes the id the step before sampled on the device.
    prompts = [[rng.randrange(300, 49000) for _ in range(n)] for n in (513, 9, 900, 900, 40, 12, 300)]
    solo = []
    for prompt in prompts:
        sid = open_with(gpu_engine, prompt)
        solo.append(gpu_engine.generate(sid, **greedy(10)).token_ids)
        gpu_engine.close(sid)

    names: dict[str, int] = {}  # engine request id -> prompt index
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reasons: dict[str, str | None] = {}
    doomed = open_with(gpu_engine, prompts[4])
    doomed_rid = gpu_engine.start_generate(doomed, SamplingParams(**greedy(200)))  # type: ignore[arg-type]
    waiting = [4, 5, 6]
    calls = 0

    def meanwhile() -> None:
        nonlocal calls
        calls += 1
        if waiting:
            i = waiting.pop(0)
            names[gpu_engine.start_generate(open_with(gpu_engine, prompts[i]), SamplingParams(**greedy(10)))] = i  # type: ignore[arg-type]
        elif doomed in gpu_engine.sessions():
            gpu_engine.close(doomed)

    for i in range(4):
        names[gpu_engine.start_generate(open_with(gpu_engine, prompts[i]), SamplingParams(**greedy(10)))] = i  # type: ignore[arg-type]
    while gpu_engine.has_work():
        for chunk in gpu_engine.step(wait=False):
            if chunk.request_id in names:
                out[names[chunk.request_id]] += chunk.token_ids
            if chunk.finish_reason is not None:
                reasons[chunk.request_id] = chunk.finish_reason
        if gpu_engine.prefill_running:  # the worker takes the requests that came meanwhile
            meanwhile()
    assert calls >= 4 and not waiting and doomed not in gpu_engine.sessions()
    assert [out[i] for i in range(len(prompts))] == solo
    assert reasons[doomed_rid] == "cancelled"


@pytest.mark.gpu
@needs_cuda
def test_no_bleed_fork_continues_exactly_like_its_parent(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    ref = references[0]
    parent = open_with(gpu_engine, ref.prompt)
    assert gpu_engine.generate(parent, **greedy(4)).token_ids == ref.tokens[:4]
    child = gpu_engine.fork(parent)
    both = gpu_engine.generate_many([(parent, greedy(4)), (child, greedy(4))])
    assert both[0].token_ids == both[1].token_ids == ref.tokens[4:8]
    # A second fork, taken at the same point as the first, continues alone like the pair did.
    grandchild = gpu_engine.fork(child)
    assert gpu_engine.session_tokens(grandchild) == gpu_engine.session_tokens(parent)
    other = gpu_engine.fork(grandchild)
    assert gpu_engine.generate(other, **greedy(1)).token_ids == gpu_engine.generate(grandchild, **greedy(1)).token_ids
