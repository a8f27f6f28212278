"""What must happen: the answer the protocol module says each message gets, the failure a check raises, the report
of a target's run, and the good session whose tokens must never change."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import zmq

from broker.common import protocol as p
from client import Client, Session
from client.stack import Daemon

from .strategies import Frames

T = TypeVar("T")

GOOD_PROMPT = (1, 2, 3, 4, 5)
GOOD_TOKENS = 16  # greedy, ignore_eos: always this many, always the same ones
ANSWER_WAIT_S = 15.0  # how long a checkpoint waits for the answers it expects


# -- what the protocol says must happen -----------------------------------------------------------------------


ErrorKey = tuple[str, "str | None", str]  # (code, request id, the start of the message) of an ERROR
MESSAGE_KEY_CHARS = 256  # enough to tell the broker's refusals from a worker's; a long message may be cut


def strict(decode: Callable[[Frames], T], frames: Frames) -> T:
    """Run a protocol function that may only raise ProtocolError; anything else is a bug of the protocol module
    (every daemon and client trusts it to turn garbage into a typed error)."""
    try:
        return decode(frames)
    except p.ProtocolError:
        raise
    except Exception as e:
        raise FuzzFailure(f"broker.common.protocol raised {type(e).__name__} ({e}) instead of a ProtocolError on "
                          f"{show_frames(frames)}") from e


def client_error(frames: Frames) -> ErrorKey | None:
    """The error the broker must answer a client's message with; None when it is a valid request (answered by
    the broker or a worker, or one-way). The message text too: it tells the broker's refusals from a worker's."""
    try:
        envelope = strict(p.decode_envelope, frames)
        if envelope.command not in p.REQUEST_COMMANDS:
            message = f"{envelope.command.name} is not a client request"
            return p.ErrorCode.BAD_REQUEST.value, p.request_id_of(envelope.header), message
        strict(lambda _: p.parse(envelope), frames)
    except p.ProtocolError as e:
        return e.code.value, e.request_id, e.message[:MESSAGE_KEY_CHARS]
    return None


def forwarded_to(frames: Frames) -> bytes | None:
    """The client route the broker must forward a worker's message to, untouched; None when it drops it."""
    try:
        envelope = strict(p.decode_envelope, frames)
    except p.ProtocolError:
        return None
    if envelope.command not in (p.Command.REPLY, p.Command.CHUNKS, p.Command.ERROR):
        return None
    if envelope.command is p.Command.CHUNKS:
        chunks = envelope.header.get("chunks")
        if not isinstance(chunks, list) or not chunks or envelope.payload:
            return None
    return p.route_of(envelope.header) or None


RoutedErrorKey = tuple[bytes, str, "str | None", str]  # an ErrorKey and the route it goes to


def worker_error(frames: Frames) -> RoutedErrorKey | None:
    """The error a worker must answer a broken request with: when its header names a valid route and request id."""
    try:
        strict(p.decode, frames)
    except p.ProtocolError as e:
        return (e.route, e.code.value, e.request_id, e.message[:MESSAGE_KEY_CHARS]) if e.route and e.request_id else None
    return None


def decodes(frames: Frames) -> p.Message | None:
    try:
        return strict(p.decode, frames)
    except p.ProtocolError:
        return None


def describe(message: p.Message | None, frames: Frames) -> str:
    """A counter key: ERROR:code, REPLY:kind, or the command."""
    if isinstance(message, p.Error):
        return f"ERROR:{message.code.value}"
    if message is None:
        return "undecodable"
    return f"REPLY:{message.KIND}" if message.KIND else message.COMMAND.name


# -- failures and reports ----------------------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """A check failed: a process died, an answer is missing or malformed, or the good session was disturbed."""


@dataclass
class Report:
    """What one target's run did: cases sent, time taken, what came back, checks passed."""

    target: str
    cases: int = 0
    seconds: float = 0.0
    answers: Counter[str] = field(default_factory=Counter)
    checkpoints: int = 0
    good_rounds: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds > 0 else 0.0

    def errors_by_code(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: v for k, v in sorted(self.answers.items()) if k.startswith("ERROR:")}


def show_frames(frames: Frames, limit: int = 160) -> str:
    return "[" + ", ".join(repr(f[:limit]) + (f"...({len(f)} bytes)" if len(f) > limit else "") for f in frames) + "]"


def tracebacks(daemon: Daemon, limit: int = 6000) -> str:
    """The tail of a daemon's log from its first traceback (or just the tail)."""
    text = daemon.log_text()
    at = text.find("Traceback")
    return text[at : at + limit] if at >= 0 else text[-limit // 3 :]


# -- the good session ----------------------------------------------------------------------------------------


class GoodSession:
    """A client of its own, in a thread: one session made before fuzzing, then forked and generated from, round
    after round, streamed and not, until stopped. Greedy decoding of a fixed model is deterministic, so every
    round's tokens must equal the ones before fuzzing began. Rounds need one free slot (the fork)."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.route = b""
        self.session_id = ""
        self.expected: list[int] = []
        self.rounds = 0
        self.errors: list[str] = []
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._pause = threading.Event()
        self._idle = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="good-session", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(self.timeout_s) or self.errors:
            raise FuzzFailure(f"the good session did not start: {self.errors}")

    def wait_rounds(self, more: int = 1) -> int:
        """Until `more` rounds have finished after this call (or a round failed); the rounds so far."""
        with self._progress:
            goal = self.rounds + more
            if not self._progress.wait_for(lambda: self.rounds >= goal or bool(self.errors), self.timeout_s):
                self.errors.append(f"no good round finished within {self.timeout_s} s")
        return self.rounds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Between rounds: the twin is closed and nothing of the good client is in flight."""
        self._pause.set()
        try:
            if self._thread.is_alive():
                self._idle.wait(self.timeout_s)
            yield
        finally:
            self._pause.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=self.timeout_s)

    def _run(self) -> None:
        try:
            with Client(self.address, timeout=self.timeout_s) as client, client.session() as session:
                route = client._transport._socket.getsockopt(zmq.ROUTING_ID)
                assert isinstance(route, bytes)
                self.route = route
                self.session_id = session.id
                session.append(token_ids=list(GOOD_PROMPT))
                with session.fork() as first:
                    self.expected = first.generate(max_tokens=GOOD_TOKENS, ignore_eos=True).token_ids
                self._ready.set()
                while not self._stop.is_set():
                    if self._pause.is_set():
                        self._idle.set()
                        while self._pause.is_set() and not self._stop.is_set():
                            time.sleep(0.01)
                        self._idle.clear()
                        continue
                    self._round(session, stream=self.rounds % 2 == 1)
        except Exception as e:  # recorded, checked by the fuzzing loop
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._ready.set()
            with self._progress:
                self._progress.notify_all()

    def _round(self, session: Session, stream: bool) -> None:
        with session.fork() as twin:
            if stream:
                got = [t for chunk in twin.generate(max_tokens=GOOD_TOKENS, ignore_eos=True, stream=True)
                       for t in chunk.token_ids]
            else:
                got = twin.generate(max_tokens=GOOD_TOKENS, ignore_eos=True).token_ids
        length = session.info().length
        if got != self.expected or length != len(GOOD_PROMPT):
            self.errors.append(f"round {self.rounds}: tokens {got} (expected {self.expected}), length {length}")
        with self._progress:
            self.rounds += 1
            self._progress.notify_all()
