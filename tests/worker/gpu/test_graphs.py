"""Graph decode and prefill: bucket choice, step splitting, workspace sizing and GraphExecutor's host side on
the CPU (with a stand-in graph); on the GPU, the start-up bucket check, steps of more chunk ends than one
replay returns, and graph replay against the eager executor."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from worker.engine.budget import GPU_STEP_TOKENS
from worker.engine.executor import StepRows
from worker.engine.graphs import BUCKETS, buckets_for, pick_bucket, split_step
from worker.engine.workspace import workspace_bytes
from worker.kernels.tiles import TILE_ROWS
from worker.model.batch import Kernels
from worker.model.config import PRESETS
from worker.model.llama import Llama

from .device import needs_cuda
from .references import MODEL, TOKENS, Reference, greedy, open_with, relative_error, tiny_llama

# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def test_buckets_stop_at_the_table_capacity() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(6) == [1, 4, 6]
    assert buckets_for(8) == [1, 4, 8]
    assert buckets_for(64) == [1, 4, 16, 64]
    assert buckets_for(100) == [1, 4, 16, 64, 100]
    assert buckets_for(256) == list(BUCKETS) == [1, 4, 16, 64, 128, 256]
    assert buckets_for(1000) == list(BUCKETS)


def test_pick_bucket_takes_the_smallest_that_holds_the_rows() -> None:
    assert [pick_bucket([64, 100], n) for n in (1, 63, 64, 65, 100)] == [64, 64, 64, 100, 100]
    assert [pick_bucket([8], n) for n in (1, 5, 8)] == [8, 8, 8]


def test_split_step_separates_decode_rows_from_prefill_chunks() -> None:
    from worker.model.llama import Run

    # slot 3: one decode token; slot 5: a 3-token chunk; slot 1: one decode token
    decode, prefill = split_step([11, 12, 13, 14, 15], [7, 0, 1, 2, 9], [3, 5, 5, 5, 1])
    assert decode == [0, 4]
    assert prefill == [Run(slot=5, start=1, n=3, pos=0)]


def test_workspace_covers_prefill_attention_and_graph_outputs() -> None:
    small, large = tiny_llama(256), tiny_llama(4096)
    c = PRESETS["tiny"]
    assert workspace_bytes(large) > workspace_bytes(small) > 0
    chunk = min(GPU_STEP_TOKENS, 4096)
    assert workspace_bytes(large) >= 3 * c.n_heads * chunk * 4096 * 4  # masked SDPA of a whole chunk
    assert workspace_bytes(small) >= sum(BUCKETS) * c.vocab_size * 4  # every bucket's logits


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """What the Triton kernel computes, in plain torch (a stand-in on the CPU)."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].flatten(2, 3).repeat_interleave(group, 1)  # (B, H, ctx, hd)
    v = v_cache[slots].flatten(2, 3).repeat_interleave(group, 1)
    scores = torch.einsum("bhd,bhnd->bhn", q, k) / q.shape[-1] ** 0.5
    keep = torch.arange(k.shape[2])[None, :] < lengths[:, None].long()
    weights = scores.masked_fill(~keep[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhn,bhnd->bhd", weights, v)


def torch_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            lengths: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """What the tiled prefill kernel computes, in plain torch: rows in no tile stay NaN, a tile's rows share a slot."""
    out = torch.full_like(q, float("nan"))
    for first, n in tiles.t().tolist():
        if n:
            rows = slice(first, first + n)
            assert len(set(slots[rows].tolist())) == 1 and n <= TILE_ROWS
            out[rows] = torch_decode_attention(q[rows], k_cache, v_cache, slots[rows], lengths[rows])
    return out


def test_graph_executor_glue_with_a_stand_in_graph_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GraphExecutor's host side (static inputs, padding rows, bucket choice, picking logits, marking
    slots used) against the eager executor, with a "graph" that re-runs the captured step."""
    from cuda_state import HostBackend, SessionTable
    from worker.engine.executor import EagerExecutor
    from worker.engine.graphs import GraphExecutor

    class Stub:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    replayed: list[tuple[str, int]] = []  # (step, rows) of each replay

    def capture(self: GraphExecutor, step: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        logits = step()

        class Replay:
            def replay(self_) -> None:
                replayed.append((step.func.__name__, *step.args))  # type: ignore[attr-defined]
                with torch.inference_mode():  # the step's output is an inference tensor
                    logits.copy_(step())

        return Replay(), logits

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "Event", Stub)
    monkeypatch.setattr(torch.cuda, "Stream", Stub)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(GraphExecutor, "_capture", capture)

    from worker.model.loader import load_model

    loaded = load_model("random:tiny")
    model = Llama(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, 64,
                  kernels=Kernels(decode_attention=torch_decode_attention, prefill_attention=torch_prefill_attention))
    graph_table = SessionTable(HostBackend(model.state_spec(), 6))
    eager_table = SessionTable(HostBackend(model.state_spec(), 6))
    marked: list[list[int]] = []
    monkeypatch.setattr(graph_table, "mark_used", lambda slots: marked.append(list(slots)))
    graphs = GraphExecutor(model, graph_table)
    eager = EagerExecutor(model, eager_table)
    assert graphs.buckets == [1, 4, 6]
    assert graphs.prefill_buckets == [128, 256, 512, 1024, 2048]

    gen = torch.Generator().manual_seed(3)
    slots = [graph_table.create(graph_table.spec.max_context) for _ in range(6)]
    assert slots == [eager_table.create(eager_table.spec.max_context) for _ in range(6)]
    lengths = [5, 9, 3, 7, 4, 6]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    tokens = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    rows = [s for s, p in zip(slots, prompts, strict=True) for _ in p]
    last = (torch.tensor(lengths).cumsum(0) - 1).tolist()
    prefilled = [executor.execute(StepRows(tokens, positions, rows, last)) for executor in (graphs, eager)]
    torch.testing.assert_close(prefilled[0], prefilled[1], atol=1e-4, rtol=1e-4)  # slab attention = per-run SDPA
    assert graphs.replays == 0 and graphs.prefill_replays == 1
    assert replayed == [("_prefill_forward", 128)]  # 34 prompt tokens: the smallest prefill graph
    # Two chunk ends per replay: three replays of the one output, each replay's logits kept before the next.
    few = GraphExecutor(model, graph_table, prefill_logits=2)
    replayed.clear()
    torch.testing.assert_close(few.execute(StepRows(tokens, positions, rows, last)), prefilled[1], atol=1e-4, rtol=1e-4)
    assert replayed == [("_prefill_forward", 128)] * 3
    _, chunks = split_step(tokens, positions, rows)
    with pytest.raises(ValueError, match="one prefill replay takes 2 chunks"):  # more than its tiles' grid holds
        few.replay_prefill(chunks[:3], tokens, positions, set())
    pos = list(lengths)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    for chosen in ([3, 0, 5], [1], [0, 1, 2, 3, 4, 5], [5, 4], [2, 0, 1], [2, 0, 1, 4]):
        step_tokens = torch.randint(0, 512, (len(chosen),), generator=gen).tolist()
        args = (step_tokens, [pos[i] for i in chosen], [slots[i] for i in chosen])
        want = list(range(len(chosen)))
        got, expected = graphs.execute(StepRows(*args, want)), eager.execute(StepRows(*args, want))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        history.append((got, expected))
        assert sorted(marked[-1]) == sorted(slots[i] for i in chosen)
        assert (graphs._decode_in.host[:, len(chosen) :] == graphs._padding).all()  # no stale rows: padding only
        picked = graphs.execute(StepRows(*args, [len(chosen) - 1]))  # the same step again: only the last row
        torch.testing.assert_close(picked, expected[-1:], atol=1e-4, rtol=1e-4)
        for i in chosen:
            pos[i] += 1
    assert graphs.replays == 12
    assert replayed[-1] == ("_decode_forward", 4)  # [2, 0, 1, 4]: a 4-row bucket
    for got, expected in history:  # returned logits are copies: later replays did not overwrite them
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # A step launched ahead: its first rows read their ids from a device tensor (the last step's samples),
    # then a decode row with a host token; once alone, once beside a 3-token prompt chunk.
    samples = torch.tensor([7, 300, 11, 42])
    for chunk in (0, 3):
        step_tokens = [0, 0, 123] + torch.randint(0, 512, (chunk,), generator=gen).tolist()
        step_positions = [pos[0], pos[3], pos[1]] + [pos[4] + j for j in range(chunk)]
        step_slots = [slots[0], slots[3], slots[1]] + [slots[4]] * chunk
        want = [0, 1, 2] + ([5] if chunk else [])
        ahead = (step_tokens, step_positions, step_slots, want)
        rows_ahead = StepRows(*ahead, source=(samples, [2, 0]))
        got, expected = graphs.execute(rows_ahead), eager.execute(rows_ahead)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert replayed[-1 - bool(chunk)] == ("_decode_forward", 4)
        for i in (0, 3, 1):
            pos[i] += 1
        pos[4] += chunk
    # The host ids of the rows it reads from the device are placeholders: they change nothing.
    placeholders = ([1, 2, 3], [pos[0], pos[3], pos[1]], [slots[0], slots[3], slots[1]], [0, 1, 2])
    torch.testing.assert_close(graphs.execute(StepRows(*placeholders, source=(samples, [2, 0, 1]))),
                               eager.execute(StepRows([11, 7, 300], *placeholders[1:])), atol=1e-4, rtol=1e-4)
    # In order (steady decoding: row i takes the last step's i-th sample): the ids are copied as they are.
    torch.testing.assert_close(graphs.execute(StepRows(*placeholders, source=(samples, [0, 1, 2]))),
                               eager.execute(StepRows([7, 300, 11], *placeholders[1:])), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graphs.execute(StepRows(*placeholders, source=(samples, [0, 1]))),
                               eager.execute(StepRows([7, 300, 3], *placeholders[1:])), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="first rows"):  # a device row after a host one: refused, not misread
        graphs.execute(StepRows([0, 0, 0, 0], [pos[4], pos[4] + 1, pos[0], pos[2]], [slots[4], slots[4], slots[0], slots[2]],
                                [1, 2, 3], source=(samples, [0])))
    graphs.long_rows_from = 2  # a step with no rows has no long row either
    assert graphs.execute(StepRows([], [], [], [])).shape == (0, loaded.config.vocab_size)
    spare = graph_table.views()["k"][graph_table.spare_slot]
    # padding rows wrote position 0 of the spare only (within its first page: every later page is the first again)
    by_position = spare.flatten(2, 3)  # (layers, KV, positions, hd)
    assert torch.count_nonzero(by_position[:, :, 1 : graph_table.spec.tokens_in(1, graph_table.page_bytes)]) == 0


@pytest.mark.gpu
@needs_cuda
def test_a_bucket_whose_rows_differ_from_the_largest_is_dropped_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check compares each bucket's logits with the largest bucket's for the same rows: a bucket
    whose numbers differ in any bit (here: skewed on purpose) is not used; its batches run in the next one.
    The same for prefill buckets."""
    from worker.engine import Engine
    from worker.engine.graphs import GraphExecutor

    step, prefill_step = GraphExecutor._decode_forward, GraphExecutor._prefill_forward

    def skewed(self: GraphExecutor, b: int) -> torch.Tensor:
        logits = step(self, b)
        return logits * (1 + 2**-7) if b == 1 else logits  # one bf16 ulp: what another summation order can do

    def skewed_prefill(self: GraphExecutor, b: int) -> torch.Tensor:
        logits = prefill_step(self, b)  # the shared output: skewed in place
        if b == 256:
            with torch.inference_mode():
                logits.mul_(1 + 2**-7)
        return logits

    monkeypatch.setattr(GraphExecutor, "_decode_forward", skewed)
    monkeypatch.setattr(GraphExecutor, "_prefill_forward", skewed_prefill)
    engine = Engine.load("random:smollm2-135m", device="cuda", max_sessions=8, max_context=256)
    try:
        executor = engine.executor
        assert isinstance(executor, GraphExecutor)
        assert executor.buckets == [4, 8] and executor.replays == 0
        assert executor.prefill_buckets == [128, 512, 1024, 2048] and executor.prefill_replays == 0
        assert engine.table.live == 0 and engine.free_slots == 8 and engine.table.kept == 0  # the check's slots: released
        prefills: list[int] = []  # the rows of each prefill replay

        class Spy:
            def __init__(self, rows: int, graph: torch.cuda.CUDAGraph) -> None:
                self.rows, self.graph = rows, graph

            def replay(self) -> None:
                prefills.append(self.rows)
                self.graph.replay()

        executor._prefill_graphs = {b: Spy(b, g) for b, g in executor._prefill_graphs.items()}  # type: ignore[misc]
        sids = [engine.create_session() for _ in range(2)]
        for sid in sids:
            engine.append(sid, token_ids=[300, 301, 302])
        generations = engine.generate_many([(sid, {"max_tokens": 3, "ignore_eos": True}) for sid in sids])
        assert [len(g.token_ids) for g in generations] == [3, 3]  # two rows ran in the 4-row bucket
        [solo] = engine.generate_many([(sids[0], {"max_tokens": 2, "ignore_eos": True})])
        assert len(solo.token_ids) == 2  # one row too: the 1-row bucket is gone
        engine.append(sids[1], token_ids=list(range(1000, 1200)))  # 200 prompt tokens: 512 rows, 256 is gone
        assert len(engine.generate(sids[1], max_tokens=2, ignore_eos=True).token_ids) == 2
        assert prefills == [128, 512]  # both 3-token prompts in one replay (generate_many starts them together)
    finally:
        engine.table.close()


@pytest.mark.gpu
@needs_cuda
def test_more_prompt_chunks_than_one_prefill_replay_returns() -> None:
    """72 sessions' prompts join in one step: 72 chunk ends, more than the 64 one prefill replay returns, so the
    step takes two replays of the one shared output. Every session's tokens are its tokens alone."""
    from worker.engine import Engine
    from worker.engine.sampling import SamplingParams

    engine = Engine.load(MODEL, device="cuda", max_sessions=72, max_context=64)
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(300, 49000) for _ in range(rng.randrange(3, 10))] for _ in range(72)]
        solo = []
        for prompt in prompts:
            sid = open_with(engine, prompt)
            solo.append(engine.generate(sid, **greedy(3)).token_ids)
            engine.close(sid)
        sids = [open_with(engine, prompt) for prompt in prompts]
        before = engine.executor.prefill_replays  # type: ignore[attr-defined]
        order = {engine.start_generate(sid, SamplingParams(max_tokens=3, ignore_eos=True)): i
                 for i, sid in enumerate(sids)}
        batched: list[list[int]] = [[] for _ in sids]
        while engine.has_work():
            for chunk in engine.step():
                batched[order[chunk.request_id]] += chunk.token_ids
        assert engine.executor.prefill_replays - before == 2  # type: ignore[attr-defined]
        assert batched == solo
    finally:
        engine.table.close()


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_matches_eager(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine
    from worker.engine.executor import EagerExecutor

    assert isinstance(gpu_engine, Engine)
    graphs = gpu_engine.executor
    eager = EagerExecutor(gpu_engine.model, gpu_engine.table)
    outputs = {}
    try:
        for name, executor in (("graph", graphs), ("eager", eager)):
            gpu_engine.executor = executor
            sids = [open_with(gpu_engine, ref.prompt) for ref in references]
            outputs[name] = [g.token_ids for g in gpu_engine.generate_many([(s, greedy(TOKENS)) for s in sids])]
            for sid in sids:
                gpu_engine.close(sid)
    finally:
        gpu_engine.executor = graphs
    assert outputs["graph"] == outputs["eager"] == [ref.tokens for ref in references]

    # The same decode step (8 rows, one full bucket) through both: logits agree to bf16 rounding. The graph's
    # products are worker.kernels.matmul's, the norm a row scale after them; the eager step's are cuBLAS's with the
    # norm before: two bf16 roundings of the same sums, apart as much as bf16 is from fp32 (the CPU test's 4e-2).
    sids = [open_with(gpu_engine, ref.prompt) for ref in references]
    gpu_engine.generate_many([(s, greedy(1)) for s in sids])  # prompts in; one pending token each
    sessions = [gpu_engine._sessions[s] for s in sids]
    step = ([s.tokens[s.computed] for s in sessions], [s.computed for s in sessions], [s.slot for s in sessions])
    from_graph = graphs.execute(StepRows(*step, list(range(8))))
    from_eager = eager.execute(StepRows(*step, list(range(8))))
    err = relative_error(from_graph, from_eager)
    assert err < 4e-2, f"relative error {err:.4f}"
    assert from_graph.argmax(-1).tolist() == from_eager.argmax(-1).tolist()
