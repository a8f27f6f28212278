"""The session table: which slots are live, and the only door to create, clone and free them.

The table accounts; the backend moves memory. Slot numbers are what the model indexes state with.

With `keep_mapped` > 0, up to that many freed slots keep their memory mapped, and the next create or
clone takes one of them instead of mapping a new one: no driver allocation, mapping or release on the
path of a session that closes while another opens. A reused slot is zeroed before it is handed out
(create, and clone before its prefix is copied), so nothing of the session it held survives. `trim()`
releases slots kept longer than a given age (the worker calls it when idle) and all of them on close.
"""

from __future__ import annotations

import time

import torch

from cuda_state.backend import StateBackend
from cuda_state.errors import CapacityExhausted, SlotError
from cuda_state.spec import StateSpec


class SessionTable:
    def __init__(self, backend: StateBackend, keep_mapped: int = 0) -> None:
        self.backend = backend
        self.capacity = backend.num_slots - 1
        self.spare_slot = backend.num_slots - 1
        self.keep_mapped = keep_mapped  # freed slots kept mapped for reuse (0: every free unmaps)
        # Lowest slot first, so a small table stays dense and tests see predictable slots.
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))  # unmapped
        self._kept: dict[int, float] = {}  # freed but still mapped -> when it was freed (oldest first)
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
        return len(self._free) + len(self._kept)

    @property
    def kept(self) -> int:
        """Freed slots still mapped, waiting for reuse or `trim()`."""
        return len(self._kept)

    def views(self) -> dict[str, torch.Tensor]:
        return self.backend.views()

    def create(self) -> int:
        """A new zeroed slot. Raises CapacityExhausted when none is left."""
        slot, _ = self._take()
        try:
            self.backend.zero(slot)
        except BaseException:
            self._give_back(slot)
            raise
        return slot

    def clone(self, src: int, used: int) -> int:
        """A new slot holding the first `used` positions of `src` (the rest is left unwritten, or zero when
        the slot is a reused one)."""
        self._check_live(src)
        slot, reused = self._take()
        try:
            if reused:
                self.backend.zero(slot)
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

    def trim(self, older_than_s: float = 0.0) -> int:
        """Unmap the kept slots freed at least `older_than_s` ago (waiting for their last queued use first).
        Returns how many were released."""
        cutoff = time.monotonic() - older_than_s
        released = 0
        while self._kept:
            slot, freed_at = next(iter(self._kept.items()))  # the oldest
            if freed_at > cutoff:
                break
            del self._kept[slot]
            self.backend.unmap(slot)
            self._free.append(slot)
            released += 1
        return released

    def close(self) -> None:
        """Release every slot, live or kept: the backend waits for all queued work, then unmaps everything."""
        self._live.clear()
        self._kept.clear()
        self.backend.close()

    def _take(self) -> tuple[int, bool]:
        """A mapped slot, now live, and whether it is a reused one (freed and kept mapped)."""
        if self._kept:
            slot, _ = self._kept.popitem()  # the most recently freed
            self._live.add(slot)
            return slot, True
        if not self._free:
            raise CapacityExhausted(f"all {self.capacity} session slots are in use")
        slot = self._free.pop()
        try:
            self.backend.map(slot)
        except BaseException:
            self._free.append(slot)
            raise
        self._live.add(slot)
        return slot, False

    def _give_back(self, slot: int) -> None:
        self._live.discard(slot)
        if len(self._kept) < self.keep_mapped:
            self._kept[slot] = time.monotonic()  # reused by the next create, or unmapped by trim()
            return
        self.backend.unmap(slot)
        self._free.append(slot)

    def _check_live(self, slot: int) -> None:
        if slot not in self._live:
            raise SlotError(f"slot {slot} is not live")
