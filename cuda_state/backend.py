"""The interface every state backend implements, and the slab views they share.

A backend owns `num_slots` slots of `slot_bytes` each at fixed addresses. Slot `num_slots - 1` is the spare: always
backed, never given to a session, the target of padding rows in a batch. The views are built once over the whole
slab and never move, so a step captured in a CUDA graph stays valid whatever sessions come and go.

A slot is backed page by page from its start (`page_bytes` each, the allocation granularity): `grow` maps pages
after the ones it has, `shrink` releases pages past a count. The spec's layout (cuda_state.spec) puts the fixed
state and then the first tokens of every layer first, so a session holding N tokens needs
`spec.pages_for(N, page_bytes)` pages. `page_budget` bounds the pages all sessions together may hold (the spare
is not counted); a growth past it, or past what the device has, raises CapacityExhausted and maps nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cuda_state.spec import StateSpec


class StateBackend(Protocol):
    spec: StateSpec
    num_slots: int  # session slots + 1 spare (the last)
    slot_bytes: int  # bytes per slot after rounding to the allocation granularity
    granularity: int  # = page_bytes
    page_bytes: int
    pages_per_slot: int
    page_budget: int  # pages the session slots may hold together
    device: torch.device

    def views(self) -> dict[str, torch.Tensor]:
        """name -> tensor of shape (num_slots, *spec.view_shape(name)) over the slab, zero copy."""
        ...

    def prefix(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's first `nbytes` bytes as a uint8 tensor over the slab (zero copy; they must be mapped)."""
        ...

    def pages(self, slot: int) -> int:
        """Pages mapped at the start of `slot` now."""
        ...

    @property
    def mapped_pages(self) -> int:
        """Pages the session slots hold now (the spare not counted)."""
        ...

    def grow(self, slot: int, pages: int) -> None:
        """Map pages after the slot's current ones until it has `pages`, and zero them (stream ordered). Raises
        CapacityExhausted past the page budget or when the device has no memory left; then nothing changes."""
        ...

    def shrink(self, slot: int, pages: int) -> None:
        """Release the slot's pages past the first `pages`, once no queued device work can still touch them."""
        ...

    def zero(self, slot: int) -> None:
        """Zero every mapped page of the slot (stream ordered)."""
        ...

    def copy_prefix(self, dst: int, src: int, nbytes: int) -> None:
        """Copy the first `nbytes` bytes of `src` into `dst`, both mapped that far (stream ordered)."""
        ...

    def mark_used(self, slots: list[int]) -> None:
        """Queued device work now touches `slots`: a later release must wait for it."""
        ...

    def mapped_bytes(self) -> int:
        """Bytes of physical memory the backend holds now (slots + spare)."""
        ...

    def close(self) -> None: ...


def slab_views(slab: torch.Tensor, spec: StateSpec, num_slots: int, slot_bytes: int) -> dict[str, torch.Tensor]:
    """Typed strided views of each buffer over a flat uint8 slab of num_slots * slot_bytes bytes (see
    cuda_state.spec for the layout: a growing buffer's position axis is split into (blocks, positions of a block))."""
    assert slab.dtype == torch.uint8 and slab.numel() == num_slots * slot_bytes
    out: dict[str, torch.Tensor] = {}
    offsets = spec.offsets
    for buf in spec.buffers:
        item = buf.itemsize
        assert slot_bytes % item == 0 and offsets[buf.name] % item == 0 and spec.block_bytes % item == 0
        typed = slab.view(buf.dtype)
        out[buf.name] = typed.as_strided(
            (num_slots, *spec.view_shape(buf.name)), (slot_bytes // item, *spec.strides(buf.name)),
            offsets[buf.name] // item,
        )
    return out


def zeroed_views(spec: StateSpec, num_slots: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every buffer's view for `num_slots` slots, laid out as a table lays them out, over a fresh zeroed slab (for
    tests and tools that run a model without a session table)."""
    slot_bytes = spec.slot_bytes(4096)
    slab = torch.zeros(num_slots * slot_bytes, dtype=torch.uint8, device=device)
    return slab_views(slab, spec, num_slots, slot_bytes)
