"""The tiny hybrid model (worker.model.qwen3_5) through its GPU forward (the DeltaNet, norm and row-product kernels,
the attention kernels) against its torch forward, in fp32: steps shaped as the GPU executor shapes them (no runs: the
prefill steps' runs come from the tiles, padding rows in the spare slot at position 0), a prefill step of two
sessions' prompts, a decode step with row products and a session starting with one token, a prefill step continuing
a session and another, and a mixed step planned by the model (a prompt's chunk beside two decode rows). The logits of
every step and, at the end, every session's K/V, convolution and recurrent states agree (the weights sharpened: every
state matters). Run by tests/worker/test_deltanet.py."""

from __future__ import annotations

import os

import torch

from cuda_state import HostBackend, SessionTable
from worker.model.batch import Batch, Kernels
from worker.model.families import model_class
from worker.model.loader import load_model
from worker.model.qwen3_5 import UNIT_OFFSET_NORMS, Qwen3_5

SESSIONS = 3  # slots 0..2; slot 3 is the spare
# (kind, [(slot, first position, tokens)], padding rows): "prefill" and "decode" steps as the GPU executor shapes them,
# "eager" a mixed step whose batch the model plans (an eager GPU step). (Runs of several 64-token tiles are
# tests/worker/interpreted/deltanet_kernels.py's.)
STEPS = [
    ("prefill", [(0, 0, 20), (2, 0, 5)], 3),
    ("decode", [(2, 5, 1), (0, 20, 1), (1, 0, 1)], 1),
    ("prefill", [(0, 21, 6), (1, 1, 4)], 2),
    ("eager", [(0, 27, 3), (1, 5, 1), (2, 6, 1)], 0),
]


def main(preset: str = "tiny-qwen3.5") -> None:
    """The check for the random preset `preset` (a Qwen3.5 or Qwen3.5-MoE one: tests/worker/interpreted/moe_forward.py
    runs it for the latter)."""
    assert os.environ["TRITON_INTERPRET"] == "1"
    from worker.kernels import hybrid_kernels  # imports triton: after the check above
    from worker.kernels.attention import decode_attention
    from worker.kernels.prefill import prefill_attention
    from worker.kernels.tiles import max_tiles, prefill_tiles

    loaded = load_model(f"random:{preset}")
    cls = model_class(loaded.config)
    assert issubclass(cls, Qwen3_5)
    gen = torch.Generator().manual_seed(3)
    weights = {name: (0.2 * torch.randn(t.shape, generator=gen) if name.rsplit(".", 1)[-1] in UNIT_OFFSET_NORMS
                      or name == "norm" else t * 5) for name, t in loaded.weights.items()}  # sharp: states matter
    cpu = torch.device("cpu")
    plain = cls(loaded.config, weights, cpu, torch.float32, 256)
    kernels = Kernels(decode_attention=decode_attention, prefill_attention=prefill_attention, hybrid=hybrid_kernels())
    fast = cls(loaded.config, weights, cpu, torch.float32, 256, kernels=kernels)
    tables = [SessionTable(HostBackend(plain.state_spec(), SESSIONS)) for _ in range(2)]
    for table in tables:
        assert [table.create() for _ in range(SESSIONS)] == list(range(SESSIONS))
    spare = tables[0].spare_slot
    for kind, runs, padding in STEPS:
        prefill = kind == "prefill"
        slots = [s for s, _, n in runs for _ in range(n)]
        positions = [p + i for _, p, n in runs for i in range(n)]
        ends = [sum(n for _, _, n in runs[: i + 1]) - 1 for i in range(len(runs))]
        tokens = torch.randint(0, loaded.config.vocab_size, (len(slots) + padding,), generator=gen)
        expected = plain.forward(tokens[: len(slots)], torch.tensor(positions), torch.tensor(slots),
                                 tables[0].views(), logits_at=torch.tensor(ends))
        padded_slots = torch.tensor(slots + [spare] * padding)
        padded_positions = torch.tensor(positions + [0] * padding)
        lengths = (padded_positions + 1).to(torch.int32)
        tiles = None
        if prefill:
            starts = [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]
            firsts, counts = prefill_tiles([*starts, len(slots)], [n for _, _, n in runs] + [padding])
            tiles = torch.zeros(2, max_tiles(len(slots) + padding, len(runs)), dtype=torch.long)
            tiles[0, : len(firsts)] = torch.from_numpy(firsts)
            tiles[1, : len(firsts)] = torch.from_numpy(counts)
        batch = None if kind == "eager" else Batch(runs=[], decode_only=True, lengths=lengths, attention_splits=1,
                                                   tiles=tiles, row_products=not prefill)
        got = fast.forward(tokens, padded_positions, padded_slots, tables[1].views(), batch=batch,
                           logits_at=torch.tensor(ends))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for name in ("k", "v", "conv", "recurrent"):  # fp32 through different sums: the states agree to ~1e-5 overall
        a, b = (t.views()[name][:SESSIONS] for t in tables)
        assert float((b - a).norm() / a.norm()) < 1e-4, name
    print("ok")


if __name__ == "__main__":
    main()
