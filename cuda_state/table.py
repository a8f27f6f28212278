"""The session table: which slots are live, how many pages each holds, and the only door to create, grow, clone
and free them.

The table accounts; the backend moves memory. Slot numbers are what the model indexes state with. A slot's virtual
range is fixed; its pages are mapped from its start as the session grows (`ensure`), `ahead_tokens` positions ahead
of need when pages allow, and released when it is freed. A session of N tokens holds
`spec.pages_for(N + ahead, page)` pages at most. Admission is by free pages: a create, or a growth, that cannot get
its pages raises CapacityExhausted and changes nothing.

With `keep_mapped` > 0, up to that many freed slots stay mapped, every page of them, and the next create or clone
takes one of them instead of mapping anew: no driver call on the path of a session that closes while another opens,
and none while the new session grows into pages its slot already has. (Mapping is not free for the device either: a
page mapped or unmapped while a step runs slows that step.) A reused slot is zeroed before it is handed out, so
nothing of the session it held survives. `trim()` releases slots kept longer than a given age (the worker calls it
when idle), all of them on close.

A reused slot may hold more pages than its session's tokens (and the `ahead_tokens`) call for: its surplus. Surplus
pages count as free (`free_pages`, `free_slots`), so admission is by the tokens sessions use. When a create or a
growth finds too few pages unmapped, the kept slots give theirs back first, then live slots their surplus (each
after its last queued use, as any unmapping); so do they all when the budget has room but the device has no memory
left (another process holds it), before a create or a growth is refused. The table learns a live slot's tokens from
`create`, `ensure`, `covers`, `prefix` (a restore's copy in) and `clone` (its source's), the most asked of it since
it was handed out, so a surplus never reaches a page a session's tokens use.
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
        # A live slot's claim: the pages its tokens and the ahead_tokens call for, and the tokens that claim covers
        # before it must rise. Pages past the claim are surplus; _surplus is their sum over the live slots.
        self._claim = [0] * backend.num_slots
        self._claim_covers = [-1] * backend.num_slots
        self._surplus = 0

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
        """Pages a create or growth can have: unmapped ones and the live slots' surplus."""
        return self.backend.page_budget - self.backend.mapped_pages + self._surplus

    @property
    def surplus_pages(self) -> int:
        """Pages live slots hold past what their tokens call for (kept from the session a reused slot held)."""
        return self._surplus

    @property
    def page_budget(self) -> int:
        return self.backend.page_budget

    @property
    def free_slots(self) -> int:
        """Sessions a create can still admit: free slots, as far as free pages (and kept slots) go, each create
        taking its pages ahead while they last (as `_grow` maps them)."""
        slots = len(self._free) + len(self._kept)
        want = max(self.create_pages, self.spec.pages_for(self.ahead_tokens, self.page_bytes))
        full, rest = divmod(self.free_pages, want)
        return min(slots, len(self._kept) + full + (rest >= self.create_pages))

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
        """The slot holds `tokens` positions and the `ahead_tokens` after them (as far as max_context). The slot's
        session uses `tokens` positions from here on (its claim covers them)."""
        if tokens > self._claim_covers[slot]:
            self._raise_claim(slot, tokens)
        return min(tokens + self.ahead_tokens, self._max_context) <= self._room[slot]

    def ensure(self, slot: int, tokens: int) -> None:
        """Back the slot's first `tokens` positions and, when pages allow, the `ahead_tokens` after them: a page is
        mapped before the first token that needs it. Raises CapacityExhausted (nothing changed) when the pages for
        `tokens` themselves cannot be had."""
        self._check_live(slot)
        claim, claim_covers = self._claim[slot], self._claim_covers[slot]
        if self.covers(slot, tokens):
            return
        try:
            self._grow(slot, tokens)
        except CapacityExhausted:  # the claim back where it was: the pages it held past it stay free to others
            before = self._surplus_of(slot)
            self._claim[slot], self._claim_covers[slot] = claim, claim_covers
            self._surplus += self._surplus_of(slot) - before
            raise

    def clone(self, src: int, used: int) -> int:
        """A new slot holding the fixed state and the first `used` positions of `src` (the rest zero)."""
        self._check_live(src)
        self._raise_claim(src, used)  # the pages being copied: no surplus for the new slot's growth to take
        slot = self.create(used)
        try:
            self.backend.copy_prefix(slot, src, self.spec.bytes_for(used))
            self.backend.mark_used([slot, src])
        except BaseException:
            self._give_back(slot)
            raise
        return slot

    def copy_fixed(self, dst: int, src: int) -> None:
        """Copy the fixed-size state (a recurrent and a convolution state) of live slot `src` into live slot `dst`,
        after the work queued on the current stream: a recurrent state's checkpoint taken, or put back."""
        self._check_live(src)
        self._check_live(dst)
        self.backend.copy_prefix(dst, src, self.spec.token_offset)
        self.backend.mark_used([dst, src])

    def prefix(self, slot: int, tokens: int) -> torch.Tensor:
        """The slot's state for its first `tokens` positions as one uint8 tensor over the slab (zero copy): what a
        hibernation copies out and a restore copies in. The slot's session uses `tokens` positions from here on."""
        self._check_live(slot)
        self._raise_claim(slot, tokens)  # a restore writes them into pages a reused slot may count as surplus
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
        self._surplus = 0
        self.backend.close()

    # -- internals ----------------------------------------------------------------------------------------------

    def _grow(self, slot: int, tokens: int) -> None:
        """Pages for `tokens` positions, and for `ahead_tokens` more when they are free; kept slots give theirs back
        first when a growth finds none unmapped, then live slots their surplus."""
        self._raise_claim(slot, tokens)
        spec, page = self.spec, self.page_bytes
        need = max(self.create_pages, spec.pages_for(tokens, page))
        want = max(need, spec.pages_for(tokens + self.ahead_tokens, page))
        have = self.backend.pages(slot)
        if want <= have:
            return
        self._unmapped_room(want - have, slot)
        before = self._surplus_of(slot)
        try:
            try:
                self._map(slot, want, need, have)
            except CapacityExhausted:
                # Within the budget, yet the device itself is full (another process holds its memory): the kept
                # slots' pages and the live slots' surplus are ours, so they go back to the driver and the pages are
                # asked for again, rather than refusing a session while the table holds the memory it needs.
                if not self._reclaim(slot):
                    raise
                self._map(slot, want, need, have)
        finally:
            self._set_room(slot)
            self._surplus += self._surplus_of(slot) - before

    def _map(self, slot: int, want: int, need: int, have: int) -> None:
        """The slot's pages up to `want`, or only up to `need` when the pages ahead are not to be had."""
        try:
            self.backend.grow(slot, want)
        except CapacityExhausted:
            if need <= have:
                return  # the pages ahead are not to be had; the pages needed are there
            if need == want:
                raise  # nothing less to ask for: asking again would create and release the same pages
            self.backend.grow(slot, need)

    def _reclaim(self, slot: int) -> bool:
        """Unmap every kept slot and every other live slot's surplus (each after its last queued use). Whether any
        page was released."""
        mapped = self.backend.mapped_pages
        self._unmapped_room(_NO_LIMIT, slot)
        return self.backend.mapped_pages < mapped

    def _unmapped_room(self, pages: int, slot: int) -> None:
        """Make `pages` pages unmapped if the kept slots, then the other live slots' surplus, can give them."""
        short = pages - (self.backend.page_budget - self.backend.mapped_pages)
        if short > 0 and self._kept:
            self.trim()
            short = pages - (self.backend.page_budget - self.backend.mapped_pages)
        if short <= 0 or not self._surplus:
            return
        for other in list(self._live):  # under pressure only: each shrink waits for the slot's last queued use
            if other == slot or short <= 0:
                continue
            surplus = self._surplus_of(other)
            if surplus:
                self.backend.shrink(other, self._claim[other])
                self._set_room(other)
                self._surplus -= surplus
                short -= surplus

    def _raise_claim(self, slot: int, tokens: int) -> None:
        """The live slot's session uses `tokens` positions: its claim covers them and the ahead_tokens."""
        if slot not in self._live or tokens <= self._claim_covers[slot]:
            return
        spec, page = self.spec, self.page_bytes
        before = self._surplus_of(slot)
        claim = max(self.create_pages, spec.pages_for(tokens + self.ahead_tokens, page))
        self._claim[slot] = claim
        # The claim rises again once tokens reach past what these pages hold less the ahead_tokens.
        self._claim_covers[slot] = (spec.tokens_in(claim, page) - self.ahead_tokens) if spec.token_bytes else _NO_LIMIT
        self._surplus += self._surplus_of(slot) - before

    def _surplus_of(self, slot: int) -> int:
        return max(0, self.backend.pages(slot) - self._claim[slot]) if slot in self._live else 0

    def _set_room(self, slot: int) -> None:
        spec = self.spec
        pages = self.backend.pages(slot)
        self._room[slot] = spec.tokens_in(pages, self.page_bytes) if spec.token_bytes else _NO_LIMIT

    def _take(self) -> tuple[int, bool]:
        """A slot, now live, and whether it is a reused one (freed and kept mapped)."""
        if self._kept:
            slot, _ = self._kept.popitem()  # the most recently freed
            reused = True
        elif not self._free:
            raise CapacityExhausted(f"all {self.capacity} session slots are in use")
        else:
            slot, reused = self._free.pop(), False
        self._live.add(slot)
        self._claim[slot], self._claim_covers[slot] = self.create_pages, -1
        self._surplus += self._surplus_of(slot)  # a kept slot's pages past a create's, until its tokens claim them
        return slot, reused

    def _give_back(self, slot: int) -> None:
        self._surplus -= self._surplus_of(slot)
        self._live.discard(slot)
        if len(self._kept) < self.keep_mapped and self.backend.pages(slot) >= self.create_pages:
            self._kept[slot] = time.monotonic()  # every page kept: reused by the next create, or unmapped by trim()
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
