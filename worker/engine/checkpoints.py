"""Checkpoints of a recurrent state: where a session's next turn can start again without computing it all.

A state laid out by position (K/V) can be cut back to any of its tokens; a recurrent state (Qwen3.5's DeltaNet and
convolution states) has taken every token in and cannot give one back. So a session whose context is taken back
inside what it computed (a from_start GENERATE: an edited conversation, an answer generated again, a template that
renders an earlier answer otherwise, as Qwen3.5's drops its reasoning) would be computed again from its start.

A checkpoint is a copy of a session's fixed-size state taken when it held exactly the first `at` tokens: the
generation's prompt but its last token (the engine computes a recurrent model's last prompt token alone, in the step
after the rest, so that state exists between two steps; see worker.engine.scheduler). Put back, with the session's
K/V for those positions still in its slot, the session holds `at` tokens again, and its last prompt token runs once
more to sample from: a regenerate computes one token, a next turn what follows the last prompt.

Each checkpoint takes a slot of the session table holding only the fixed-size state (its pages, nothing per token),
and only room no session needs: it is taken where a slot is free without hibernating anyone, and dropped, the oldest
first, before a session is hibernated or refused for want of a slot or a page. A session holds one at most (its latest
turn's); its copy is queued on the stream after the step that leaves the state there, and put back in stream order
too, so no step ever waits for either. A checkpoint holds for as long as the session's first `at` tokens stay as they
were: a context cut inside them drops it, and so does the session's close; a fork copies it (into another session's
checkpoint's slot, the least recently used, where no slot is free); a hibernating session takes it along
(worker.engine.hibernation: host memory, or a file beside the session's) and has it back, in a free slot, when it is
restored. A moved session leaves it behind.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from cuda_state import CapacityExhausted, SessionTable

log = structlog.get_logger(__name__)

NOT_TAKEN = 0  # a checkpoint's `at` before its copy is queued (no session holds 0 tokens worth keeping)


@dataclass
class Checkpoint:
    """One session's checkpoint: its slot, and the tokens whose state the slot holds (NOT_TAKEN: none yet)."""

    slot: int
    at: int = NOT_TAKEN
    dropped: bool = False  # its slot went back to the table: a copy planned into it must not run


class Checkpoints:
    """The checkpoints of one engine's sessions, by session id, the least recently used first."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table
        self._held: OrderedDict[str, Checkpoint] = OrderedDict()
        self.taken = self.used = self.restored = 0  # copies queued, put back, and brought back from hibernation

    def __len__(self) -> int:
        return len(self._held)

    def get(self, session_id: str) -> Checkpoint | None:
        """The session's checkpoint, once its copy is queued."""
        cp = self._held.get(session_id)
        return cp if cp is not None and cp.at != NOT_TAKEN else None

    def within(self, session_id: str, computed: int) -> Checkpoint | None:
        """The session's checkpoint if its state holds the `at` tokens the checkpoint needs (see fork)."""
        cp = self.get(session_id)
        return cp if cp is not None and cp.at <= computed else None

    def reserve(self, session_id: str) -> Checkpoint | None:
        """The slot the session's next checkpoint goes into: the one it has, or a free one (None when the table has
        no slot or page free: nothing is hibernated or dropped for a checkpoint)."""
        cp = self._held.get(session_id)
        if cp is None:
            try:
                cp = Checkpoint(self.table.create(0))
            except CapacityExhausted:
                return None
            self._held[session_id] = cp
        self._held.move_to_end(session_id)
        return cp

    def take(self, cp: Checkpoint, session_slot: int, at: int) -> None:
        """Copy the session's fixed-size state, which holds its first `at` tokens once the work queued so far is done,
        into its checkpoint (unless the checkpoint was dropped since it was reserved)."""
        if cp.dropped:
            return
        self.table.copy_fixed(cp.slot, session_slot)
        cp.at = at
        self.taken += 1

    def put_back(self, session_id: str, session_slot: int) -> int:
        """Copy the session's checkpoint into its slot; the tokens the slot then holds."""
        cp = self._held[session_id]
        self.table.copy_fixed(session_slot, cp.slot)
        self._held.move_to_end(session_id)
        self.used += 1
        return cp.at

    def save(self, cp: Checkpoint, out: torch.Tensor) -> None:
        """Copy the checkpoint's bytes into `out` (host memory, `table.spec.bytes_for(0)` bytes), after the work queued
        so far: a hibernating session takes its checkpoint with it."""
        self.table.save_prefix(cp.slot, 0, out)

    def load(self, session_id: str, at: int, state: torch.Tensor) -> bool:
        """A restored session's checkpoint, `state` being what `save` took when it held `at` tokens, in a free slot
        (False where none is: the session comes back without one)."""
        cp = self.reserve(session_id)
        if cp is None:
            return False
        self.table.load_prefix(cp.slot, 0, state)
        cp.at = at
        self.restored += 1
        return True

    def keep_within(self, session_id: str, tokens: int) -> None:
        """The session's first `tokens` tokens stay, those after are replaced: a checkpoint past them no longer holds
        the session's tokens (its slot is kept for the next one)."""
        cp = self._held.get(session_id)
        if cp is not None and cp.at > tokens:
            cp.at = NOT_TAKEN

    def fork(self, parent_id: str, child_id: str, copied: int) -> None:
        """The child's copy of the parent's checkpoint, in a free slot or in the least recently used other
        checkpoint's (a fork is most often made to be used at once: an answer asked again); else the child has none.
        `copied`: the positions of the parent's K/V the child holds; a checkpoint past them (the parent's state was
        reset below it: a cancel, a from_start cut) would start the child on positions it lacks, so it has none."""
        cp = self.within(parent_id, copied)
        if cp is None:
            return
        while True:
            try:
                slot = self.table.clone(cp.slot, 0)
                break
            except CapacityExhausted:
                other = next((sid for sid in self._held if sid != parent_id), None)
                if other is None:
                    return
                self.drop(other)
        self._held[child_id] = Checkpoint(slot, cp.at)

    def drop(self, session_id: str) -> None:
        cp = self._held.pop(session_id, None)
        if cp is not None:
            cp.dropped = True
            self.table.free(cp.slot)  # after the queued work that copies into or out of it

    def drop_oldest(self) -> bool:
        """Give the least recently used checkpoint's slot and pages back; False when there is none."""
        if not self._held:
            return False
        session_id = next(iter(self._held))
        self.drop(session_id)
        log.debug("checkpoint_dropped", session=session_id, reason="room")
        return True

    def clear(self) -> None:
        """Forget every checkpoint (the table is being closed: it releases their slots itself)."""
        for cp in self._held.values():
            cp.dropped = True
        self._held.clear()
