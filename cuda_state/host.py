"""Host backend: the slab is one pinned-free CPU tensor. Same layout and interface as the GPU one."""

from __future__ import annotations

import torch

from cuda_state.backend import slab_views
from cuda_state.spec import StateSpec

HOST_GRANULARITY = 4096  # a page: slots start on page boundaries


class HostBackend:
    def __init__(self, spec: StateSpec, capacity: int) -> None:
        self.spec = spec
        self.num_slots = capacity + 1
        self.granularity = HOST_GRANULARITY
        self.slot_bytes = spec.slot_bytes(self.granularity)
        self.device = torch.device("cpu")
        # torch.empty does not touch the pages; a slot's pages become resident when it is zeroed.
        self._slab = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8)
        self._views = slab_views(self._slab, spec, self.num_slots, self.slot_bytes)
        self._mapped: set[int] = set()
        self.map(self.num_slots - 1)
        self.zero(self.num_slots - 1)

    def views(self) -> dict[str, torch.Tensor]:
        return self._views

    def map(self, slot: int) -> None:
        self._mapped.add(slot)

    def unmap(self, slot: int) -> None:
        self._mapped.discard(slot)

    def zero(self, slot: int) -> None:
        self._slab[slot * self.slot_bytes : (slot + 1) * self.slot_bytes].zero_()

    def copy_prefix(self, dst: int, src: int, used: int) -> None:
        for buf in self.spec.buffers:
            view = self._views[buf.name]
            if buf.seq_axis is None:
                view[dst].copy_(view[src])
            else:
                idx = (slice(None),) * buf.seq_axis + (slice(0, used),)
                view[dst][idx].copy_(view[src][idx])

    def mark_used(self, slots: list[int]) -> None:
        pass  # host work is synchronous: nothing can still be in flight

    def mapped_bytes(self) -> int:
        return len(self._mapped) * self.slot_bytes

    def close(self) -> None:
        self._mapped.clear()
