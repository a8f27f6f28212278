"""Sessions through hibernation, the session store and moves, on the CPU engine of the tiny presets: a restore that
must make room by spilling host copies (its own among them), files cut short or not of this layout, sessions whose ids
are no file names, the free slots the broker places by, and a hybrid session whose state ran ahead of its history."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from cuda_state import CapacityExhausted
from worker.engine import Engine
from worker.engine.hibernation import DIGEST_BYTES, MAGIC, SessionLost
from worker.engine.migration import MoveRefused

HYB = "random:tiny-qwen3.5"


def load(preset: str = HYB, **options: Any) -> Engine:
    options.setdefault("max_sessions", 4)
    options.setdefault("max_context", 128)
    return Engine.load(preset, device="cpu", **options)


def greedy(engine: Engine, sid: str, n: int) -> list[int]:
    return engine.generate(sid, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids


@pytest.mark.parametrize("preset", ["random:tiny", HYB, "random:tiny-qwen3.5-moe"])
def test_restore_whose_eviction_spills_the_restoring_session(preset: str, tmp_path: Path) -> None:
    nb = load(preset, max_sessions=1).table.spec.bytes_for(20)
    e = load(preset, max_sessions=1, host_cache_bytes=nb, session_store=tmp_path)
    ref = load(preset, max_sessions=2)
    for x in (e, ref):
        x.create_session("A")
        x.append("A", token_ids=list(range(1, 17)))
        greedy(x, "A", 3)
    assert e.hibernate("A")
    for x in (e, ref):
        x.create_session("B")
        x.append("B", token_ids=list(range(30, 46)))
        greedy(x, "B", 3)
    e.restore("A")  # B hibernates for the slot; the host overflows; its oldest copy (A itself) spills to disk
    assert e.is_resident("A")
    assert greedy(e, "A", 5) == greedy(ref, "A", 5)
    assert greedy(e, "B", 5) == greedy(ref, "B", 5)


def test_store_file_cut_inside_its_length_field_is_set_aside(tmp_path: Path) -> None:
    e = load(HYB, session_store=tmp_path)
    for s in ("good", "victim"):
        e.create_session(s)
        e.append(s, token_ids=[1, 2, 3])
        greedy(e, s, 2)
    assert e.persist() == 2
    f = tmp_path / "victim.session"
    f.write_bytes(f.read_bytes()[:12])
    again = load(HYB, session_store=tmp_path)
    assert again.sessions() == ["good"]


def test_unstorable_id_in_host_memory_blocks_spills_and_persist(tmp_path: Path) -> None:
    nb = load(HYB).table.spec.bytes_for(16)
    e = load(HYB, host_cache_bytes=2 * nb, session_store=tmp_path)
    for i, s in enumerate(["chat:1", "b", "c"]):
        e.create_session(s)
        e.append(s, token_ids=[1 + i, 2, 3])
        greedy(e, s, 2)
    assert e.hibernate("chat:1") and e.hibernate("b")
    assert e.hibernate("c")  # "chat:1", the oldest, cannot go to disk: "b" does
    e.persist()  # "chat:1" cannot be written; the others are
    assert (tmp_path / "b.session").exists()


def test_free_slots_counts_only_sessions_that_can_hibernate() -> None:
    nb = load(HYB).table.spec.bytes_for(16)
    e = load(HYB, max_sessions=2, host_cache_bytes=nb)
    for s in ("a", "b"):
        e.create_session(s)
        e.append(s, token_ids=[1, 2, 3, 4])
        greedy(e, s, 2)
    e.create_session("c")  # a hibernates: the host cache is now full, nothing else can hibernate
    advertised = e.free_slots
    made = 0
    for i in range(advertised):
        try:
            e.create_session(f"n{i}")
            made += 1
        except CapacityExhausted:
            pass
    assert made == advertised, f"free_slots said {advertised}, {made} creates succeeded"


def test_hybrid_generate_after_a_stop_when_state_ran_ahead() -> None:
    """GPU default (overlap): a hybrid generation ending on a stop token leaves computed == len(tokens); a move
    carries that to any engine (here: a CPU one, overlap off) and the next generate with no new prompt crashes."""
    src = load(HYB)
    src.overlap = True
    ref = load(HYB)
    for x in (src, ref):
        x.create_session("y")
        x.append("y", token_ids=[1, 2, 3, 4, 5])
        x.generate("y", max_tokens=20, temperature=0.0, stop_token_ids=[107], ignore_eos=True)
    while src.has_work():
        src.step()
    snap = src.export_session("y")
    assert snap is not None
    cpu = load(HYB)
    cpu.import_session(snap, snap.digest())
    assert greedy(cpu, "y", 5) == greedy(ref, "y", 5)


def test_empty_state_session_read_back_from_the_store(tmp_path: Path) -> None:
    """random:tiny has no fixed-size state: a session with 0 computed tokens has a 0-byte state."""
    e = load("random:tiny", session_store=tmp_path)
    e.create_session("empty")
    e.create_session("prompted")
    e.append("prompted", token_ids=[7, 8, 9])
    assert e.persist() == 2
    again = load("random:tiny", session_store=tmp_path)
    again.append("empty", token_ids=[5, 6])
    assert len(greedy(again, "prompted", 2)) == 2


def test_failed_restore_does_not_leak_a_slot(tmp_path: Path) -> None:
    """A store file whose header's nbytes != bytes_for(computed) (valid checksum): refused as SessionLost, no slot kept."""
    e = load(HYB, session_store=tmp_path)
    e.create_session("s")
    e.append("s", token_ids=[1, 2, 3, 4])
    greedy(e, "s", 20)
    e.persist()
    f = tmp_path / "s.session"
    data = f.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 8)
    head = json.loads(data[16:16 + n])
    head["computed"] = 5
    h = json.dumps(head, separators=(",", ":")).encode()
    new = MAGIC + struct.pack("<Q", len(h)) + h + data[16 + n:-DIGEST_BYTES]
    f.write_bytes(new + hashlib.blake2b(new, digest_size=DIGEST_BYTES).digest())
    again = load(HYB, session_store=tmp_path)
    live = again.table.live
    with pytest.raises(SessionLost, match="its stored state is"):
        again.restore("s")
    with pytest.raises(SessionLost):
        again.restore("s")  # lost for good
    assert again.table.live == live and "s" not in again.sessions()


def test_state_of_other_weights_under_the_same_name_is_not_served(tmp_path: Path) -> None:
    """random:tiny:1 and random:tiny:2 are both "random-tiny" (as two quantizations of one GGUF, or two fine-tunes in
    folders of one name): a store written by one was served by the other, K/V of other weights taken as its own, and
    a move between them was taken too. Now both are refused; the same weights serve the store again."""
    first = load("random:tiny:1", session_store=tmp_path / "store")
    first.create_session("s")
    first.append("s", token_ids=list(range(1, 30)))
    greedy(first, "s", 3)
    snap = first.export_session("s")
    assert snap is not None
    other = load("random:tiny:2", session_store=tmp_path / "other")
    assert other.model_name == first.model_name == "random-tiny"
    with pytest.raises(MoveRefused, match="another build, configuration or weights"):
        other.import_session(snap, snap.digest())
    assert first.persist() == 1
    assert load("random:tiny:2", session_store=tmp_path / "store").sessions() == []
    assert (tmp_path / "store" / "s.session").exists()  # left for the weights that wrote it
    assert load("random:tiny:1", session_store=tmp_path / "store").sessions() == ["s"]


def test_weights_identity_follows_content_not_place(tmp_path: Path) -> None:
    from worker.model.loader import weights_identity

    data = bytes(range(256)) * 8192  # 2 MiB
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.gguf").write_bytes(data)
    changed = bytearray(data)
    changed[-4096:] = bytes(4096)  # inside the last window (the same size: only the sampled bytes differ)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "m.gguf").write_bytes(bytes(changed))
    ids = [weights_identity([tmp_path / name / "m.gguf"]) for name in ("a", "b", "c")]
    assert ids[0] == ids[1] != ids[2]


def test_a_write_that_fails_leaves_no_part_and_the_session_serves(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while a session hibernates to the store: its partial .tmp file stayed, one per session tried,
    holding the space a full disk lacks until the worker restarted. Now it is removed; the session stays resident."""
    e = load("random:tiny", session_store=tmp_path)
    ref = load("random:tiny")
    for x in (e, ref):
        x.create_session("s")
        x.append("s", token_ids=list(range(1, 40)))
        greedy(x, "s", 2)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert not e.hibernate("s")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.glob("*.session*")) == []
    assert e.is_resident("s") and e.residency() == (1, 0, 0)
    assert greedy(e, "s", 5) == greedy(ref, "s", 5)
    assert e.hibernate("s") and [p.name for p in tmp_path.glob("*.session*")] == ["s.session"]


@pytest.mark.parametrize("preset", ["random:tiny", HYB, "random:tiny-qwen3.5-moe"])
def test_stored_and_moved_state_is_read_at_any_context_that_holds_it(preset: str, tmp_path: Path) -> None:
    """A slot's prefix is the same bytes at any --max-context: a worker restarted with a longer context served none of
    its store's sessions (the layout named the context), and moves between workers of different contexts were
    refused. Now a longer context serves them with an uninterrupted run's tokens; a shorter one serves those that fit
    and leaves the others' files in place."""
    store = tmp_path / "store"
    first = load(preset, max_context=64, session_store=store)
    ref = load(preset, max_context=128)
    for x in (first, ref):
        for sid, n in (("short", 10), ("long", 40)):
            x.create_session(sid)
            x.append(sid, token_ids=list(range(1, n + 1)))
            greedy(x, sid, 3)
    moved = first.export_session("short")
    assert moved is not None
    longer = load(preset, max_context=128)
    assert longer.import_session(moved, moved.digest()) == "short"
    ref.fork("short", "short-moved")
    assert greedy(longer, "short", 6) == greedy(ref, "short-moved", 6)
    assert first.persist() == 2
    first.table.close()
    again = load(preset, max_context=128, session_store=store)
    assert sorted(again.sessions()) == ["long", "short"]
    assert greedy(again, "long", 6) == greedy(ref, "long", 6)
    assert again.persist() == 2  # "long" now holds 49 tokens, "short" 16
    again.table.close()
    shorter = load(preset, max_context=32, session_store=store)
    assert shorter.sessions() == ["short"]
    assert greedy(shorter, "short", 5) == greedy(ref, "short", 5)
    assert (store / "long.session").exists()  # left for a worker whose context holds it


def test_an_unloaded_engine_lets_go_of_its_store(tmp_path: Path) -> None:
    """Each engine with a store held the store's lock descriptor open for good: loads and unloads in one process (a
    worker reloading, the tests) added one each. Now unload closes it, and another process may take the store."""
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        e = load(HYB, session_store=tmp_path)
        e.unload()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_session_no_file_can_name_hibernates_where_others_can_spill(tmp_path: Path) -> None:
    """Host memory for one and a half sessions, and a store: a session whose id names no file hibernates into host
    memory, the storable copy there spilling to disk for it (it stayed resident: the host's count charged it for a
    copy that could go)."""
    e = load(HYB, host_cache_bytes=int(1.5 * load(HYB).table.spec.bytes_for(20)), session_store=tmp_path)
    for sid, first in (("s", 10), ("n/1", 40)):
        e.create_session(sid)
        e.append(sid, token_ids=list(range(first, first + 20)))
        greedy(e, sid, 1)
        assert e.checkpoints is not None
        e.checkpoints.drop(sid)
    assert e.hibernate("s") and "s" in e.hibernation.host  # type: ignore[union-attr]
    assert e.hibernate("n/1")
    assert "n/1" in e.hibernation.host and "s" in e.hibernation.disk  # type: ignore[union-attr]
