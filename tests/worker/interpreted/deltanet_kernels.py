"""The gated DeltaNet kernels (worker.kernels.deltanet) against the torch reference the CPU model runs
(worker.model.delta_rule, and the causal convolution written out in float64), in fp32 and fp16 (the interpreter's bf16
is not exact): steps packing several sessions' runs that start at position 0, continue a held state (runs shorter
than the convolution's window and longer than one 64-token block, across tiles), and padding rows in the spare slot;
decode steps of one token per slot. The state is a strided view of a slab, the other slots' state is checked
untouched, and every output is NaN-poisoned first. Run by tests/worker/test_deltanet.py (see this package)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SLOTS = 6  # session slots; the slab's last slot (SLOTS) is the spare
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, TAPS = 2, 4, 16, 24, 4
CHANNELS = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM  # 160


def slab(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(SLOTS + 1, *shape) random, as a strided view of a wider slab (another buffer between slots)."""
    wide = torch.randn((SLOTS + 1, 2, *shape), generator=gen).to(dtype)
    return wide[:, 1]


def conv_reference(x: torch.Tensor, w: torch.Tensor, held: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal depthwise conv) of one run x (n, C) after `held` (C, TAPS - 1) (None: zeros), rounded to x's dtype
    once before silu as the kernel and torch do; and the new held inputs."""
    before = torch.zeros(x.shape[1], TAPS - 1, dtype=torch.float64) if held is None else held.double()
    window = torch.cat([before, x.double().t()], dim=1)
    out = F.conv1d(window[None], w.double(), groups=x.shape[1])[0].t().to(x.dtype)
    return F.silu(out.float()).to(x.dtype), window[:, -(TAPS - 1):].to(x.dtype)


# (slot, first position, tokens) of each run in a prefill step, then padding rows: for the delta rule, runs within a
# 64-token tile, of 2 and 3 tiles, and of one whole tile; for the convolution, runs longer and shorter than its window
PREFILL_RUNS = [(1, 5, 7), (3, 0, 70), (0, 9, 2), (4, 1, 130), (2, 33, 64), (5, 300, 1)]
CONV_RUNS = [(1, 5, 7), (3, 0, 5), (0, 9, 2), (4, 1, 3), (2, 33, 1), (5, 300, 4)]
PADDING = 9


def check_conv(dtype: torch.dtype, tol: float) -> None:
    from worker.kernels.deltanet import conv_decode, conv_prefill

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(CHANNELS, 1, TAPS, generator=gen).to(dtype)
    for decode in (False, True):
        state = slab((CHANNELS, TAPS - 1), dtype, gen)
        before = state.clone()
        runs = [(s, p, 1) for s, p in ((2, 7), (0, 0), (5, 3), (1, 1))] if decode else CONV_RUNS
        slots = [s for s, _, n in runs for _ in range(n)] + [SLOTS] * (0 if decode else PADDING)
        positions = [p + i for _, p, n in runs for i in range(n)] + [0] * (0 if decode else PADDING)
        x = torch.randn(len(slots), CHANNELS, generator=gen).to(dtype)
        out = torch.full_like(x, float("nan"))
        launch = conv_decode if decode else conv_prefill
        assert launch(x, weight, state, torch.tensor(slots), torch.tensor(positions), out=out) is out
        row = 0
        for slot, pos, n in runs:
            expected, held = conv_reference(x[row : row + n], weight, None if pos == 0 else before[slot])
            err = (out[row : row + n].double() - expected.double()).abs().max().item()
            assert err <= tol, (dtype, decode, slot, err)
            assert torch.equal(state[slot], held), (dtype, decode, slot)
            row += n
        untouched = {s for s in range(SLOTS)} - {s for s, _, _ in runs}
        for slot in untouched:
            assert torch.equal(state[slot], before[slot])


def check_delta(dtype: torch.dtype, tol: float) -> None:
    from worker.kernels.deltanet import delta_decode, delta_prefill
    from worker.kernels.tiles import max_tiles, prefill_tiles
    from worker.model import delta_rule

    gen = torch.Generator().manual_seed(2)
    a_log = torch.empty(VALUE_HEADS).uniform_(0.01, 2.0, generator=gen).log().to(dtype)
    dt_bias = (torch.randn(VALUE_HEADS, generator=gen) - 1).to(dtype)
    for decode in (False, True):
        state = slab((VALUE_HEADS, KEY_DIM, VALUE_DIM), torch.float32, gen)
        before = state.clone()
        runs = [(s, p, 1) for s, p in ((2, 7), (0, 0), (5, 3), (1, 1))] if decode else PREFILL_RUNS
        slots = [s for s, _, n in runs for _ in range(n)] + [SLOTS] * (0 if decode else PADDING)
        positions = [p + i for _, p, n in runs for i in range(n)] + [0] * (0 if decode else PADDING)
        rows = len(slots)
        qkv = torch.randn(rows, CHANNELS, generator=gen) * 0.5
        keys = KEY_HEADS * KEY_DIM
        if not decode:  # keys alike (as a real model's can be): the blocks' triangular systems are ill-conditioned
            qkv[:, keys : keys + KEY_DIM] += 4 * torch.randn(KEY_DIM, generator=gen)
        qkv = qkv.to(dtype)
        ab = torch.randn(rows, 2, VALUE_HEADS, generator=gen).to(dtype)
        a, b = ab[:, 0], ab[:, 1]  # strided alike, as the product's split gives them
        out = torch.full((rows, VALUE_HEADS, VALUE_DIM), float("nan"), dtype=dtype)
        t_slots, t_positions = torch.tensor(slots), torch.tensor(positions)
        if decode:
            got = delta_decode(qkv, a, b, a_log, dt_bias, state, t_slots, t_positions, KEY_HEADS, KEY_DIM, out=out)
        else:
            starts, counts, row = [], [], 0
            for _, _, n in runs:
                starts.append(row)
                counts.append(n)
                row += n
            firsts, sizes = prefill_tiles([*starts, row], [*counts, PADDING])
            tiles = torch.zeros(2, max_tiles(rows, len(runs)), dtype=torch.long)
            tiles[0, : len(firsts)] = torch.from_numpy(firsts)
            tiles[1, : len(firsts)] = torch.from_numpy(sizes)
            got = delta_prefill(qkv, a, b, a_log, dt_bias, state, t_slots, t_positions, tiles, KEY_HEADS, KEY_DIM,
                                out=out)
        assert got is out
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        beta = b.float().sigmoid()
        row = 0
        for slot, pos, n in runs:
            span = slice(row, row + n)
            q = qkv[span, :keys].reshape(1, n, KEY_HEADS, KEY_DIM).float()
            k = qkv[span, keys : 2 * keys].reshape(1, n, KEY_HEADS, KEY_DIM).float()
            v = qkv[span, 2 * keys :].reshape(1, n, VALUE_HEADS, VALUE_DIM).float()
            schedule = delta_rule.recurrent if decode else delta_rule.chunked
            expected, final = schedule(q, k, v, g[span][None], beta[span][None], None if pos == 0 else before[slot][None])
            err = (out[span].double() - expected[0].to(dtype).double()).abs().max().item()
            assert err <= tol, (dtype, decode, slot, n, err)
            state_err = (state[slot] - final[0]).abs().max().item()
            assert state_err <= tol * 10, (dtype, decode, slot, n, state_err)
            row += n
        for slot in {s for s in range(SLOTS)} - {s for s, _, _ in runs}:
            assert torch.equal(state[slot], before[slot])


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 4e-3)):
        check_conv(dtype, tol)
        check_delta(dtype, tol)
    print("ok")


if __name__ == "__main__":
    main()
