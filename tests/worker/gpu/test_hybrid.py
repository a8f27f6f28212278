"""The hybrid model (Qwen3.5) on the GPU: the folder tests/worker/test_qwen3_5.py has transformers write, served in bf16
through the DeltaNet, norm and attention kernels and the CUDA graphs, against the same folder on the CPU in fp32 (exact
against transformers there); on the GPU a session's tokens are the same alone, batched with others and after a fork,
from the graphs and from eager replays of the same steps, running ahead or not; no bucket is dropped at start-up (the
rows are batch-invariant); create/fork/close cycles return to the same device memory.

Run on the GPU machine: `python -m pytest -m gpu tests/worker/gpu/test_hybrid.py` (and the `bleed or cycle` ones under
compute-sanitizer, tests/gpu_run.sh)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.engine import Engine

from ..test_qwen3_5 import NEW_TOKENS, Folder, drive, write_folder
from .device import UNDER_SANITIZER, device_free_bytes, needs_cuda
from .references import greedy, open_with, relative_error, teacher_forced

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Folder, Engine, Engine]]:
    folder = write_folder(Path(tmp_path_factory.mktemp("gpu-hybrid")))
    cpu = Engine.load(str(folder.path), device="cpu", max_sessions=2, max_context=512)
    gpu = Engine.load(str(folder.path), device="cuda", max_sessions=8, max_context=512)
    yield folder, cpu, gpu
    gpu.unload()
    cpu.unload()


def test_no_bucket_is_dropped_at_start(served: tuple[Folder, Engine, Engine]) -> None:
    """Every decode and prefill bucket gave the largest one's bits at start-up (with the check's recurrent states
    restored before each replay)."""
    from worker.engine.graphs import GraphExecutor, buckets_for, prefill_buckets_for

    _, _, gpu = served
    executor = gpu.executor
    assert isinstance(executor, GraphExecutor)
    assert executor.buckets == buckets_for(gpu.table.capacity)
    assert executor.prefill_buckets == prefill_buckets_for(executor.prefill_rows)
    assert executor.row_products  # decode products in the row-invariant kernels


def test_gpu_logits_follow_the_cpu_within_bf16_tolerance(served: tuple[Folder, Engine, Engine]) -> None:
    """Teacher-forced on transformers' tokens: the prompt (prefill replays, in 64-token chunks for the longest) and
    every decode step (a graph)."""
    folder, cpu, gpu = served
    for prompt, tokens in zip(folder.prompts, folder.expected, strict=True):
        got, expected = teacher_forced(cpu, gpu, prompt, tokens, chunk=64)
        n = len(prompt)
        for step in range(len(tokens) + 1):
            err = relative_error(got[step], expected[step])
            assert err < 0.15, f"prompt of {n}, step {step}: relative error {err:.4f}"


def test_gpu_tokens_alone_batched_and_forked_agree(served: tuple[Folder, Engine, Engine]) -> None:
    folder, _, gpu = served
    solo = []
    for prompt in folder.prompts:
        sid = open_with(gpu, prompt)
        solo.append(gpu.generate(sid, **greedy(NEW_TOKENS)).token_ids)
        gpu.close(sid)
    sids = [open_with(gpu, prompt) for prompt in folder.prompts]
    batched = gpu.generate_many([(sid, greedy(NEW_TOKENS)) for sid in sids])
    assert [g.token_ids for g in batched] == solo
    for sid in sids:
        gpu.close(sid)
    for i in (1, 3):
        parent = open_with(gpu, folder.prompts[i])
        head = gpu.generate(parent, **greedy(10)).token_ids
        child = gpu.fork(parent)
        tails = gpu.generate_many([(child, greedy(NEW_TOKENS - 10)), (parent, greedy(NEW_TOKENS - 10))])
        assert [head + t.token_ids for t in tails] == [solo[i], solo[i]]
        gpu.close(parent)
        gpu.close(child)


def test_no_bleed_between_sessions_in_one_batch(served: tuple[Folder, Engine, Engine]) -> None:
    """Eight sessions at once, the same prompts in different slots and orders: each session's tokens are its own."""
    folder, _, gpu = served
    prompts = [folder.prompts[i % len(folder.prompts)] for i in range(8)]
    sids = [open_with(gpu, p) for p in prompts]
    first = [g.token_ids for g in gpu.generate_many([(s, greedy(12)) for s in sids])]
    for sid in sids:
        gpu.close(sid)
    sids = [open_with(gpu, p) for p in reversed(prompts)]
    second = [g.token_ids for g in gpu.generate_many([(s, greedy(12)) for s in sids])]
    for sid in sids:
        gpu.close(sid)
    assert second == list(reversed(first))
    n = len(folder.prompts)  # sessions i and i + n had the same prompt, in other slots and batch rows
    assert n < 8 and all(first[i] == first[i + n] for i in range(8 - n))


def test_graph_replay_matches_eager(served: tuple[Folder, Engine, Engine]) -> None:
    """The same padded steps without the graphs give the same tokens (the switch changes launch overhead only)."""
    folder, _, gpu = served
    executor = gpu.executor
    outputs = {}
    try:
        for use in (True, False):
            executor.use_graphs = use  # type: ignore[attr-defined]
            sids = [open_with(gpu, p) for p in folder.prompts]
            outputs[use] = [g.token_ids for g in gpu.generate_many([(s, greedy(NEW_TOKENS)) for s in sids])]
            for sid in sids:
                gpu.close(sid)
    finally:
        executor.use_graphs = True  # type: ignore[attr-defined]
    assert outputs[True] == outputs[False]


def test_running_ahead_gives_what_one_step_at_a_time_gives(served: tuple[Folder, Engine, Engine]) -> None:
    """Stops, a cancel, and a fork right after a generation while steps launched ahead still hold the requests' rows:
    the recurrent states end where the tokens say."""
    folder, _, gpu = served
    stop_id = folder.expected[0][5]
    ahead = drive(gpu, folder.prompts, True, stop_id)
    plain = drive(gpu, folder.prompts, False, stop_id)
    gpu.overlap = True
    assert ahead == plain


def test_create_fork_close_cycles_return_to_baseline(served: tuple[Folder, Engine, Engine]) -> None:
    folder, _, gpu = served
    parent = open_with(gpu, folder.prompts[2])
    gpu.generate(parent, **greedy(1))

    def cycle() -> None:
        a = gpu.create_session()
        b = gpu.fork(parent)
        gpu.close(a)
        gpu.close(b)

    for _ in range(10):
        cycle()
    mapped = gpu.table.backend.mapped_bytes()
    baseline = device_free_bytes()
    for _ in range(1000):
        cycle()
    assert gpu.table.backend.mapped_bytes() == mapped
    if not UNDER_SANITIZER:
        assert device_free_bytes() == baseline
    child = gpu.fork(parent)
    tail = gpu.generate(child, **greedy(NEW_TOKENS - 1)).token_ids
    assert tail == gpu.generate(parent, **greedy(NEW_TOKENS - 1)).token_ids
    gpu.close(child)
    gpu.close(parent)
