"""Moving live sessions between workers: the worker's half (the broker's, and the whole protocol, is broker.moves).

As a source: a MOVE names a session and its target. Once no request of the session runs here (a generation in
flight ends first; the broker holds its new requests), the session's snapshot (worker.engine.migration: tokens,
computed count, owner, state bytes, layout, digest) goes to the broker as one MOVE_STATE and MOVE_CHUNKs of
MOVE_CHUNK_BYTES, with the answers this worker keeps for the session's recent requests (so that a resent request is
answered on the target, never run again). The session stays here, unchanged, until MOVE_END: `release` closes it
(reported `released`), `abort` keeps it.

As a target: a MOVE_STATE is checked against this engine (model, layout, sizes, a free session id) before any byte
is taken, then the chunks must come in order and add up to its size; the last one makes the digest checked and the
session imported into a slot (idle sessions hibernate for it if needed). Reported `imported`, or `failed` with the
reason (nothing kept). A MOVE_END abort closes what was imported (reported `aborted`).

A worker that registers with a new broker (its id changed) forgets the moves in progress: the new broker knows none,
and sorts out a session two workers list (the first to register keeps it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from broker.common import protocol as p
from worker.serve.dispatch import Dispatch, error_code

log = structlog.get_logger()

MAX_IMPORTS = 64  # moves received at once; a MOVE_STATE past this is refused (the broker starts few per source)
MAX_RELEASED = 1024  # releases remembered, to answer one sent again
# An imported session's move is remembered this long (the broker may still abort it; it never says it switched):
# well past the broker's MOVE_TIMEOUT_S, after which it aborts a move that has not reached its release.
IMPORT_KEEP_S = 120.0


class ImportStalled(Exception):
    """A move into this worker whose chunks stopped coming."""

    code = "timeout"


@dataclass
class Export:
    migration: str
    session_id: str
    target: str
    checkpoint: bool = False  # the target takes the session's checkpoint
    sent: bool = False  # the state went out: waiting for MOVE_END


@dataclass
class Import:
    header: p.MoveState
    state: torch.Tensor  # uint8 (nbytes,), filled chunk by chunk
    next_index: int = 0
    session_id: str | None = None  # set once imported (an abort closes it)
    started: float = field(default_factory=time.perf_counter)
    touched: float = field(default_factory=time.perf_counter)  # when its state or last chunk came


@dataclass
class MoveCounts:
    """For the metrics: sessions moved out and in, moves that failed here."""

    sent: int = 0
    released: int = 0
    imported: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"sent": self.sent, "released": self.released, "imported": self.imported, "failed": self.failed}


class Moves:
    """Both halves of the moves of one worker. The compute loop hands it the broker's move messages (`handle`) and
    calls `poll` every turn (the exports whose sessions became idle go out then)."""

    def __init__(self, engine: Any, dispatch: Dispatch, broker_id: Callable[[], str | None],
                 pause_for_tests: tuple[str, float] | None = None, corrupt_for_tests: bool = False) -> None:
        self.engine = engine
        self.dispatch = dispatch
        self._broker_id = broker_id
        self._epoch: str | None = None  # the broker these moves are with
        self._pause = pause_for_tests
        self.exports: dict[str, Export] = {}  # migration id -> export
        # Migration id -> session, of the latest releases: a release sent again (its report was lost) is reported again.
        self.released: OrderedDict[str, str] = OrderedDict()
        self.imports: dict[str, Import] = {}  # migration id -> import in progress or imported
        self.evacuated: p.Evacuated | None = None  # the broker's answer to this worker's evacuation
        self.counts = MoveCounts()
        self._corrupt = corrupt_for_tests  # flip a state byte of every export (tests of the checksum only)

    @property
    def supported(self) -> bool:
        return hasattr(self.engine, "export_session")

    def handle(self, message: p.Message) -> list[p.Message]:
        """One of the broker's move messages; what to send now."""
        self.check_broker()
        if isinstance(message, p.Move):
            return self._move(message)
        if isinstance(message, p.MoveState):
            return self._begin_import(message)
        if isinstance(message, p.MoveChunk):
            return self._chunk(message)
        if isinstance(message, p.MoveEnd):
            return self._end(message)
        if isinstance(message, p.Evacuated):
            self.evacuated = message
            log.info("worker_evacuated", moved=message.moved, kept=message.kept)
        return []

    def check_broker(self) -> None:
        """Moves are with one broker: a new one (its id changed: it restarted) knows none of them."""
        broker = self._broker_id()
        if broker != self._epoch:
            if self._epoch is not None:
                self.forget_all()
            self._epoch = broker

    def _pause_at(self, step: str) -> None:
        """Tests only: sleep at this step of a move (WORKER_TEST_MOVE_PAUSE), so that a process can be killed there."""
        if self._pause is not None and self._pause[0] == step:
            log.warning("move_paused_for_test", step=step, seconds=self._pause[1])
            time.sleep(self._pause[1])
            self.check_broker()

    def forget_all(self) -> None:
        """A new broker: it knows none of these moves. Exported sessions stay here; partial imports are dropped;
        imported sessions stay (the broker keeps whichever copy registers first)."""
        if self.exports or self.imports:
            log.info("moves_forgotten", exports=len(self.exports), imports=len(self.imports),
                     detail="registered with a new broker")
        self.exports.clear()
        self.imports.clear()
        self.released.clear()
        self.dispatch.moving.clear()

    # -- source ------------------------------------------------------------------------------------

    def _move(self, move: p.Move) -> list[p.Message]:
        if move.migration in self.exports:
            return []
        if not self.supported:
            return [self._report(move.migration, move.session_id, "failed", p.ErrorCode.BAD_REQUEST,
                                 "this worker's engine cannot move sessions")]
        self._pause_at("export")
        self.exports[move.migration] = Export(move.migration, move.session_id, move.target, move.checkpoint)
        self.dispatch.moving.add(move.session_id)
        return self.poll()

    def poll(self) -> list[p.Message]:
        """Send the state of every export whose session no request runs on any more."""
        out: list[p.Message] = []
        if self.imports:
            now = time.perf_counter()
            for mid in [m for m, w in self.imports.items() if w.session_id is not None and now - w.started > IMPORT_KEEP_S]:
                del self.imports[mid]
            # A partial import whose chunks stopped coming (lost, never sent, or undecodable: a MOVE_CHUNK without its
            # payload is dropped unanswered) held its state buffer and one of the MAX_IMPORTS places for good; 64 of
            # them refused every later move into this worker until the broker restarted. The broker aborts a stalled
            # move long before this (MOVE_TIMEOUT_S); past it the move is given up here and reported failed.
            for mid in [m for m, w in self.imports.items() if w.session_id is None and now - w.touched > IMPORT_KEEP_S]:
                work = self.imports.pop(mid)
                out.append(self._failed(mid, work.header.session_id, ImportStalled(
                    f"no chunk for {IMPORT_KEEP_S:g} s: chunk {work.next_index} of {work.header.chunks} was due")))
        for export in list(self.exports.values()):
            if export.sent or self.dispatch.busy(export.session_id):
                continue
            try:
                snapshot = self.engine.export_session(export.session_id, export.checkpoint)
            except Exception as e:  # the session is gone here (closed, lost), or busy after all
                if error_code(e) is p.ErrorCode.BAD_REQUEST:
                    continue  # busy: a generation started meanwhile (a resend); it moves after it
                out.append(self._export_failed(export, error_code(e), str(e)))
                continue
            if snapshot is None:
                continue  # a step launched ahead still holds a row of it: after the next step
            try:
                messages = self._state_messages(export, snapshot)
            except Exception as e:  # noqa: BLE001  (reported as this move's failure; the session stays here)
                log.exception("move_state_failed", session=export.session_id, migration=export.migration)
                out.append(self._export_failed(export, p.ErrorCode.INTERNAL, str(e)))
                continue
            out += messages
            export.sent = True
            self.counts.sent += 1
        return out

    def _export_failed(self, export: Export, code: p.ErrorCode, message: str) -> p.MoveReport:
        """The source gives up a move it could not send: forgotten here, the session stays and serves, reported."""
        del self.exports[export.migration]
        self.dispatch.moving.discard(export.session_id)
        self.counts.failed += 1
        return self._report(export.migration, export.session_id, "failed", code, message)

    def _state_messages(self, export: Export, snapshot: Any) -> list[p.Message]:
        digest = snapshot.digest()
        # The chunks are views of the snapshot's host copies (the state's, then the checkpoint's), sent without a copy
        # (ZeroMQ keeps them alive until they are out) but for a chunk across the two; nothing writes to them meanwhile
        # (fresh buffers, or a hibernated copy, read-only until dropped).
        parts = snapshot.parts()
        if self._corrupt and parts:
            parts[0] = memoryview(bytes([parts[0][0] ^ 0xFF]) + bytes(parts[0][1:]))
        size = p.MOVE_CHUNK_BYTES
        data = _chunked(parts, size)
        chunks = len(data)
        nbytes = sum(len(part) for part in parts)
        header = p.MoveState(
            migration=export.migration, session_id=snapshot.session_id, tokens=tuple(snapshot.tokens),
            computed=snapshot.computed, nbytes=nbytes, chunks=chunks, model=snapshot.model, layout=snapshot.layout,
            digest=digest, owner=snapshot.owner, holder=self.dispatch.routes.get(snapshot.session_id, b""),
            answers=self.dispatch.answers_of(snapshot.session_id), checkpoint_at=snapshot.checkpoint_at,
            checkpoint_bytes=snapshot.checkpoint_bytes)
        log.info("session_sending", session=snapshot.session_id, target=export.target, tokens=len(snapshot.tokens),
                 bytes=nbytes, checkpoint=snapshot.checkpoint_at, migration=export.migration)
        return [header, *(p.MoveChunk(migration=export.migration, index=i, data=chunk) for i, chunk in enumerate(data))]

    # -- target ------------------------------------------------------------------------------------

    def _begin_import(self, header: p.MoveState) -> list[p.Message]:
        mid, sid = header.migration, header.session_id
        if mid in self.imports:
            return []
        epoch = self._epoch
        self._pause_at("import")
        if self._epoch != epoch:  # a new broker meanwhile: it knows nothing of this move
            log.info("moves_forgotten", exports=0, imports=1, detail="registered with a new broker")
            return []
        try:
            if not self.supported:
                raise ValueError("this worker's engine cannot take moved sessions")
            if len(self.imports) >= MAX_IMPORTS:
                raise ValueError(f"{MAX_IMPORTS} moves are being received already")
            self.engine.check_import(sid, list(header.tokens), header.computed, header.nbytes, header.model,
                                     header.layout, header.checkpoint_at, header.checkpoint_bytes)
        except Exception as e:
            return [self._failed(mid, sid, e)]
        state = torch.empty(header.nbytes, dtype=torch.uint8, pin_memory=self.engine.device.startswith("cuda"))
        self.imports[mid] = Import(header, state)
        return self._complete(mid) if header.chunks == 0 else []

    def _chunk(self, chunk: p.MoveChunk) -> list[p.Message]:
        work = self.imports.get(chunk.migration)
        if work is None or work.session_id is not None:
            log.info("move_chunk_unexpected", migration=chunk.migration, index=chunk.index)
            return []
        header = work.header
        start = chunk.index * p.MOVE_CHUNK_BYTES
        expected = min(p.MOVE_CHUNK_BYTES, header.nbytes - start)
        if chunk.index != work.next_index or len(chunk.data) != expected:
            del self.imports[chunk.migration]
            return [self._failed(chunk.migration, header.session_id, ValueError(
                f"chunk {chunk.index} of {len(chunk.data)} bytes where chunk {work.next_index} of {expected} was due"))]
        if expected:
            work.state.numpy()[start:start + expected] = np.frombuffer(chunk.data, dtype=np.uint8)  # one copy
        work.next_index += 1
        work.touched = time.perf_counter()
        return self._complete(chunk.migration) if work.next_index == header.chunks else []

    def _complete(self, mid: str) -> list[p.Message]:
        """Every byte is here: the digest is checked and the session taken (or the move reported failed)."""
        work = self.imports[mid]
        h = work.header
        from worker.engine.migration import Snapshot

        state_bytes = h.nbytes - h.checkpoint_bytes
        snapshot = Snapshot(h.session_id, h.owner, list(h.tokens), h.computed, h.model, h.layout,
                            work.state[:state_bytes], h.checkpoint_at,
                            work.state[state_bytes:] if h.checkpoint_bytes else None)
        try:
            self.engine.import_session(snapshot, h.digest)
        except Exception as e:
            del self.imports[mid]
            return [self._failed(mid, h.session_id, e)]
        work.session_id = h.session_id
        work.state = torch.empty(0, dtype=torch.uint8)  # the bytes are in the slot now
        self.dispatch.adopt(h.session_id, h.owner, h.holder, h.answers)
        self.counts.imported += 1
        log.info("session_received", session=h.session_id, tokens=len(h.tokens), bytes=h.nbytes, migration=mid,
                 ms=round((time.perf_counter() - work.started) * 1e3, 3))
        return [self._report(mid, h.session_id, "imported")]

    # -- either side -------------------------------------------------------------------------------

    def _end(self, end: p.MoveEnd) -> list[p.Message]:
        export = self.exports.get(end.migration)
        if export is not None and export.session_id == end.session_id:  # (another session's id: not this move's end)
            if end.outcome == "release":
                self._pause_at("release")
            del self.exports[end.migration]
            self.dispatch.moving.discard(export.session_id)
            if end.outcome == "release":
                self.dispatch.release(export.session_id)
                self.counts.released += 1
                self.released[end.migration] = end.session_id
                if len(self.released) > MAX_RELEASED:
                    self.released.popitem(last=False)
                log.info("session_released", session=export.session_id, target=export.target,
                         migration=end.migration)
                return [self._report(end.migration, end.session_id, "released")]
            log.info("session_move_aborted", session=export.session_id, side="source", migration=end.migration)
            return [self._report(end.migration, end.session_id, "aborted")]
        if end.outcome == "release" and self.released.get(end.migration) == end.session_id:
            return [self._report(end.migration, end.session_id, "released")]  # its first report was lost
        work = self.imports.pop(end.migration, None)
        if work is not None and end.outcome == "abort":
            if work.session_id is not None:
                self.dispatch.release(work.session_id)
            log.info("session_move_aborted", session=end.session_id, side="target", migration=end.migration)
        return [self._report(end.migration, end.session_id, "aborted")] if end.outcome == "abort" else []

    def _failed(self, mid: str, sid: str, e: BaseException) -> p.MoveReport:
        self.counts.failed += 1
        log.warning("session_move_refused", session=sid, migration=mid, error=str(e)[:512])
        code = error_code(e)
        return self._report(mid, sid, "failed", code if code is not p.ErrorCode.INTERNAL else p.ErrorCode.BAD_REQUEST,
                            str(e))

    @staticmethod
    def _report(mid: str, sid: str, status: str, code: p.ErrorCode | None = None, message: str = "") -> p.MoveReport:
        return p.MoveReport(migration=mid, session_id=sid, status=status, code=code, message=message[:4096])


def _chunked(parts: list[memoryview], size: int) -> list[memoryview | bytes]:
    """The bytes of `parts`, one after the other, in chunks of `size` (the last shorter): views of the parts, but for a
    chunk across two of them, which is copied."""
    chunks: list[memoryview | bytes] = []
    pending: list[memoryview] = []  # the pieces of a chunk that spans parts
    have = 0
    for part in parts:
        at = 0
        while at < len(part):
            take = min(size - have, len(part) - at)
            piece = part[at:at + take]
            at += take
            if not pending and take == size:
                chunks.append(piece)
                continue
            pending.append(piece)
            have += take
            if have == size:
                chunks.append(b"".join(pending))
                pending, have = [], 0
    if pending:
        chunks.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return chunks
