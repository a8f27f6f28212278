"""Executors run one scheduled batch through the model and return the logits the sampler needs.

The eager executor serves the CPU and every batch a GPU graph does not cover (prefill, mixed
batches, sizes past the largest graph). After launching, it tells the session table which slots
the queued work touches, so no slot is freed under a running kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from cuda_state import SessionTable
from worker.model.llama import Llama


class StepRows(NamedTuple):
    """One step's rows, as the scheduler hands them to an executor.

    Row t is token `tokens[t]` of the session in slot `slots[t]`, at position `positions[t]`; a session's rows are
    contiguous and in order. `source` (ids, picks): the first len(picks) rows are decode rows of distinct sessions
    whose token is ids[picks[i]], a tensor on the model's device (the previous step's samples, not read by the
    host); `tokens` holds placeholders there."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    logits_at: list[int]  # the rows whose logits the step returns, in this order
    source: tuple[torch.Tensor, list[int]] | None = None


class Executor(Protocol):
    @property
    def overlaps(self) -> bool:
        """execute() only queues device work: the engine may launch a step before reading the last."""
        ...

    @property
    def max_decode_rows(self) -> int:
        """The most decode rows one execute() with `source` takes."""
        ...

    def execute(self, rows: StepRows, copy_logits: bool = True) -> torch.Tensor:
        """float32 logits (len(rows.logits_at), vocab), on the model's device.

        copy_logits False: the result may be a view of a graph's output, valid only until the next
        execute() (the engine samples it at once; work queued later on the stream sees it intact)."""
        ...


class EagerExecutor:
    overlaps = False  # synchronous on the CPU: running ahead gains nothing there
    max_decode_rows = 1 << 30

    def __init__(self, model: Llama, table: SessionTable) -> None:
        self.model = model
        self.table = table
        self.state = table.views()

    def execute(self, rows: StepRows, copy_logits: bool = True) -> torch.Tensor:
        tokens, positions, slots, logits_at, source = rows
        dev = self.model.device
        batch = self.model.plan(slots, positions, lengths_on_device=dev.type == "cuda")
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        if source is not None and source[1]:
            picks = torch.tensor(source[1], dtype=torch.long, device=dev)
            ids[: len(source[1])] = source[0].index_select(0, picks)
        logits = self.model.forward(
            ids,
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            self.state,
            batch,
            torch.tensor(logits_at, dtype=torch.long, device=dev),
        )
        self.table.mark_used(sorted(set(slots)))
        return logits
