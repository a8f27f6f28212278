"""The tiny model through Llama.forward, the fused layer stack (worker.kernels.layers) hooked in or not, in fp32 and
fp16: a step of prefill runs, then a step of decode rows; logits and every session slot's K/V agree. Run by
tests/worker/test_fused.py."""

from __future__ import annotations

import os

import torch

from cuda_state import HostBackend, SessionTable
from worker.model.batch import NO_KERNELS, Kernels
from worker.model.llama import Llama
from worker.model.loader import load_model

# step 1: prefill runs of slots 0 and 2; step 2: decode rows of 2, 0, 1 (1 starts with one token). (slots, positions)
STEPS = [([0] * 6 + [2] * 9, list(range(6)) + list(range(9))), ([2, 0, 1], [9, 6, 0])]


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    from worker.kernels.layers import fused_layers  # imports triton: after the check above

    loaded = load_model("random:tiny")
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        llama = Llama(loaded.config, loaded.weights, torch.device("cpu"), dtype, 64)
        assert llama.kernels == NO_KERNELS  # the CPU path stays the torch loop
        tables = [SessionTable(HostBackend(llama.state_spec(), 3)) for _ in range(2)]
        for table in tables:
            assert [table.create() for _ in range(3)] == [0, 1, 2]
        gen = torch.Generator().manual_seed(5)
        for slots, positions in STEPS:
            tokens = torch.randint(0, 512, (len(slots),), generator=gen)
            logits = []
            for fused, table in zip((None, fused_layers), tables, strict=True):
                llama.kernels = Kernels(fused_layers=fused)
                args = (tokens, torch.tensor(positions), torch.tensor(slots), table.views())
                logits.append(llama.forward(*args, batch=llama.plan(slots, positions)))
            torch.testing.assert_close(logits[1], logits[0], rtol=tol, atol=tol)
            for name in ("k", "v"):
                a, b = (t.views()[name][:3] for t in tables)  # session slots; the spare is never touched
                torch.testing.assert_close(b, a, rtol=tol, atol=tol)
        llama.kernels = NO_KERNELS
    print("ok")


if __name__ == "__main__":
    main()
