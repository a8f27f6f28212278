"""Sessions bounded by the tokens they hold: growth page by page, admission by free pages, a generation that cannot
grow, hibernation to host memory and to the session store, and a restart from the store. On the CPU, whose host
backend accounts pages exactly as the GPU maps them (2 MiB each): SmolLM2-135M's shape in fp32 holds 46,080 bytes a
token, so a page holds 45 tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cuda_state import CapacityExhausted
from worker.engine import Engine
from worker.engine.budget import AHEAD_TOKENS
from worker.engine.hibernation import SessionLost

MODEL = None  # the bundled SmolLM2-135M-Instruct: real text, so a state that came back wrong shows in the tokens
CONTEXT = 512
PAGE_TOKENS = 45  # (2 MiB) // 46,080 bytes
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from")
PROMPT: list[int] = []  # TEXT's 30 tokens (set by the reference fixture): within the first page


def load(**kwargs: object) -> Engine:
    args: dict[str, object] = {"model": MODEL, "device": "cpu", "max_sessions": 4, "max_context": CONTEXT}
    args.update(kwargs)
    return Engine.load(**args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference() -> Iterator[Engine]:
    """Every slot backed whole, nothing hibernates: the tokens every other engine must give."""
    eng = load()
    PROMPT[:] = eng.tokenizer.encode(TEXT)
    assert len(PROMPT) == 30, len(PROMPT)
    yield eng
    eng.unload()


def greedy(eng: Engine, sid: str, n: int) -> list[int]:
    return eng.generate(sid, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids


def expected(reference: Engine, prompt: list[int], turns: list[int]) -> list[list[int]]:
    sid = reference.create_session()
    try:
        reference.append(sid, token_ids=prompt)
        return [greedy(reference, sid, n) for n in turns]
    finally:
        reference.close(sid)


def test_a_session_holds_its_tokens_rounded_to_a_page(reference: Engine) -> None:
    eng = load(state_pages=40)
    try:
        table = eng.table
        assert table.spec.token_bytes == 30 * 2 * 3 * 64 * 4 == 46_080 and table.page_bytes == 2 << 20
        assert table.spec.tokens_in(1, table.page_bytes) == PAGE_TOKENS and table.page_budget == 40
        sid = eng.create_session()
        slot = eng._sessions[sid].slot
        assert table.pages(slot) == 1  # the first page: 0 tokens and the 16 ahead
        eng.append(sid, token_ids=PROMPT)
        first = greedy(eng, sid, 10)
        # 39 positions computed (the last token pending); its rows reached 40, 16 ahead of that: 56 -> 2 pages
        assert eng._sessions[sid].computed == 39 and table.pages(slot) == 2
        second = greedy(eng, sid, 70)
        computed = eng._sessions[sid].computed
        assert computed == 109 and table.pages(slot) == table.spec.pages_for(computed + 1 + AHEAD_TOKENS,
                                                                                table.page_bytes) == 3
        assert [first, second] == expected(reference, PROMPT, [10, 70])
        assert table.backend.mapped_pages == 3
        eng.close(sid)
        assert table.backend.mapped_pages == 0 and table.free_pages == 40
    finally:
        eng.unload()


def test_admission_is_by_free_pages() -> None:
    eng = load(state_pages=4)
    try:
        a = eng.create_session()
        eng.append(a, token_ids=PROMPT * 3)  # 90 tokens
        greedy(eng, a, 1)
        assert eng.table.pages(eng._sessions[a].slot) == 3  # 91 + 16 ahead
        b = eng.create_session()
        assert eng.free_slots == 0  # 2 slots left, no page
        with pytest.raises(CapacityExhausted):
            eng.create_session()
        assert eng.sessions() == [a, b]
        eng.close(a)
        assert eng.free_slots == 3
        eng.create_session()
    finally:
        eng.unload()


def test_a_generation_that_cannot_grow_ends_capacity_and_its_session_goes_on(reference: Engine) -> None:
    eng = load(state_pages=2)
    try:
        a, b = eng.create_session(), eng.create_session()  # a page each: no page is left
        eng.append(a, token_ids=PROMPT)
        first = eng.generate(a, max_tokens=30, temperature=0.0, ignore_eos=True)
        assert first.finish_reason == "capacity"
        # the last row fits the page (position 44): its token is the last one, pending as after any generation
        assert len(first.token_ids) == PAGE_TOKENS - len(PROMPT) + 1
        assert eng.session_length(a) == PAGE_TOKENS + 1 and eng._sessions[a].computed == PAGE_TOKENS
        with pytest.raises(CapacityExhausted):
            eng.fork(a)
        eng.append(b, token_ids=PROMPT[:3])
        other = eng.generate(b, max_tokens=3, temperature=0.0, ignore_eos=True)
        assert other.finish_reason == "length"  # the other session is unaffected
        eng.close(b)  # its page is free again: the session goes on where it stopped
        second = greedy(eng, a, 30 - len(first.token_ids))
        assert first.token_ids + second == expected(reference, PROMPT, [30])[0]
    finally:
        eng.unload()


def test_hibernated_sessions_restore_and_give_the_same_tokens(reference: Engine, tmp_path: Path) -> None:
    eng = load(host_cache_bytes=4 << 20, session_store=tmp_path)  # room for a's 79 tokens (3.6 MB), not b's too
    try:
        a, b = eng.create_session(owner="alice"), eng.create_session(owner="bob")
        eng.append(a, token_ids=PROMPT)
        eng.append(b, token_ids=PROMPT[::-1])
        turns_a = [greedy(eng, a, 50)]
        turns_b = [greedy(eng, b, 5)]
        assert eng.hibernate(a) and eng.hibernate(b)
        assert not eng.is_resident(a) and eng.residency() == (0, 1, 1)  # a spilled to disk when b came
        assert eng.table.backend.mapped_pages == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == [a + ".session"]
        turns_a.append(greedy(eng, a, 20))  # restored from disk
        turns_b.append(greedy(eng, b, 20))  # restored from host memory
        assert eng.residency() == (2, 0, 0) and not list(tmp_path.iterdir())  # a restore deletes the file
        assert turns_a == expected(reference, PROMPT, [50, 20])
        assert turns_b == expected(reference, PROMPT[::-1], [5, 20])
        assert eng.session_owner(a) == "alice"
        child = eng.fork(a)
        assert eng.hibernate(a) and eng.hibernate(child)  # 99 tokens: 4.6 MB, more than the host holds: to disk
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a + ".session", child + ".session"])
        eng.close(a)  # a hibernated session closes: its copy is gone too
        assert eng.residency() == (1, 0, 1) and [p.name for p in tmp_path.iterdir()] == [child + ".session"]
    finally:
        eng.unload()


def test_the_least_recently_used_idle_session_hibernates_when_pages_run_out(reference: Engine) -> None:
    eng = load(state_pages=3, host_cache_bytes=64 << 20)
    try:
        a = eng.create_session()
        eng.append(a, token_ids=PROMPT)
        turns = [greedy(eng, a, 10)]  # 2 pages
        b = eng.create_session()  # the last page
        c = eng.create_session()  # none left: a, idle longest, hibernates
        assert not eng.is_resident(a) and eng.is_resident(b) and eng.is_resident(c)
        # a comes back into the free page (its 39 tokens fit one); growing past it, it takes b's: b idled longest
        turns.append(greedy(eng, a, 10))
        assert eng.is_resident(a) and not eng.is_resident(b) and eng.is_resident(c)
        assert turns == expected(reference, PROMPT, [10, 10])
        assert eng.hibernated == 2 and eng.restored == 1
    finally:
        eng.unload()


def test_without_hibernation_a_full_table_refuses() -> None:
    eng = load(state_pages=1)
    try:
        eng.create_session()
        with pytest.raises(CapacityExhausted):
            eng.create_session()
    finally:
        eng.unload()


def test_a_corrupt_or_missing_store_file_loses_that_session_only(reference: Engine, tmp_path: Path) -> None:
    eng = load(session_store=tmp_path)
    try:
        sids = [eng.create_session() for _ in range(3)]
        for sid in sids:
            eng.append(sid, token_ids=PROMPT)
            greedy(eng, sid, 5)
            assert eng.hibernate(sid)
        files = {sid: tmp_path / (sid + ".session") for sid in sids}
        data = bytearray(files[sids[0]].read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit of its state
        files[sids[0]].write_bytes(bytes(data))
        files[sids[1]].unlink()
        for sid in sids[:2]:
            with pytest.raises(SessionLost) as info:
                greedy(eng, sid, 5)
            assert info.value.code == "session_lost"
            with pytest.raises(SessionLost):
                eng.session_length(sid)  # gone for good, and said so
        assert (tmp_path / (sids[0] + ".session.corrupt")).exists()  # set aside for a person to look at
        assert greedy(eng, sids[2], 5) == expected(reference, PROMPT, [5, 5])[1]
        assert eng.sessions() == [sids[2]]
        eng.close(sids[0])  # closing a lost session is not an error
    finally:
        eng.unload()


def test_a_new_engine_serves_the_sessions_its_store_holds(reference: Engine, tmp_path: Path) -> None:
    eng = load(session_store=tmp_path)
    a = eng.create_session(owner="alice")
    eng.append(a, token_ids=PROMPT)
    first = greedy(eng, a, 12)
    b = eng.create_session(owner="bob")
    eng.append(b, token_ids=[7, 8, 9])  # nothing computed yet: its history alone
    assert eng.persist() == 2
    eng.unload()
    (tmp_path / "junk.session").write_bytes(b"not a session file")
    again = load(session_store=tmp_path)
    try:
        assert sorted(again.sessions()) == sorted([a, b]) and again.residency() == (0, 0, 2)
        assert again.session_owner(a) == "alice" and again.session_owner(b) == "bob"
        assert again.session_length(b) == 3
        assert [first, greedy(again, a, 12)] == expected(reference, PROMPT, [12, 12])
        assert (tmp_path / "junk.session.corrupt").exists()
    finally:
        again.unload()
