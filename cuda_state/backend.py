"""The interface every state backend implements, and the slab views they share.

A backend owns `num_slots` slots of `slot_bytes` each at fixed addresses. Slot `num_slots - 1` is
the spare: always backed, never given to a session, the target of padding rows in a batch. The
views are built once over the whole slab and never move, so a step captured in a CUDA graph stays
valid whatever sessions come and go.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cuda_state.spec import StateSpec


class StateBackend(Protocol):
    spec: StateSpec
    num_slots: int  # session slots + 1 spare (the last)
    slot_bytes: int  # bytes per slot after rounding to the allocation granularity
    granularity: int
    device: torch.device

    def views(self) -> dict[str, torch.Tensor]:
        """name -> tensor of shape (num_slots, *buffer.shape) over the slab, zero copy."""
        ...

    def map(self, slot: int) -> None:
        """Back `slot` with memory. Raises CapacityExhausted when the device has none left."""
        ...

    def unmap(self, slot: int) -> None:
        """Release `slot`'s memory once no queued device work can still touch it."""
        ...

    def zero(self, slot: int) -> None: ...

    def copy_prefix(self, dst: int, src: int, used: int) -> None:
        """Copy the first `used` positions of every buffer of `src` into `dst` (stream ordered)."""
        ...

    def mark_used(self, slots: list[int]) -> None:
        """Queued device work now touches `slots`: a later unmap must wait for it."""
        ...

    def mapped_bytes(self) -> int:
        """Bytes of physical memory the backend holds now (slots + spare)."""
        ...

    def close(self) -> None: ...


def slab_views(slab: torch.Tensor, spec: StateSpec, num_slots: int, slot_bytes: int) -> dict[str, torch.Tensor]:
    """Typed strided views of each buffer over a flat uint8 slab of num_slots * slot_bytes bytes."""
    assert slab.dtype == torch.uint8 and slab.numel() == num_slots * slot_bytes
    out: dict[str, torch.Tensor] = {}
    for buf, offset in zip(spec.buffers, spec.offsets.values(), strict=True):
        typed = slab.view(buf.dtype)  # slot_bytes and offsets are multiples of every itemsize
        item = buf.itemsize
        inner = [1] * len(buf.shape)
        for i in range(len(buf.shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * buf.shape[i + 1]
        out[buf.name] = typed.as_strided(
            (num_slots, *buf.shape), (slot_bytes // item, *inner), offset // item
        )
    return out
