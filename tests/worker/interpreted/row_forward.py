"""The tiny model with norm weights that are not ones, in fp32 and fp16: folded norms and row products (through the
fused stack) against the plain torch loop, over a prefill step and two decode steps; row products with the norms
not folded are refused. Run by tests/worker/test_row_matmul.py."""

from __future__ import annotations

import os

import torch

from cuda_state import HostBackend, SessionTable
from tests.worker.tensors import random_norms
from worker.model.batch import Kernels
from worker.model.llama import Llama
from worker.model.loader import load_model

# a prefill step (the fused stack without row products), then two decode steps with them. (slots, positions)
STEPS = [([0] * 6 + [2] * 9, list(range(6)) + list(range(9))), ([2, 0, 1], [9, 6, 0]), ([2, 0, 1], [10, 7, 1])]


def main() -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    from worker.kernels.layers import fused_head, fused_layers  # imports triton: after the check above

    loaded = load_model("random:tiny")
    weights = random_norms(loaded.weights)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        plain = Llama(loaded.config, weights, torch.device("cpu"), dtype, 64)
        folded = Llama(loaded.config, weights, torch.device("cpu"), dtype, 64, fold_norms=True,
                       kernels=Kernels(fused_layers=fused_layers, fused_head=fused_head))
        tables = [SessionTable(HostBackend(plain.state_spec(), 3)) for _ in range(2)]
        for table in tables:
            assert [table.create() for _ in range(3)] == [0, 1, 2]
        gen = torch.Generator().manual_seed(5)
        for i, (slots, positions) in enumerate(STEPS):
            tokens = torch.randint(0, 512, (len(slots),), generator=gen)
            logits = []
            for model, table in zip((plain, folded), tables, strict=True):
                batch = model.plan(slots, positions)
                batch.row_products = model is folded and i > 0
                args = (tokens, torch.tensor(positions), torch.tensor(slots), table.views())
                logits.append(model.forward(*args, batch=batch))
            assert logits[1].dtype == torch.float32
            torch.testing.assert_close(logits[1], logits[0], rtol=tol, atol=tol)
            for name in ("k", "v"):
                a, b = (t.views()[name][:3] for t in tables)
                torch.testing.assert_close(b, a, rtol=tol, atol=tol)
        batch = plain.plan([0], [11])
        batch.row_products = True
        plain.kernels = Kernels(fused_layers=fused_layers)
        try:
            plain.forward(torch.tensor([1]), torch.tensor([11]), torch.tensor([0]), tables[0].views(), batch=batch)
            raise AssertionError("row products ran with the norms not folded")
        except ValueError as e:
            assert "folded" in str(e)
    print("ok")


if __name__ == "__main__":
    main()
