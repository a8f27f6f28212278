"""A session's state as a move takes it out of one engine and puts it into another.

What moves is exactly what a hibernation copies out (worker.engine.hibernation): the session's tokens, its computed
count, its owner, and its state, `table.prefix(slot, computed)` (one contiguous byte range in the layout of
cuda_state.spec, named by `StateSpec.fingerprint()`). The bytes are opaque here: an engine takes a snapshot only into
the same model and layout, and checks its digest (XXH3-128 of the session's fields and the bytes: a checksum against
corruption on the way, fast enough not to count beside the copy) first.

- `export_session`: the snapshot of an idle session, resident (copied from its slot after the steps launched before,
  as a hibernation copies it) or hibernated (its host copy, or its file read and checked). The session stays in the
  engine unchanged: the source closes it only once the target has it (worker.serve.moves).
- `import_session`: a new session from a snapshot, in a slot backed for its computed tokens (idle sessions hibernate
  for it as for a create), the bytes copied in; refused whole (nothing changes) on any mismatch.

A snapshot may carry the session's latest recurrent-state checkpoint (worker.engine.checkpoints), where the target
takes one (the broker says so, from the target's READY): its bytes follow the state's, and the target puts it in a
free slot, as a restore from hibernation does, so that the moved session's next rewritten turn starts from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import xxhash

from cuda_state import CapacityExhausted
from worker.engine.hibernation import SessionLost
from worker.engine.session import Session
from worker.errors import BadRequest, EngineError, SessionBusy

# `engine` below is a worker.engine.core.Engine (not imported: core imports this module); these functions are its
# export_session / check_import / import_session, kept here with the rest of what a move needs.
Engine = Any

DIGEST_BYTES = 16

__all__ = ["CapacityExhausted", "MoveRefused", "Snapshot", "export_session", "import_session", "state_digest"]


class MoveRefused(EngineError):
    """A snapshot this engine cannot take: another model or layout, sizes that do not add up, a bad digest."""

    code = "bad_request"


@dataclass
class Snapshot:
    """A session as it moves: its fields, its state's bytes, and its checkpoint's where it carries one (host memory,
    `nbytes` long together: the order they travel in)."""

    session_id: str
    owner: str
    tokens: list[int]
    computed: int
    model: str
    layout: str
    state: torch.Tensor  # uint8, (bytes_for(computed),), on the host
    checkpoint_at: int = 0  # the checkpoint's tokens (0: none)
    checkpoint: torch.Tensor | None = None  # its bytes (uint8, the layout's fixed-size state), on the host

    @property
    def checkpoint_bytes(self) -> int:
        return 0 if self.checkpoint is None else int(self.checkpoint.numel())

    @property
    def nbytes(self) -> int:
        return int(self.state.numel()) + self.checkpoint_bytes

    def parts(self) -> list[memoryview]:
        """The bytes, as they travel (views, no copy)."""
        return [t.numpy().data for t in (self.state, self.checkpoint) if t is not None and t.numel()]

    def digest(self) -> bytes:
        return state_digest(self.session_id, self.owner, self.tokens, self.computed, self.model, self.layout,
                            self.parts(), self.checkpoint_at)


def state_digest(session_id: str, owner: str, tokens: list[int], computed: int, model: str, layout: str,
                 parts: Sequence[memoryview | bytes], checkpoint_at: int = 0) -> bytes:
    """XXH3-128 of a moved session's fields and bytes (its state's, then its checkpoint's): what the target checks
    before it takes the session."""
    digest = xxhash.xxh3_128()
    fields: list[Any] = [session_id, owner, tokens, computed, model, layout, sum(len(part) for part in parts)]
    if checkpoint_at:  # (a move without one hashes as before: either side may be older)
        fields.append(checkpoint_at)
    digest.update(msgpack.packb(fields, use_bin_type=True))
    for part in parts:
        digest.update(part)
    return digest.digest()


def export_session(engine: Engine, session_id: str, checkpoint: bool = False) -> Snapshot | None:
    """The snapshot of an idle session (with `checkpoint`, and its latest checkpoint, where it has one), or None while
    a step launched ahead still holds a row of it (ask again after the next step). SessionBusy while it generates;
    SessionNotFound / SessionLost as any request for it."""
    session = engine._session(session_id)
    if session.request is not None:
        raise SessionBusy(f"session {session_id} is generating: it moves once the generation ends")
    pin = engine.model.device.type == "cuda"
    checkpoint_at, extra = 0, None
    if session.resident:
        if id(session) in engine._in_flight():
            return None
        nbytes = engine.table.spec.bytes_for(session.computed)
        state = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        engine.table.save_prefix(session.slot, session.computed, state)  # after the steps
        cp = engine.checkpoints.within(session.id, session.computed) \
            if checkpoint and engine.checkpoints is not None else None
        if cp is not None:
            extra = torch.empty(engine.table.spec.bytes_for(0), dtype=torch.uint8, pin_memory=pin)
            engine.checkpoints.save(cp, extra)
            checkpoint_at = cp.at
        computed = session.computed
    else:
        h = engine.hibernation
        if h is None:
            raise SessionLost(f"session {session_id} has no slot and no stored state")
        on_disk = session_id not in h.host
        try:
            stored = h.take(session_id)
        except SessionLost:
            engine._lose(session)
            raise
        assert stored.state is not None
        state, computed = stored.state, stored.computed
        if checkpoint and stored.checkpoint is not None:
            checkpoint_at, extra = stored.checkpoint_at, stored.checkpoint
        if on_disk:
            stored.state = stored.checkpoint = None  # the files stay the truth until the session is released
    return Snapshot(session.id, session.owner, list(session.tokens), computed, engine.model_name, engine.state_layout,
                    state, checkpoint_at, extra)


def check_snapshot(engine: Engine, session_id: str, tokens: list[int], computed: int, nbytes: int, model: str,
                   layout: str, checkpoint_at: int = 0, checkpoint_bytes: int = 0) -> None:
    """MoveRefused (nothing changes) unless a snapshot with these fields fits this engine: its model and layout, the
    state size its computed count takes (and its checkpoint's, one of this layout's fixed-size state within the
    computed tokens), tokens within the context and the vocabulary, a session id not in use."""
    if model != engine.model_name:
        raise MoveRefused(f"the session is of model {model!r}; this worker serves {engine.model_name!r}")
    if layout != engine.state_layout:
        raise MoveRefused("the session's state layout is not this worker's (another build, configuration or weights)")
    if not 0 <= computed <= len(tokens) or len(tokens) > engine.max_context:
        raise MoveRefused(f"a session of {len(tokens)} tokens ({computed} computed) does not fit max_context "
                          f"{engine.max_context}")
    if checkpoint_at or checkpoint_bytes:
        if engine.checkpoints is None or checkpoint_bytes != engine.table.spec.bytes_for(0) \
                or not 0 < checkpoint_at <= computed:
            raise MoveRefused(f"a checkpoint of {checkpoint_bytes} bytes at {checkpoint_at} tokens does not fit this "
                              "layout or the session's computed tokens")
    nbytes -= checkpoint_bytes
    if nbytes != engine.table.spec.bytes_for(computed):
        raise MoveRefused(f"{nbytes} state bytes for {computed} computed tokens; this layout takes "
                          f"{engine.table.spec.bytes_for(computed)}")
    vocab = engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise MoveRefused(f"a token id is out of this model's vocabulary [0, {vocab})")
    try:
        engine._new_id(session_id)
    except BadRequest as e:
        raise MoveRefused(str(e)) from e


def import_session(engine: Engine, snapshot: Snapshot, digest: bytes) -> str:
    """Take a moved session: checked (check_snapshot, then the digest), then a slot backed for its computed tokens
    and its bytes copied in. MoveRefused, SessionExists or CapacityExhausted leave the engine unchanged."""
    s = snapshot
    check_snapshot(engine, s.session_id, s.tokens, s.computed, s.nbytes, s.model, s.layout, s.checkpoint_at,
                   s.checkpoint_bytes)
    if s.digest() != digest:
        raise MoveRefused(f"session {s.session_id}: its state does not match its digest (checksum mismatch)")
    slot = engine._with_room(lambda: engine.table.create(s.computed))
    try:
        engine.table.load_prefix(slot, s.computed, s.state)  # the host copy is released by the caller
    except BaseException:
        engine.table.free(slot)
        raise
    engine._lost.pop(s.session_id, None)
    engine._sessions[s.session_id] = Session(s.session_id, slot, list(s.tokens), s.computed, owner=s.owner)
    if s.checkpoint is not None and engine.checkpoints is not None:  # where one is taken (Checkpoints.reserve)
        engine.checkpoints.load(s.session_id, s.checkpoint_at, s.checkpoint)
    return s.session_id
