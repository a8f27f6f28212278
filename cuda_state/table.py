"""The session table: which slots are live, and the only door to create, clone and free them.

The table accounts; the backend moves memory. Slot numbers are what the model indexes state with.
"""

from __future__ import annotations

import torch

from .backend import StateBackend
from .errors import CapacityExhausted, SlotError
from .spec import StateSpec


class SessionTable:
    def __init__(self, backend: StateBackend) -> None:
        self.backend = backend
        self.capacity = backend.num_slots - 1
        self.spare_slot = backend.num_slots - 1
        # Lowest slot first, so a small table stays dense and tests see predictable slots.
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        self._live: set[int] = set()

    @property
    def spec(self) -> StateSpec:
        return self.backend.spec

    @property
    def bytes_per_session(self) -> int:
        return self.backend.spec.bytes_per_session

    @property
    def slot_bytes(self) -> int:
        return self.backend.slot_bytes

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def views(self) -> dict[str, torch.Tensor]:
        return self.backend.views()

    def create(self) -> int:
        """A new zeroed slot. Raises CapacityExhausted when none is left."""
        slot = self._take()
        try:
            self.backend.zero(slot)
        except BaseException:
            self._give_back(slot)
            raise
        return slot

    def clone(self, src: int, used: int) -> int:
        """A new slot holding the first `used` positions of `src` (the rest is left unwritten)."""
        self._check_live(src)
        slot = self._take()
        try:
            self.backend.copy_prefix(slot, src, used)
            self.backend.mark_used([slot, src])
        except BaseException:
            self._give_back(slot)
            raise
        return slot

    def free(self, slot: int) -> None:
        self._check_live(slot)
        self._give_back(slot)

    def mark_used(self, slots: list[int]) -> None:
        self.backend.mark_used(slots)

    def close(self) -> None:
        for slot in sorted(self._live):
            self._give_back(slot)
        self.backend.close()

    def _take(self) -> int:
        if not self._free:
            raise CapacityExhausted(f"all {self.capacity} session slots are in use")
        slot = self._free.pop()
        try:
            self.backend.map(slot)
        except BaseException:
            self._free.append(slot)
            raise
        self._live.add(slot)
        return slot

    def _give_back(self, slot: int) -> None:
        self._live.discard(slot)
        self.backend.unmap(slot)
        self._free.append(slot)

    def _check_live(self, slot: int) -> None:
        if slot not in self._live:
            raise SlotError(f"slot {slot} is not live")
