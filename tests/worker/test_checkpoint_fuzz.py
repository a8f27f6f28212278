"""Recurrent-state checkpoints (worker.engine.checkpoints) under a seeded random sequence of operations.

On a tiny random hybrid model (Qwen3.5-MoE's DeltaNet and attention layers), a few sessions are created (at times more
than the table has slots, so that checkpoints are dropped for room and, with hibernation on, sessions hibernate),
generate (a prompt appended, nothing new, or a from_start context cut before, at or after the session's checkpoint,
the prompt exactly again, extended; turn_tail 0 to 3; max_tokens 0 to 8), are cancelled (some after 0 to 2 steps, and
forked right then), forked (and generate at once), closed and hibernated, with the engine reading each step before the
next and running a step ahead (where the device may not have finished a prefill step yet, as on the GPU). It proves:

- every generation's tokens, those of a cancelled one too, are the greedy tokens of a separate engine given the
  session's context from nothing, whether the generation started from a checkpoint, a state kept, or nothing;
- after every operation the session table holds exactly the resident sessions and the checkpoints, in distinct slots,
  and no checkpoint is held for a closed or hibernated session; a create, fork or restore refused for want of room
  dropped every checkpoint first; at the end, with every session closed, the table holds nothing;
- at every other operation, each checkpoint's state (its fixed-size state and its session's K/V below it) and each
  idle session's state are the state a prefill of the same tokens leaves. Within 1e-4 of their scale, not bit for
  bit: the engine computes a session's tokens in other chunks than a prefill from the start (the same arithmetic,
  not always the same bits: docs/architecture.md); measured over 96 runs of this test's kind, 83% of the comparisons
  were not bit-identical, all within 2.1e-6 of the scale, where a state that holds other tokens is off by its scale.

Tokens are compared exactly, with no guard for near ties: over 56 runs the engine's log-probability of each of its
tokens was within 4.8e-7 of the reference's, and the closest top-two gap among those tokens was 1.5e-5 (30 times
more). Should another CPU's kernels ever flip a tie that close, the test fails at that token: a near tie to report
(the reference can give its top two, SamplingParams.logprobs), not a reason to loosen the comparison.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cuda_state import CapacityExhausted
from worker.engine import Chunk, Engine, SamplingParams
from worker.engine.checkpoints import NOT_TAKEN, PER_SESSION, Checkpoints
from worker.engine.session import Launched

PRESET = "random:tiny-qwen3.5-moe"
MAX_CONTEXT = 256
STEP_TOKENS = 64
MAX_TOKENS = 8
OPERATIONS = 300
ROOMY, CROWDED = 60, 30  # operations of each phase: few sessions (room for checkpoints), more than the slots
ABANDONED = 0.25  # of the generations: cancelled after 0 to 2 steps
STATES_EVERY = 2  # operations between two checks of every state
STATE_TOLERANCE = 1e-4  # of the state's scale (see the module's docstring)
SEEDS = (0, 13)  # (with Checkpoints.fork's `cp.at > copied` check taken out, 6 of their 8 runs fail)
CONTEXTS = ("append", "append", "continue", "cut", "same", "extend", "at", "at_new", "past", "before")
NEAR_CHECKPOINT = ("at", "at", "at_new", "past", "past", "after", "after", "before", "same", "continue")  # most often


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """(see tests/worker/test_qwen3_5.py's one_thread)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load(max_sessions: int) -> Engine:
    return Engine.load(PRESET, device="cpu", max_sessions=max_sessions, max_context=MAX_CONTEXT,
                       step_tokens=STEP_TOKENS)


# -- the reference: a separate engine, each context computed from nothing ---------------------------------------------


@dataclass
class State:
    fixed: dict[str, torch.Tensor]  # the fixed-size buffers (DeltaNet and convolution states)
    kv: dict[str, torch.Tensor]  # the buffers laid out by position, cut to the tokens


def fixed_state(engine: Engine, slot: int) -> dict[str, torch.Tensor]:
    views = engine.table.views()
    return {b.name: views[b.name][slot].clone() for b in engine.table.spec.buffers if b.seq_axis is None}


def kv_state(engine: Engine, slot: int, tokens: int) -> dict[str, torch.Tensor]:
    """The slot's K/V of its first `tokens` positions (a view's position axis is split into blocks)."""
    views = engine.table.views()
    out: dict[str, torch.Tensor] = {}
    for b in engine.table.spec.buffers:
        if b.seq_axis is not None:
            out[b.name] = views[b.name][slot].flatten(b.seq_axis, b.seq_axis + 1).narrow(b.seq_axis, 0, tokens).clone()
    return out


def drain(engine: Engine) -> list[Chunk]:
    chunks: list[Chunk] = []
    while engine.has_work():
        chunks += engine.step()
    return chunks


class Reference:
    """A separate engine's greedy tokens after a context and its state after a prefill of some tokens, from a new
    session each time (one at a time: its other slot is the session's checkpoint's), each computed once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._greedy: dict[tuple[int, ...], list[int]] = {}
        self._states: dict[tuple[int, ...], State] = {}

    def greedy(self, context: list[int], n: int) -> list[int]:
        if n == 0:
            return []
        key = tuple(context)
        if key not in self._greedy:
            sid = self.engine.create_session()
            self.engine.start_generate(sid, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), prompt_ids=context)
            self._greedy[key] = [t for c in drain(self.engine) for t in c.token_ids]
            self.engine.close(sid)
        return self._greedy[key][:n]

    def state(self, tokens: list[int]) -> State:
        key = tuple(tokens)
        if key not in self._states:
            engine = self.engine
            sid = engine.create_session()
            engine.start_generate(sid, SamplingParams(max_tokens=0), prompt_ids=[*tokens, 0])  # prefill all but the 0
            drain(engine)
            session = engine._sessions[sid]
            assert session.computed == len(tokens)
            self._states[key] = State(fixed_state(engine, session.slot), kv_state(engine, session.slot, len(tokens)))
            engine.close(sid)
        return self._states[key]


@pytest.fixture(scope="module")
def reference() -> Iterator[Reference]:
    engine = load(max_sessions=2)
    yield Reference(engine)
    engine.unload()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[bool, Engine]]:
    """The engines under test, by whether idle sessions may hibernate (6 slots each)."""
    resident, hibernating = load(max_sessions=6), load(max_sessions=6)
    hibernating.enable_hibernation(host_cache_bytes=64 << 20, session_store=None)
    yield {False: resident, True: hibernating}
    resident.unload()
    hibernating.unload()


def assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name, expected in want.items():
        actual = got[name]
        assert actual.shape == expected.shape, f"{what}: {name} of shape {tuple(actual.shape)}"
        scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
        error = (actual - expected).abs().max().item() if expected.numel() else 0.0
        assert error <= STATE_TOLERANCE * scale, f"{what}: {name} off by {error:.3g} (its scale {scale:.3g})"


# -- the fuzzer ---------------------------------------------------------------------------------------------------------


@dataclass
class Pending:
    """A generation in flight: its session, the context it continues, and what it has generated so far."""

    session: str
    context: list[int]
    max_tokens: int
    what: str  # how its context was made, for a failure's message
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False  # cancelled, or its session closed: it may end "cancelled"


class Fuzz:
    """One seeded run of operations on an engine, each followed by the checks; then every session closed."""

    def __init__(self, engine: Engine, reference: Reference, seed: int, hibernation: bool) -> None:
        assert engine.checkpoints is not None  # a hybrid model
        self.engine, self.reference, self.hibernation = engine, reference, hibernation
        self.checkpoints: Checkpoints = engine.checkpoints
        self.rng = random.Random(seed)
        self.cap = 0  # the sessions a create stops at, by phase (a fork makes one more)
        self.pending: dict[str, Pending] = {}
        self.ended = self.refused = 0
        self.trail: deque[str] = deque(maxlen=40)  # the last operations, for a failure's message

    # -- the run

    def run(self, operations: int) -> None:
        ops: list[tuple[Callable[[], None], float]] = [
            (self.create, 2), (self.generate, 5), (self.step, 12), (self.cancel, 1), (self.fork, 1.5),
            (self.close, 0.7)]
        if self.hibernation:
            ops.append((self.hibernate, 1))
        fns, weights = zip(*ops, strict=True)
        for op in range(operations):
            self.cap = 3 if op % (ROOMY + CROWDED) < ROOMY else self.engine.capacity + 2
            try:
                if len(self.engine.sessions()) < 2:
                    self.create()
                elif len(self.engine.sessions()) > self.cap and self.rng.random() < 0.3:
                    self.close()
                else:
                    self.rng.choices(fns, weights)[0]()
                self.check_table()
                if op % STATES_EVERY == 0:
                    self.check_states()
            except AssertionError as e:
                raise AssertionError(f"{e}\nat operation {op}, after:\n  " + "\n  ".join(self.trail)) from e
        self.take(drain(self.engine))
        assert not self.pending, self.pending
        for sid in self.engine.sessions():
            self.engine.close(sid)
        drain(self.engine)
        self.check_table()
        assert self.engine.table.live == 0 and len(self.checkpoints) == 0

    def note(self, *what: object) -> None:
        self.trail.append(" ".join(str(w) for w in what))

    def idle(self) -> list[str]:
        return [sid for sid, s in self.engine._sessions.items() if s.request is None]

    def new_ids(self, least: int, most: int) -> list[int]:
        return [self.rng.randrange(3, 500) for _ in range(self.rng.randint(least, most))]

    # -- the operations

    def create(self) -> None:
        if len(self.engine.sessions()) >= self.cap:
            return
        try:
            self.note("create", self.engine.create_session()[:6])
        except CapacityExhausted:
            self.no_room("create")

    def generate(self) -> None:
        idle = self.idle()
        if idle:
            self.generate_on(self.rng.choice(idle))

    def generate_on(self, sid: str) -> None:
        tokens = self.engine.session_tokens(sid)
        cp = self.checkpoints.get(sid)
        at = None if cp is None else cp.at
        mode, kwargs = self.context(tokens, at)
        n = 0 if self.rng.random() < 0.15 else self.rng.randint(1, MAX_TOKENS)
        resident = self.engine.is_resident(sid)
        try:
            rid = self.engine.start_generate(sid, SamplingParams(max_tokens=n, ignore_eos=True), **kwargs)
        except CapacityExhausted:
            assert not resident, "only a hibernated session's restore may find no room"
            self.no_room("restore")
            return
        what = (f"{mode} max_tokens={n} turn_tail={kwargs.get('turn_tail', 0)} held={len(tokens)} "
                f"checkpoint={at} computed={self.engine.session_computed(sid)}")
        self.note("generate", rid, sid[:6], what)
        self.pending[rid] = Pending(sid, self.engine.session_tokens(sid), n, what)
        if self.rng.random() < ABANDONED:
            for _ in range(self.rng.randint(0, 2)):
                self.step()
            if rid in self.pending:
                self.cancel_one(rid)

    def context(self, tokens: list[int], at: int | None) -> tuple[str, dict[str, Any]]:
        """A generation's prompt arguments: how the context is made, and start_generate's keywords."""
        rng = self.rng
        mode = rng.choice(NEAR_CHECKPOINT if at is not None and rng.random() < 0.8 else CONTEXTS)
        if not tokens:
            mode = "append"
        kwargs: dict[str, Any] = {}
        if mode == "append":
            kwargs = {"prompt_ids": self.new_ids(1, 40)}
        elif mode != "continue":
            kwargs = {"prompt_ids": self.whole_context(mode, tokens, rng.randint(1, len(tokens)) if at is None else at),
                      "from_start": True}
        length = (0 if kwargs.get("from_start") else len(tokens)) + len(kwargs.get("prompt_ids", []))
        if length + MAX_TOKENS >= MAX_CONTEXT - 4:
            mode, kwargs = "shrink", {"prompt_ids": tokens[:rng.randint(1, 60)] + self.new_ids(0, 10),
                                      "from_start": True}
        if "prompt_ids" in kwargs and rng.random() < 0.5:
            kwargs["turn_tail"] = rng.randint(0, 3)
        return mode, kwargs

    def whole_context(self, mode: str, tokens: list[int], at: int) -> list[int]:
        """A from_start context made of the session's tokens, around `at` (its checkpoint's, if it has one)."""
        rng = self.rng
        if mode == "cut":
            return tokens[:rng.randint(1, len(tokens))] + self.new_ids(0, 20)
        if mode == "same":
            return tokens
        if mode == "extend":
            return tokens + self.new_ids(1, 20)
        if mode == "at":
            return tokens[:at]
        if mode == "at_new":
            return tokens[:at] + self.new_ids(1, 10)
        if mode == "past":
            return tokens[:at + rng.randint(1, 4)]
        if mode == "after":
            return tokens[:rng.randint(at, len(tokens))] + self.new_ids(0, 6)
        assert mode == "before", mode
        return tokens[:max(1, at - rng.randint(1, 3))] + self.new_ids(0, 3)

    def step(self) -> None:
        wait = not self.engine.overlap or self.rng.random() < 0.6
        self.take(self.engine.step(wait=wait))

    def cancel(self) -> None:
        running = [rid for rid, p in self.pending.items() if not p.cancelled]
        if running:
            self.cancel_one(self.rng.choice(running))

    def cancel_one(self, rid: str) -> None:
        """Cancel the generation, and half the time fork its session right then (its state as the cancel left it)."""
        pending = self.pending[rid]
        self.note("cancel", rid)
        self.engine.cancel(rid)
        pending.cancelled = True
        if self.rng.random() < 0.5 and pending.session in self.idle():
            self.fork_of(pending.session)

    def fork(self) -> None:
        idle = self.idle()
        if idle:
            self.fork_of(self.rng.choice(idle))

    def fork_of(self, sid: str) -> None:
        if len(self.engine.sessions()) > self.cap:
            return
        cp = self.checkpoints.get(sid)
        self.note("fork", sid[:6], "computed", self.engine.session_computed(sid), "checkpoint", cp and cp.at)
        try:
            child = self.engine.fork(sid)
        except CapacityExhausted:
            self.no_room("fork")
            return
        self.note("->", child[:6])
        if self.rng.random() < 0.5:  # a fork most often generates at once (n choices, an answer asked again)
            self.generate_on(child)

    def close(self) -> None:
        sid = self.rng.choice(self.engine.sessions())
        self.note("close", sid[:6])
        self.engine.close(sid)
        for pending in self.pending.values():
            if pending.session == sid:
                pending.cancelled = True

    def hibernate(self) -> None:
        idle = [sid for sid in self.idle() if self.engine.is_resident(sid)]
        if idle:
            sid = self.rng.choice(idle)
            self.note("hibernate", sid[:6], self.engine.hibernate(sid))

    def no_room(self, what: str) -> None:
        """A create, fork or restore refused for want of a slot or a page: every checkpoint went first."""
        self.note(what, "-> no room")
        assert len(self.checkpoints) == 0, f"{what} refused with {len(self.checkpoints)} checkpoints held"
        self.refused += 1

    # -- the oracles

    def take(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            pending = self.pending.get(chunk.request_id)
            assert pending is not None, f"a chunk of no generation in flight: {chunk}"
            pending.tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                del self.pending[chunk.request_id]
                self.ended += 1
                self.check_generation(chunk.request_id, pending, chunk.finish_reason)

    def check_generation(self, rid: str, pending: Pending, reason: str) -> None:
        """Its tokens are a new session's greedy tokens after its context, all it asked for unless cancelled."""
        self.note("ended", rid, reason, pending.tokens)
        assert reason == "length" or (reason == "cancelled" and pending.cancelled), (rid, reason, pending.what)
        assert reason == "cancelled" or len(pending.tokens) == pending.max_tokens, (rid, pending.what)
        want = self.reference.greedy(pending.context, len(pending.tokens))
        assert pending.tokens == want, (f"{rid} ({pending.what}) generated {pending.tokens}, a new session given its "
                                        f"context of {len(pending.context)} tokens {want}")

    def check_table(self) -> None:
        """The table holds the resident sessions and the checkpoints, each in a slot of its own; a checkpoint only
        for a resident session, within its tokens."""
        engine = self.engine
        resident = [s for s in engine._sessions.values() if s.resident]
        held = {id(cp): cp for sid in engine._sessions for cp in self.checkpoints.of(sid)}
        assert len(held) == len(self.checkpoints), "a checkpoint held for a closed session"
        assert engine.table.live == len(resident) + len(held), (engine.table.live, len(resident), len(held))
        for cp in held.values():
            assert cp.owners and not cp.dropped, cp
            for sid in cp.owners:
                session = engine._sessions[sid]
                assert cp in self.checkpoints.of(sid), (sid[:6], cp)
                assert session.resident, f"a checkpoint held for hibernated session {sid[:6]}"
                assert cp.at <= len(session.tokens), (sid[:6], cp, len(session.tokens))
        assert all(len(self.checkpoints.of(sid)) <= PER_SESSION for sid in engine._sessions)
        slots = [s.slot for s in resident] + [cp.slot for cp in held.values()]
        assert len(set(slots)) == len(slots), slots

    def check_states(self) -> None:
        """Each checkpoint holds the state of its session's first `at` tokens, with the session's K/V below it; each
        idle session (no step in flight holds a row of it) the state of the tokens it computed."""
        engine = self.engine
        in_flight = engine._in_flight()
        for sid, s in engine._sessions.items():
            for cp in self.checkpoints.of(sid):
                if cp.at == NOT_TAKEN:
                    continue
                want = self.reference.state(s.tokens[:cp.at])
                assert_state(fixed_state(engine, cp.slot), want.fixed, f"checkpoint of {sid[:6]} at {cp.at}")
                assert_state(kv_state(engine, s.slot, cp.at), want.kv,
                             f"{sid[:6]}'s K/V below its checkpoint at {cp.at} (computed {s.computed})")
            if s.resident and s.request is None and id(s) not in in_flight and s.computed > 0:
                want = self.reference.state(s.tokens[:s.computed])
                assert_state(fixed_state(engine, s.slot), want.fixed, f"{sid[:6]} at {s.computed}")
                assert_state(kv_state(engine, s.slot, s.computed), want.kv, f"{sid[:6]} at {s.computed}")


# -- the tests ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def fuzz_engine(engines: dict[bool, Engine], hibernation: bool) -> Iterator[Engine]:
    """The engine under test, left as it was found (no sessions, in order) whatever the test did."""
    engine = engines[hibernation]
    yield engine
    engine.overlap = False
    for sid in engine.sessions():
        engine.close(sid)
    drain(engine)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hibernation", [False, True], ids=["resident", "hibernating"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in_order", "ahead"])
def test_sessions_with_checkpoints_generate_what_new_sessions_generate(
    fuzz_engine: Engine, reference: Reference, overlap: bool, hibernation: bool, seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module's docstring. Running a step ahead, a step with prompt tokens is not always done when
    step(wait=False) looks (emulated as in tests/worker/test_overlap.py): the engine then returns without reading it,
    with the step after it launched too, as the GPU worker's loop does while it takes requests."""
    engine = fuzz_engine
    engine.overlap = overlap
    if overlap:
        device = random.Random(seed)

        def done(self: Launched) -> bool:
            return device.random() < 0.5

        monkeypatch.setattr(Launched, "done", done)
    fuzz = Fuzz(engine, reference, seed, hibernation)
    taken, used, hibernated = fuzz.checkpoints.taken, fuzz.checkpoints.used, engine.hibernated
    fuzz.run(OPERATIONS)
    # The run did what it is for (else the operations' mix or SEEDS need another look): generations ended,
    # checkpoints were taken and put back, and room ran short.
    coverage = (fuzz.ended, fuzz.checkpoints.taken - taken, fuzz.checkpoints.used - used, fuzz.refused,
                engine.hibernated - hibernated)
    assert fuzz.ended >= 40 and coverage[1] > 0 and coverage[2] > 0, coverage
    assert (coverage[4] if hibernation else coverage[3]) > 0, coverage
