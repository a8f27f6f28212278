"""The fused GPU kernels (worker.kernels.fused) and the fused layer stack (worker.kernels.layers).

CPU tests run the kernels in Triton's interpreter (in a subprocess: TRITON_INTERPRET is read at
import) in fp32 and fp16 (the interpreter's bf16 is not exact), against worker.model.llama's torch code,
with NaN-poisoned outputs and the K/V caches as the strided slab views the model passes. They also
run the whole tiny model through Llama.forward with the fused stack hooked in.

GPU tests (-m gpu) compare the bf16 kernels with the same torch code on the device: bit for bit
where nothing but IEEE adds and multiplies is involved (the residual add, RoPE, the cache write),
and all but rarely (a last-bit flip of an intermediate rounding, <= 2 ulps of the output, >= 99.9%
of elements exact) where a reduction order or a libm call may differ (rms_norm, silu); then the
SmolLM2-135M-shaped engine with and without the fused stack, and its launch count per layer.
"""

from __future__ import annotations

import dataclasses
import gc
import random
from collections.abc import Iterator

import pytest
import torch

from cuda_state import store_positions
from tests.worker.interpreted import run_interpreted
from tests.worker.tensors import rope_rows, same_bits, slab_caches, ulps
from worker.model import llama as reference

MODEL = "random:smollm2-135m"
CONTEXT = 1024
THETA = 100000.0  # SmolLM2's rope_theta
TOKENS = 6  # greedy tokens per prompt in the engine test
CANDIDATES = 24  # random prompts tried until 3 have safe margins at every token
# Top-1 minus top-2 logit, as tests/worker/gpu's SAFE_MARGIN: graph decode runs the 8-row bucket's GEMMs, the
# eager reference one row's, so their bf16 logits differ by more than fused vs torch (rare last bits).
SAFE_MARGIN = 0.06

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def test_fused_kernels_match_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("fused_kernels", timeout_s=600)


def test_fused_forward_matches_the_torch_layers_in_the_interpreter() -> None:
    """The tiny model through Llama.forward, fused stack hooked in or not: mixed prefill and decode."""
    pytest.importorskip("triton")
    run_interpreted("fused_forward", timeout_s=600)


# -- GPU: the kernels ------------------------------------------------------------------------------

def assert_nearly_exact(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-exact but for rare last-bit flips of the intermediate rounding (normed or silu, in the dtype):
    one such flip, times the weight or `up` and rounded again, moves the output by at most 2 ulps."""
    dist = ulps(got, expected)
    assert int(dist.max()) <= 2, f"{what}: {int(dist.max())} ulps"
    share = float((dist == 0).float().mean())
    assert share >= 0.999, f"{what}: only {share:.5f} of the elements are bit-exact"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 64, 2048])
def test_gpu_norms_match_torch(rows: int) -> None:
    from worker.kernels.fused import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(rows)
    x, r = ((torch.randn(rows, 576, generator=gen) * 3).to("cuda", torch.bfloat16) for _ in range(2))
    w = torch.randn(576, generator=gen).to("cuda", torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, w, 1e-5, out=out) is out
    assert_nearly_exact(out, reference.rms_norm(x, w, 1e-5), "rms_norm")
    normed, residual = add_rms_norm(x, r, w, 1e-5)
    assert same_bits(residual, r + x)
    assert_nearly_exact(normed, reference.rms_norm(r + x, w, 1e-5), "add_rms_norm")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_gpu_silu_mul_matches_torch(rows: int) -> None:
    import torch.nn.functional as F

    from worker.kernels.fused import silu_mul

    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to("cuda", torch.bfloat16)
    out = torch.full((rows, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert silu_mul(gate_up, out=out) is out
    gate, up = gate_up.chunk(2, dim=-1)
    assert_nearly_exact(out, F.silu(gate) * up, "silu_mul")


def rope_case(rows: int, gen: torch.Generator, k_cache: torch.Tensor, slots: list[int],
              positions: list[int]) -> tuple[torch.Tensor, ...]:
    """qkv (bf16), cos, sin, slots, positions on the GPU, for the 135M shapes (9 heads, 3 kv, 64)."""
    dev = k_cache.device
    qkv = torch.randn(rows, 15 * 64, generator=gen).to(dev, torch.bfloat16)
    pos = torch.tensor(positions, device=dev)
    cos, sin = rope_rows(64, THETA, k_cache.shape[2] * k_cache.shape[3], pos)
    return qkv, cos, sin, torch.tensor(slots, device=dev), pos


def expected_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the torch layer loop does: q roped, returned; k roped and v written in place."""
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    store_positions(k_cache, slots, positions, reference.apply_rope(k.view(-1, 3, 64), cos, sin))
    store_positions(v_cache, slots, positions, v.view(-1, 3, 64))
    return reference.apply_rope(q.view(-1, 9, 64), cos, sin)


@pytest.mark.gpu
@needs_cuda
def test_gpu_rope_and_store_matches_torch_bit_for_bit() -> None:
    from worker.kernels.fused import rope_and_store

    gen = torch.Generator().manual_seed(11)
    k_all, v_all = slab_caches(7, 3, 3, 512, 64, torch.bfloat16, "cuda")
    k_all.copy_(torch.randn(k_all.shape, generator=gen))
    v_all.copy_(torch.randn(v_all.shape, generator=gen))
    slots = [4] * 20 + [0, 6, 2]  # a prefill run, then decode rows (6: the spare)
    positions = list(range(100, 120)) + [511, 0, 37]
    qkv, cos, sin, slot_t, pos_t = rope_case(len(slots), gen, k_all[:, 0], slots, positions)
    expect_k, expect_v = k_all.clone(), v_all.clone()
    q_expected = expected_rope(qkv, cos, sin, expect_k[:, 2], expect_v[:, 2], slot_t, pos_t)
    q = rope_and_store(qkv, cos, sin, k_all[:, 2], v_all[:, 2], slot_t, pos_t, 9, 3, 64)
    assert same_bits(q, q_expected)
    assert same_bits(k_all, expect_k) and same_bits(v_all, expect_v)


@pytest.mark.gpu
@needs_cuda
def test_gpu_rope_and_store_writes_a_vmm_slab_whose_first_slots_are_unmapped() -> None:
    """Triton validates pointer arguments with the driver; slot 0 of a fresh slab is not mapped."""
    from cuda_state import BufferSpec, StateSpec
    from cuda_state.vmm import VmmBackend
    from worker.kernels.fused import rope_and_store

    shape = (2, 3, 512, 64)  # (layers, KV, ctx, hd)
    spec = StateSpec((BufferSpec("k", shape, torch.bfloat16, 2), BufferSpec("v", shape, torch.bfloat16, 2)))
    backend = VmmBackend(spec, 4, torch.device("cuda", 0))
    try:
        backend.grow(2, backend.pages_per_slot)
        k_all, v_all = backend.views()["k"], backend.views()["v"]
        spare = backend.num_slots - 1
        gen = torch.Generator().manual_seed(3)
        qkv, cos, sin, slots, positions = rope_case(3, gen, k_all[:, 1], [2, spare, 2], [7, 0, 300])
        # torch's writes go to a copy of the two mapped slots, (slot 2, spare) -> local (0, 1)
        expect_k, expect_v = torch.stack([k_all[2], k_all[spare]]), torch.stack([v_all[2], v_all[spare]])
        local = torch.tensor([0, 1, 0], device="cuda")
        q_expected = expected_rope(qkv, cos, sin, expect_k[:, 1], expect_v[:, 1], local, positions)
        q = rope_and_store(qkv, cos, sin, k_all[:, 1], v_all[:, 1], slots, positions, 9, 3, 64)
        torch.cuda.synchronize()
        assert same_bits(q, q_expected)
        assert same_bits(k_all[2], expect_k[0]) and same_bits(v_all[2], expect_v[0])
        assert same_bits(k_all[spare], expect_k[1]) and same_bits(v_all[spare], expect_v[1])
        backend.mark_used([2])
    finally:
        backend.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_rope_and_store_replays_in_a_cuda_graph_with_new_slots_and_positions() -> None:
    from worker.kernels.fused import rope_and_store

    gen = torch.Generator().manual_seed(5)
    k_all, v_all = slab_caches(9, 2, 3, 256, 64, torch.bfloat16, "cuda")
    k_cache, v_cache = k_all[:, 1], v_all[:, 1]
    qkv, cos, sin, slots, positions = rope_case(4, gen, k_cache, [0, 1, 2, 3], [0, 1, 2, 3])
    q = torch.empty((4, 9, 64), device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, positions, 9, 3, 64, out=q)  # compile outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, positions, 9, 3, 64, out=q)
    for _ in range(3):
        slots.copy_(torch.randperm(9, generator=gen)[:4])  # distinct slots; 8 is the spare
        positions.copy_(torch.randint(0, 256, (4,), generator=gen))
        qkv.copy_(torch.randn(qkv.shape, generator=gen))
        new_cos, new_sin = rope_rows(64, THETA, 256, positions)
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        expect_k, expect_v = k_all.clone(), v_all.clone()
        q_expected = expected_rope(qkv, cos, sin, expect_k[:, 1], expect_v[:, 1], slots, positions)
        graph.replay()
        assert same_bits(q, q_expected)
        assert same_bits(k_all, expect_k) and same_bits(v_all, expect_v)


# -- GPU: the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_box() -> Iterator[list[object]]:
    """The fused GPU engine, in a list that teardown empties: its memory is given back before the next
    module (tests/worker/gpu/test_memory measures the device memory its own engine takes)."""
    from worker.engine import Engine

    box: list[object] = [Engine.load(model=MODEL, device="cuda", max_sessions=8, max_context=CONTEXT)]
    yield box
    engine = box.pop()
    assert isinstance(engine, Engine)
    engine.table.close()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture
def fused_engine(engine_box: list[object]) -> object:
    return engine_box[0]


def eager_steps(engine: object, prompt: list[int], n: int, fused: bool,
                forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Eager prefill, then decode steps: n tokens, greedy or `forced`, and the logits (n, vocab) that chose them."""
    from worker.engine import Engine
    from worker.engine.executor import EagerExecutor, StepRows
    from worker.kernels.layers import fused_layers

    assert isinstance(engine, Engine)
    executor = EagerExecutor(engine.model, engine.table)
    kernels = engine.model.kernels
    engine.model.kernels = dataclasses.replace(kernels, fused_layers=fused_layers if fused else None)
    slot = engine.table.create(engine.max_context)  # backed whole: the rows reach past a page
    try:
        p = len(prompt)
        rows = [executor.execute(StepRows(prompt, list(range(p)), [slot] * p, [p - 1]))[0]]
        tokens: list[int] = []
        for i in range(n):
            tokens.append(forced[i] if forced is not None else int(rows[-1].argmax()))
            if i + 1 < n:
                rows.append(executor.execute(StepRows([tokens[-1]], [p + i], [slot], [0]))[0])
        return tokens, torch.stack(rows).float().cpu()
    finally:
        engine.model.kernels = kernels
        engine.table.free(slot)


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_uses_the_fused_stack(fused_engine: object) -> None:
    from worker.engine import Engine
    from worker.kernels.layers import fused_layers

    assert isinstance(fused_engine, Engine)
    assert fused_engine.model.kernels.fused_layers is fused_layers


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_logits_and_greedy_tokens_match_the_torch_layers(fused_engine: object) -> None:
    """Prefill and decode steps (eager), fused vs the torch loop: logits within 1e-2 at every step;
    greedy tokens identical, eager and from the fused graphs, wherever the torch margins are safe."""
    from worker.engine import Engine

    assert isinstance(fused_engine, Engine)
    rng = random.Random(4321)
    checked = 0
    for _ in range(CANDIDATES):
        prompt = [rng.randrange(300, 49000) for _ in range(rng.randrange(6, 40))]
        tokens, plain = eager_steps(fused_engine, prompt, TOKENS, fused=False)
        _, fused = eager_steps(fused_engine, prompt, TOKENS, fused=True, forced=tokens)
        for step in range(TOKENS):
            err = float((fused[step].double() - plain[step].double()).norm() / plain[step].double().norm())
            assert err < 1e-2, f"step {step}: relative error {err:.5f}"
        top = plain.topk(2, dim=-1).values
        if float((top[:, 0] - top[:, 1]).min()) < SAFE_MARGIN:
            continue  # a near tie somewhere: either token is right
        assert fused.argmax(-1).tolist() == tokens
        sid = fused_engine.create_session()
        fused_engine.append(sid, token_ids=prompt)
        assert fused_engine.generate(sid, max_tokens=TOKENS, ignore_eos=True).token_ids == tokens  # from graphs
        fused_engine.close(sid)
        checked += 1
        if checked == 3:
            return
    pytest.fail(f"only {checked} of {CANDIDATES} random prompts had greedy margins >= {SAFE_MARGIN}")


def kernels_in_decode_step(engine: object, fused: bool, row_products: bool = False, splits: int | None = None,
                           rope_in_attention: bool = False) -> int:
    """CUDA kernels launched by one eager 8-row decode step (the bucket's shape), counted by the profiler.
    `splits`: the attention's (default: the executor's, as in the split graphs)."""
    from torch.profiler import ProfilerActivity, profile

    from worker.engine import Engine
    from worker.kernels.layers import fused_layers
    from worker.model.llama import Batch

    assert isinstance(engine, Engine)
    model, spare = engine.model, engine.table.spare_slot
    rows = 8
    zeros = torch.zeros(rows, dtype=torch.long, device="cuda")
    slots = torch.full((rows,), spare, dtype=torch.long, device="cuda")  # padding rows: the spare only
    batch = Batch(runs=[], decode_only=True, lengths=torch.ones(rows, dtype=torch.int32, device="cuda"),
                  attention_splits=splits or engine.executor.attention_splits,  # type: ignore[attr-defined]
                  row_products=row_products, rope_in_attention=rope_in_attention)
    kernels = model.kernels
    model.kernels = dataclasses.replace(kernels, fused_layers=fused_layers if fused else None)
    try:
        model.forward(zeros, zeros, slots, engine.table.views(), batch)  # compiled and warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.forward(zeros, zeros, slots, engine.table.views(), batch)
            torch.cuda.synchronize()
    finally:
        model.kernels = kernels
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len([n for n in names if not n.startswith(("Memcpy", "Memset"))])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.filterwarnings("ignore::UserWarning")  # the profiler's own notices (CUPTI, kineto) are not failures
def test_gpu_fused_decode_step_launches_about_ten_kernels_per_layer(fused_engine: object) -> None:
    from worker.engine import Engine

    assert isinstance(fused_engine, Engine)
    layers = fused_engine.model.config.n_layers
    plain, fused = kernels_in_decode_step(fused_engine, False), kernels_in_decode_step(fused_engine, True)
    if plain == 0:
        pytest.skip("the profiler recorded no CUDA kernels here")
    # A fused layer: 2 add_rms_norm, rope_and_store, silu_mul, attention (2 when split, as at 8 rows) and
    # 4 GEMMs (cuBLAS may add split-K reductions; the torch loop runs the same ones). ~35 fewer per layer.
    counts = f"{plain} kernels with the torch loop, {fused} fused, {layers} layers"
    assert fused <= 16 * layers, counts
    assert plain - fused >= 25 * layers, counts


@pytest.mark.gpu
@needs_cuda
@pytest.mark.filterwarnings("ignore::UserWarning")  # the profiler's own notices (CUPTI, kineto) are not failures
def test_gpu_row_products_decode_step_launches_seven_kernels_per_layer(fused_engine: object) -> None:
    """qkv (normed), rope_and_store, attention and its merge (2 splits), o (+ residual, squares), gate|up
    (normed, silu), down (+ residual, squares); per step the embedding, RoPE rows, the first squares and the head.
    A step whose rows are all short (the graphs without split attention) has no merge and RoPE in the attention's
    launch: 5 per layer."""
    from worker.engine import Engine

    assert isinstance(fused_engine, Engine)
    layers = fused_engine.model.config.n_layers
    assert fused_engine.executor.attention_splits == 2  # type: ignore[attr-defined]
    assert fused_engine.executor.row_products  # type: ignore[attr-defined]
    rows = kernels_in_decode_step(fused_engine, True, row_products=True)
    if rows == 0:
        pytest.skip("the profiler recorded no CUDA kernels here")
    cublas = kernels_in_decode_step(fused_engine, True)
    counts = f"{rows} kernels with row products, {cublas} without, {layers} layers"
    assert 7 * layers <= rows <= 7 * layers + 10, counts
    assert kernels_in_decode_step(fused_engine, True, row_products=True, splits=1) == rows - layers
    assert kernels_in_decode_step(fused_engine, True, row_products=True, splits=1, rope_in_attention=True) == rows - 2 * layers
    assert cublas - rows >= 3 * layers, counts
