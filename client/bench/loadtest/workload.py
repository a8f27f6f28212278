"""What each simulated user does, written once for both drivers (full stack and in-process).

A user is a generator that yields actions (Create, Turn, Fork, Close) and is sent each result; a failed
action is thrown into it as `Failed(code)`. The driver executes and times the actions; the script only
decides what comes next:

    open a session; repeat turns (append P prompt tokens, generate M tokens streamed); every
    `fork_every`-th turn first fork, run one turn on the child and close it; after `turns` turns, or
    when the next turn would overflow `max_context`, close the session and open a new one; stop when
    the budget (a count of generate requests or a deadline) is spent, or after `conversations`
    completed conversations, closing what is open.

A failed turn closes its session and opens another; a user whose session cannot be opened (no
capacity, no such model) gives up. Every failure is counted by the driver, by its wire error code.
Once a run is stopped (interrupt.py), its driver fails every action but a close with `Failed(INTERRUPTED)`
without sending it: each user closes the sessions it holds, cannot open another, and ends.

Prompts are deterministic: each user draws from its own RNG seeded by (seed, user index), so the same
seed gives the same prompts whichever driver and however many client processes run them.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from client.bench.loadtest.stats import INTERRUPTED

# A small seeded word list for text prompts (common English words, most of them one BPE token).
WORDS = (
    "the of and to in is was for on that with as by at from his her they this be are or an which one had "
    "not but all were when we there can more has been would their who other time if will out so about up "
    "what into some only its new two them than first may like now these any over most after people also "
    "where made years many before well such through back just because much good same world place city "
    "water light house river small large long old great little under early north south east west state "
    "music story school night family country number part system market power study paper voice field"
).split()
GONE = ("session_lost", "session_not_found")  # codes after which a session is no more
TEXT_MARGIN = 1.125  # a text prompt's token count is estimated; keep this much room for it in the context


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    max_tokens: int
    turns: int
    fork_every: int  # 0: never fork
    max_context: int
    prompt_kind: str  # "tokens" or "text"
    temperature: float
    ignore_eos: bool
    seed: int
    vocab_size: int  # token-id prompts draw ids from [0, vocab_size)
    # Conversations a user completes before it stops (None: as many as the budget allows). The default length, one
    # conversation per session, sets 1: with a shared count of requests a fast user would start a second one and
    # leave a slower one's unfinished.
    conversations: int | None = None

    @property
    def prompt_room(self) -> int:
        """Context tokens to keep free for a prompt (a text prompt's size is estimated, so with a margin)."""
        n = self.prompt_tokens
        return n if self.prompt_kind == "tokens" else int(n * TEXT_MARGIN) + 2


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int] | None = None
    text: str | None = None


@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None


# -- actions and their results --------------------------------------------------------------------


@dataclass(frozen=True)
class Create:
    pass


@dataclass(frozen=True)
class Turn:
    session: Any  # the driver's handle
    length: int  # the session's length before the turn
    prompt: Prompt
    params: Params
    forked: bool = False


def session_opened_at(created: tuple[Any, float] | None, action: object) -> float | None:
    """When the turn `action` began for its user, if it opens its session: `created` is the session a driver's last
    action created and when its CREATE was sent. The turn sent right after it, on it, counts its TTFT from there, as
    its user waits for both (and as through the gateway, which opens the session within that turn); any other action
    in between (a fork on the first turn with --fork-every 1) ends that: the turn was not waiting on it. None: now."""
    if created is not None and isinstance(action, Turn) and action.session == created[0]:
        return created[1]
    return None


@dataclass(frozen=True)
class Fork:
    session: Any


@dataclass(frozen=True)
class Close:
    session: Any


Action = Create | Turn | Fork | Close


@dataclass(frozen=True)
class Opened:
    session: Any
    max_context: int  # the worker's, 0 when unknown


@dataclass(frozen=True)
class TurnDone:
    length: int  # the session's length in tokens afterwards
    prompt_tokens: int  # what the append added


class Failed(Exception):
    """An action failed with this wire error code (the driver has recorded it)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


Script = Generator[Action, Any, None]


# -- the budget ---------------------------------------------------------------------------------


class Budget:
    """Generate requests left to start: a count, a duration, or both (whichever ends first).

    Shared by the users of one process; `begin(start)` starts the clock (every process gets the same start).
    """

    def __init__(self, requests: int | None, duration: float | None) -> None:
        self.left = requests
        self.duration = duration
        self.deadline: float | None = None

    def begin(self, start: float) -> None:
        if self.duration is not None:
            self.deadline = start + self.duration

    def take(self) -> bool:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def refund(self) -> None:
        """A taken request that could not be started (its session could not be opened or forked)."""
        if self.left is not None:
            self.left += 1


# -- prompts ------------------------------------------------------------------------------------


class Prompts:
    """One user's prompts. Text prompts learn their tokens-per-character ratio from what appends report."""

    def __init__(self, workload: Workload, user: int) -> None:
        self.workload = workload
        self.rng = random.Random(workload.seed * 1_000_003 + user)
        self._chars = 0
        self._tokens = 0

    def next(self) -> Prompt:
        n = self.workload.prompt_tokens
        if self.workload.prompt_kind == "tokens":
            return Prompt(token_ids=[self.rng.randrange(self.workload.vocab_size) for _ in range(n)])
        return Prompt(text=self._text(max(1, round(n / self._tokens_per_char()))))

    def observe(self, prompt: Prompt, tokens: int) -> None:
        if prompt.text is not None:
            self._chars += len(prompt.text)
            self._tokens += tokens

    def sampling_seed(self) -> int | None:
        return self.rng.getrandbits(62) if self.workload.temperature > 0 else None

    def _tokens_per_char(self) -> float:
        # Byte-level vocabularies give at most one token per byte: start there, then learn.
        return self._tokens / self._chars if self._chars else 1.0

    def _text(self, chars: int) -> str:
        words: list[str] = []
        size = 0
        while size < chars:
            word = self.rng.choice(WORDS)
            words.append(word)
            size += len(word) + 1
        return " " + " ".join(words)


# -- the user -----------------------------------------------------------------------------------


def user(index: int, workload: Workload, budget: Budget, counts: Counter[str]) -> Script:
    """One simulated user's whole life; see the module docstring."""
    prompts = Prompts(workload, index)
    session: Any = None
    limit = workload.max_context
    length = turns = completed = 0
    while True:
        if session is not None and (turns >= workload.turns or length + workload.prompt_room + workload.max_tokens > limit):
            counts["conversations_completed" if turns >= workload.turns else "context_rollovers"] += 1
            completed += turns >= workload.turns
            yield from _close(session)
            session = None
        if workload.conversations is not None and completed >= workload.conversations:
            break
        if not budget.take():  # the ticket for this turn
            break
        if session is None:
            try:
                opened: Opened = yield Create()
            except Failed:
                budget.refund()
                return  # this user gives up (the failure is counted)
            session, length, turns = opened.session, 0, 0
            limit = min(workload.max_context, opened.max_context or workload.max_context)
            counts["sessions_opened"] += 1
        turns += 1
        if workload.fork_every and turns % workload.fork_every == 0 and budget.take():
            if not (yield from _fork_turn(session, length, prompts, workload, budget, counts)):
                session = None  # the parent is gone: its turn is not sent, its ticket goes back
                budget.refund()
                counts["sessions_reopened_after_error"] += 1
                continue
        turn = _turn(session, length, prompts, workload)
        try:
            done: TurnDone = yield turn
        except Failed as e:
            yield from _close(session)
            session = None
            if e.code != INTERRUPTED:  # (a stopped run opens no other: the budget is spent)
                counts["sessions_reopened_after_error"] += 1
            continue
        prompts.observe(turn.prompt, done.prompt_tokens)
        length = done.length
    if session is not None:
        yield from _close(session)


def _turn(session: Any, length: int, prompts: Prompts, workload: Workload, forked: bool = False) -> Turn:
    params = Params(workload.max_tokens, workload.temperature, workload.ignore_eos, prompts.sampling_seed())
    return Turn(session, length, prompts.next(), params, forked)


def _fork_turn(
    parent: Any, length: int, prompts: Prompts, workload: Workload, budget: Budget, counts: Counter[str]
) -> Generator[Action, Any, bool]:
    """Fork, run one turn on the child, close it. False when the parent itself turned out to be gone."""
    try:
        child: Opened = yield Fork(parent)
    except Failed as e:
        budget.refund()  # the child's turn will not run
        if e.code in GONE:
            yield from _close(parent)
            return False
        return True  # e.g. no slot for the child: the parent carries on
    counts["forks"] += 1
    turn = _turn(child.session, length, prompts, workload, forked=True)
    try:
        done: TurnDone = yield turn
        prompts.observe(turn.prompt, done.prompt_tokens)
    except Failed:
        pass
    yield from _close(child.session)
    return True


def _close(session: Any) -> Generator[Action, Any, None]:
    try:
        yield Close(session)
    except Failed:
        pass
