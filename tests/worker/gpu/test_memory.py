"""Memory: the weights packed in one allocation and loaded once, each session holding the pages its tokens need,
device memory back to its baseline after session churn, and a closed slot that a running step still uses neither
reused unzeroed nor released under it."""

from __future__ import annotations

import random
import time

import pytest
import torch

from cuda_state import CapacityExhausted
from cuda_state.backend import zeroed_views
from worker.engine.executor import StepRows
from worker.engine.workspace import workspace_bytes

from ..tensors import random_norms
from .device import PAGE_TABLE_SLACK, UNDER_SANITIZER, Loaded, device_free_bytes, needs_cuda
from .references import CONTEXT, TOKENS, Reference, greedy, open_with

# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def test_packed_weights_are_views_of_one_block_whatever_order_the_tensors_come_in() -> None:
    """Llama packs its weights into one allocation (worker.model.packing), filled tensor by tensor as a loader
    streams them: the same model whatever the order, norms folded or not (a product that comes before its norm
    waits for it)."""
    from worker.model.llama import PACK_ALIGN, Llama
    from worker.model.loader import load_model

    loaded = load_model("random:tiny")
    weights = random_norms(loaded.weights)
    ids, positions, slots = torch.tensor([5, 9, 3, 7]), torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 1])
    for fold in (False, True):
        llama = Llama(loaded.config, weights, torch.device("cpu"), torch.float32, 64, fold_norms=fold)
        backwards = Llama(loaded.config, reversed(list(weights.items())), torch.device("cpu"), torch.float32, 64,
                          fold_norms=fold)
        tensors = [backwards.lm_head.weight, backwards.norm, backwards.cos, backwards.sin]
        for layer in backwards.layers:
            tensors += layer.tensors()
        bases = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(bases) == 1
        assert all((t.data_ptr() - min(bases)) % PACK_ALIGN == 0 and t.is_contiguous() for t in tensors)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # no shared byte
        spec = llama.state_spec()
        before = llama.forward(ids, positions, slots, zeroed_views(spec, 2))
        state = zeroed_views(spec, 2)
        assert torch.equal(backwards.forward(ids, positions, slots, state), before)


@pytest.mark.gpu
@needs_cuda
def test_weights_once_and_memory_per_session(loaded: Loaded, gpu_engine: object) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    model, table = gpu_engine.model, gpu_engine.table
    load_cost = loaded.free_before - loaded.free_after
    fixed = model.weight_bytes() + table.backend.granularity  # weights once, plus the spare slot's one page
    assert fixed <= load_cost <= fixed + workspace_bytes(model), (load_cost, fixed)

    base = device_free_bytes()
    sids = [gpu_engine.create_session() for _ in range(table.capacity)]
    used = base - device_free_bytes()
    first = table.spec.pages_for(table.ahead_tokens, table.page_bytes)  # an empty session: its first positions
    assert [table.pages(gpu_engine._sessions[sid].slot) for sid in sids] == [first] * table.capacity
    expected = table.capacity * first * table.page_bytes  # the pages sessions hold, not their slots
    assert abs(used - expected) <= PAGE_TABLE_SLACK, (used, expected)
    assert table.slot_bytes == table.spec.slot_bytes(table.backend.granularity)
    with pytest.raises(CapacityExhausted):
        gpu_engine.create_session()
    for sid in sids:
        gpu_engine.close(sid)
    assert gpu_engine.table.kept == table.capacity  # closed sessions' slots stay mapped for the next ones
    assert abs(base - used - device_free_bytes()) <= PAGE_TABLE_SLACK
    assert gpu_engine.release_idle_slots(0.0) == table.capacity
    assert abs(device_free_bytes() - base) <= PAGE_TABLE_SLACK


@pytest.mark.gpu
@needs_cuda
def test_create_fork_close_cycles_return_to_baseline(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    parent = open_with(gpu_engine, references[0].prompt)
    gpu_engine.generate(parent, **greedy(1))  # the prompt's K/V are in the slot: forks copy them

    def cycle() -> None:
        a = gpu_engine.create_session()
        b = gpu_engine.fork(parent)
        gpu_engine.close(a)
        gpu_engine.close(b)

    for _ in range(10):  # first uses (events, driver-internal pools) happen before the baseline
        cycle()
    mapped = gpu_engine.table.backend.mapped_bytes()
    baseline = device_free_bytes()
    for _ in range(1000):
        cycle()
    assert gpu_engine.table.backend.mapped_bytes() == mapped
    if not UNDER_SANITIZER:  # the sanitizer keeps device memory of its own
        assert device_free_bytes() == baseline
    child = gpu_engine.fork(parent)
    assert gpu_engine.generate(child, **greedy(TOKENS - 1)).token_ids == references[0].tokens[1:]


@pytest.mark.gpu
@needs_cuda
def test_device_memory_stays_flat_under_traffic_with_prompts_of_every_length(gpu_engine: object) -> None:
    """Rounds of sessions with prompts of random lengths, forks, sampled and greedy generations and cancelled
    streams: after the first rounds, device memory at zero live sessions does not move. (torch's cuDNN
    attention backend kept device memory per new prompt length: ~3 MiB per 40 prompts, without end.)"""
    from worker.bench.memory_churn import one_round
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    rng = random.Random(7)
    for _ in range(2):  # first uses: allocator blocks for the largest shapes, driver pools
        one_round(gpu_engine, rng, 6, prompt_max=CONTEXT - 200)
    gpu_engine.release_idle_slots(0.0)  # closed sessions' slots keep their pages for the next: measured apart
    baseline = device_free_bytes()
    for _ in range(8):
        one_round(gpu_engine, rng, 6, prompt_max=CONTEXT - 200)
    assert gpu_engine.sessions() == []
    gpu_engine.release_idle_slots(0.0)
    if not UNDER_SANITIZER:
        assert baseline - device_free_bytes() <= PAGE_TABLE_SLACK, (baseline - device_free_bytes()) / 2**20


@pytest.mark.gpu
@needs_cuda
def test_closing_a_session_inflight_waits_for_the_step(gpu_engine: object, references: list[Reference]) -> None:
    """A closed session's slot stays mapped: a new session that takes it while a step still uses it is zeroed
    behind that step (stream order), and releasing the slot's memory waits for the step."""
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    a, b = (open_with(gpu_engine, ref.prompt) for ref in references[:2])
    gpu_engine.generate_many([(a, greedy(1)), (b, greedy(1))])
    sa, sb = gpu_engine._sessions[a], gpu_engine._sessions[b]
    step = ([sa.tokens[sa.computed], sb.tokens[sb.computed]], [sa.computed, sb.computed], [sa.slot, sb.slot], [0, 1])
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time ahead of the step
    logits = gpu_engine.executor.execute(StepRows(*step))  # queued: reads and writes slot a after the sleep
    gpu_engine.close(a)  # kept mapped: nothing to wait for
    c = gpu_engine.create_session()
    assert gpu_engine._sessions[c].slot == sa.slot  # slot a again, its zeroing queued behind the step
    torch.cuda.synchronize()
    state = gpu_engine.table.views()
    room = gpu_engine.table.room(sa.slot)  # the positions its mapped page holds (the rest is not mapped)
    blocks = room // gpu_engine.table.spec.block  # whole blocks: (layers, KV, blocks, block, hd) of the slot
    assert all(torch.count_nonzero(state[name][sa.slot][:, :, :blocks]) == 0 for name in ("k", "v"))  # zeroed
    assert logits[1].argmax().item() == references[1].tokens[1]

    torch.cuda._sleep(400_000_000)
    gpu_engine.executor.execute(StepRows([1], [0], [sa.slot], [0]))  # queued: writes slot a after the sleep
    gpu_engine.close(c)
    start = time.perf_counter()
    assert gpu_engine.release_idle_slots(0.0) == 1  # must not give slot a's memory back under the running step
    waited = time.perf_counter() - start
    if not UNDER_SANITIZER:  # the sanitizer runs every launch to completion: nothing is left to wait for
        assert waited > 0.02, f"the release returned after {waited:.4f} s, before the queued step could have run"
    assert gpu_engine.generate(b, **greedy(TOKENS - 1)).token_ids == references[1].tokens[1:]
    torch.cuda.synchronize()
