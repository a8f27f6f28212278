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

A session holds up to PER_SESSION (2): its latest turn's, which the next turn and a regenerate start from, and the
turn's before, which an edited last question starts from (the edit cuts inside the latest one). A turn starts from
the latest checkpoint its context keeps; its own checkpoint goes into a new slot where one is free, else into the
slot of its own checkpoint it needs least (one that no longer holds its tokens, else the one of the fewest), and is
not taken again where the session already has one at that position (a regenerate).

Each checkpoint takes a slot of the session table holding only the fixed-size state (its pages, nothing per token),
and only room no session needs: a slot free without hibernating anyone, or one another session's older checkpoint
gives up (never a session's latest: sessions taking turns would take each other's, and none would start from one).
Checkpoints are dropped, the least recently used first (a fork's parent's last), before a session is hibernated or
refused for want of a slot or a page. Its copy is queued on
the stream after the step that leaves the state there, and put back in stream order too, so no step ever waits for
either. A checkpoint holds for as long as the session's first `at` tokens stay as they were: a context cut inside
them drops it, and so does the session's close. A fork shares its parent's checkpoints within the state it copies,
without a copy or a slot (their bytes are only read once taken, and a generating session, whose checkpoint may be
written, is not forked), so that the fork's first turn, an answer asked again or an edited question, starts from
whichever it keeps. A hibernating session takes its latest along (worker.engine.hibernation: host memory, or a
file beside the session's) and has it back when it is restored; a moved session takes it along where the target
takes one (worker.engine.migration).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import structlog
import torch

from cuda_state import CapacityExhausted, SessionTable

log = structlog.get_logger(__name__)

NOT_TAKEN = 0  # a checkpoint's `at` before its copy is queued (no session holds 0 tokens worth keeping)
PER_SESSION = 2  # the latest turn's, and the one before (an edited last question starts from it)


@dataclass(eq=False)
class Checkpoint:
    """A checkpoint: its slot, the tokens whose state the slot holds (NOT_TAKEN: none yet), and the sessions it serves
    (a fork shares its parent's: the bytes are only ever read once taken)."""

    slot: int
    at: int = NOT_TAKEN
    dropped: bool = False  # its slot went back to the table: a copy planned into it must not run
    owners: set[str] = field(default_factory=set)


class Checkpoints:
    """The checkpoints of one engine's sessions: each session's, and every checkpoint least recently used first."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table
        self._of: dict[str, list[Checkpoint]] = {}
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()
        self.taken = self.used = self.restored = 0  # copies queued, put back, and brought back from hibernation

    def __len__(self) -> int:
        """The slots checkpoints hold."""
        return len(self._lru)

    def of(self, session_id: str) -> list[Checkpoint]:
        """The session's checkpoints, taken or not."""
        return list(self._of.get(session_id, ()))

    def get(self, session_id: str) -> Checkpoint | None:
        """The session's latest checkpoint (of the most tokens), once its copy is queued."""
        return self.within(session_id, None)

    def within(self, session_id: str, tokens: int | None) -> Checkpoint | None:
        """The session's checkpoint of the most tokens up to `tokens` (None: any), once its copy is queued. A
        checkpoint past what the session's slot has computed would start it on K/V it lacks (see fork)."""
        best = None
        for cp in self._of.get(session_id, ()):
            if cp.at != NOT_TAKEN and (tokens is None or cp.at <= tokens) and (best is None or cp.at > best.at):
                best = cp
        return best

    def reserve(self, session_id: str, at: int) -> Checkpoint | None:
        """The checkpoint the session's state at `at` tokens is copied into; None where the session already holds `at`
        (the same tokens: taking it again changes nothing). A session of PER_SESSION checkpoints reuses the one of its
        own (shared with no other session) of the fewest tokens; else a new one takes a free slot, or, where none is,
        the session reuses its own, or takes the slot of another session's older checkpoint (see _slot). Nothing is
        hibernated for a checkpoint."""
        held = self._of.get(session_id, [])
        if any(cp.at == at for cp in held):
            return None
        own = self._own(session_id)
        if len(held) >= PER_SESSION and own is not None:
            return own
        slot = self._slot(spare=session_id, take_others=own is None)
        if slot is None:
            return own
        if len(held) >= PER_SESSION:  # both shared: it lets go of the older one (its other owners keep it)
            self._detach(session_id, min(held, key=lambda c: c.at))
        cp = Checkpoint(slot, owners={session_id})
        self._of.setdefault(session_id, []).append(cp)
        self._lru[cp] = None
        return cp

    def take(self, cp: Checkpoint, session_slot: int, at: int) -> None:
        """Copy the session's fixed-size state, which holds its first `at` tokens once the work queued so far is done,
        into its checkpoint (unless the checkpoint was dropped since it was reserved). A reserved checkpoint has one
        owner until the generation ends (a generating session is not forked)."""
        if cp.dropped:
            return
        assert len(cp.owners) == 1, "a shared checkpoint written"
        self.table.copy_fixed(cp.slot, session_slot)
        cp.at = at
        self._lru.move_to_end(cp)
        self.taken += 1

    def put_back(self, cp: Checkpoint, session_slot: int) -> int:
        """Copy checkpoint `cp` into a session's slot; the tokens the slot then holds."""
        self.table.copy_fixed(session_slot, cp.slot)
        self._lru.move_to_end(cp)
        self.used += 1
        return cp.at

    def save(self, cp: Checkpoint, out: torch.Tensor) -> None:
        """Copy the checkpoint's bytes into `out` (host memory, `table.spec.bytes_for(0)` bytes), after the work queued
        so far: a hibernating session takes its checkpoint with it."""
        self.table.save_prefix(cp.slot, 0, out)

    def load(self, session_id: str, at: int, state: torch.Tensor) -> bool:
        """A restored or moved session's checkpoint, `state` being what `save` took when it held `at` tokens, where
        `reserve` finds it a slot. False where it does not, or the copy fails (a checkpoint is a shortcut: the
        session comes back without one)."""
        cp = self.reserve(session_id, at)
        if cp is None:
            return False
        try:
            self.table.load_prefix(cp.slot, 0, state)
        except Exception:  # noqa: BLE001  (its slot may hold part of the copy: let go of it)
            log.exception("checkpoint_not_loaded", session=session_id)
            self._detach(session_id, cp)
            return False
        cp.at = at
        self.restored += 1
        return True

    def keep_within(self, session_id: str, tokens: int) -> None:
        """The session's first `tokens` tokens stay, those after are replaced: it lets go of a checkpoint past them,
        which no longer holds its tokens (its slot goes back unless another session shares it)."""
        for cp in self.of(session_id):
            if cp.at > tokens:
                self._detach(session_id, cp)

    def fork(self, parent_id: str, child_id: str, copied: int) -> None:
        """The child shares the parent's checkpoints (no copy, no room: their bytes are read only, and a turn writes a
        checkpoint of its own). `copied`: the positions of the parent's K/V the child holds; a checkpoint past them
        (the parent's state was reset below it: a cancel, a from_start cut) would start the child on positions it
        lacks, so it is not shared."""
        shared = [cp for cp in self._of.get(parent_id, ()) if cp.at != NOT_TAKEN and cp.at <= copied]
        for cp in shared:
            cp.owners.add(child_id)
        if shared:
            self._of[child_id] = shared

    def drop(self, session_id: str) -> None:
        for cp in self.of(session_id):
            self._detach(session_id, cp)

    def drop_oldest(self, spare: str | None = None, older_only: bool = False) -> bool:
        """Give the least recently used checkpoint's slot and pages back (every session it serves lets go of it), none
        of `spare`'s, and with `older_only` none that is a session's latest or a running turn's (not taken yet); False
        when there is none."""
        cp = next((c for c in self._lru if spare not in c.owners and not (older_only and (
            c.at == NOT_TAKEN or any(self.get(owner) is c for owner in c.owners)))), None)
        if cp is None:
            return False
        owners = list(cp.owners)
        for owner in owners:
            self._detach(owner, cp)
        log.debug("checkpoint_dropped", sessions=owners, at=cp.at, reason="room")
        return True

    def clear(self) -> None:
        """Forget every checkpoint (the table is being closed: it releases their slots itself)."""
        for cp in self._lru:
            cp.dropped = True
        self._lru.clear()
        self._of.clear()

    def _own(self, session_id: str) -> Checkpoint | None:
        """The session's checkpoint of the fewest tokens among those no other session shares."""
        own = [cp for cp in self._of.get(session_id, ()) if cp.owners == {session_id}]
        return min(own, key=lambda c: c.at) if own else None

    def _slot(self, spare: str, take_others: bool) -> int | None:
        """A slot for a new checkpoint: a free one, or (`take_others`) the slot of another session's older checkpoint
        (not its latest: sessions taking turns would otherwise take each other's, and none would start from one), the
        least recently used first; None when there is neither."""
        while True:
            try:
                return self.table.create(0)
            except CapacityExhausted:
                if not take_others or not self.drop_oldest(spare=spare, older_only=True):
                    return None

    def _detach(self, session_id: str, cp: Checkpoint) -> None:
        """The session lets go of the checkpoint; its slot goes back once no session holds it."""
        held = self._of.get(session_id)
        if held is not None and cp in held:
            held.remove(cp)
            if not held:
                del self._of[session_id]
        cp.owners.discard(session_id)
        if not cp.owners and not cp.dropped:
            cp.dropped = True
            del self._lru[cp]
            self.table.free(cp.slot)  # after the queued work that copies into or out of it
