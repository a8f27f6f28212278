"""Host backend: the slab is one CPU tensor. Same layout, interface and page accounting as the GPU one.

Pages are accounted exactly as the VMM backend maps them (a slot's pages from its start, a budget for all of
them, CapacityExhausted past it), so the CPU tests check growth and admission page for page. `page_bytes`
defaults to the GPU's granularity (2 MiB), so a CPU worker admits what a GPU worker with the same budget would.
The memory itself is one `torch.empty` slab: the operating system backs its pages when they are first written.
"""

from __future__ import annotations

import torch

from cuda_state.backend import slab_views
from cuda_state.errors import CapacityExhausted, SlotError, StateError
from cuda_state.spec import StateSpec

HOST_PAGE_BYTES = 2 << 20  # the H100's VMM granularity: the same page counts on the CPU as on the GPU


class HostBackend:
    def __init__(self, spec: StateSpec, capacity: int, page_bytes: int = HOST_PAGE_BYTES,
                 page_budget: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if page_bytes <= 0 or page_bytes % 256:
            raise ValueError(f"page_bytes must be a positive multiple of 256, got {page_bytes}")
        self.spec = spec
        self.num_slots = capacity + 1
        self.granularity = self.page_bytes = page_bytes
        self.slot_bytes = spec.slot_bytes(page_bytes)
        self.pages_per_slot = self.slot_bytes // page_bytes
        full = capacity * self.pages_per_slot
        self.page_budget = full if page_budget is None else max(0, min(page_budget, full))
        self.device = torch.device("cpu")
        # torch.empty does not touch the pages; a slot's pages become resident when they are zeroed.
        self._slab = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8)
        self._views = slab_views(self._slab, spec, self.num_slots, self.slot_bytes)
        self._pages = [0] * self.num_slots
        self._mapped = 0  # session pages
        self._closed = False
        # The spare: one page backs it on the GPU; here it is simply there. It never counts against the budget.
        self._pages[self.spare_slot] = self.pages_per_slot
        self._slab[self.spare_slot * self.slot_bytes:].zero_()

    @property
    def spare_slot(self) -> int:
        return self.num_slots - 1

    def views(self) -> dict[str, torch.Tensor]:
        return self._views

    def prefix(self, slot: int, nbytes: int) -> torch.Tensor:
        self._check_room(slot, nbytes)
        start = slot * self.slot_bytes
        return self._slab[start : start + nbytes]

    def pages(self, slot: int) -> int:
        self._check_slot(slot)
        return self._pages[slot]

    @property
    def mapped_pages(self) -> int:
        return self._mapped

    def grow(self, slot: int, pages: int) -> None:
        self._check_slot(slot)
        if slot == self.spare_slot:
            raise SlotError("the spare slot is mapped whole")
        have = self._pages[slot]
        pages = min(pages, self.pages_per_slot)
        if pages <= have:
            return
        more = pages - have
        if self._mapped + more > self.page_budget:
            raise CapacityExhausted(f"no free page for {more} more: {self._mapped} of {self.page_budget} "
                                    f"pages of {self.page_bytes} bytes are held")
        start = slot * self.slot_bytes
        self._slab[start + have * self.page_bytes : start + pages * self.page_bytes].zero_()
        self._pages[slot] = pages
        self._mapped += more

    def shrink(self, slot: int, pages: int) -> None:
        self._check_slot(slot)
        if slot == self.spare_slot:
            raise SlotError("the spare slot stays mapped until close")
        have = self._pages[slot]
        if pages < have:
            self._pages[slot] = max(0, pages)
            self._mapped -= have - self._pages[slot]

    def zero(self, slot: int) -> None:
        self._check_slot(slot)
        start = slot * self.slot_bytes
        self._slab[start : start + self._pages[slot] * self.page_bytes].zero_()

    def copy_prefix(self, dst: int, src: int, nbytes: int) -> None:
        self.prefix(dst, nbytes).copy_(self.prefix(src, nbytes))

    def mark_used(self, slots: list[int]) -> None:
        pass  # host work is synchronous: nothing can still be in flight

    def mapped_bytes(self) -> int:
        if self._closed:
            return 0
        return (self._mapped + 1) * self.page_bytes  # the sessions' pages and the spare's one (as on the GPU)

    def close(self) -> None:
        self._closed = True
        self._pages = [0] * self.num_slots
        self._mapped = 0

    def _check_slot(self, slot: int) -> None:
        if self._closed:
            raise StateError("the host backend is closed")
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} is outside 0..{self.num_slots - 1}")

    def _check_room(self, slot: int, nbytes: int) -> None:
        self._check_slot(slot)
        if nbytes > self._pages[slot] * self.page_bytes:
            raise SlotError(f"slot {slot} has {self._pages[slot]} pages mapped: {nbytes} bytes reach past them")
