"""The engine on the GPU: Triton decode attention, CUDA-graph decode, isolation and memory.

GPU tests (-m gpu) use the SmolLM2-135M architecture with seeded random weights in bf16 and compare
with the same weights on the CPU in fp32. bf16 moves logits by about 1e-2 of their spread, and with
random weights the top two logits are often closer than that, so greedy tokens are only comparable
where the CPU's top-1 margin is safely larger than bf16 noise. The references are therefore
prompts whose every generated token has a CPU margin of at least SAFE_MARGIN (about six standard
deviations of the bf16-vs-fp32 logit difference measured on the CPU); for those, every GPU
configuration (solo, batched, interleaved, graph, eager, forked) must produce the CPU's tokens.

CPU tests here need no CUDA: bucket choice, workspace sizing, and the Triton kernel's math run by
Triton's interpreter (fp32/fp16: the interpreter's bf16 dot is not exact).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cuda_state import CapacityExhausted
from worker.engine.graphs import BUCKETS, buckets_for, pick_bucket, split_step, workspace_bytes
from worker.kernels.tiles import TILE_ROWS, max_tiles, prefill_tiles
from worker.model.config import PRESETS
from worker.model.llama import Llama

MODEL = "random:smollm2-135m"
CONTEXT = 1024
TOKENS = 8  # greedy tokens per reference
SAFE_MARGIN = 0.06
CANDIDATES = 48  # random prompts tried, 8 at a time, until 8 have safe margins
UNDER_SANITIZER = os.environ.get("GPU_TESTS_UNDER_SANITIZER") == "1"
PAGE_TABLE_SLACK = 2 << 20
REPO = Path(__file__).resolve().parents[2]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


# -- CPU: no CUDA needed ---------------------------------------------------------------------------


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


def tiny_llama(max_context: int) -> Llama:
    from worker.model.loader import load_model

    loaded = load_model("random:tiny")
    return Llama(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, max_context)


def test_prefill_tiles_cut_each_chunk_from_its_first_row() -> None:
    firsts, counts = prefill_tiles([0, 150, 152, 300], [150, 2, 148, 0])
    assert TILE_ROWS == 64
    assert firsts.tolist() == [0, 64, 128, 150, 152, 216, 280]
    assert counts.tolist() == [64, 64, 22, 2, 64, 64, 20]
    assert [x.tolist() for x in prefill_tiles([], [])] == [[], []]
    # The grid: at most one tile a row; 2048 rows in 64 chunks and padding: 32 whole tiles and 64 partial ones.
    assert max_tiles(128, 64) == 66 and max_tiles(2048, 64) == 96 and max_tiles(16, 64) == 16
    starts = [0, 64, 65, 130, 1000]  # 5 chunks, the last 1048 rows of padding
    assert len(prefill_tiles(starts, [64, 1, 65, 870, 1048])[0]) == 1 + 1 + 2 + 14 + 17 <= max_tiles(2048, 4)


def test_workspace_covers_prefill_attention_and_graph_outputs() -> None:
    from worker.engine.core import GPU_STEP_TOKENS

    small, large = tiny_llama(256), tiny_llama(4096)
    c = PRESETS["tiny"]
    assert workspace_bytes(large) > workspace_bytes(small) > 0
    chunk = min(GPU_STEP_TOKENS, 4096)
    assert workspace_bytes(large) >= 3 * c.n_heads * chunk * 4096 * 4  # masked SDPA of a whole chunk
    assert workspace_bytes(small) >= sum(BUCKETS) * c.vocab_size * 4  # every bucket's logits


def test_packed_weights_are_views_of_one_block_and_give_the_same_logits() -> None:
    """On the GPU Llama packs its weights into one allocation (Llama.pack_weights); the same packing on the CPU."""
    from worker.model.llama import PACK_ALIGN

    llama = tiny_llama(64)
    spec = llama.state_spec()
    state = {b.name: torch.zeros((2, *b.shape), dtype=b.dtype) for b in spec.buffers}
    ids, positions, slots = torch.tensor([5, 9, 3, 7]), torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 1])
    before = llama.forward(ids, positions, slots, {k: v.clone() for k, v in state.items()})
    llama.pack_weights()
    tensors = [llama.lm_head.weight, llama.norm, llama.cos, llama.sin]
    for layer in llama.layers:
        tensors += [layer.input_norm, layer.post_norm, *(linear.weight for linear in layer.linears())]
    bases = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(bases) == 1
    assert all((t.data_ptr() - min(bases)) % PACK_ALIGN == 0 and t.is_contiguous() for t in tensors)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # no two share a byte
    assert torch.equal(llama.forward(ids, positions, slots, state), before)


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """What the Triton kernel computes, in plain torch (a stand-in on the CPU)."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].repeat_interleave(group, 1)  # (B, H, ctx, hd)
    v = v_cache[slots].repeat_interleave(group, 1)
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
    model = Llama(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, 64)
    monkeypatch.setattr(model, "decode_attention", torch_decode_attention)
    monkeypatch.setattr(model, "prefill_attention", torch_prefill_attention)
    graph_table = SessionTable(HostBackend(model.state_spec(), 6))
    eager_table = SessionTable(HostBackend(model.state_spec(), 6))
    marked: list[list[int]] = []
    monkeypatch.setattr(graph_table, "mark_used", lambda slots: marked.append(list(slots)))
    graphs = GraphExecutor(model, graph_table)
    eager = EagerExecutor(model, eager_table)
    assert graphs.buckets == [1, 4, 6]
    assert graphs.prefill_buckets == [128, 256, 512, 1024, 2048]

    gen = torch.Generator().manual_seed(3)
    slots = [graph_table.create() for _ in range(6)]
    assert slots == [eager_table.create() for _ in range(6)]
    lengths = [5, 9, 3, 7, 4, 6]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    tokens = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    rows = [s for s, p in zip(slots, prompts, strict=True) for _ in p]
    last = (torch.tensor(lengths).cumsum(0) - 1).tolist()
    prefilled = [executor.execute(tokens, positions, rows, last) for executor in (graphs, eager)]
    torch.testing.assert_close(prefilled[0], prefilled[1], atol=1e-4, rtol=1e-4)  # slab attention = per-run SDPA
    assert graphs.replays == 0 and graphs.prefill_replays == 1
    assert replayed == [("_prefill_step", 128)]  # 34 prompt tokens: the smallest prefill graph
    # Two chunk ends per replay: three replays of the one output, each replay's logits kept before the next.
    few = GraphExecutor(model, graph_table, prefill_logits=2)
    replayed.clear()
    torch.testing.assert_close(few.execute(tokens, positions, rows, last), prefilled[1], atol=1e-4, rtol=1e-4)
    assert replayed == [("_prefill_step", 128)] * 3
    _, chunks = split_step(tokens, positions, rows)
    with pytest.raises(ValueError, match="one prefill replay takes 2 chunks"):  # more than its tiles' grid holds
        few._prefill(chunks[:3], tokens, positions, set())
    pos = list(lengths)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    for chosen in ([3, 0, 5], [1], [0, 1, 2, 3, 4, 5], [5, 4], [2, 0, 1], [2, 0, 1, 4]):
        step_tokens = torch.randint(0, 512, (len(chosen),), generator=gen).tolist()
        args = (step_tokens, [pos[i] for i in chosen], [slots[i] for i in chosen])
        want = list(range(len(chosen)))
        got, expected = graphs.execute(*args, want), eager.execute(*args, want)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        history.append((got, expected))
        assert sorted(marked[-1]) == sorted(slots[i] for i in chosen)
        assert (graphs._decode_in.host[:, len(chosen) :] == graphs._padding).all()  # no stale rows: padding only
        picked = graphs.execute(*args, [len(chosen) - 1])  # the same step again: only the last row
        torch.testing.assert_close(picked, expected[-1:], atol=1e-4, rtol=1e-4)
        for i in chosen:
            pos[i] += 1
    assert graphs.replays == 12
    assert replayed[-1] == ("_step", 4)  # [2, 0, 1, 4]: a 4-row bucket
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
        args = (step_tokens, step_positions, step_slots, want)
        got, expected = graphs.execute(*args, source=(samples, [2, 0])), eager.execute(*args, source=(samples, [2, 0]))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert replayed[-1 - bool(chunk)] == ("_step", 4)
        for i in (0, 3, 1):
            pos[i] += 1
        pos[4] += chunk
    # The host ids of the rows it reads from the device are placeholders: they change nothing.
    args = ([1, 2, 3], [pos[0], pos[3], pos[1]], [slots[0], slots[3], slots[1]], [0, 1, 2])
    torch.testing.assert_close(graphs.execute(*args, source=(samples, [2, 0, 1])),
                               eager.execute([11, 7, 300], *args[1:]), atol=1e-4, rtol=1e-4)
    # In order (steady decoding: row i takes the last step's i-th sample): the ids are copied as they are.
    torch.testing.assert_close(graphs.execute(*args, source=(samples, [0, 1, 2])),
                               eager.execute([7, 300, 11], *args[1:]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graphs.execute(*args, source=(samples, [0, 1])),
                               eager.execute([7, 300, 3], *args[1:]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="first rows"):  # a device row after a host one: refused, not misread
        graphs.execute([0, 0, 0, 0], [pos[4], pos[4] + 1, pos[0], pos[2]], [slots[4], slots[4], slots[0], slots[2]],
                       [1, 2, 3], source=(samples, [0]))
    graphs.long_rows_from = 2  # a step with no rows has no long row either
    assert graphs.execute([], [], [], []).shape == (0, loaded.config.vocab_size)
    spare = graph_table.views()["k"][graph_table.spare_slot]
    assert torch.count_nonzero(spare[:, :, 1:]) == 0  # padding rows wrote position 0 of the spare only


INTERPRETED_KERNEL_CHECK = textwrap.dedent(
    """
    import math, os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from worker.kernels.attention import decode_attention

    def reference(q, k, v, slots, lengths):
        rows, heads, hd = q.shape
        group = heads // k.shape[1]
        out = torch.empty(rows, heads, hd, dtype=torch.float64)
        for r in range(rows):
            n, s = int(lengths[r]), int(slots[r])
            for h in range(heads):
                kk, vv = k[s, h // group, :n].double(), v[s, h // group, :n].double()
                out[r, h] = torch.softmax(kk @ q[r, h].double() / math.sqrt(hd), 0) @ vv
        return out

    torch.manual_seed(0)
    worst = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        for rows, heads, kv, hd, ctx, splits in [(3, 9, 3, 64, 300, 1), (3, 9, 3, 64, 300, 4), (2, 4, 4, 32, 130, 3),
                                                 (4, 8, 2, 80, 200, 2), (5, 9, 3, 64, 500, 5), (1, 2, 1, 16, 64, 1),
                                                 (2, 9, 3, 64, 800, 3)]:  # 800 keys: 3 splits
            slots_n = rows + 2
            slab = torch.randn(slots_n, 2, 2, kv, ctx, hd).to(dtype)  # (slot, layer, k|v, KV, ctx, hd)
            k, v = slab[:, 1, 0], slab[:, 1, 1]  # strided views, as the model passes them
            slots = torch.randperm(slots_n)[:rows]
            lengths = torch.randint(1, ctx + 1, (rows,), dtype=torch.int32)
            lengths[0], lengths[-1] = ctx, 1
            for r in range(rows):  # poison what must not be read
                k[slots[r], :, int(lengths[r]):] = float("nan")
                v[slots[r], :, int(lengths[r]):] = float("nan")
            q = torch.randn(rows, heads, hd).to(dtype)
            out = torch.full((rows, heads, hd), float("nan"), dtype=dtype)
            got = decode_attention(q, k, v, slots, lengths, out=out, splits=splits)
            assert got is out
            err = (out.double() - reference(q, k, v, slots, lengths)).abs().max().item()
            assert err < tol, (dtype, rows, heads, kv, hd, ctx, splits, err)
    print("ok")
    """
)


INTERPRETED_PREFILL_CHECK = textwrap.dedent(
    """
    import torch
    from worker.kernels.tiles import prefill_tiles
    from worker.kernels.attention import decode_attention
    from worker.kernels.prefill import prefill_attention

    torch.manual_seed(1)
    for dtype, tol, heads, kv, hd in ((torch.float32, 1e-5, 9, 3, 64), (torch.float16, 3e-3, 4, 4, 80)):
        ctx, chunks = 300, [(2, 100, 130), (0, 0, 70), (1, 298, 2)]  # (slot, first position, rows)
        slab = torch.randn(5, 2, 2, kv, ctx, hd).to(dtype)  # slot 4: the spare
        k, v = slab[:, 1, 0], slab[:, 1, 1]
        slots, positions, starts = [], [], []
        for slot, pos, n in chunks:
            starts.append(len(slots))
            slots += [slot] * n
            positions += range(pos, pos + n)
            k[slot, :, pos + n:] = float("nan")  # poison what no row of the chunk may read
            v[slot, :, pos + n:] = float("nan")
        starts.append(len(slots))
        slots += [4] * 10  # padding rows: position 0 of the spare
        positions += [0] * 10
        slots, lengths = torch.tensor(slots), torch.tensor(positions, dtype=torch.int32) + 1
        q = torch.randn(len(slots) + 3, heads, hd).to(dtype)  # 3 rows in no tile: left as they are
        firsts, counts = prefill_tiles(starts, [n for _, _, n in chunks] + [10])
        tiles = torch.zeros(2, len(firsts) + 4, dtype=torch.long)  # unused tiles: 0 rows
        tiles[0, : len(firsts)], tiles[1, : len(firsts)] = torch.from_numpy(firsts), torch.from_numpy(counts)
        out = torch.full_like(q, 7.0)
        rows = len(slots)
        pad_slots, pad_lengths = torch.cat([slots, slots[:3]]), torch.cat([lengths, lengths[:3]])
        assert prefill_attention(q, k, v, pad_slots, pad_lengths, tiles, out=out) is out
        expected = decode_attention(q[:rows].double(), k.double(), v.double(), slots, lengths, splits=1)
        err = (out[:rows].double() - expected).abs().max().item()
        assert err < tol, (dtype, err)
        assert (out[rows:] == 7.0).all()
    print("ok")
    """
)


def test_triton_kernel_math_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED_KERNEL_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_triton_prefill_kernel_math_in_the_interpreter() -> None:
    """The tiled prompt-chunk attention against the decode kernel's math in float64, chunks of 1 to 3 tiles at
    offsets, padding rows in the spare slot, K/V past each chunk poisoned, rows outside every tile untouched."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED_PREFILL_CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


# -- GPU: references -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    tokens: list[int]  # CPU fp32 greedy continuation
    margins: list[float]  # CPU top-1 minus top-2 logit at each generated token


def cpu_greedy(engine: object, prompts: list[list[int]], n: int) -> list[Reference]:
    """Greedy continuations of all prompts at once through the CPU engine's executor, with margins."""
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    table, executor = engine.table, engine.executor
    slots = [table.create() for _ in prompts]
    try:
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        last: list[int] = []
        for slot, prompt in zip(slots, prompts, strict=True):
            tokens += prompt
            positions += range(len(prompt))
            rows += [slot] * len(prompt)
            last.append(len(tokens) - 1)
        logits = executor.execute(tokens, positions, rows, last)
        out: list[list[int]] = [[] for _ in prompts]
        margins: list[list[float]] = [[] for _ in prompts]
        for step in range(n):
            top = logits.topk(2, dim=-1)
            for i in range(len(prompts)):
                out[i].append(int(top.indices[i, 0]))
                margins[i].append(float(top.values[i, 0] - top.values[i, 1]))
            if step < n - 1:
                steps = [len(p) + step for p in prompts]
                logits = executor.execute([o[-1] for o in out], steps, slots, list(range(len(prompts))))
    finally:
        for slot in slots:
            table.free(slot)
    return [Reference(p, o, m) for p, o, m in zip(prompts, out, margins, strict=True)]


@pytest.fixture(scope="module")
def cpu_engine() -> Iterator[object]:
    from worker.engine import Engine

    engine = Engine.load(model=MODEL, device="cpu", max_sessions=8, max_context=CONTEXT)
    yield engine
    engine.table.close()


@pytest.fixture(scope="module")
def references(cpu_engine: object) -> list[Reference]:
    """8 prompts whose CPU greedy continuations have safe margins at every token."""
    rng = random.Random(1234)
    safe: list[Reference] = []
    for _ in range(0, CANDIDATES, 8):
        prompts = [[rng.randrange(300, 49000) for _ in range(rng.randrange(6, 24))] for _ in range(8)]
        safe += [r for r in cpu_greedy(cpu_engine, prompts, TOKENS) if min(r.margins) >= SAFE_MARGIN]
        if len(safe) >= 8:
            return safe[:8]
    pytest.fail(f"only {len(safe)} of {CANDIDATES} random prompts have CPU margins >= {SAFE_MARGIN}")


@dataclass
class Loaded:
    engine: object
    free_before: int  # device bytes free before Engine.load (context and cuBLAS already up)
    free_after: int  # ... after it, caching allocator emptied


def device_free_bytes() -> int:
    """Free device memory as the driver reports it (not torch's allocator statistics)."""
    from cuda.bindings import driver

    torch.cuda.synchronize()
    err, free, _ = driver.cuMemGetInfo()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return int(free)


@pytest.fixture(scope="module")
def loaded() -> Iterator[Loaded]:
    from worker.engine import Engine

    warm = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (warm @ warm).sum().item()  # the context and the cuBLAS handle exist before the baseline
    del warm
    torch.cuda.empty_cache()
    before = device_free_bytes()
    engine = Engine.load(model=MODEL, device="cuda", max_sessions=8, max_context=CONTEXT)
    torch.cuda.empty_cache()
    yield Loaded(engine, before, device_free_bytes())
    engine.table.close()


@pytest.fixture
def gpu_engine(loaded: Loaded) -> Iterator[object]:
    """The module's GPU engine, with no sessions (and no slots kept mapped) before and after each test."""
    from worker.engine import Engine

    engine = loaded.engine
    assert isinstance(engine, Engine)
    for sid in engine.sessions():
        engine.close(sid)
    engine.release_idle_slots(0.0)
    yield engine
    for sid in engine.sessions():
        engine.close(sid)
    engine.release_idle_slots(0.0)


def open_with(engine: object, prompt: list[int]) -> str:
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    sid = engine.create_session()
    engine.append(sid, token_ids=prompt)
    return sid


def greedy(n: int) -> dict[str, object]:
    return {"max_tokens": n, "ignore_eos": True}


# -- GPU: the kernel -------------------------------------------------------------------------------


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
    rows, heads, hd = q.shape
    group = heads // k.shape[1]
    out = torch.empty(rows, heads, hd, dtype=torch.float64, device=q.device)
    for r in range(rows):
        n, s = int(lengths[r]), int(slots[r])
        kk = k[s, :, :n].double().repeat_interleave(group, 0)  # (H, n, hd)
        vv = v[s, :, :n].double().repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[r].double(), kk) / hd**0.5, -1)
        out[r] = torch.einsum("hn,hnd->hd", w, vv)
    return out


def random_decode_case(rows: int, heads: int, kv: int, hd: int, ctx: int, dtype: torch.dtype,
                       gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dev = torch.device("cuda")
    slab = torch.randn(rows + 3, 3, kv, ctx, hd, generator=gen).to(dev, dtype)  # (slot, layer, KV, ctx, hd)
    k, v = slab[:, 1], slab[:, 2]  # strided views, as the model passes them
    slots = torch.randperm(rows + 3, generator=gen)[:rows].to(dev)
    lengths = torch.randint(1, ctx + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = ctx
    if rows > 1:
        lengths[-1] = 1
    for r in range(rows):  # poison everything past each row's length
        k[int(slots[r]), :, int(lengths[r]):] = float("nan")
        v[int(slots[r]), :, int(lengths[r]):] = float("nan")
    q = torch.randn(rows, heads, hd, generator=gen).to(dev, dtype)
    return q, k, v, slots, lengths.to(dev)


KERNEL_CASES = [  # (dtype, (rows, heads, kv_heads, head_dim, max_context), splits); None = chosen from shapes
    (torch.bfloat16, (1, 9, 3, 64, 2048), None),  # batch 1, long context: split-K
    (torch.bfloat16, (1, 9, 3, 64, 2048), 1),
    (torch.bfloat16, (7, 9, 3, 64, 700), 3),
    (torch.bfloat16, (6, 9, 3, 64, 1100), 4),  # the longest row in 4 splits (one per 256 keys)
    (torch.bfloat16, (3, 9, 3, 64, 900), 3),
    (torch.bfloat16, (64, 8, 2, 128, 300), None),  # enough rows to fill the GPU: one pass
    (torch.bfloat16, (5, 4, 4, 80, 129), 2),  # no GQA, head_dim not a power of two
    (torch.float16, (7, 9, 3, 64, 700), None),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("dtype", "shape", "splits"), KERNEL_CASES)
def test_triton_decode_matches_a_float64_reference(
    dtype: torch.dtype, shape: tuple[int, int, int, int, int], splits: int | None
) -> None:
    from worker.kernels.attention import decode_attention

    gen = torch.Generator().manual_seed(sum(shape) * 31 + (splits or 0))
    q, k, v, slots, lengths = random_decode_case(*shape, dtype=dtype, gen=gen)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = decode_attention(q, k, v, slots, lengths, out=out, splits=splits)
    assert got is out
    expected = attention_reference(q, k, v, slots, lengths)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [2, 4])
def test_split_attention_gives_rows_too_short_to_split_the_bits_of_one_program(splits: int) -> None:
    """A row splits its keys only when each split gets MIN_SPLIT_KEYS of them: a shorter row runs in one split and
    its output is bitwise the one-program kernel's (so the executor may pick the attention by a step's longest
    row without moving the other rows' numbers). Longer rows split and stay close to the reference."""
    from worker.kernels.attention import MIN_SPLIT_KEYS, decode_attention

    gen = torch.Generator().manual_seed(splits)
    q, k, v, slots, lengths = random_decode_case(16, 9, 3, 64, 3 * MIN_SPLIT_KEYS, dtype=torch.bfloat16, gen=gen)
    short = lengths < 2 * MIN_SPLIT_KEYS
    assert 0 < int(short.sum()) < 16
    split = decode_attention(q, k, v, slots, lengths, splits=splits)
    whole = decode_attention(q, k, v, slots, lengths, splits=1)
    assert torch.equal(split[short], whole[short])
    assert not torch.equal(split[~short], whole[~short])  # the long rows did split
    torch.testing.assert_close(split.double(), attention_reference(q, k, v, slots, lengths), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_triton_decode_replays_in_a_cuda_graph_with_new_slots_and_lengths() -> None:
    from worker.kernels.attention import decode_attention

    gen = torch.Generator().manual_seed(7)
    q, k, v, slots, lengths = random_decode_case(4, 9, 3, 64, 1024, dtype=torch.bfloat16, gen=gen)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k, v, slots, lengths, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        decode_attention(q, k, v, slots, lengths, out=out)
    first_slots, first_lengths = slots.clone(), lengths.clone()  # K/V are valid up to these lengths
    for _ in range(3):
        perm = torch.randperm(4, generator=gen).to(slots.device)
        shrink = (0.2 + 0.8 * torch.rand(4, generator=gen)).to(lengths.device)
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        slots.copy_(first_slots[perm])
        lengths.copy_((first_lengths[perm] * shrink).to(lengths.dtype).clamp(min=1))
        graph.replay()
        assert torch.equal(out, decode_attention(q, k, v, slots, lengths))  # same kernel, same grid: bitwise


@pytest.mark.gpu
@needs_cuda
def test_triton_decode_reads_a_vmm_slab_whose_first_slots_are_unmapped() -> None:
    """Triton validates pointer arguments with the driver; slot 0 of a fresh slab is not mapped."""
    from cuda_state import BufferSpec, StateSpec
    from cuda_state.vmm import VmmBackend
    from worker.kernels.attention import decode_attention

    shape = (2, 3, 512, 64)  # (layers, KV, ctx, hd)
    spec = StateSpec((BufferSpec("k", shape, torch.bfloat16, 2), BufferSpec("v", shape, torch.bfloat16, 2)))
    backend = VmmBackend(spec, 4, torch.device("cuda", 0))
    try:
        backend.map(2)
        backend.zero(2)
        k_all, v_all = backend.views()["k"], backend.views()["v"]
        k_all[2].normal_()
        v_all[2].normal_()
        k, v = k_all[:, 1], v_all[:, 1]  # layer 1, as the model passes it
        spare = backend.num_slots - 1
        q = torch.randn(3, 9, 64, device="cuda", dtype=torch.bfloat16)
        slots = torch.tensor([2, spare, 2], device="cuda")
        lengths = torch.tensor([300, 1, 512], device="cuda", dtype=torch.int32)
        for splits in (None, 1, 4):
            out = decode_attention(q, k, v, slots, lengths, splits=splits)
            expected = attention_reference(q, k, v, slots, lengths)
            torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
        backend.mark_used([2])
    finally:
        backend.close()


def random_prefill_case(chunks: list[tuple[int, int, int]], heads: int, kv: int, hd: int, ctx: int, dtype: torch.dtype,
                        gen: torch.Generator, padding: int = 0) -> tuple[torch.Tensor, ...]:
    """Prompt chunks (slot, first position, rows) packed in order, then `padding` rows at position 0 of the spare
    (the last slot); K/V past each chunk's last row poisoned. q, k, v, slots, lengths on the GPU."""
    dev = torch.device("cuda")
    slab = torch.randn(max(c[0] for c in chunks) + 2, 3, kv, ctx, hd, generator=gen).to(dev, dtype)
    k, v = slab[:, 1], slab[:, 2]  # strided views, as the model passes them
    slots: list[int] = []
    positions: list[int] = []
    for slot, pos, n in chunks:
        slots += [slot] * n
        positions += range(pos, pos + n)
        k[slot, :, pos + n :] = float("nan")
        v[slot, :, pos + n :] = float("nan")
    slots += [slab.shape[0] - 1] * padding
    positions += [0] * padding
    q = torch.randn(len(slots), heads, hd, generator=gen).to(dev, dtype)
    lengths = torch.tensor(positions, dtype=torch.int32, device=dev) + 1
    return q, k, v, torch.tensor(slots, device=dev), lengths


def tiles_of(counts: list[int], grid: int) -> torch.Tensor:
    """The tiles of chunks of `counts` rows packed from row 0, in a (2, grid) tensor on the GPU."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    firsts, rows = prefill_tiles(starts, counts)
    tiles = torch.zeros(2, grid, dtype=torch.long)
    tiles[0, : len(firsts)], tiles[1, : len(firsts)] = torch.from_numpy(firsts), torch.from_numpy(rows)
    return tiles.cuda()


PREFILL_CASES = [  # (dtype, (heads, kv_heads, head_dim, max_context), chunks (slot, first position, rows), padding)
    (torch.bfloat16, (9, 3, 64, 2048), [(1, 0, 2048)], 0),  # one long prompt from position 0: 32 tiles
    (torch.bfloat16, (9, 3, 64, 2048), [(0, 1500, 128), (2, 0, 130), (3, 700, 2), (1, 63, 65)], 11),
    (torch.bfloat16, (4, 4, 80, 300), [(0, 10, 100), (1, 0, 37)], 3),  # no GQA, head_dim not a power of two
    (torch.float16, (9, 3, 64, 700), [(2, 5, 200)], 56),
    (torch.bfloat16, (32, 8, 128, 600), [(0, 300, 70), (1, 0, 3)], 7),  # Llama-3-8B's heads
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("dtype", "shape", "chunks", "padding"), PREFILL_CASES)
def test_triton_prefill_matches_a_float64_reference(
    dtype: torch.dtype, shape: tuple[int, int, int, int], chunks: list[tuple[int, int, int]], padding: int
) -> None:
    from worker.kernels.prefill import prefill_attention

    gen = torch.Generator().manual_seed(sum(shape) + len(chunks))
    q, k, v, slots, lengths = random_prefill_case(chunks, *shape, dtype=dtype, gen=gen, padding=padding)
    counts = [n for _, _, n in chunks] + [padding]
    out = torch.full_like(q, float("nan"))  # poisoned: every row is in a tile and must be written
    assert prefill_attention(q, k, v, slots, lengths, tiles_of(counts, max_tiles(len(slots), len(chunks))), out=out) is out
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, slots, lengths), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_triton_prefill_rows_give_the_same_bits_however_chunks_are_cut_and_packed() -> None:
    """A row's numbers do not depend on its tile: the same prompt rows cut into other chunks, packed after other
    chunks, or launched on a larger grid give bitwise the same output (so a prompt's tokens do not depend on
    how the scheduler cuts it or what shares its step)."""
    from worker.kernels.prefill import prefill_attention

    gen = torch.Generator().manual_seed(11)
    chunks = [(0, 1000, 300), (1, 0, 200)]
    q, k, v, slots, lengths = random_prefill_case(chunks, 9, 3, 64, 2048, dtype=torch.bfloat16, gen=gen, padding=12)
    whole = prefill_attention(q, k, v, slots, lengths, tiles_of([300, 200, 12], 64))
    cut = prefill_attention(q, k, v, slots, lengths, tiles_of([37, 64, 150, 49, 1, 199, 12], 64))
    assert torch.equal(cut, whole)
    wide = prefill_attention(q, k, v, slots, lengths, tiles_of([300, 200, 12], 200))
    assert torch.equal(wide, whole)
    order = torch.cat([torch.arange(300, 500), torch.arange(0, 300), torch.arange(500, 512)]).cuda()  # chunk 1 first
    swapped = prefill_attention(q[order], k, v, slots[order], lengths[order], tiles_of([200, 300, 12], 64))
    assert torch.equal(swapped, whole[order])


@pytest.mark.gpu
@needs_cuda
def test_triton_prefill_replays_in_a_cuda_graph_with_new_tiles() -> None:
    from worker.kernels.prefill import prefill_attention

    gen = torch.Generator().manual_seed(5)
    chunks = [(0, 900, 256), (1, 0, 200), (2, 40, 40)]
    q, k, v, slots, lengths = random_prefill_case(chunks, 9, 3, 64, 2048, dtype=torch.bfloat16, gen=gen, padding=16)
    grid = max_tiles(len(slots), 8)
    tiles = tiles_of([256, 200, 40, 16], grid)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefill_attention(q, k, v, slots, lengths, tiles, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        prefill_attention(q, k, v, slots, lengths, tiles, out=out)
    for counts in ([256, 200, 40, 16], [100, 156, 50, 150, 40, 16], [512]):  # the last: every row one slot's
        if counts == [512]:
            slots.fill_(0)
            lengths.copy_(torch.arange(1, 513, dtype=torch.int32))
            k[0].normal_()
            v[0].normal_()
        tiles.copy_(tiles_of(counts, grid))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, prefill_attention(q, k, v, slots, lengths, tiles_of(counts, grid)))
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, slots, lengths), atol=2e-2, rtol=2e-2)


# -- GPU: the engine -------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_runs_bf16_on_the_vmm_slab_with_graphs(gpu_engine: object) -> None:
    from cuda_state.vmm import VmmBackend
    from worker.engine import Engine
    from worker.engine.graphs import GraphExecutor

    assert isinstance(gpu_engine, Engine)
    assert gpu_engine.model.dtype == torch.bfloat16 and gpu_engine.model.decode_attention is not None
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
def test_a_bucket_whose_rows_differ_from_the_largest_is_dropped_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check compares each bucket's logits with the largest bucket's for the same rows: a bucket
    whose numbers differ in any bit (here: skewed on purpose) is not used; its batches run in the next one.
    The same for prefill buckets."""
    from worker.engine import Engine
    from worker.engine.graphs import GraphExecutor

    step, prefill_step = GraphExecutor._step, GraphExecutor._prefill_step

    def skewed(self: GraphExecutor, b: int) -> torch.Tensor:
        logits = step(self, b)
        return logits * (1 + 2**-7) if b == 1 else logits  # one bf16 ulp: what another summation order can do

    def skewed_prefill(self: GraphExecutor, b: int) -> torch.Tensor:
        logits = prefill_step(self, b)  # the shared output: skewed in place
        if b == 256:
            with torch.inference_mode():
                logits.mul_(1 + 2**-7)
        return logits

    monkeypatch.setattr(GraphExecutor, "_step", skewed)
    monkeypatch.setattr(GraphExecutor, "_prefill_step", skewed_prefill)
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
        assert prefills == [128, 128, 512]  # each 3-token prompt alone (generate_many starts one at a time)
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
def test_gpu_greedy_tokens_match_the_cpu(gpu_engine: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    assert isinstance(gpu_engine, Engine)
    for ref in references:
        sid = open_with(gpu_engine, ref.prompt)
        assert gpu_engine.generate(sid, **greedy(TOKENS)).token_ids == ref.tokens
        gpu_engine.close(sid)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


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
        cpu_slot = cpu_engine.table.create()
        cpu = cpu_engine.executor.execute(seq, list(range(len(seq))), [cpu_slot] * len(seq), list(range(n - 1, len(seq))))
        cpu_engine.table.free(cpu_slot)
        slot = gpu_engine.table.create()
        try:
            rows = [gpu_engine.executor.execute(ref.prompt, list(range(n)), [slot] * n, [n - 1])]
            for i, token in enumerate(ref.tokens):
                rows.append(gpu_engine.executor.execute([token], [n + i], [slot], [0]))
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
    """The worker takes requests while step() waits for a step with prompt tokens (Engine.while_prefilling):
    sessions opened, generations started and a generating session closed from inside step() leave every
    session's tokens exactly as when each runs alone."""
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
    gpu_engine.while_prefilling = meanwhile
    try:
        while gpu_engine.has_work():
            for chunk in gpu_engine.step():
                if chunk.request_id in names:
                    out[names[chunk.request_id]] += chunk.token_ids
                if chunk.finish_reason is not None:
                    reasons[chunk.request_id] = chunk.finish_reason
    finally:
        gpu_engine.while_prefilling = None
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
    from_graph = graphs.execute(*step, list(range(8)))
    from_eager = eager.execute(*step, list(range(8)))
    err = relative_error(from_graph, from_eager)
    assert err < 4e-2, f"relative error {err:.4f}"
    assert from_graph.argmax(-1).tolist() == from_eager.argmax(-1).tolist()


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
    expected = table.capacity * table.slot_bytes
    assert abs(used - expected) <= 0.01 * expected, (used, expected)
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
    torch.cuda.synchronize()
    baseline = device_free_bytes()
    for _ in range(8):
        one_round(gpu_engine, rng, 6, prompt_max=CONTEXT - 200)
    assert gpu_engine.sessions() == []
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
    logits = gpu_engine.executor.execute(*step)  # queued: reads and writes slot a after the sleep
    gpu_engine.close(a)  # kept mapped: nothing to wait for
    c = gpu_engine.create_session()
    assert gpu_engine._sessions[c].slot == sa.slot  # slot a again, its zeroing queued behind the step
    torch.cuda.synchronize()
    state = gpu_engine.table.views()
    assert all(torch.count_nonzero(state[name][sa.slot]) == 0 for name in ("k", "v"))  # the step's K/V: zeroed
    assert logits[1].argmax().item() == references[1].tokens[1]

    torch.cuda._sleep(400_000_000)
    gpu_engine.executor.execute([1], [0], [sa.slot], [0])  # queued: writes slot a after the sleep
    gpu_engine.close(c)
    start = time.perf_counter()
    assert gpu_engine.release_idle_slots(0.0) == 1  # must not give slot a's memory back under the running step
    waited = time.perf_counter() - start
    if not UNDER_SANITIZER:  # the sanitizer runs every launch to completion: nothing is left to wait for
        assert waited > 0.02, f"the release returned after {waited:.4f} s, before the queued step could have run"
    assert gpu_engine.generate(b, **greedy(TOKENS - 1)).token_ids == references[1].tokens[1:]
    torch.cuda.synchronize()
