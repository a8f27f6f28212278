"""Moving live sessions between workers: the broker's half (the workers' is worker.serve.moves).

One move takes session X from its source worker S to a target T serving the same model:

    broker -> S   MOVE                 (the broker holds X's new requests from now on)
    S -> broker -> T  MOVE_STATE, MOVE_CHUNK...  (once no request of X runs on S; the broker relays them unread)
    T -> broker   MOVE_REPORT imported (T checked the digest and holds X in its table; nothing is routed to it yet)
    broker -> S   MOVE_END release
    S -> broker   MOVE_REPORT released (S closed X)
                  the broker routes X to T and sends it the held requests: the move is done

The route switches only once S has closed X, and nothing is routed to T's copy before that, so at any moment the
copies of X that exist hold the same state, and at most one of them is routed to. Every failure ends the move:

- T fails (checksum or layout mismatch, no room) or dies before it imported X: S keeps X (MOVE_END abort to S), the
  held requests go to S. A T that comes back holding X is told to drop it.
- S fails (X lost there) or dies before the release: X answers session_lost (as any session of a dead worker); T is
  told to abort (it closes what it imported, then reports aborted).
- S dies after the release was sent: T holds the only copy that can still be routed to: the move is done. T dies
  after the release was sent: S closes X (the release reached it first): X answers session_lost.
- A move that has not reached the release in `MOVE_TIMEOUT_S`: T is told to abort, and S gets X back only once T has
  reported `aborted` (or is gone), so no copy that might be routed to later is left behind.
- A release or abort whose report has not come in `MOVE_END_RESEND_S` is sent again (a send to a worker can be lost,
  and so can its report): a worker answers a repeated MOVE_END as it answered the first.
- The broker restarts mid-move: the new one knows no move. Both workers list X in their READY with the same state;
  the first to register keeps it and the other is told to drop it (a session two workers claim is always dropped on
  the second), and each worker forgets its moves when it registers with a new broker.

Moves come in jobs: a draining worker's evacuation (it asked by saying `draining` in its heartbeat), `broker drain
WORKER`, `broker rebalance`. A job starts at most `per_source` (--moves-per-worker) moves at a time from one worker (each holds a
copy of a session's state in flight), each to the worker of the model with the most free slots at that moment, and
ends when its moves have: a draining worker is then told EVACUATED, a DRAIN or REBALANCE is answered.

Pure logic like the router: it returns nothing and sends through the router's callbacks.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import structlog

from broker.common import protocol as p
from broker.registry import Gone, Registry, SessionRecord, WorkerRecord

log = structlog.get_logger()

DEFAULT_MOVES_PER_SOURCE = 4  # moves running at once from one worker (broker --moves-per-worker): each holds a
# session's state in flight
MOVE_TIMEOUT_S = 30.0  # a move that has not reached its release by then is aborted
MOVE_END_RESEND_S = 5.0  # a release or abort not reported on by then is sent again (a send can be lost; workers answer
# a repeated one as they did the first)
MAX_HELD_PER_MOVE = 1024  # requests held for one moving session; past this they are refused (retry)
PAUSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


Held = tuple[bytes, p.SessionRequest, str]  # a request held while its session moves: (route, request, user)


class Phase(Enum):
    SENDING = "sending"  # MOVE sent; the state goes from the source through the broker to the target
    RELEASING = "releasing"  # the target imported it; the source is closing its copy
    ABORTING = "aborting"  # the target was told to abort: the source gets the session back once it has


class Kind(Enum):
    EVACUATE = "evacuate"  # a draining worker's sessions
    DRAIN = "drain"  # broker drain WORKER
    REBALANCE = "rebalance"


@dataclass
class Job:
    kind: Kind
    source: bytes | None  # the worker emptied (EVACUATE, DRAIN); None for a rebalance
    key: tuple[bytes, str] | None = None  # the client request to answer (DRAIN, REBALANCE)
    queue: deque[tuple[str, bytes | None]] = field(default_factory=deque)  # (session, its target or None: any)
    running: set[str] = field(default_factory=set)  # migration ids
    moved: int = 0
    failed: int = 0
    kept: int = 0


@dataclass
class Migration:
    id: str
    session_id: str
    source: bytes
    target: bytes
    started: float
    job: Job
    phase: Phase = Phase.SENDING
    held: list[Held] = field(default_factory=list)
    record: SessionRecord | None = None  # the session's owner, client and length as the move began
    end_sent: float = 0.0  # RELEASING, ABORTING: when the MOVE_END was last sent


@dataclass(slots=True)
class MoveStats:
    """What moves did since the broker started (broker.metrics reads them)."""

    outcomes: dict[str, int] = field(default_factory=dict)  # moved, failed, lost
    pause_buckets: list[int] = field(default_factory=lambda: [0] * len(PAUSE_BUCKETS))
    pause_sum: float = 0.0
    pause_count: int = 0

    def ended(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def paused(self, seconds: float) -> None:
        """A moved session's requests were held this long (from MOVE to the switch)."""
        for i, bound in enumerate(PAUSE_BUCKETS):
            if seconds <= bound:
                self.pause_buckets[i] += 1
        self.pause_sum += seconds
        self.pause_count += 1


class Moves:
    """The moves in flight and the jobs they belong to. The router calls it with what workers and clients say, and
    it sends through `send` (a message to a worker), `route_again` (requests held for a session, routed as if they
    had just come) and `answer` (a DRAIN or REBALANCE is done)."""

    def __init__(self, registry: Registry, send: Callable[[bytes, p.Message | Sequence[p.Frame]], None],
                 route_again: Callable[[list[Held]], None],
                 answer: Callable[[tuple[bytes, str], p.Message], None],
                 per_source: int = DEFAULT_MOVES_PER_SOURCE) -> None:
        self.registry = registry
        self.per_source = per_source
        self._send = send
        self._route_again = route_again
        self._answer = answer
        self.moving: dict[str, Migration] = {}  # session id -> its move
        self._by_id: dict[str, Migration] = {}
        self.jobs: list[Job] = []
        self.stats = MoveStats()

    # -- starting ---------------------------------------------------------------------------------

    def evacuate(self, worker: WorkerRecord, now: float) -> None:
        """A worker drains: move its sessions to the other workers of its model (once; again after a re-register)."""
        if any(j.kind is Kind.EVACUATE and j.source == worker.identity for j in self.jobs):
            return
        self._start_job(Job(Kind.EVACUATE, worker.identity), worker, now)

    def drain(self, worker: WorkerRecord, key: tuple[bytes, str], now: float) -> None:
        worker.cordoned = True
        self._start_job(Job(Kind.DRAIN, worker.identity, key), worker, now)

    def rebalance(self, key: tuple[bytes, str], now: float, idle: Callable[[str], bool]) -> None:
        """Plan moves from the fullest workers (by sessions per slot) to the emptiest of each model, idle sessions
        only, until one more move would not make the spread smaller."""
        job = Job(Kind.REBALANCE, None, key)
        models: dict[str, list[WorkerRecord]] = {}
        for w in self.registry.workers.values():
            if not w.closed and w.capacity > 0:
                models.setdefault(w.model.casefold(), []).append(w)
        for workers in models.values():
            counts = {w.identity: len(w.sessions) for w in workers}
            movable = {w.identity: sorted((sid for sid in w.sessions if sid not in self.moving and idle(sid)),
                                          key=self._idle_first) for w in workers}
            caps = {w.identity: w.capacity for w in workers}
            while True:
                full = max(counts, key=lambda i: counts[i] / caps[i])
                empty = min(counts, key=lambda i: counts[i] / caps[i])
                if full == empty or not movable[full] or counts[empty] + 1 > caps[empty]:
                    break
                if (counts[empty] + 1) / caps[empty] >= counts[full] / caps[full]:
                    break  # one more move would not narrow the spread
                job.queue.append((movable[full].pop(0), empty))
                counts[full] -= 1
                counts[empty] += 1
        self.jobs.append(job)
        log.info("rebalance_planned", moves=len(job.queue))
        self.pump(now)

    def _idle_first(self, session_id: str) -> float:
        known = self.registry.session(session_id)
        return 0.0 if known is None else known.used_at

    def _start_job(self, job: Job, worker: WorkerRecord, now: float) -> None:
        job.queue.extend((sid, None) for sid in sorted(worker.sessions, key=self._idle_first)
                         if sid not in self.moving)
        self.jobs.append(job)
        log.info("sessions_moving_off", worker=worker.name, why=job.kind.value, sessions=len(job.queue))
        self.pump(now)

    def pump(self, now: float) -> None:
        """Start what the jobs have queued, within `per_source` moves per source; end the jobs that are done."""
        for job in list(self.jobs):
            while job.queue:
                sid, target_id = job.queue[0]
                source = self.registry.worker_of(sid)
                if source is None or sid in self.moving or (job.source is not None and source.identity != job.source):
                    job.queue.popleft()  # closed, lost or moved meanwhile
                    continue
                if self._running_from(source.identity) >= self.per_source:
                    break
                job.queue.popleft()
                target = self._target(source, target_id)
                if target is None:
                    job.kept += 1
                    continue
                self._start(job, sid, source, target, now)
            if not job.queue and not job.running:
                self._finish(job)

    def _running_from(self, identity: bytes) -> int:
        return sum(1 for m in self._by_id.values() if m.source == identity)

    def _target(self, source: WorkerRecord, wanted: bytes | None) -> WorkerRecord | None:
        """Where a session of `source` can go: `wanted` if it still can take one, else the worker of its model (not
        draining, not drained) with the most free slots, if it has one."""
        candidates = [w for w in self.registry.workers.values()
                      if w.identity != source.identity and w.model.casefold() == source.model.casefold()
                      and not w.closed and w.free > 0]
        if wanted is not None:
            candidates = [w for w in candidates if w.identity == wanted]
        if not candidates:
            return None
        return max(candidates, key=lambda w: (w.free, -len(w.sessions), w.identity))

    def _start(self, job: Job, session_id: str, source: WorkerRecord, target: WorkerRecord, now: float) -> None:
        migration = Migration(f"mv-{secrets.token_hex(8)}", session_id, source.identity, target.identity, now, job,
                              record=self.registry.session(session_id))
        self.moving[session_id] = migration
        self._by_id[migration.id] = migration
        job.running.add(migration.id)
        target.pending += 1  # its slot is promised until the move ends
        log.info("session_moving", session=session_id, source=source.name, target=target.name,
                 migration=migration.id)
        self._send(source.identity, p.Move(migration=migration.id, session_id=session_id, target=target.name,
                                           checkpoint=target.checkpoints))

    # -- while it runs ----------------------------------------------------------------------------

    def hold(self, route: bytes, request: p.SessionRequest, user: str) -> p.Error | None:
        """Keep a request for a moving session until the move ends (a resend replaces the request it repeats). An
        error to answer instead when too many wait."""
        migration = self.moving[request.session_id]
        held = migration.held
        for i, (r, earlier, _) in enumerate(held):
            if r == route and earlier.request_id == request.request_id:
                held[i] = (route, request, user)
                return None
        if len(held) >= MAX_HELD_PER_MOVE:
            return p.Error(request_id=request.request_id, code=p.ErrorCode.INTERNAL,
                           message="the session is moving to another worker and too many requests wait: retry")
        held.append((route, request, user))
        return None

    def relay(self, record: WorkerRecord, command: p.Command, frames: Sequence[p.Frame]) -> str | None:
        """MOVE_STATE or MOVE_CHUNK from a worker: forwarded unread to its move's target. Why not, else None."""
        try:
            header = p.decode_envelope(frames[:3]).header
        except p.ProtocolError as e:
            return e.message
        mid = header.get("migration")
        migration = self._by_id.get(mid) if isinstance(mid, str) else None
        if migration is None or migration.source != record.identity or migration.phase is not Phase.SENDING:
            return f"{command.name} for no move of this worker's"
        if command is p.Command.MOVE_STATE and header.get("session_id") != migration.session_id:
            return "MOVE_STATE for another session than its move's"
        self._send(migration.target, frames)  # relayed as they came, unread
        return None

    def report(self, record: WorkerRecord, message: p.MoveReport, now: float) -> str | None:
        """A worker's MOVE_REPORT. Why it is not used, else None."""
        migration = self._by_id.get(message.migration)
        if migration is None or migration.session_id != message.session_id:
            return None if message.status in ("aborted", "released") else "a report for no move"  # a late echo
        side = "source" if record.identity == migration.source else "target" if record.identity == migration.target \
            else None
        if side is None:
            return "a report about another worker's move"
        status = message.status
        if side == "target" and status == "imported" and migration.phase is Phase.SENDING:
            migration.phase = Phase.RELEASING
            self._send_end(migration, now)
        elif side == "source" and status == "released" and migration.phase is Phase.RELEASING:
            self._commit(migration, now)
        elif side == "target" and status in ("failed", "aborted") and migration.phase is not Phase.RELEASING:
            log.warning("session_move_failed", session=migration.session_id, side=side, code=_code(message),
                        error=message.message[:256], migration=migration.id)
            self._give_back(migration, now)
        elif side == "source" and status == "failed" and migration.phase is Phase.SENDING:
            log.warning("session_move_failed", session=migration.session_id, side=side, code=_code(message),
                        error=message.message[:256], migration=migration.id)
            self._abort_target(migration, now)
        self.pump(now)  # the next moves start; a job whose moves have all ended is answered
        return None

    def tick(self, now: float) -> None:
        for migration in list(self._by_id.values()):
            if migration.phase is Phase.SENDING and now - migration.started > MOVE_TIMEOUT_S:
                log.warning("session_move_timed_out", session=migration.session_id, migration=migration.id,
                            seconds=round(now - migration.started, 3))
                self._abort_target(migration, now)
            elif migration.phase is not Phase.SENDING and now - migration.end_sent > MOVE_END_RESEND_S:
                log.warning("session_move_end_resent", session=migration.session_id, migration=migration.id,
                            phase=migration.phase.value, seconds=round(now - migration.started, 3))
                self._send_end(migration, now)
        self.pump(now)

    def _send_end(self, migration: Migration, now: float) -> None:
        """The MOVE_END its phase waits on: the release to the source, or the abort to the target."""
        releasing = migration.phase is Phase.RELEASING
        migration.end_sent = now
        self._send(migration.source if releasing else migration.target,
                   p.MoveEnd(migration=migration.id, session_id=migration.session_id,
                             outcome="release" if releasing else "abort"))

    def worker_gone(self, identity: bytes, now: float) -> tuple[list[str], list[Held]]:
        """A worker is gone (call before the registry forgets it). Its moves end. Returns the sessions it may hold a
        copy of that are not its own (to be dropped should it come back), and the requests held for its moves, to be
        routed again once the registry has forgotten it."""
        copies: list[str] = []
        held: list[Held] = []
        route_again, self._route_again = self._route_again, held.extend
        for migration in list(self._by_id.values()):
            if migration.target == identity:
                copies.append(migration.session_id)
                if migration.phase is Phase.RELEASING:  # the source closes it: nothing of it is left
                    self._end(migration, "lost", now)
                    self.registry.drop_session(migration.session_id, Gone.LOST)
                    self._route_again(migration.held)
                else:
                    self._give_back(migration, now)
            elif migration.source == identity:
                if migration.phase is Phase.RELEASING:  # the target holds the only copy that can be routed to
                    self._commit(migration, now)
                else:
                    self._abort_target(migration, now, source_gone=True)
        for job in list(self.jobs):
            if job.source == identity:
                job.kept += len(job.queue)
                job.queue.clear()
        self._route_again = route_again
        return copies, held  # (the next tick starts what is queued: the registry still holds this worker now)

    def claimed_by_target(self, identity: bytes, session_id: str) -> bool:
        """Whether `identity` is the target of the session's move (its READY may list the copy it imported)."""
        migration = self.moving.get(session_id)
        return migration is not None and migration.target == identity

    # -- ending -----------------------------------------------------------------------------------

    def _commit(self, migration: Migration, now: float) -> None:
        """The source closed its copy (or is gone): the session is the target's from now on."""
        self._end(migration, "moved", now)
        known = migration.record
        if self.registry.session(migration.session_id) is None and known is not None:  # the source re-registered
            self.registry.add_session(migration.target, migration.session_id, known.owner, known.client, now,
                                      known.length)  # without it meanwhile (it had closed it)
        self.registry.move_session(migration.session_id, migration.target)
        pause = now - migration.started
        self.stats.paused(pause)
        target = self.registry.workers.get(migration.target)
        log.info("session_moved", session=migration.session_id, target=target.name if target else "?",
                 pause_ms=round(pause * 1e3, 3), held=len(migration.held), migration=migration.id)
        self._route_again(migration.held)

    def _give_back(self, migration: Migration, now: float) -> None:
        """The target has no copy (it failed, aborted or is gone): the source keeps the session."""
        self._end(migration, "failed", now)
        if migration.source in self.registry.workers:
            self._send(migration.source, p.MoveEnd(migration=migration.id, session_id=migration.session_id,
                                                   outcome="abort"))
        self._route_again(migration.held)

    def _abort_target(self, migration: Migration, now: float, source_gone: bool = False) -> None:
        """Tell the target to forget the move; the source gets the session back once it has (see report)."""
        if source_gone:  # the session is lost with its source; the target only has to drop what it got
            self._end(migration, "lost", migration.started)
            if migration.target in self.registry.workers:
                self._send(migration.target, p.MoveEnd(migration=migration.id, session_id=migration.session_id,
                                                       outcome="abort"))
            self._route_again(migration.held)  # the session is gone with its worker: they answer session_lost
            return
        if migration.phase is Phase.ABORTING:
            return
        migration.phase = Phase.ABORTING
        self._send_end(migration, now)

    def _end(self, migration: Migration, outcome: str, now: float) -> None:
        self.moving.pop(migration.session_id, None)
        self._by_id.pop(migration.id, None)
        target = self.registry.workers.get(migration.target)
        if target is not None:
            target.pending = max(0, target.pending - 1)
        job = migration.job
        job.running.discard(migration.id)
        if outcome == "moved":
            job.moved += 1
        else:
            job.failed += 1
        self.stats.ended(outcome)

    def _finish(self, job: Job) -> None:
        self.jobs.remove(job)
        source = self.registry.workers.get(job.source) if job.source is not None else None
        if source is not None:
            job.kept = len(source.sessions)
        log.info("sessions_moved_off", why=job.kind.value, worker=source.name if source else None, moved=job.moved,
                 failed=job.failed, kept=job.kept)
        if job.kind is Kind.EVACUATE and source is not None:
            self._send(source.identity, p.Evacuated(moved=job.moved, kept=job.kept))
        if job.key is not None:
            self._answer(job.key, p.MovesDone(request_id=job.key[1], moved=job.moved, failed=job.failed,
                                              kept=job.kept))


def _code(message: p.MoveReport) -> str | None:
    return None if message.code is None else message.code.value
