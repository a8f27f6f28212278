"""The penalties' kernels (worker.kernels.penalties) against worker.engine.penalties' torch ops, bit for bit: a pool
of 6 rows with random bias, context, counts and factors, 3 of a 5-row step's rows penalized. Run by
tests/worker/test_penalties.py."""

from __future__ import annotations

import torch

from worker.engine.penalties import Penalties
from worker.engine.sampling import SamplingParams
from worker.kernels.penalties import apply_penalties, count_samples


def main() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 3000  # two programs a row, the second partly masked
    pool = Penalties(vocab, torch.device("cpu"))
    for i in range(6):
        params = SamplingParams(repetition_penalty=0.5 + 0.3 * i, frequency_penalty=0.4 * i - 1.0,
                                presence_penalty=1.0 - 0.3 * i, logit_bias=((7 * i, 3.5 * i - 9.0), (2999, 1.5)))
        row = pool.open(params, torch.randint(0, vocab, (300,), generator=gen).tolist())
        pool.rebuild(row, torch.randint(0, vocab, (300,), generator=gen).tolist(),
                     torch.randint(0, vocab, (50,), generator=gen).tolist())
    logits = torch.randn((5, vocab), generator=gen) * 8
    logits[:, :10] = 0.0  # zeros neither divided nor multiplied differently
    rows = pool.rows_of([4, 0, 2], [1, 5, 3])
    want = pool.apply(logits, rows)
    got = apply_penalties(logits, rows.at, rows.pool, pool.bias, pool.counts, pool.context, pool.factors)
    assert torch.equal(got, want) and not torch.equal(got, logits)
    ids = torch.tensor([5, 9, 2999, 1, 0])
    counts = pool.counts.clone()
    count_samples(counts, ids, rows.at, rows.pool)
    pool.count(ids, rows)
    assert torch.equal(counts, pool.counts)
    print("ok")


if __name__ == "__main__":
    main()
