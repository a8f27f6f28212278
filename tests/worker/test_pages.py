"""Sessions bounded by the tokens they hold: growth page by page, admission by free pages, a generation that cannot
grow, hibernation to host memory and to the session store, and a restart from the store. On the CPU, whose host
backend accounts pages exactly as the GPU maps them; here with pages of one block, 16 tokens of SmolLM2-135M in fp32
(46,080 bytes a token), so that sessions grow in a few tokens (a GPU page of 2 MiB holds 5 blocks, 80 tokens, in bf16)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cuda_state import CapacityExhausted
from cuda_state.select import select_backend
from worker.engine import Engine
from worker.engine.budget import AHEAD_TOKENS
from worker.engine.build import build_parts, open_table
from worker.engine.executor import EagerExecutor
from worker.engine.hibernation import SessionLost
from worker.engine.options import EngineOptions

MODEL = None  # the bundled SmolLM2-135M-Instruct: real text, so a state that came back wrong shows in the tokens
CONTEXT = 256
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
PAGE = 16 * TOKEN_BYTES  # one block of the slot layout
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from")
PROMPT: list[int] = []  # TEXT's 30 tokens (set by the model fixture, which every test takes)
_expected: dict[tuple[tuple[int, ...], tuple[int, ...]], list[list[int]]] = {}


class Model:
    """The bundled model loaded once for the module; each test's engine gets its own session table over it."""

    def __init__(self) -> None:
        self.parts = build_parts(MODEL, "cpu", 4, CONTEXT, None, EngineOptions.from_env())

    def engine(self, state_pages: int | None = None, host_page_bytes: int | None = PAGE, host_cache_bytes: int = 0,
               session_store: Path | None = None) -> Engine:
        parts = self.parts
        table = open_table(select_backend("cpu"), parts.model, 4, state_pages, host_page_bytes)
        eng = Engine(parts.model, parts.tokenizer, table, EagerExecutor(parts.model, table), parts.model_name,
                     parts.step_tokens)
        if host_cache_bytes or session_store is not None:
            eng.enable_hibernation(host_cache_bytes, session_store)
        return eng


def close(eng: Engine) -> None:
    """Give the table back (the shared model stays)."""
    for sid in eng.sessions():
        eng.close(sid)
    eng.table.close()


@pytest.fixture(scope="module")
def model() -> Model:
    m = Model()
    PROMPT[:] = m.parts.tokenizer.encode(TEXT)
    assert len(PROMPT) == 30, len(PROMPT)
    return m


@pytest.fixture(scope="module")
def reference(model: Model) -> Iterator[Engine]:
    """Every slot backed whole, nothing hibernates: the tokens every other engine must give."""
    eng = model.engine(host_page_bytes=None)
    yield eng
    close(eng)


def greedy(eng: Engine, sid: str, n: int) -> list[int]:
    return eng.generate(sid, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids


def expected(reference: Engine, prompt: list[int], turns: list[int]) -> list[list[int]]:
    """The tokens of `turns` greedy generations after `prompt`, uninterrupted (computed once per case)."""
    key = (tuple(prompt), tuple(turns))
    if key not in _expected:
        sid = reference.create_session()
        reference.append(sid, token_ids=prompt)
        _expected[key] = [greedy(reference, sid, n) for n in turns]
        reference.close(sid)
    return _expected[key]


def pages_after(eng: Engine, computed: int) -> int:
    """The pages a session holds after its rows reached `computed` + 1 positions: those and the ones ahead."""
    return eng.table.spec.pages_for(computed + 1 + AHEAD_TOKENS, PAGE)


def test_a_session_holds_its_tokens_rounded_to_a_page(model: Model, reference: Engine) -> None:
    eng = model.engine(state_pages=40)
    try:
        table = eng.table
        assert table.spec.token_bytes == TOKEN_BYTES and table.page_bytes == PAGE and table.page_budget == 40
        sid = eng.create_session()
        slot = eng._sessions[sid].slot
        assert table.pages(slot) == 1  # no token yet, 16 ahead
        eng.append(sid, token_ids=PROMPT)
        first = greedy(eng, sid, 4)
        assert eng._sessions[sid].computed == 33 and table.pages(slot) == pages_after(eng, 33) == 4
        second = greedy(eng, sid, 16)
        assert eng._sessions[sid].computed == 49 and table.pages(slot) == pages_after(eng, 49) == 5
        assert [first, second] == expected(reference, PROMPT, [4, 16])
        assert table.backend.mapped_pages == 5
        eng.close(sid)
        assert table.backend.mapped_pages == 0 and table.free_pages == 40
    finally:
        close(eng)


def test_admission_is_by_free_pages(model: Model) -> None:
    eng = model.engine(state_pages=5)
    try:
        a = eng.create_session()
        eng.append(a, token_ids=PROMPT)
        greedy(eng, a, 1)
        assert eng.table.pages(eng._sessions[a].slot) == 3  # 31 positions, 16 ahead
        b = eng.create_session()
        c = eng.create_session()  # the last two pages
        assert eng.table.free_pages == 0 and eng.free_slots == 0  # a slot is left, no page
        with pytest.raises(CapacityExhausted):
            eng.create_session()
        assert eng.sessions() == [a, b, c]
        eng.close(a)
        assert eng.free_slots == 2  # pages for 3, slots for 2
        eng.create_session()
    finally:
        close(eng)


def test_a_generation_that_cannot_grow_ends_capacity_and_its_session_goes_on(model: Model, reference: Engine) -> None:
    eng = model.engine(state_pages=4)
    try:
        a, b = eng.create_session(), eng.create_session()  # 1 page each (16 positions ahead), 2 left
        prompt = PROMPT[:10]
        eng.append(a, token_ids=prompt)
        first = eng.generate(a, max_tokens=50, temperature=0.0, ignore_eos=True)
        room = eng.table.spec.tokens_in(3, PAGE)
        assert first.finish_reason == "capacity" and room == 48 and eng.table.free_pages == 0
        # its last row was the page's last position: its token is the last one, pending as after any generation
        assert len(first.token_ids) == room - len(prompt) + 1
        assert eng.session_length(a) == room + 1 and eng._sessions[a].computed == room
        with pytest.raises(CapacityExhausted):
            eng.fork(a)
        eng.append(b, token_ids=PROMPT[:3])
        other = eng.generate(b, max_tokens=3, temperature=0.0, ignore_eos=True)
        assert other.finish_reason == "length"  # the other session is unaffected
        eng.close(b)  # its pages are free again: the session goes on where it stopped
        second = greedy(eng, a, 50 - len(first.token_ids))
        assert first.token_ids + second == expected(reference, prompt, [50])[0]
    finally:
        close(eng)


def test_hibernated_sessions_restore_and_give_the_same_tokens(model: Model, reference: Engine, tmp_path: Path) -> None:
    # host memory for a's 41 positions or b's 34 (3 blocks, 2.2 MB, each), not both
    eng = model.engine(host_cache_bytes=3 << 20, session_store=tmp_path)
    try:
        a, b = eng.create_session(owner="alice"), eng.create_session(owner="bob")
        eng.append(a, token_ids=PROMPT)
        eng.append(b, token_ids=PROMPT[::-1])
        turns_a = [greedy(eng, a, 12)]
        turns_b = [greedy(eng, b, 5)]
        assert eng.hibernate(a) and eng.hibernate(b)
        assert not eng.is_resident(a) and eng.residency() == (0, 1, 1)  # a went on to disk when b came
        assert eng.table.backend.mapped_pages == 0
        assert [p.name for p in tmp_path.glob("*.session*")] == [a + ".session"]
        turns_a.append(greedy(eng, a, 8))  # restored from disk
        turns_b.append(greedy(eng, b, 8))  # restored from host memory
        assert eng.residency() == (2, 0, 0) and not list(tmp_path.glob("*.session*"))  # a restore deletes the file
        assert turns_a == expected(reference, PROMPT, [12, 8])
        assert turns_b == expected(reference, PROMPT[::-1], [5, 8])
        assert eng.session_owner(a) == "alice" and eng.restored == 2
        child = eng.fork(a)
        assert eng.hibernate(a) and eng.hibernate(child)  # a to host memory, then to disk when its child comes
        assert eng.residency() == (1, 1, 1) and [p.name for p in tmp_path.glob("*.session*")] == [a + ".session"]
        eng.close(a)  # a hibernated session closes: its copy is gone too
        assert eng.residency() == (1, 1, 0) and not list(tmp_path.glob("*.session*"))
    finally:
        close(eng)


def test_the_least_recently_used_idle_session_hibernates_when_pages_run_out(model: Model, reference: Engine) -> None:
    eng = model.engine(state_pages=5, host_cache_bytes=64 << 20)
    try:
        a = eng.create_session()
        eng.append(a, token_ids=PROMPT)
        turns = [greedy(eng, a, 4)]  # 4 pages
        b = eng.create_session()  # the last one
        assert eng.table.free_slots == 0 and eng.free_slots == 2  # what the broker sees: a and b may hibernate
        c = eng.create_session()  # none left: a, idle longest, hibernates
        assert not eng.is_resident(a) and eng.is_resident(b) and eng.is_resident(c)
        # a comes back into the 3 free pages its 33 positions need; growing past them it takes b's (idle longest)
        turns.append(greedy(eng, a, 20))
        assert eng.is_resident(a) and not eng.is_resident(b) and eng.is_resident(c)
        assert turns == expected(reference, PROMPT, [4, 20])
        assert eng.hibernated == 2 and eng.restored == 1
    finally:
        close(eng)


def test_without_hibernation_a_full_table_refuses(model: Model) -> None:
    eng = model.engine(state_pages=1)
    try:
        eng.create_session()
        with pytest.raises(CapacityExhausted):
            eng.create_session()
    finally:
        close(eng)


def test_a_corrupt_or_missing_store_file_loses_that_session_only(model: Model, reference: Engine, tmp_path: Path) -> None:
    eng = model.engine(session_store=tmp_path)
    try:
        sids = [eng.create_session() for _ in range(3)]
        for sid in sids:
            eng.append(sid, token_ids=PROMPT)
            greedy(eng, sid, 4)
            assert eng.hibernate(sid)
        files = {sid: tmp_path / (sid + ".session") for sid in sids}
        data = bytearray(files[sids[0]].read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit of its state
        files[sids[0]].write_bytes(bytes(data))
        files[sids[1]].unlink()
        for sid in sids[:2]:
            with pytest.raises(SessionLost) as info:
                greedy(eng, sid, 4)
            assert info.value.code == "session_lost"
            with pytest.raises(SessionLost):
                eng.session_length(sid)  # gone for good, and said so
        assert (tmp_path / (sids[0] + ".session.corrupt")).exists()  # set aside for a person to look at
        assert greedy(eng, sids[2], 8) == expected(reference, PROMPT, [4, 8])[1]
        assert eng.sessions() == [sids[2]]
        eng.close(sids[0])  # closing a lost session is not an error
    finally:
        close(eng)


def test_a_new_engine_serves_the_sessions_its_store_holds(model: Model, reference: Engine, tmp_path: Path) -> None:
    eng = model.engine(session_store=tmp_path)
    a = eng.create_session(owner="alice")
    eng.append(a, token_ids=PROMPT)
    first = greedy(eng, a, 4)
    b = eng.create_session(owner="bob")
    eng.append(b, token_ids=[7, 8, 9])  # nothing computed yet: its history alone
    assert eng.persist() == 2
    eng.table.close()  # the worker stops: its sessions are in the store, not closed
    (tmp_path / "junk.session").write_bytes(b"not a session file")
    again = model.engine(session_store=tmp_path)
    try:
        assert sorted(again.sessions()) == sorted([a, b]) and again.residency() == (0, 0, 2)
        assert again.session_owner(a) == "alice" and again.session_owner(b) == "bob"
        assert again.session_length(b) == 3
        assert [first, greedy(again, a, 8)] == expected(reference, PROMPT, [4, 8])
        assert (tmp_path / "junk.session.corrupt").exists()
    finally:
        close(again)
