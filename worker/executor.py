"""Executors run one scheduled batch through the model and return the logits the sampler needs.

The eager executor serves the CPU and every batch a GPU graph does not cover (prefill, mixed
batches, sizes past the largest graph). After launching, it tells the session table which slots
the queued work touches, so no slot is freed under a running kernel.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cuda_state import SessionTable

from .model import Llama


class Executor(Protocol):
    def execute(self, tokens: list[int], positions: list[int], slots: list[int], logits_at: list[int]) -> torch.Tensor:
        """float32 logits (len(logits_at), vocab), on the model's device."""
        ...


class EagerExecutor:
    def __init__(self, model: Llama, table: SessionTable) -> None:
        self.model = model
        self.table = table
        self.state = table.views()

    def execute(self, tokens: list[int], positions: list[int], slots: list[int], logits_at: list[int]) -> torch.Tensor:
        dev = self.model.device
        batch = self.model.plan(slots, positions, lengths_on_device=dev.type == "cuda")
        logits = self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            self.state,
            batch,
            torch.tensor(logits_at, dtype=torch.long, device=dev),
        )
        self.table.mark_used(sorted(set(slots)))
        return logits
