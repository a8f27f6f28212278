"""The start-up invariance check (worker.engine.invariance) with a state that replays advance: an executor whose every
replay moves its rows' fixed-size state (as a hybrid model's recurrent state moves) and whose logits read it. Each
bucket gives the same rows the same numbers, so none may be dropped: the check gives its slots their first state back
before each replay. Without that, every smaller bucket would meet a state the replay before it had moved."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import torch

from cuda_state import BufferSpec, HostBackend, SessionTable, StateSpec
from worker.engine.invariance import Replays, keep_row_invariant_buckets
from worker.model.batch import Run

SPEC = StateSpec((BufferSpec("k", (1, 1, 64, 4), torch.float32, seq_axis=2),
                  BufferSpec("recurrent", (2, 4), torch.float32)))


class Advancing:
    """Buckets of the same numbers; each replay advances the rows' recurrent state and returns what it reads."""

    def __init__(self, restoring: bool = True) -> None:
        self.model = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(vocab_size=50), max_context=64)
        self.table = SessionTable(HostBackend(SPEC, 8))
        self.state = self.table.views()
        self.buckets = [1, 4, 8]
        self.prefill_buckets = [128, 256]
        self.prefill_rows = 256
        self.prefill_logits = 64
        self.long_rows_from: int | None = None
        self.dropped: tuple[list[int], list[int]] | None = None

    def _advance(self, slot: int, token: int) -> torch.Tensor:
        rec = self.state["recurrent"][slot]
        rec.mul_(0.5).add_(token)
        return rec.sum(0)

    def replay_decode(self, tokens: list[int], positions: list[int], slots: list[int], source: Any = None,
                      copy_logits: bool = True, bucket: int | None = None, long: bool | None = None) -> torch.Tensor:
        return torch.stack([self._advance(s, t) for s, t in zip(slots, tokens, strict=True)])

    def replay_prefill(self, runs: list[Run], tokens: list[int], positions: list[int], wanted: set[int],
                       bucket: int | None = None) -> tuple[list[int], torch.Tensor]:
        out = []
        for run in runs:
            for t in tokens[run.start : run.start + run.n]:
                last = self._advance(run.slot, t)
            out.append(last)
        return [run.start + run.n - 1 for run in runs], torch.stack(out)

    def drop_buckets(self, decode: list[int], prefill: list[int]) -> None:
        self.dropped = (decode, prefill)


def test_no_bucket_is_dropped_when_replays_advance_the_state() -> None:
    ex = Advancing()
    keep_row_invariant_buckets(cast(Replays, ex))
    assert ex.dropped == ([], [])
    assert ex.table.live == 0 and ex.table.free_slots == 8  # the check's slots are given back


def test_the_check_does_see_a_bucket_that_differs() -> None:
    ex = Advancing()
    replay = ex.replay_decode

    def skewed(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = replay(*args, **kwargs)
        return logits * (1 + 2**-20) if kwargs.get("bucket") == 4 else logits

    ex.replay_decode = skewed  # type: ignore[method-assign]
    keep_row_invariant_buckets(cast(Replays, ex))
    assert ex.dropped == ([4], [])
