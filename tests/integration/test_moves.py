"""Sessions that move between workers, through the real broker and workers on loopback (CPU, the bundled SmolLM2:
real text, so a state that arrived wrong shows in the tokens). SIGTERM on a worker moves its sessions to the other
worker, mid-conversation, with exactly the tokens an undisturbed run gives. `broker drain` and `broker rebalance` as
commands, and each failure of a move, are in test_move_failures.py."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest
import torch

from client import AsyncClient, AsyncSession
from worker.engine import Engine

from .cluster import Cluster

MODEL = None  # the bundled SmolLM2-135M-Instruct
CONTEXT = 256
SESSIONS = 16
TURNS = (4, 8, 4, 4)  # tokens generated per turn: w1 is stopped during the second, the last runs once it is gone


def prompt(i: int) -> str:
    return f"Write one sentence about the number {i} and a city whose name starts with the letter {'ABCDEFGHIJKLMNOP'[i]}."


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The daemons run beside this process: two OpenMP pools spinning on two cores crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference(engine: Engine, prompts: list[str], turns: tuple[int, ...]) -> list[list[list[int]]]:
    """The same conversations in this process (the shared engine, 8 sessions at a time: a row's tokens do not depend
    on its batch), undisturbed: per session, the tokens of every turn."""
    out: list[list[list[int]]] = []
    for at in range(0, len(prompts), 8):
        sids = [engine.create_session() for _ in prompts[at:at + 8]]
        for sid, text in zip(sids, prompts[at:at + 8], strict=True):
            engine.append(sid, text=text)
        batch: list[list[list[int]]] = [[] for _ in sids]
        for n in turns:
            results = engine.generate_many([(sid, {"max_tokens": n, "temperature": 0.0, "ignore_eos": True})
                                            for sid in sids])
            for tokens, result in zip(batch, results, strict=True):
                tokens.append(result.token_ids)
        for sid in sids:
            engine.close(sid)
        out += batch
    return out


async def streamed(session: AsyncSession, n: int) -> list[int]:
    stream = await session.generate(max_tokens=n, temperature=0.0, ignore_eos=True, stream=True)
    tokens: list[int] = []
    async for chunk in stream:
        tokens += chunk.token_ids
    return tokens


@pytest.mark.slow
def test_sigterm_moves_every_session_to_the_other_worker(cluster: Cluster, engine: Engine, one_thread: None) -> None:
    """16 sessions on w1, mid-conversation (streams running), w1 gets SIGTERM: every generation running finishes on
    w1, every session moves to w2 and its next turns run there, with the tokens of an undisturbed run; no client sees
    an error, and w1 exits 0 once its sessions are gone."""
    prompts = [prompt(i) for i in range(SESSIONS)]
    cluster.start_broker()
    cluster.start_worker("w1", model=MODEL, max_sessions=SESSIONS, max_context=CONTEXT)
    cluster.wait_for_workers({"w1"})

    async def run() -> tuple[list[list[list[int]]], list[str]]:
        async with AsyncClient(cluster.clients, timeout=120) as client:
            sessions = [await client.session() for _ in prompts]
            assert {s.worker for s in sessions} == {"w1"}
            cluster.start_worker("w2", model=MODEL, max_sessions=SESSIONS, max_context=CONTEXT)  # loads meanwhile
            firsts = await asyncio.gather(*(s.generate(max_tokens=TURNS[0], temperature=0.0, ignore_eos=True,
                                                       prompt=text) for s, text in zip(sessions, prompts, strict=True)))
            await asyncio.get_running_loop().run_in_executor(None, cluster.wait_for_workers, {"w1", "w2"})

            async def rest(s: AsyncSession) -> list[list[int]]:
                return [await streamed(s, TURNS[1]), await streamed(s, TURNS[2])]

            tasks = [asyncio.ensure_future(rest(s)) for s in sessions]
            await asyncio.sleep(0.3)  # the second turn's streams are running
            w1 = cluster.workers["w1"].proc
            w1.send_signal(signal.SIGTERM)
            later = await asyncio.gather(*tasks)
            assert await asyncio.get_running_loop().run_in_executor(None, lambda: w1.wait(timeout=60)) == 0
            where = [(await s.info()).worker for s in sessions]
            lasts = await asyncio.gather(*(s.generate(max_tokens=TURNS[3], temperature=0.0, ignore_eos=True)
                                           for s in sessions))
            return [[first.token_ids, *turns, last.token_ids]
                    for first, turns, last in zip(firsts, later, lasts, strict=True)], where

    got, where = asyncio.run(run())
    assert where == ["w2"] * SESSIONS
    assert cluster.broker is not None and cluster.broker.log_text().count('"session_moved"') == SESSIONS
    assert got == reference(engine, prompts, TURNS)
    assert len({t for session in got for turn in session for t in turn}) > 20  # real text, not one token repeated
