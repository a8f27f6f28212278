"""What is fuzzed: a `Target` fires cases at one socket and checks at every checkpoint; `ClientSocket` (the
broker's client socket), `WorkerSocket` (the broker's worker socket, from fake workers), `HostilePeers` (the same
socket from peers that answer without registering, oversized READYs, FANOUTs with bad parts) and `WorkerLink` (a
real worker, from a fake broker)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import zmq
from hypothesis import strategies as st

from broker.admission import DEFAULT_MAX_WORKER_SESSIONS, READY_BURST, Admission
from broker.common import protocol as p
from client import ClientError
from client.stack import Daemon

from .checks import (
    ANSWER_WAIT_S,
    GOOD_PROMPT,
    GOOD_TOKENS,
    MESSAGE_KEY_CHARS,
    ErrorKey,
    FuzzFailure,
    Report,
    RoutedErrorKey,
    client_error,
    decodes,
    describe,
    forwarded_to,
    show_frames,
    tracebacks,
    worker_error,
)
from .stack import HEARTBEAT_MS
from .strategies import (
    Case,
    Frames,
    client_cases,
    hostile_cases,
    oversized_readies,
    worker_link_cases,
    worker_socket_cases,
)

if TYPE_CHECKING:
    from .stack import FuzzStack

TargetT = TypeVar("TargetT", bound="Target")

VICTIMS = 3  # live sessions of another client that the fuzzer addresses
SPARE_SESSIONS = 16  # sessions the fuzz cases may make before they are closed, mid-batch if need be


class Target:
    """One thing under fuzz: `fire` sends a case, `checkpoint` checks everything (every `batch` cases), `finish`
    makes the final checks. A context manager: leaving it releases the target's sockets, pass or fail."""

    name = "target"

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        self.stack = stack
        self.known = stack.known()
        self.batch = batch
        self.report = Report(self.name)
        self.failure: FuzzFailure | None = None
        self.created: set[str] = set()  # sessions the fuzz cases made (from the answers), closed before they pile up
        self._recent: list[Case] = []

    def strategy(self) -> st.SearchStrategy[Case]:
        raise NotImplementedError

    def fire(self, case: Case) -> None:
        if self.failure is not None:  # hypothesis replays a failing case: the live system has not healed since
            raise self.failure
        self._recent.append(case)
        for _ in range(case.times):
            self._send(case.frames, case.peer)
        if case.then is not None:
            self._send(case.then, case.peer)
        self.report.cases += 1
        self._pump(0)
        if len(self._recent) >= self.batch:
            self.checkpoint()
        elif len(self.created) >= SPARE_SESSIONS:  # keep a slot for the good session's fork
            self._close_created()

    def checkpoint(self) -> None:
        """Check everything, clean up what the cases left, start a new batch."""
        self._check()
        self._recent = []
        self.report.checkpoints += 1

    def finish(self) -> None:
        """A last checkpoint, then the target's final checks."""
        if self._recent:
            self.checkpoint()

    def release(self) -> None:
        """Close what the target opened, after `finish` or after a failure (on leaving the `with`)."""

    def __enter__(self: TargetT) -> TargetT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _naming(self, answer: p.Error) -> str:
        """The cases of this batch whose frames name the answer's request id (the likely culprits)."""
        rid = (answer.request_id or "").encode()
        named = [c for c in self._recent if rid and any(rid in f for f in [*c.frames, *(c.then or [])])]
        return "".join(f"\n  sent as {show_frames(c.frames)}" + (f" then {show_frames(c.then)}" if c.then else "")
                       for c in named[-3:])

    def fail(self, what: str, daemons: Sequence[Daemon] = ()) -> FuzzFailure:
        """The failure to raise: the check, the batch's last cases, the daemons' tracebacks. Sticky (see fire)."""
        batch = "\n".join(f"  {show_frames(c.frames)} x{c.times} peer {c.peer}"
                          + (f" then {show_frames(c.then)}" if c.then else "") for c in self._recent[-40:])
        logs = "\n".join(f"--- {d.log.name} (alive: {d.alive}) ---\n{tracebacks(d)}" for d in daemons)
        self.failure = FuzzFailure(f"{self.name}: {what}\nlast cases of the batch:\n{batch}\n{logs}")
        return self.failure

    def _send(self, frames: Frames, peer: int) -> None:
        raise NotImplementedError

    def _pump(self, timeout_ms: int) -> None:
        raise NotImplementedError

    def _check(self) -> None:
        raise NotImplementedError

    def _close_created(self) -> None:
        """Close the sessions the fuzz cases made; remember a few as stale ids to address."""
        for sid in sorted(self.created):
            self._close_session(sid)
        self.known.stale[:] = sorted(self.created)[-8:] or self.known.stale
        self.created.clear()

    def _close_session(self, sid: str) -> None:
        raise NotImplementedError

    def _wait(self, done: Callable[[], bool], timeout_s: float = ANSWER_WAIT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self._pump(20)
        return True


def _dealer(context: zmq.Context[zmq.Socket[bytes]], address: str, identity: bytes) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


class ReadyLedger:
    """Each peer's READYs and the broker's answers to them: every READY gets its WELCOME (admissible) or ERROR
    (refused), in order; one may go unanswered only when the peer had sent READY_BURST - 1 others (well formed or
    not) in the 2 s before it (the broker's per-peer rate)."""

    def __init__(self, peers: int) -> None:
        self.readies: list[list[tuple[float, str]]] = [[] for _ in range(peers)]  # (sent at, answer due)
        self.answers: list[list[str]] = [[] for _ in range(peers)]  # WELCOME or ERROR, as they came
        self.sent: list[list[float]] = [[] for _ in range(peers)]  # every READY sent in the last 2 s

    def sent_ready(self, peer: int, frames: Frames, due: str | None) -> None:
        """A READY command went out (`due`: the answer it calls for; None when it does not decode: none)."""
        now = time.monotonic()
        self.sent[peer].append(now)  # any READY, well formed or not, takes from its rate
        if due is not None:
            self.readies[peer].append((now, due))

    def problem(self, peer: int) -> str | None:
        sent, got = self.readies[peer], self.answers[peer]
        j, skipped = 0, []
        for at, kind in sent:
            if j < len(got) and got[j] == kind:
                j += 1
            else:
                skipped.append(at)
        if j < len(got):
            return f"peer {peer} got READY answers {got}, its READYs called for {[k for _, k in sent]}"
        for at in skipped:
            if sum(1 for t in self.sent[peer] if at - 2.0 <= t < at) < READY_BURST - 1:
                return f"peer {peer}: a READY was not answered ({len(got)} answers to {len(sent)} READYs)"
        return None

    def settle(self, report: Report) -> None:
        """At a checkpoint: count what went unanswered (over the rate), keep 2 s of history, start afresh."""
        now = time.monotonic()
        for peer, readies in enumerate(self.readies):
            report.answers["READY unanswered (rate)"] += len(readies) - len(self.answers[peer])
            report.answers["READY refused"] += self.answers[peer].count("ERROR")
            self.sent[peer] = [t for t in self.sent[peer] if now - t < 2.0]
            readies.clear()
            self.answers[peer].clear()


def _connect(bystander: zmq.Socket[bytes]) -> None:
    """A ROUTER knows a peer only once it has sent something: a STATUS, and its answer."""
    bystander.send_multipart(p.encode(p.Status(request_id="hello")))
    if not bystander.poll(10_000, zmq.POLLIN):
        raise FuzzFailure("the broker does not answer STATUS")
    bystander.recv_multipart()


def _recv_all(sock: zmq.Socket[bytes], timeout_ms: int) -> list[Frames]:
    out: list[Frames] = []
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return out
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out


class ClientSocket(Target):
    """The broker's client socket. Every message the protocol rejects must come back as its typed error; valid
    requests run on the real worker. The fuzzer's own sessions are closed at every checkpoint and the other
    client's sessions it addresses (victims) made again, so that capacity never runs out."""

    name = "broker client socket"

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.route = b"fz" + uuid.uuid4().bytes
        self.sock = _dealer(self.context, stack.cluster.clients, self.route)
        self.victim_client = stack.cluster.client()
        self.expected: Counter[ErrorKey] = Counter()
        self.errors: Counter[ErrorKey] = Counter()
        self.known.routes[:] = [self.route, stack.good.route]
        try:
            self._renew_victims()
        except BaseException:
            self.release()
            raise

    def strategy(self) -> st.SearchStrategy[Case]:
        return client_cases(self.known)

    def _send(self, frames: Frames, peer: int) -> None:
        self.sock.send_multipart(frames)
        expected = client_error(frames)
        if expected is not None:
            self.expected[expected] += 1

    def _pump(self, timeout_ms: int) -> None:
        for frames in _recv_all(self.sock, timeout_ms):
            message = decodes(frames)
            self.report.answers[describe(message, frames)] += 1
            if message is None:
                self.report.notes.append(f"undecodable answer from the broker: {show_frames(frames)}")
            elif isinstance(message, p.Error):
                self.errors[message.code.value, message.request_id, message.message[:MESSAGE_KEY_CHARS]] += 1
                if message.code is p.ErrorCode.INTERNAL:
                    self.report.notes.append(f"an internal error answers a fuzz case: {message}{self._naming(message)}")
            elif isinstance(message, p.Created):
                self.created.add(message.session_id)
            elif isinstance(message, p.Forked):
                self.created.add(message.child_id)

    def _check(self) -> None:
        if not self._wait(lambda: not (self.expected - self.errors)):
            missing = dict((self.expected - self.errors).most_common(8))
            raise self.fail(f"errors never answered (code, request id, message): {missing}", self.stack.daemons())
        self.errors.clear()  # the rest are a worker's refusals of valid requests
        self.expected.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], self.stack.daemons())
        self.stack.check_alive(self)
        self.stack.check_good(self)
        self._cleanup()

    def _cleanup(self) -> None:
        self._close_created()
        self._renew_victims()

    def _renew_victims(self) -> None:
        for sid in list(self.known.sessions):
            self._close_session(sid)
        fresh = []
        for _ in range(VICTIMS):
            try:
                session = self.victim_client.session()
                session.append(token_ids=list(GOOD_PROMPT))
            except ClientError as e:
                raise self.fail(f"a victim session could not be made: {e.code}: {e}", self.stack.daemons()) from e
            fresh.append(session.id)
        self.known.sessions[:] = fresh

    def _close_session(self, sid: str) -> None:
        try:
            self.victim_client.attach(sid).close()
        except ClientError:
            pass  # already closed by a fuzz case

    def finish(self) -> None:
        """Close every session the fuzzer made or touched: then the broker must count the good session alone."""
        super().finish()
        self._wait(lambda: False, 0.3)  # late answers: creates that finished after the last checkpoint
        self._cleanup()
        for sid in self.known.sessions:
            self._close_session(sid)
        self.known.sessions[:] = [uuid.uuid4().hex]
        with self.stack.good.paused():
            self.stack.check_accounting(self)

    def release(self) -> None:
        self.victim_client.close()
        self.sock.close(linger=0)
        self.context.term()


class WorkerSocket(Target):
    """The broker's worker socket, from fake workers. An admissible READY is welcomed, one the broker's admission
    refuses (more slots or sessions than it takes, too long) is answered with its ERROR; an answer routed to a real
    client (the bystander, a DEALER on the client socket) arrives there untouched if its fake is registered, and never
    if it is not; everything the broker sends decodes. A fake that registers is a legitimate peer (no auth) and may be
    chosen for a new session: during every batch the bystander has one CREATE in flight, and it must be answered
    (created, on the real worker or placed again once the fake that got it leaves or falls silent). The good session
    lives on the real worker from before and must not notice.

    Whether a fake is registered is what its messages make it: an admissible READY registers it, a DISCONNECT ends
    it. The broker may also end it on its own (a fake silent for the stack's silence window), or not take a READY
    over its rate: then it drops the fake's answers and tells the fake so, with RECONNECT (or DROP, for an answer about
    a session it declared lost). So an answer a registered fake sent must reach the bystander unless the broker told
    that fake one of those since shortly before the batch began; an answer sent while the fake was not registered
    must never arrive."""

    name = "broker worker socket"
    PEERS = 3
    EXPLAINED_S = 1.0  # a RECONNECT or DROP this long before a batch explains the drops of that batch too

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.fakes = [
            _dealer(self.context, stack.cluster.workers_address, f"fake{i}-{uuid.uuid4().hex[:8]}".encode())
            for i in range(self.PEERS)
        ]
        self.bystander_route = b"by" + uuid.uuid4().bytes
        self.bystander = _dealer(self.context, stack.cluster.clients, self.bystander_route)
        try:
            _connect(self.bystander)
        except BaseException:
            self.release()
            raise
        self.known.routes[:] = [self.bystander_route, stack.good.route]
        self.known.sessions[:] = [stack.good.session_id]  # the good session is held by the real worker
        self.admission = Admission(HEARTBEAT_MS / 1000, DEFAULT_MAX_WORKER_SESSIONS)
        self.registered = [False] * self.PEERS
        self.ledger = ReadyLedger(self.PEERS)
        self.told_at = [-1e9] * self.PEERS  # when the broker last told the fake it dropped its messages
        self.batch_started = time.monotonic()
        self.forward_expected: list[tuple[int, tuple[bytes, ...]]] = []  # (peer, frames) sent while registered
        self.forwarded: Counter[tuple[bytes, ...]] = Counter()
        self.own: dict[str, p.Message | None] = {}  # the bystander's own requests -> their answers
        self.create_id = self._start_create()

    def strategy(self) -> st.SearchStrategy[Case]:
        return worker_socket_cases(self.known, self.PEERS)

    def _send(self, frames: Frames, peer: int) -> None:
        self.fakes[peer].send_multipart(frames)
        message = decodes(frames)
        if _command(frames) is p.Command.READY:
            self.ledger.sent_ready(peer, frames, _ready_answer(self.admission, frames, message))
        if isinstance(message, p.Ready):
            if _ready_answer(self.admission, frames, message) == "WELCOME":
                self.registered[peer] = True
        elif isinstance(message, p.Disconnect):
            self.registered[peer] = False
        if forwarded_to(frames) == self.bystander_route and self.registered[peer]:
            self.forward_expected.append((peer, tuple(frames)))

    def _pump(self, timeout_ms: int) -> None:
        for i, fake in enumerate(self.fakes):
            for frames in _recv_all(fake, timeout_ms if i == 0 else 0):
                message = decodes(frames)
                self.report.answers[describe(message, frames)] += 1
                if not isinstance(message, (p.Welcome, p.Reconnect, p.Heartbeat, p.Drop, p.Error, *p.REQUEST_TYPES)):
                    self.report.notes.append(f"fake worker {i} got {show_frames(frames)}")
                if isinstance(message, p.Error) and message.request_id is None:  # a READY refused
                    self.ledger.answers[i].append("ERROR")
                elif isinstance(message, p.Welcome):
                    self.ledger.answers[i].append("WELCOME")
                elif isinstance(message, (p.Reconnect, p.Drop)):
                    self.told_at[i] = time.monotonic()
        for frames in _recv_all(self.bystander, 0):
            message = decodes(frames)
            if isinstance(message, p.Lease):  # the broker's probe of a client holding sessions: not an answer
                continue
            rid = getattr(message, "request_id", None)
            if rid in self.own:
                self.own[rid] = message
            else:
                self.forwarded[tuple(frames)] += 1
                self.report.answers["forwarded"] += 1

    def _outstanding(self) -> tuple[list[tuple[int, tuple[bytes, ...]]], Counter[tuple[bytes, ...]]]:
        """(expected forwards that did not arrive, forwards nobody expected)."""
        left = Counter(self.forwarded)
        missing = []
        for peer, frames in self.forward_expected:
            if left[frames] > 0:
                left[frames] -= 1
            else:
                missing.append((peer, frames))
        return missing, +left

    def _explained(self, peer: int) -> bool:
        return self.told_at[peer] >= self.batch_started - self.EXPLAINED_S

    def _check(self) -> None:
        def settled() -> bool:
            missing, _ = self._outstanding()
            return (not any(self.ledger.problem(i) for i in range(self.PEERS))
                    and all(self._explained(peer) for peer, _ in missing))

        done = self._wait(settled)
        missing, extra = self._outstanding()
        if not done:
            unexplained = [f"fake {peer}: {show_frames(list(f))}" for peer, f in missing if not self._explained(peer)][:5]
            problems = [q for i in range(self.PEERS) if (q := self.ledger.problem(i))]
            now = time.monotonic()
            state = [(self.registered[i], round(self.told_at[i] - self.batch_started, 3)) for i in range(self.PEERS)]
            raise self.fail(f"{problems}; answers of registered fakes not forwarded to the bystander: {unexplained}; "
                            f"(registered, told at since the batch began) per fake {state}, batch began "
                            f"{now - self.batch_started:.1f} s ago", self.stack.daemons())
        self._pump(50)
        missing, extra = self._outstanding()
        problems = [q for i in range(self.PEERS) if (q := self.ledger.problem(i))]
        if extra or problems:
            raise self.fail(f"unexpected: forwarded {[show_frames(list(f)) for f in extra][:5]}; {problems}",
                            self.stack.daemons())
        self.ledger.settle(self.report)
        self.report.answers["dropped, the fake told"] += len(missing)
        self.forwarded.clear()
        self.forward_expected.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], self.stack.daemons())
        self.stack.check_alive(self)
        self.stack.check_good(self)
        self._settle_create()
        self.create_id = self._start_create()
        self.batch_started = time.monotonic()

    def _start_create(self) -> str:
        """The bystander's CREATE for the next batch: placed on the real worker or on a fake, answered later."""
        request = p.CreateSession(request_id=uuid.uuid4().hex)
        self.own[request.request_id] = None
        self.bystander.send_multipart(p.encode(request))
        return request.request_id

    def _settle_create(self) -> None:
        created = self._answer_to(self.create_id, "CREATE")
        if isinstance(created, p.Created):
            close = p.Close(request_id=uuid.uuid4().hex, session_id=created.session_id)
            self.own[close.request_id] = None
            self.bystander.send_multipart(p.encode(close))
            self._answer_to(close.request_id, "CLOSE")

    def _answer_to(self, request_id: str, what: str) -> p.Message:
        """The final answer to a request of the bystander's own, whichever worker (real or fake) it went to."""
        if not self._wait(lambda: self.own[request_id] is not None):
            raise self.fail(f"the bystander's {what} {request_id} was never answered", self.stack.daemons())
        answer = self.own.pop(request_id)
        assert answer is not None
        self.report.answers[f"bystander {describe(answer, [])}"] += 1
        return answer

    def finish(self) -> None:
        """The fakes fall silent: the broker must forget them and list the real worker alone."""
        super().finish()
        self._settle_create()
        self.stack.check_workers(self, {self.stack.worker_name})

    def release(self) -> None:
        for sock in (*self.fakes, self.bystander):
            sock.close(linger=0)
        self.context.term()


class WorkerLink(Target):
    """A real worker process driven by a fake broker (a ROUTER the worker connects to). A broken request whose
    header names a route and a request id is answered with its error; everything the worker sends decodes; it keeps
    heartbeating and registering; between batches a good session on it generates the tokens it did before."""

    name = "worker link"
    BROKER_ID = "fuzzbroker"
    GOOD_ROUTE = b"good"
    JANITOR_ROUTE = b"janitor"

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.daemon = stack.lone
        self.sock = stack.lone_router
        self.identity = b""
        self.last_beat = 0.0
        self._next_beat = 0.0
        self._seq = 0
        self._mail: dict[tuple[bytes, str], list[p.Message]] = {}
        self.expected: Counter[RoutedErrorKey] = Counter()
        self.errors: Counter[RoutedErrorKey] = Counter()
        self.known.routes[:] = [b"fz-a", b"fz-b", self.GOOD_ROUTE]
        self.known.names[:] = [stack.lone_name]
        if not self._wait(lambda: bool(self.identity), 60.0):
            raise self.fail("the worker never sent READY", [self.daemon])
        self.good_session = uuid.uuid4().hex
        self._call(p.CreateSession(request_id=self._rid(), session_id=self.good_session), p.Created)
        self._call(p.Append(request_id=self._rid(), session_id=self.good_session, token_ids=GOOD_PROMPT), p.Appended)
        self.expected_tokens, _ = self._good_round(stream=False)
        self.known.sessions[:] = self._victims()

    def strategy(self) -> st.SearchStrategy[Case]:
        return worker_link_cases(self.known)

    # -- the fake broker --

    def _rid(self) -> str:
        self._seq += 1
        return f"fuzzbroker-{self._seq}"

    def _to_worker(self, frames: Frames) -> None:
        try:
            self.sock.send_multipart([self.identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise self.fail(f"the worker cannot be reached ({e})", [self.daemon]) from e

    def _send(self, frames: Frames, peer: int) -> None:
        self._to_worker(frames)
        expected = worker_error(frames)
        if expected is not None:
            self.expected[expected] += 1

    def _pump(self, timeout_ms: int) -> None:
        now = time.monotonic()
        if self.identity and now >= self._next_beat:
            self._to_worker(p.encode(p.Heartbeat(broker_id=self.BROKER_ID)))
            self._next_beat = now + HEARTBEAT_MS / 1000
        for identity, *frames in _recv_all(self.sock, timeout_ms):
            message = decodes(frames)
            self.report.answers[describe(message, frames)] += 1
            if message is None:
                self.report.notes.append(f"undecodable message from the worker: {show_frames(frames)}")
                continue
            if isinstance(message, p.Ready):
                self.identity = identity
                self._welcome()
            elif isinstance(message, p.Heartbeat):
                self.last_beat = time.monotonic()
            route: bytes = getattr(message, "route", b"")
            if isinstance(message, p.Error):
                self.errors[message.route, message.code.value, message.request_id, message.message[:MESSAGE_KEY_CHARS]] += 1
                if message.code is p.ErrorCode.INTERNAL:  # bad input gets a typed error, never "internal"
                    self.report.notes.append(f"an internal error answers a fuzz case: {message}{self._naming(message)}")
            ours = route in (self.GOOD_ROUTE, self.JANITOR_ROUTE)  # fuzz cases may use the good route too: no matter
            if isinstance(message, p.Created) and not ours:
                self.created.add(message.session_id)
            elif isinstance(message, p.Forked) and not ours:
                self.created.add(message.child_id)
            rid = getattr(message, "request_id", None)
            if isinstance(message, p.Chunks):
                for chunk in message.chunks:
                    self._deliver((route, chunk.request_id), message)
            elif rid is not None:
                self._deliver((route, rid), message)

    def _deliver(self, key: tuple[bytes, str], message: p.Message) -> None:
        """Into the mailbox of a call of ours (the good session's and the janitor's requests)."""
        box = self._mail.get(key)
        if box is not None:
            box.append(message)

    def _welcome(self) -> None:
        self._to_worker(p.encode(p.Welcome(broker_id=self.BROKER_ID, heartbeat_ms=HEARTBEAT_MS, liveness=3)))

    def _call(self, request: p.Message, kind: type[p.Message], route: bytes = GOOD_ROUTE) -> p.Message:
        """Send a request as the broker would and wait for its final answer."""
        rid: str = request.request_id  # type: ignore[attr-defined]  # every request has one
        self._mail[route, rid] = []
        self._to_worker(p.encode(request.routed(route)))
        box = self._mail[route, rid]

        def final() -> bool:
            return any(not isinstance(m, p.Chunks) for m in box)

        if not self._wait(final):
            raise self.fail(f"no answer to {request}", [self.daemon])
        answer = next(m for m in box if not isinstance(m, p.Chunks))
        if not any(isinstance(m, p.Chunks) for m in box):
            del self._mail[route, rid]
        if not isinstance(answer, kind):
            raise self.fail(f"{type(request).__name__} got {answer}, expected {kind.__name__}", [self.daemon])
        return answer

    def _good_round(self, stream: bool) -> tuple[list[int], list[int]]:
        """Fork the good session, generate from the fork, close it: (final tokens, streamed tokens)."""
        child = uuid.uuid4().hex
        self._call(p.Fork(request_id=self._rid(), session_id=self.good_session, child_id=child), p.Forked)
        rid = self._rid()
        params = p.Sampling(max_tokens=GOOD_TOKENS, ignore_eos=True)
        answer = self._call(p.Generate(request_id=rid, session_id=child, params=params, stream=stream), p.Generated)
        streamed = [t for m in self._mail.pop((self.GOOD_ROUTE, rid), []) if isinstance(m, p.Chunks)
                    for c in m.chunks if c.request_id == rid for t in c.token_ids]
        self._call(p.Close(request_id=self._rid(), session_id=child), p.Closed)
        assert isinstance(answer, p.Generated)
        return list(answer.token_ids), streamed

    def _victims(self) -> list[str]:
        fresh = [uuid.uuid4().hex for _ in range(VICTIMS)]
        for sid in fresh:
            self._call(p.CreateSession(request_id=self._rid(), session_id=sid), p.Created, self.JANITOR_ROUTE)
            self._call(p.Append(request_id=self._rid(), session_id=sid, token_ids=GOOD_PROMPT), p.Appended,
                       self.JANITOR_ROUTE)
        return fresh

    def _close_session(self, sid: str) -> None:
        self._call(p.Close(request_id=self._rid(), session_id=sid), p.Message, self.JANITOR_ROUTE)

    # -- checks --

    def _check(self) -> None:
        if not self._wait(lambda: not (self.expected - self.errors)):
            missing = dict((self.expected - self.errors).most_common(5))
            raise self.fail(f"errors never answered (route, code, request id, message): {missing}", [self.daemon])
        self.errors.clear()  # the rest are refusals of valid requests
        self.expected.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], [self.daemon])
        if not self.daemon.alive:
            raise self.fail("the worker died", [self.daemon])
        restored = time.monotonic()
        self._welcome()  # a fuzzed WELCOME may have changed its heartbeat: set it back
        final, streamed = self._good_round(stream=self.report.checkpoints % 2 == 1)
        # The last step's token comes in the final answer only: the streamed ones are a prefix of it.
        if final != self.expected_tokens or streamed != final[: len(streamed)]:
            raise self.fail(f"good session: tokens {final}, streamed {streamed}, expected {self.expected_tokens}",
                            [self.daemon])
        self.report.good_rounds += 1
        if not self._wait(lambda: self.last_beat > restored, 5.0):
            raise self.fail("the worker stopped heartbeating", [self.daemon])
        self._cleanup()

    def _cleanup(self) -> None:
        self._wait(lambda: False, 0.05)
        self._close_created()
        for sid in self.known.sessions:
            self._close_session(sid)
        self.known.sessions[:] = self._victims()

    def finish(self) -> None:
        """The victims closed, the good session must hold its prompt alone, idle."""
        super().finish()
        for sid in self.known.sessions:
            self._close_session(sid)
        info = self._call(p.Info(request_id=self._rid(), session_id=self.good_session), p.SessionInfo)
        assert isinstance(info, p.SessionInfo)
        if info.length != len(GOOD_PROMPT) or info.busy:
            raise self.fail(f"the good session changed: {info}", [self.daemon])


class HostilePeers(Target):
    """The broker's worker socket against peers that are not what they claim. Peer 0 registers (a worker of one slot)
    and keeps heartbeating, sending FANOUTs of every kind: parts that are not msgpack maps, routes to clients that are
    not there. Its parts for the bystander (a DEALER on the client socket) arrive there as CHUNKS, verbatim; the rest go
    nowhere, and the broker lives on. (Should the broker give it up meanwhile, silent while a checkpoint waits, it says
    so with RECONNECT: the fake registers again, and what it sent before that need not have arrived.) The other peers
    never register: their answers, FANOUTs included, are never forwarded, their READYs (more slots than the broker
    takes, more sessions than slots, a session twice, too long to read: 200k sessions) are refused with an ERROR and
    never welcomed (or, over their rate, not answered), and they hear nothing else but RECONNECT. The good session on
    the real worker must not notice."""

    name = "broker worker socket, hostile"
    PEERS = 4
    BEAT_S = HEARTBEAT_MS / 2000

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.admission = Admission(HEARTBEAT_MS / 1000, DEFAULT_MAX_WORKER_SESSIONS)
        self.oversized = oversized_readies(DEFAULT_MAX_WORKER_SESSIONS)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.peers = [_dealer(self.context, stack.cluster.workers_address, f"hostile{i}-{uuid.uuid4().hex[:8]}".encode())
                      for i in range(self.PEERS)]
        self.bystander_route = b"hb" + uuid.uuid4().bytes
        self.bystander = _dealer(self.context, stack.cluster.clients, self.bystander_route)
        self.fake_name = f"hostile-{uuid.uuid4().hex[:8]}"
        self.expected: list[tuple[float, tuple[bytes, ...]]] = []  # (sent at, frames) for the bystander
        self.received: Counter[tuple[bytes, ...]] = Counter()
        self.told_at = -1e9  # when the broker last told the fake it was not registered
        self.ledger = ReadyLedger(self.PEERS)  # the strangers' READYs (peer 0 sends none of the cases')
        self._next_beat = 0.0
        try:
            _connect(self.bystander)
            self._register()
            if not self._wait(lambda: self.report.answers["WELCOME"] > 0):
                raise FuzzFailure("the registered fake was not welcomed")
            for i, frames in enumerate(self.oversized):  # each refused with its ERROR, whatever the cases draw
                self._send(frames, 1 + i % (self.PEERS - 1))
            if not self._wait(lambda: sum(map(len, self.ledger.answers)) == len(self.oversized)):
                raise FuzzFailure(f"oversized READYs not all refused: {self.ledger.answers}")
            self.ledger.settle(self.report)
        except BaseException:
            self.release()
            raise
        self.known.routes[:] = [self.bystander_route, stack.good.route]
        self.known.sessions[:] = [stack.good.session_id]

    def strategy(self) -> st.SearchStrategy[Case]:
        return hostile_cases(self.known, self.PEERS, self.oversized)

    def _register(self) -> None:
        self.peers[0].send_multipart(p.encode(p.Ready(name=self.fake_name, model="hostile", capacity=1, free_slots=1,
                                                      max_context=64)))

    def _send(self, frames: Frames, peer: int) -> None:
        message = decodes(frames)
        if peer > 0 and isinstance(message, p.Ready):
            if not (self.admission.too_large(p.Command.READY, len(frames[2])) or self.admission.ready_problem(message)):
                return  # a stranger that would register is no stranger: not sent
        if peer > 0 and isinstance(message, p.Disconnect):
            return
        if peer == 0 and (isinstance(message, (p.Disconnect, p.Ready)) or _command(frames) is p.Command.READY):
            return  # the registered fake stays registered, as itself
        self.peers[peer].send_multipart(frames)
        if peer > 0 and _command(frames) is p.Command.READY:
            self.ledger.sent_ready(peer, frames, _ready_answer(self.admission, frames, message))
        now = time.monotonic()
        if peer == 0 and forwarded_to(frames) == self.bystander_route:
            self.expected.append((now, tuple(frames)))
        if peer == 0 and isinstance(message, p.Fanout):
            for route, part in zip(message.routes, message.parts, strict=True):
                if route == self.bystander_route:
                    self.expected.append((now, (p.VERSION, p.Command.CHUNKS.value, part)))

    def _pump(self, timeout_ms: int) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            self.peers[0].send_multipart(p.encode(p.Heartbeat(free_slots=1, sessions=0)))
            self._next_beat = now + self.BEAT_S
        for i, peer in enumerate(self.peers):
            for frames in _recv_all(peer, timeout_ms if i == 0 else 0):
                message = decodes(frames)
                self.report.answers[describe(message, frames)] += 1
                allowed: tuple[type[p.Message], ...] = (
                    (p.Welcome, p.Heartbeat, p.Reconnect) if i == 0 else (p.Reconnect, p.Error))
                if not isinstance(message, allowed):
                    self.report.notes.append(f"peer {i} got {show_frames(frames)}")
                if i == 0 and isinstance(message, p.Reconnect):  # given up on (silent while a checkpoint waited)
                    self.report.answers["RECONNECT to the fake"] += 1
                    self.told_at = time.monotonic()
                    self._register()
                if i > 0 and isinstance(message, p.Error):
                    if not message.message.startswith("registration refused: "):
                        self.report.notes.append(f"peer {i} got an ERROR that refuses no READY: {message}")
                    self.ledger.answers[i].append("ERROR")
        for frames in _recv_all(self.bystander, 0):
            if isinstance(decodes(frames), p.Lease):
                continue
            self.received[tuple(frames)] += 1
            self.report.answers["forwarded"] += 1

    def _outstanding(self) -> tuple[list[tuple[float, tuple[bytes, ...]]], Counter[tuple[bytes, ...]]]:
        """(expected parts that did not arrive, parts that arrived unexpected)."""
        left = Counter(self.received)
        missing = []
        for sent_at, frames in self.expected:
            if left[frames] > 0:
                left[frames] -= 1
            else:
                missing.append((sent_at, frames))
        return missing, +left

    def _check(self) -> None:
        def settled() -> bool:  # what is missing was sent before the broker told the fake it had given it up
            return (all(sent_at <= self.told_at for sent_at, _ in self._outstanding()[0])
                    and not any(self.ledger.problem(i) for i in range(1, self.PEERS)))

        if not self._wait(settled):
            late = [show_frames(list(f)) for t, f in self._outstanding()[0] if t > self.told_at][:5]
            problems = [q for i in range(1, self.PEERS) if (q := self.ledger.problem(i))]
            raise self.fail(f"FANOUT parts of the registered fake not delivered to the bystander: {late}; {problems}",
                            self.stack.daemons())
        self._pump(50)
        missing, extra = self._outstanding()
        problems = [q for i in range(1, self.PEERS) if (q := self.ledger.problem(i))]
        if extra or problems:
            raise self.fail(f"forwarded though no registered worker sent it: {[show_frames(list(f)) for f in extra][:5]}; "
                            f"{problems}", self.stack.daemons())
        self.ledger.settle(self.report)
        self.report.answers["parts dropped, the fake told"] += len(missing)
        self.expected.clear()
        self.received.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], self.stack.daemons())
        self.stack.check_alive(self)
        self.stack.check_good(self)
        names = {w.name for w in self.stack.status()}
        if not names <= {self.stack.worker_name, self.fake_name} or self.stack.worker_name not in names:
            raise self.fail(f"registered workers {sorted(names)}: only the real one and the fake may be",
                            self.stack.daemons())

    def finish(self) -> None:
        """The fake leaves; the strangers never registered."""
        super().finish()
        self.peers[0].send_multipart(p.encode(p.Disconnect(reason="done")))
        self.stack.check_workers(self, {self.stack.worker_name})

    def release(self) -> None:
        for sock in (*self.peers, self.bystander):
            sock.close(linger=0)
        self.context.term()


def _command(frames: Frames) -> p.Command | None:
    return p.COMMANDS.get(bytes(frames[1])) if len(frames) >= 3 and frames[0] == p.VERSION else None


def _ready_answer(admission: Admission, frames: Frames, message: p.Message | None) -> str | None:
    """What the broker answers a READY command with, over its rate or not: ERROR when it refuses it (too long to read,
    or read and not admissible), WELCOME when it takes it, None (nothing) when it does not decode."""
    if admission.too_large(p.Command.READY, len(frames[2])):
        return "ERROR"
    if not isinstance(message, p.Ready):
        return None
    return "ERROR" if admission.ready_problem(message) else "WELCOME"


TARGETS: dict[str, type[Target]] = {"client": ClientSocket, "worker-socket": WorkerSocket, "hostile-peers": HostilePeers,
                                    "worker-link": WorkerLink}
