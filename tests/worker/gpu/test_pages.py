"""Sessions on the GPU backed page by page: growth as they decode (pages mapped between steps, a page ahead, the
CUDA graphs replaying over them), admission by free pages, a generation that cannot grow, hibernation to pinned host
memory and to disk with the same tokens, and 1,000 grow/close cycles back to the baseline device memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cuda_state import CapacityExhausted

from .device import UNDER_SANITIZER, device_free_bytes, needs_cuda
from .references import TOKENS, Reference, greedy, open_with

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")

MODEL = "random:smollm2-135m"
CONTEXT = 1024


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A GPU engine of 16 slots whose sessions may hold 40 pages together (80 tokens a page), hibernating to 64 MiB
    of pinned host memory and then to a store."""
    from worker.engine import Engine

    engine = Engine.load(model=MODEL, device="cuda", max_sessions=16, max_context=CONTEXT, state_pages=40,
                         host_cache_bytes=64 << 20, session_store=tmp_path_factory.mktemp("store"))
    yield engine
    engine.unload()


def fresh(engine: object) -> object:
    from worker.engine import Engine

    assert isinstance(engine, Engine)
    for sid in engine.sessions():
        engine.close(sid)
    engine.release_idle_slots(0.0)
    return engine


@pytest.mark.gpu
@needs_cuda
def test_gpu_sessions_grow_page_by_page_with_the_cpus_tokens(paged: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    eng = fresh(paged)
    assert isinstance(eng, Engine)
    table = eng.table
    assert table.page_bytes == 2 << 20 and table.spec.tokens_in(1, table.page_bytes) == 80  # 5 blocks of 16
    for ref in references[:4]:
        sid = open_with(eng, ref.prompt)
        assert eng.generate(sid, **greedy(TOKENS)).token_ids == ref.tokens
        s = eng._sessions[sid]
        assert table.pages(s.slot) == table.spec.pages_for(s.computed + 1 + table.ahead_tokens, table.page_bytes)
        eng.close(sid)
    eng.release_idle_slots(0.0)
    assert table.backend.mapped_pages == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_hibernation_to_host_and_disk_gives_the_same_tokens(paged: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    eng = fresh(paged)
    assert isinstance(eng, Engine)
    h = eng.hibernation
    assert h is not None
    for ref in references[:3]:
        sid = open_with(eng, ref.prompt)
        first = eng.generate(sid, **greedy(TOKENS // 2)).token_ids
        assert eng.hibernate(sid) and not eng.is_resident(sid)
        second = eng.generate(sid, **greedy(TOKENS // 4)).token_ids  # from pinned host memory
        h.host_limit_bytes = 0  # the next copy goes straight to disk
        assert eng.hibernate(sid) and eng.residency()[2] == 1
        h.host_limit_bytes = 64 << 20
        third = eng.generate(sid, **greedy(TOKENS - TOKENS // 2 - TOKENS // 4)).token_ids  # from disk
        assert first + second + third == ref.tokens
        eng.close(sid)


@pytest.mark.gpu
@needs_cuda
def test_gpu_admission_by_pages_and_a_generation_that_cannot_grow(paged: object,
                                                                  references: list[Reference]) -> None:
    from worker.engine import Engine

    eng = fresh(paged)
    assert isinstance(eng, Engine)
    h = eng.hibernation
    assert h is not None
    saved, h.host_limit_bytes, h.store = (h.host_limit_bytes, h.store), 0, None  # nothing may hibernate here
    try:
        ref = references[0]
        table = eng.table
        assert table.page_budget == 40 and table.capacity == 16
        hogs = []
        for _ in range(7):  # 400 tokens and 16 ahead: 5 pages each, 35 in all
            hog = eng.create_session()
            eng.append(hog, token_ids=[300 + i for i in range(400)])
            eng.generate(hog, max_tokens=1, ignore_eos=True)
            hogs.append(hog)
        assert table.backend.mapped_pages == 35
        sid = open_with(eng, ref.prompt)  # 1 page; 4 left: it may grow to 5 pages, 448 tokens (28 blocks)
        others = [eng.create_session() for _ in range(4)]  # a page each: every page is held, 4 slots still free
        with pytest.raises(CapacityExhausted, match="no free page"):
            eng.create_session()
        for other in others:
            eng.close(other)
        eng.release_idle_slots(0.0)
        out = eng.generate(sid, max_tokens=600, temperature=0.0, ignore_eos=True)
        assert out.finish_reason == "capacity" and eng.session_length(sid) == table.spec.tokens_in(5, table.page_bytes) + 1 == 449
        for hog in hogs:
            eng.close(hog)
        more = eng.generate(sid, max_tokens=10, temperature=0.0, ignore_eos=True)
        assert more.finish_reason == "length"  # intact, and it goes on
        assert (out.token_ids + more.token_ids)[:TOKENS] == ref.tokens
    finally:
        h.host_limit_bytes, h.store = saved


@pytest.mark.gpu
@needs_cuda
def test_gpu_grow_close_cycles_return_to_baseline(paged: object, references: list[Reference]) -> None:
    from worker.engine import Engine

    eng = fresh(paged)
    assert isinstance(eng, Engine)

    def cycle(i: int) -> None:
        sid = eng.create_session()
        eng.append(sid, token_ids=[100 + (i * 7 + j) % 1000 for j in range(1 + (i * 37) % 300)])
        eng.generate(sid, max_tokens=1 + i % 3, temperature=0.0, ignore_eos=True)
        eng.close(sid)

    for i in range(10):  # first uses (events, driver-internal pools) happen before the baseline
        cycle(i)
    eng.release_idle_slots(0.0)
    baseline = device_free_bytes()
    for i in range(100 if UNDER_SANITIZER else 1000):  # under memcheck every kernel is slow: what it checks, sooner
        cycle(i)
    eng.release_idle_slots(0.0)
    assert eng.table.backend.mapped_pages == 0
    if not UNDER_SANITIZER:  # the sanitizer keeps device memory of its own
        assert device_free_bytes() == baseline


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_session_moves_to_another_engine_with_the_same_tokens(paged: object, references: list[Reference]) -> None:
    """A move's two halves on the GPU: a resident session's snapshot (its slot's prefix through pinned host memory),
    taken into a second engine of the same model, which generates the tokens the session would have; a hibernated
    one moves too; a snapshot whose bytes changed is refused and leaves the target as it was."""
    from worker.engine import Engine
    from worker.engine.migration import MoveRefused

    eng = fresh(paged)
    assert isinstance(eng, Engine)
    target = Engine.load(model=MODEL, device="cuda", max_sessions=4, max_context=CONTEXT)
    try:
        for ref, hibernate in zip(references[:2], (False, True), strict=True):
            sid = open_with(eng, ref.prompt)
            first = eng.generate(sid, **greedy(5)).token_ids
            if hibernate:
                assert eng.hibernate(sid)
            snapshot = eng.export_session(sid)
            assert snapshot is not None and snapshot.nbytes == eng.table.spec.bytes_for(snapshot.computed)
            digest = snapshot.digest()
            bad = snapshot.state.clone()
            bad[len(bad) // 2] ^= 1
            corrupt = type(snapshot)(snapshot.session_id, snapshot.owner, snapshot.tokens, snapshot.computed,
                                     snapshot.model, snapshot.layout, bad)
            with pytest.raises(MoveRefused, match="checksum"):
                target.import_session(corrupt, digest)
            assert target.sessions() == [] and target.table.live == 0
            assert target.import_session(snapshot, digest) == sid
            eng.close(sid)
            rest = target.generate(sid, **greedy(TOKENS - 5)).token_ids
            assert first + rest == ref.tokens
            target.close(sid)
    finally:
        target.unload()
