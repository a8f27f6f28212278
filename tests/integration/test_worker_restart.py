"""A worker stopped cleanly (SIGTERM) with a session store, and a new worker started with the same store: the
conversations go on through the real broker on loopback, with exactly the tokens they would have had, and a session
whose stored file was corrupted meanwhile answers session_lost, alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from client import SessionLost
from client.stack import LocalStack
from worker.cli import EXIT_STARTUP_FAILED
from worker.engine import Engine

from .cluster import TEST_ENV

MODEL = None  # the bundled SmolLM2-135M-Instruct: real text, so a state that came back wrong shows in the tokens
CONTEXT = 256
PROMPTS = ("The three most useful things to pack for a week of hiking in the mountains are",
           "Water boils at a lower temperature at altitude because")


def reference(engine: Engine, prompt: str, turns: list[int]) -> list[list[int]]:
    """The same model in this process (the shared engine), uninterrupted: the tokens every turn must give."""
    sid = engine.create_session()
    try:
        engine.append(sid, text=prompt)
        return [engine.generate(sid, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids for n in turns]
    finally:
        engine.close(sid)


def test_sessions_survive_a_worker_restart_through_the_store(tmp_path: Path, engine: Engine) -> None:
    store = tmp_path / "store"
    worker_args = ["--session-store", str(store)]
    with LocalStack(tmp_path, env=TEST_ENV) as stack:
        stack.start_broker()
        stack.start_worker("w1", model=MODEL, device="cpu", max_sessions=4, max_context=CONTEXT, extra=worker_args)
        stack.wait_for_workers({"w1"})
        with stack.client(timeout=60) as c:
            kept, spoiled = c.session(), c.session()
            length = kept.append(text=PROMPTS[0])
            spoiled.append(text=PROMPTS[1])
            first = kept.generate(max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
            spoiled.generate(max_tokens=3, temperature=0.0, ignore_eos=True)
            assert stack.workers["w1"].terminate(timeout=60) == 0  # drains, writes every session, says DISCONNECT
            files = sorted(p.name for p in store.iterdir() if p.name != ".lock")
            assert files == sorted([kept.id + ".session", spoiled.id + ".session"])
            path = store / (spoiled.id + ".session")
            data = bytearray(path.read_bytes())
            data[-40] ^= 0xFF  # a byte of its state, past the header
            path.write_bytes(bytes(data))
            stack.start_worker("w2", model=MODEL, device="cpu", max_sessions=4, max_context=CONTEXT,
                               extra=worker_args)
            stack.wait_for_workers({"w2"})
            second = kept.generate(max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
            assert [first, second] == reference(engine, PROMPTS[0], [12, 12])
            assert len(set(first + second)) > 4  # real tokens, not one repeated: a wrong state would show
            with pytest.raises(SessionLost):
                spoiled.generate(max_tokens=3, temperature=0.0, ignore_eos=True)
            third = kept.generate(max_tokens=4, temperature=0.0, ignore_eos=True).token_ids  # nothing else affected
            assert len(third) == 4 and kept.info().length == length + 28
            assert not (store / (kept.id + ".session")).exists()  # restored: in a slot again, its file gone


def test_a_second_worker_on_the_same_store_refuses_to_start(tmp_path: Path) -> None:
    """Two workers on one store: the second listed the first one's hibernated sessions as its own, the broker dropped
    them there as claimed twice, and the drop deleted the files the first one restores from (session_lost). Now the
    second worker refuses to start, naming the store, and the first one's session goes on."""
    store = tmp_path / "store"
    worker_args = ["--session-store", str(store), "--hibernate-after", "0.2"]
    with LocalStack(tmp_path, env=TEST_ENV) as stack:
        stack.start_broker()
        stack.start_worker("w1", model="random:tiny", device="cpu", max_sessions=4, max_context=64, extra=worker_args)
        stack.wait_for_workers({"w1"})
        with stack.client(timeout=30) as c:
            s = c.session()
            s.append(token_ids=[1, 2, 3, 4, 5])
            first = s.generate(max_tokens=4, temperature=0.0, ignore_eos=True).token_ids
            file = store / (s.id + ".session")
            deadline = time.monotonic() + 10
            while not file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert file.exists()  # hibernated to disk: w1 restores it from this file
            second = stack.start_worker("w2", model="random:tiny", device="cpu", max_sessions=4, max_context=64,
                                        extra=worker_args)
            assert second.proc.wait(timeout=30) == EXIT_STARTUP_FAILED
            assert f"session store {store} is in use by another worker (pid {stack.workers['w1'].pid})" in \
                second.log_text()
            assert file.exists()
            assert len(s.generate(max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4
            assert len(first) == 4
