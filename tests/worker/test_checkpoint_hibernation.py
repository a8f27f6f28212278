"""A hybrid session's recurrent-state checkpoint (worker.engine.checkpoints) goes with it into hibernation: host
memory, the session store's files, a worker started again on that store. Restored, the session's next rewritten turn
starts from the checkpoint instead of its first token, and gives transformers' greedy tokens (fp32, CPU) on a
Qwen3.5 folder transformers wrote. A checkpoint is only a shortcut: a companion file that is corrupt or of other
tokens is deleted and the session computes its context from the start, with the same tokens."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker import test_qwen3_5
from tests.worker.test_from_start import Model, finish, run
from worker.engine import Engine, SamplingParams
from worker.engine.hibernation import CHECKPOINT_MAGIC, DIGEST_BYTES
from worker.engine.migration import MoveRefused

pytest.importorskip("transformers")

ONE = 1 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    hybrid = test_qwen3_5.write_folder(tmp_path_factory.mktemp("checkpoint_hibernation"))
    return Model(hybrid.path, hybrid.prompts, recurrent=True)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (see tests/worker/test_qwen3_5.py's one_thread)
    yield
    torch.set_num_threads(threads)


def load(model: Model, store: Path | None = None, host: int = 64 * ONE, **options: Any) -> Engine:
    engine = Engine.load(str(model.path), device="cpu", max_sessions=options.pop("max_sessions", 4), max_context=256,
                         step_tokens=64, **options)
    engine.enable_hibernation(host, store)
    return engine


def answered(engine: Engine, sid: str, prompt: list[int], n: int) -> list[int]:
    [answer] = run(engine, [(sid, n, {"prompt_ids": prompt})])
    return answer


def regenerate(engine: Engine, sid: str, prompt: list[int], n: int) -> tuple[int, list[int]]:
    """The session's answer asked again (its context cut back to the prompt): what it computed before the step, and
    the tokens."""
    rid = engine.start_generate(sid, SamplingParams(max_tokens=n, ignore_eos=True), prompt_ids=prompt,
                                from_start=True)
    return engine.session_computed(sid), finish(engine, rid)


def test_a_hibernated_session_keeps_its_checkpoint_in_host_memory(model: Model) -> None:
    engine = load(model)
    cps = engine.checkpoints
    assert cps is not None
    prompt = model.prompts[1]
    sid = engine.create_session()
    answer = answered(engine, sid, prompt, 6)
    assert answer == model.greedy(prompt, 6)
    assert engine.hibernate(sid) and not engine.is_resident(sid) and len(cps) == 0
    stored = engine.hibernation.host[sid]  # type: ignore[union-attr]
    assert (stored.checkpoint_at, stored.checkpoint_bytes) == (len(prompt) - 1, engine.table.spec.bytes_for(0))
    assert engine.hibernation.host_bytes == stored.held  # type: ignore[union-attr]
    computed, again = regenerate(engine, sid, prompt, 6)
    assert computed == len(prompt) - 1  # only the prompt's last token runs again
    assert again == answer
    assert (cps.restored, cps.used) == (1, 1)
    engine.unload()


def test_a_checkpoint_survives_a_restart_through_the_store(model: Model, tmp_path: Path) -> None:
    """Two sessions persist at a clean stop; the worker started again on the store has each one's checkpoint back.
    One turn goes on from where its prompt ended (the next turn's context keeps the prompt and cuts the answer), the
    other's answer is asked again; both give transformers' tokens."""
    store = tmp_path / "store"
    first = load(model, store)
    a, b = first.create_session("a"), first.create_session("b")
    pa, pb = model.prompts[1], model.prompts[0]
    answer_a, answer_b = answered(first, a, pa, 5), answered(first, b, pb, 5)
    assert first.persist() == 2
    assert sorted(p.name for p in store.iterdir() if p.name != ".lock") == [
        "a.checkpoint", "a.session", "b.checkpoint", "b.session"]
    first.unload()

    again = load(model, store)
    assert sorted(again.sessions()) == ["a", "b"]
    computed, got = regenerate(again, b, pb, 5)
    assert (computed, got) == (len(pb) - 1, answer_b)
    edited = pa + answer_a[:2] + [7, 8, 9]
    computed, got = regenerate(again, a, edited, 6)
    assert computed == len(pa) - 1
    assert got == model.greedy(edited, 6)
    assert again.checkpoints is not None and again.checkpoints.restored == 2
    assert sorted(p.name for p in store.iterdir() if p.name != ".lock") == []  # restored: the files go
    again.unload()


def rewrite(path: Path, change: Any) -> None:
    """A checkpoint file with its header changed by `change`, its digest made again (a valid file, wrong content)."""
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data, len(CHECKPOINT_MAGIC))
    start = len(CHECKPOINT_MAGIC) + 8
    head = json.loads(data[start : start + length])
    change(head)
    new = json.dumps(head, separators=(",", ":")).encode()
    body = CHECKPOINT_MAGIC + struct.pack("<Q", len(new)) + new + data[start + length : -DIGEST_BYTES]
    path.write_bytes(body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest())


@pytest.mark.parametrize("damage", ["bit flipped", "other tokens", "past the session", "cut short", "orphan"])
def test_a_bad_checkpoint_file_is_deleted_and_the_session_computes_again(model: Model, tmp_path: Path,
                                                                          damage: str) -> None:
    store = tmp_path / "store"
    first = load(model, store)
    prompt = model.prompts[1]
    sid = first.create_session("s")
    answer = answered(first, sid, prompt, 5)
    assert first.persist() == 1
    first.unload()
    path = store / "s.checkpoint"
    if damage == "bit flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "other tokens":
        rewrite(path, lambda head: head.update(tokens="0" * 32))
    elif damage == "past the session":
        rewrite(path, lambda head: head.update(at=10_000))
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:100])
    else:
        (store / "s.session").rename(store / "gone.bin")
    again = load(model, store)
    if damage == "orphan":
        assert again.sessions() == [] and not path.exists()
        again.unload()
        return
    computed, got = regenerate(again, sid, prompt, 5)
    assert computed == 0 and got == answer  # from the start, the same tokens
    assert not path.exists()
    assert again.checkpoints is not None and again.checkpoints.restored == 0
    again.unload()


def test_a_checkpoint_that_does_not_fit_the_host_is_left_behind(model: Model) -> None:
    """Host memory that holds the session's state but not its checkpoint too: it hibernates without one (no store to
    spill to), and its regenerate computes the prompt again."""
    probe = load(model, max_sessions=1)
    prompt = model.prompts[1]
    nbytes = probe.table.spec.bytes_for(len(prompt) + 5)
    probe.unload()
    engine = load(model, host=nbytes)
    sid = engine.create_session()
    answer = answered(engine, sid, prompt, 6)
    assert engine.hibernate(sid)
    assert engine.hibernation.host[sid].checkpoint_at == 0  # type: ignore[union-attr]
    computed, again = regenerate(engine, sid, prompt, 6)
    assert (computed, again) == (0, answer)
    engine.unload()


def hybrid(**options: Any) -> Engine:
    options.setdefault("max_sessions", 4)
    return Engine.load("random:tiny-qwen3.5", device="cpu", max_context=128, **options)


def answered_now(engine: Engine, sid: str, ids: list[int]) -> None:
    engine.create_session(sid)
    engine.append(sid, token_ids=ids)
    engine.generate(sid, max_tokens=3, temperature=0.0, ignore_eos=True)


def counted(engine: Engine) -> tuple[int, int]:
    """What the host counts, and what its copies hold."""
    h = engine.hibernation
    assert h is not None
    return h.host_bytes, sum(s.held for s in h.host.values())


def test_a_checkpoint_file_that_cannot_be_written_leaves_the_host_count_right(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk for checkpoint files only: the sessions are written without theirs, the host's count of its
    copies' bytes stays what they hold (it kept a checkpoint's bytes counted, and later hibernations failed), and the
    sessions come back with their tokens."""
    import worker.engine.hibernation as hibernation

    real = hibernation._write_file

    def no_room_for_checkpoints(path: Path, magic: bytes, header: dict[str, object], state: torch.Tensor) -> None:
        if magic == CHECKPOINT_MAGIC:
            raise OSError(28, "No space left on device")
        real(path, magic, header, state)

    monkeypatch.setattr(hibernation, "_write_file", no_room_for_checkpoints)
    engine, ref = hybrid(), hybrid()
    engine.enable_hibernation(64 * ONE, tmp_path)
    for x in (engine, ref):
        answered_now(x, "a", [1, 2, 3, 4, 5])
    assert engine.hibernate("a") and counted(engine)[0] > 0
    assert engine.persist() == 1
    assert counted(engine) == (0, 0) and engine.hibernation.host_checkpoint_bytes == 0  # type: ignore[union-attr]
    assert not (tmp_path / "a.checkpoint").exists() and (tmp_path / "a.session").exists()
    answered_now(engine, "b", [7, 8])
    assert engine.hibernate("b") and counted(engine)[0] == counted(engine)[1]
    for x in (engine, ref):
        x.append("a", token_ids=[9, 9])
    got, want = (x.generate("a", max_tokens=4, temperature=0.0, ignore_eos=True).token_ids for x in (engine, ref))
    assert got == want
    engine.unload()
    ref.unload()


def test_checkpoints_in_host_memory_give_way_to_a_sessions_state() -> None:
    """Host memory for two sessions' state and no store: the first hibernates with its checkpoint, and the second
    still hibernates, the first's checkpoint let go to make its room."""
    probe = hybrid()
    nbytes = probe.table.spec.bytes_for(8)
    probe.unload()
    engine = hybrid()
    engine.enable_hibernation(2 * nbytes, None)
    for sid in ("a", "b"):
        answered_now(engine, sid, [1, 2, 3, 4, 5])
    assert engine.hibernate("a")
    h = engine.hibernation
    assert h is not None and h.host["a"].checkpoint_at == 4
    assert h.host_bytes == nbytes + engine.table.spec.bytes_for(0) == counted(engine)[1]
    assert engine.hibernate("b")
    assert h.host["a"].checkpoint is None and h.host_bytes == 2 * nbytes == counted(engine)[1]
    engine.unload()


def test_a_session_named_like_a_temporary_file_survives_a_restart(tmp_path: Path) -> None:
    """The start-up cleanup of writes a crash cut short deletes `*.session.tmpN` and `*.checkpoint.tmpN` only, not a
    session whose id has ".checkpoint.tmp1" in it."""
    sid = "notes.checkpoint.tmp1"
    engine, ref = hybrid(), hybrid()
    engine.enable_hibernation(64 * ONE, tmp_path)
    for x in (engine, ref):
        answered_now(x, sid, [1, 2, 3, 4, 5])
    assert engine.persist() == 1
    (tmp_path / "other.session.tmp123").write_bytes(b"a write cut short")
    engine.unload()
    again = hybrid()
    again.enable_hibernation(64 * ONE, tmp_path)
    assert again.sessions() == [sid] and not (tmp_path / "other.session.tmp123").exists()
    assert again.generate(sid, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids == \
        ref.generate(sid, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids
    again.unload()
    ref.unload()


@pytest.mark.parametrize("hibernated", [False, True], ids=["resident", "hibernated"])
def test_a_moved_session_takes_its_checkpoint_where_the_target_takes_one(model: Model, tmp_path: Path,
                                                                         hibernated: bool) -> None:
    """A move that asks for the checkpoint (the target said it takes them) carries it after the state, resident or
    hibernated on the source: the target's regenerate starts from it, with transformers' tokens. A move that does not
    ask carries the state alone, as before: the same digest, and the target computes the context again."""
    source = load(model, tmp_path / "store" if hibernated else None)
    prompt = model.prompts[1]
    sid = source.create_session("m")
    answer = answered(source, sid, prompt, 5)
    if hibernated:
        assert source.persist() == 1  # on disk: the export reads both files
    bare = source.export_session(sid)
    snapshot = source.export_session(sid, checkpoint=True)
    assert bare is not None and snapshot is not None
    assert (bare.checkpoint_at, snapshot.checkpoint_at) == (0, len(prompt) - 1)
    assert snapshot.nbytes == bare.nbytes + source.table.spec.bytes_for(0) == bare.nbytes + snapshot.checkpoint_bytes
    assert snapshot.digest() != bare.digest()
    for moved, computed in ((snapshot, len(prompt) - 1), (bare, 0)):
        target = load(model)
        assert target.import_session(moved, moved.digest()) == sid
        assert regenerate(target, sid, prompt, 5) == (computed, answer)
        target.unload()
    broken = load(model)
    snapshot.checkpoint_at += 1  # not what the digest covers
    with pytest.raises(MoveRefused, match="digest"):
        broken.import_session(snapshot, bare.digest())
    with pytest.raises(MoveRefused, match="checkpoint"):
        broken.check_import(sid, list(snapshot.tokens), snapshot.computed, snapshot.nbytes, snapshot.model,
                            snapshot.layout, snapshot.computed + 1, snapshot.checkpoint_bytes)
    broken.unload()
    source.unload()


def test_a_running_turns_checkpoint_is_not_taken_for_another(model: Model) -> None:
    """A turn reserves the last free slot for its checkpoint; another session's turn, with no slot free, takes no slot
    that is any session's latest checkpoint, nor the one the running turn has not taken yet: both turns keep theirs
    where they have them."""
    engine = load(model)
    cps = engine.checkpoints
    assert cps is not None
    a = engine.create_session()
    answered(engine, a, model.prompts[0], 1)
    d = engine.create_session()
    ra = engine.start_generate(a, SamplingParams(max_tokens=4, ignore_eos=True), prompt_ids=list(range(30, 50)))
    assert engine.table.free_slots == 0
    rd = engine.start_generate(d, SamplingParams(max_tokens=4, ignore_eos=True), prompt_ids=list(range(60, 90)))
    finish(engine, ra)
    assert sorted(cp.at for cp in cps.of(a)) == [len(model.prompts[0]) - 1, len(model.prompts[0]) + 20]
    assert cps.of(d) == [] and rd
    engine.unload()


def test_a_growing_session_gives_its_own_checkpoints_before_anyone_hibernates() -> None:
    """Pages short for a generation's growth: the checkpoints go, its own session's too, before an idle session
    hibernates (only a fork's parent keeps its checkpoints past hibernations: its child shares them)."""
    engine = hybrid(max_sessions=6, host_page_bytes=4096, state_pages=28)
    engine.enable_hibernation(64 * ONE, None)
    a = engine.create_session()
    for ids, n in ((list(range(10, 30)), 1), (list(range(30, 50)), 1)):
        answered(engine, a, ids, n)
    assert engine.checkpoints is not None and len(engine.checkpoints.of(a)) == 2
    b = engine.create_session()
    answered(engine, a, list(range(50, 90)), 8)
    assert engine.is_resident(b) and engine.hibernated == 0
    engine.unload()


def fail_checkpoint_loads(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy into a slot of 0 positions (a checkpoint's: its fixed-size state only) fails once its bytes are in."""
    real = engine.table.load_prefix

    def failing(slot: int, tokens: int, state: torch.Tensor) -> None:
        real(slot, tokens, state)
        if tokens == 0:
            raise RuntimeError("copy failed")

    monkeypatch.setattr(engine.table, "load_prefix", failing)


def test_a_moved_checkpoint_that_cannot_be_loaded_leaves_the_session_in(model: Model,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint is a shortcut: a failure copying it in (its slot's state, 0 positions) leaves the moved session
    imported without one, no slot held for it, rather than a session the move reports failed."""
    source = load(model)
    prompt = model.prompts[1]
    sid = source.create_session("m")
    answer = answered(source, sid, prompt, 5)
    snapshot = source.export_session(sid, checkpoint=True)
    assert snapshot is not None and snapshot.checkpoint is not None
    target = load(model)
    fail_checkpoint_loads(target, monkeypatch)
    assert target.import_session(snapshot, snapshot.digest()) == sid
    assert target.table.live == 1 and target.checkpoints is not None and len(target.checkpoints) == 0
    assert regenerate(target, sid, prompt, 5) == (0, answer)
    target.unload()
    source.unload()


def test_a_restored_checkpoint_that_cannot_be_loaded_leaves_the_session_restored(
        model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a restore from hibernation: the session is back in its slot, its host copy let go, and its next
    regenerate computes the prompt again."""
    engine = load(model)
    prompt = model.prompts[1]
    sid = engine.create_session()
    answer = answered(engine, sid, prompt, 5)
    assert engine.hibernate(sid)
    fail_checkpoint_loads(engine, monkeypatch)
    engine.restore(sid)
    assert engine.is_resident(sid) and sid not in engine.hibernation.host  # type: ignore[union-attr]
    assert engine.table.live == 1 and engine.checkpoints is not None and len(engine.checkpoints) == 0
    assert regenerate(engine, sid, prompt, 5) == (0, answer)
    engine.unload()
