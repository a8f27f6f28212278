"""The session table: which slots are live, how many pages each holds, and the only door to create, grow, clone
and free them.

The table accounts; the backend moves memory. Slot numbers are what the model indexes state with. A slot's virtual
range is fixed; its pages are mapped from its start as the session grows (`ensure`), `ahead_tokens` positions ahead
of need when pages allow, and released when it is freed. A session of N tokens holds
`spec.pages_for(N + ahead, page)` pages at most. Admission is by free pages: a create, or a growth, that cannot get
its pages raises CapacityExhausted and changes nothing.

With `keep_mapped` > 0, up to that many freed slots keep their first pages mapped (what a create needs), and the next
create or clone takes one of them instead of mapping anew: no driver allocation, mapping or release on the path of a
session that closes while another opens. A reused slot is zeroed before it is handed out, so nothing of the session
it held survives. `trim()` releases slots kept longer than a given age (the worker calls it when idle), all of them
on close, and the kept slots give their pages back first when a create or growth finds none free.
"""

from __future__ import annotations

import time

import torch

from cuda_state.backend import StateBackend
from cuda_state.errors import CapacityExhausted, SlotError
from cuda_state.spec import StateSpec

_NO_LIMIT = 1 << 62


class SessionTable:
    def __init__(self, backend: StateBackend, keep_mapped: int = 0, ahead_tokens: int = 0) -> None:
        self.backend = backend
        self.capacity = backend.num_slots - 1
        self.spare_slot = backend.num_slots - 1
        self.keep_mapped = keep_mapped  # freed slots kept mapped for reuse (0: every free unmaps)
        self.ahead_tokens = max(0, ahead_tokens)  # positions mapped ahead of need, when pages allow
        spec = backend.spec
        self.page_bytes = backend.page_bytes
        self.create_pages = max(1, spec.pages_for(0, self.page_bytes))  # the least a session holds
        # Lowest slot first, so a small table stays dense and tests see predictable slots.
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))  # unmapped
        self._kept: dict[int, float] = {}  # freed but still mapped -> when it was freed (oldest first)
        self._live: set[int] = set()
        self._room = [0] * backend.num_slots  # positions each slot's mapped pages hold
        self._max_context = spec.max_context if spec.token_bytes else 0

    @property
    def spec(self) -> StateSpec:
        return self.backend.spec

    @property
    def bytes_per_session(self) -> int:
        """Bytes a session takes at max_context (its slot's virtual size, before rounding to pages)."""
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
    def free_pages(self) -> int:
        return self.backend.page_budget - self.backend.mapped_pages

    @property
    def page_budget(self) -> int:
        return self.backend.page_budget

    @property
    def free_slots(self) -> int:
        """Sessions a create can still admit: free slots, as far as free pages (and kept slots) go."""
        slots = len(self._free) + len(self._kept)
        return min(slots, len(self._kept) + self.free_pages // self.create_pages)

    @property
    def kept(self) -> int:
        """Freed slots still mapped, waiting for reuse or `trim()`."""
        return len(self._kept)

    def views(self) -> dict[str, torch.Tensor]:
        return self.backend.views()

    def pages(self, slot: int) -> int:
        return self.backend.pages(slot)

    def room(self, slot: int) -> int:
        """Positions the slot's mapped pages hold."""
        return self._room[slot]

    def create(self, tokens: int = 0) -> int:
        """A new zeroed slot backed for `tokens` positions (and `ahead_tokens` more when pages allow). Raises
        CapacityExhausted when no slot or no page is left."""
        slot, reused = self._take()
        try:
            if reused:
                self.backend.zero(slot)
            self._grow(slot, tokens)
        except BaseException:
            self._give_back(slot)
            raise
        return slot

    def covers(self, slot: int, tokens: int) -> bool:
        """The slot holds `tokens` positions and the `ahead_tokens` after them (as far as max_context)."""
        return min(tokens + self.ahead_tokens, self._max_context) <= self._room[slot]

    def ensure(self, slot: int, tokens: int) -> None:
        """Back the slot's first `tokens` positions and, when pages allow, the `ahead_tokens` after them: a page is
        mapped before the first token that needs it. Raises CapacityExhausted (nothing changed) when the pages for
        `tokens` themselves cannot be had."""
        if self.covers(slot, tokens):
            return
        self._check_live(slot)
        self._grow(slot, tokens)

    def clone(self, src: int, used: int) -> int:
        """A new slot holding the fixed state and the first `used` positions of `src` (the rest zero)."""
        self._check_live(src)
        slot = self.create(used)
        try:
            self.backend.copy_prefix(slot, src, self.spec.bytes_for(used))
            self.backend.mark_used([slot, src])
        except BaseException:
            self._give_back(slot)
            raise
        return slot

    def prefix(self, slot: int, tokens: int) -> torch.Tensor:
        """The slot's state for its first `tokens` positions as one uint8 tensor over the slab (zero copy): what a
        hibernation copies out and a restore copies in."""
        self._check_live(slot)
        return self.backend.prefix(slot, self.spec.bytes_for(tokens))

    def save_prefix(self, slot: int, tokens: int, out: torch.Tensor) -> None:
        """Copy the slot's state for its first `tokens` positions into `out` (host memory, `bytes_for(tokens)` bytes),
        after the work queued on the current stream, and wait for the copy: a hibernation's or a move's copy out."""
        out.copy_(self.prefix(slot, tokens), non_blocking=True)
        self._settle(slot)

    def load_prefix(self, slot: int, tokens: int, state: torch.Tensor) -> None:
        """Copy `state` (what save_prefix took) into the slot's first positions and wait for the copy, so the caller
        may release `state`: a restore's or a move's copy in."""
        self.prefix(slot, tokens).copy_(state, non_blocking=True)
        self._settle(slot)

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
            self._unmap(slot)
            released += 1
        return released

    def close(self) -> None:
        """Release every slot, live or kept: the backend waits for all queued work, then unmaps everything."""
        self._live.clear()
        self._kept.clear()
        self._room = [0] * self.backend.num_slots
        self.backend.close()

    # -- internals ----------------------------------------------------------------------------------------------

    def _grow(self, slot: int, tokens: int) -> None:
        """Pages for `tokens` positions, and for `ahead_tokens` more when they are free; kept slots give theirs back
        first when a growth finds none."""
        spec, page = self.spec, self.page_bytes
        need = max(self.create_pages, spec.pages_for(tokens, page))
        want = max(need, spec.pages_for(tokens + self.ahead_tokens, page))
        have = self.backend.pages(slot)
        if want > have and want - have > self.free_pages and self._kept:
            self.trim()
        if want > have:
            try:
                self.backend.grow(slot, want)
            except CapacityExhausted:
                if need <= have:
                    return
                self.backend.grow(slot, need)  # the pages ahead are not to be had: only those needed
            self._set_room(slot)

    def _set_room(self, slot: int) -> None:
        spec = self.spec
        pages = self.backend.pages(slot)
        self._room[slot] = spec.tokens_in(pages, self.page_bytes) if spec.token_bytes else _NO_LIMIT

    def _take(self) -> tuple[int, bool]:
        """A slot, now live, and whether it is a reused one (freed and kept mapped)."""
        if self._kept:
            slot, _ = self._kept.popitem()  # the most recently freed
            self._live.add(slot)
            return slot, True
        if not self._free:
            raise CapacityExhausted(f"all {self.capacity} session slots are in use")
        slot = self._free.pop()
        self._live.add(slot)
        return slot, False

    def _give_back(self, slot: int) -> None:
        self._live.discard(slot)
        if len(self._kept) < self.keep_mapped and self.backend.pages(slot) >= self.create_pages:
            self.backend.shrink(slot, self.create_pages)  # kept with what a create needs; the rest goes back
            self._set_room(slot)
            self._kept[slot] = time.monotonic()  # reused by the next create, or unmapped by trim()
            return
        self._unmap(slot)

    def _unmap(self, slot: int) -> None:
        self.backend.shrink(slot, 0)
        self._room[slot] = 0
        self._free.append(slot)

    def _settle(self, slot: int) -> None:
        """A copy between the slot and host memory is done: on a GPU, marked as the slot's last use and waited for."""
        if self.device.type == "cuda":
            self.backend.mark_used([slot])
            torch.cuda.current_stream(self.device).synchronize()

    def _check_live(self, slot: int) -> None:
        if slot not in self._live:
            raise SlotError(f"slot {slot} is not live")
