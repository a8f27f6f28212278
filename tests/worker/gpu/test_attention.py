"""The attention kernels: the prefill tiles, the Triton decode and prefill kernels' math in Triton's interpreter
on the CPU (fp32/fp16: the interpreter's bf16 dot is not exact), and on the GPU against a float64 reference,
in CUDA graphs and on a VMM slab."""

from __future__ import annotations

import pytest
import torch

from cuda_state import positions
from tests.worker.interpreted import run_interpreted
from tests.worker.tensors import blocked
from worker.kernels.tiles import TILE_ROWS, max_tiles, prefill_tiles

from .device import needs_cuda

# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


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


def test_triton_kernel_math_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("decode_attention", timeout_s=300)


def test_rope_in_the_decode_attention_gives_the_two_launches_bits_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("rope_decode_attention", timeout_s=300)


@pytest.mark.gpu
@needs_cuda
def test_gpu_rope_in_the_decode_attention_gives_the_two_launches_bits() -> None:
    from tests.worker.interpreted.rope_decode_attention import compare

    compare("cuda", torch.bfloat16, [(4, 32, 8, 128, 300), (5, 8, 2, 64, 100), (3, 6, 3, 48, 40)])


def test_triton_prefill_kernel_math_in_the_interpreter() -> None:
    """The tiled prompt-chunk attention against the decode kernel's math in float64, chunks of 1 to 3 tiles at
    offsets, padding rows in the spare slot, K/V past each chunk poisoned, rows outside every tile untouched."""
    pytest.importorskip("triton")
    run_interpreted("prefill_attention", timeout_s=300)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
    rows, heads, hd = q.shape
    group = heads // k.shape[1]
    out = torch.empty(rows, heads, hd, dtype=torch.float64, device=q.device)
    for r in range(rows):
        n, s = int(lengths[r]), int(slots[r])
        kk = positions(k, s, n).double().repeat_interleave(group, 0)  # (H, n, hd)
        vv = positions(v, s, n).double().repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[r].double(), kk) / hd**0.5, -1)
        out[r] = torch.einsum("hn,hnd->hd", w, vv)
    return out


def random_decode_case(rows: int, heads: int, kv: int, hd: int, ctx: int, dtype: torch.dtype,
                       gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dev = torch.device("cuda")
    k = torch.randn(rows + 3, kv, ctx, hd, generator=gen).to(dev, dtype)  # (slot, KV, ctx, hd)
    v = torch.randn(rows + 3, kv, ctx, hd, generator=gen).to(dev, dtype)
    slots = torch.randperm(rows + 3, generator=gen)[:rows].to(dev)
    lengths = torch.randint(1, ctx + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = ctx
    if rows > 1:
        lengths[-1] = 1
    for r in range(rows):  # poison everything past each row's length
        k[int(slots[r]), :, int(lengths[r]):] = float("nan")
        v[int(slots[r]), :, int(lengths[r]):] = float("nan")
    q = torch.randn(rows, heads, hd, generator=gen).to(dev, dtype)
    kb, vb = blocked(k, v)  # the table's layout of one layer, as the model passes it
    return q, kb, vb, slots, lengths.to(dev)


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
        backend.grow(2, backend.pages_per_slot)
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


@pytest.mark.gpu
@needs_cuda
def test_triton_decode_reads_only_the_pages_a_session_holds() -> None:
    """A slot backed page by page: a row reads its first `length` positions and never past them, so a session whose
    slot maps only the pages its tokens need is read right, and nothing touches the unmapped rest (an access there
    would kill the process)."""
    from cuda_state import BufferSpec, StateSpec
    from cuda_state.vmm import VmmBackend
    from worker.kernels.attention import decode_attention

    shape = (8, 8, 4096, 128)  # 32 KiB a token: 64 tokens a 2 MiB page
    spec = StateSpec((BufferSpec("k", shape, torch.bfloat16, 2), BufferSpec("v", shape, torch.bfloat16, 2)))
    backend = VmmBackend(spec, 4, torch.device("cuda", 0))
    try:
        tokens = spec.tokens_in(2, backend.page_bytes)
        assert tokens == 128 and backend.pages_per_slot == 64
        backend.grow(1, 2)  # 128 of its 4,096 positions
        k_all, v_all = backend.views()["k"], backend.views()["v"]
        k_all[1, :, :, : tokens // spec.block].normal_()  # (slot, layer, KV, blocks, block, hd)
        v_all[1, :, :, : tokens // spec.block].normal_()
        k, v = k_all[:, 5], v_all[:, 5]
        spare = backend.num_slots - 1
        q = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.tensor([1, spare, 1, 1], device="cuda")
        lengths = torch.tensor([100, 1, tokens, 64], device="cuda", dtype=torch.int32)
        for splits in (None, 1, 4):
            out = decode_attention(q, k, v, slots, lengths, splits=splits)
            expected = attention_reference(q, k, v, slots, lengths)
            torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
        torch.cuda.synchronize()
        backend.mark_used([1])
    finally:
        backend.close()


def random_prefill_case(chunks: list[tuple[int, int, int]], heads: int, kv: int, hd: int, ctx: int, dtype: torch.dtype,
                        gen: torch.Generator, padding: int = 0) -> tuple[torch.Tensor, ...]:
    """Prompt chunks (slot, first position, rows) packed in order, then `padding` rows at position 0 of the spare
    (the last slot); K/V past each chunk's last row poisoned. q, k, v, slots, lengths on the GPU."""
    dev = torch.device("cuda")
    n_slots = max(c[0] for c in chunks) + 2
    k = torch.randn(n_slots, kv, ctx, hd, generator=gen).to(dev, dtype)  # (slot, KV, ctx, hd)
    v = torch.randn(n_slots, kv, ctx, hd, generator=gen).to(dev, dtype)
    slots: list[int] = []
    positions: list[int] = []
    for slot, pos, n in chunks:
        slots += [slot] * n
        positions += range(pos, pos + n)
        k[slot, :, pos + n :] = float("nan")
        v[slot, :, pos + n :] = float("nan")
    slots += [n_slots - 1] * padding
    positions += [0] * padding
    q = torch.randn(len(slots), heads, hd, generator=gen).to(dev, dtype)
    lengths = torch.tensor(positions, dtype=torch.int32, device=dev) + 1
    kb, vb = blocked(k, v)  # the table's layout of one layer, as the model passes it
    return q, kb, vb, torch.tensor(slots, device=dev), lengths


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
