"""A turn whose resumed session cannot take it, streamed or not, named or not: on the gateway's Service in process,
against fake sessions. Where the worker refuses the new part alone (prompt_boundary, as with Qwen3's or Llama 3's
templates), the same session is given the whole conversation from its start (from_start); where the session is gone,
the turn starts over in a new session."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from client.errors import PromptBoundary, SessionLost
from client.gateway import schema
from client.gateway.errors import ApiError
from client.gateway.metrics import GatewayMetrics
from client.gateway.service import Ask, Live, Service, chat_ask
from client.gateway.sessions import SessionStore
from client.results import Chunk, Generation

FIRST = [{"role": "user", "content": "Capital of France?"}]
NEXT = [*FIRST, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "And Spain?"}]


class FakeStream:
    def __init__(self, result: Generation) -> None:
        self._result, self.ready = result, False
        self.result: Generation | None = None

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        if self.result is not None:
            raise StopAsyncIteration
        self.result = self._result
        return Chunk(self._result.token_ids, self._result.text, self._result.finish_reason)

    def close(self) -> None:
        pass


class FakeSession:
    """Answers "Hi" after 10 prompt tokens; refuses a turn sent with boundary_check (a resumed one). Sent the whole
    conversation from its start, it keeps all but one of its tokens and appends 10. `gone`: a resumed turn finds it
    lost."""

    def __init__(self, log: list[str], ids: itertools.count[int], gone: bool = False) -> None:
        self.id, self.log, self.ids, self.gone = f"s{next(ids)}", log, ids, gone
        self.max_context, self.length, self.gate = 1024, 0, asyncio.Event()
        self.fork_error: Exception | None = None
        self.gate.set()

    async def generate(self, stream: bool = False, **kw: Any) -> Generation | FakeStream:
        how = " checked" if kw.get("boundary_check") else " from_start" if kw.get("from_start") else ""
        self.log.append(f"{self.id} generate{how}")
        await self.gate.wait()
        if self.gone and (kw.get("boundary_check") or kw.get("from_start")):  # a resumed turn's
            raise SessionLost(f"session {self.id}: its hibernated state was lost")
        if kw.get("boundary_check"):
            raise PromptBoundary("the model's chat template renders the session's last answer otherwise")
        rewound = 1 if kw.get("from_start") else 0
        result = Generation([7, 8], "Hi", "stop", self.length - rewound + 13, 10, rewound=rewound)
        self.length = result.session_length
        return FakeStream(result) if stream else result

    async def fork(self) -> FakeSession:
        if self.fork_error is not None:
            self.log.append(f"{self.id} fork refused")
            raise self.fork_error
        child = FakeSession(self.log, self.ids, self.gone)
        child.length = self.length
        return child

    def close_soon(self) -> asyncio.Task[None]:
        self.log.append(f"{self.id} closed")

        async def closed() -> None:
            pass

        return asyncio.get_running_loop().create_task(closed())


class FakeClient:
    def __init__(self, gone: bool) -> None:
        self.gone = gone
        self._transport = SimpleNamespace(closed=False)
        self.log: list[str] = []
        self.ids = itertools.count()
        self.opening = asyncio.Event()
        self.opening.set()

    async def session(self, model: str) -> FakeSession:
        await self.opening.wait()
        return FakeSession(self.log, self.ids, self.gone)


class FakeModels:
    async def check(self, model: str) -> None:
        pass


def service(gone: bool = True) -> tuple[Service, FakeClient]:
    client = FakeClient(gone)
    return Service(client, SessionStore(), FakeModels(), GatewayMetrics()), client  # type: ignore[arg-type]


def ask(messages: list[dict[str, str]], name: str | None = None, stream: bool = False, n: int = 1) -> Ask:
    request = schema.ChatRequest(model="m", messages=messages, n=n, temperature=0, max_tokens=2,  # type: ignore[arg-type]
                                 stream=stream)
    return chat_ask(request, "alice", name)


async def turn(svc: Service, a: Ask) -> Live:
    if not a.stream:
        return await svc.complete(a)
    live, deltas = await svc.stream(a)
    async for _ in deltas:
        pass
    return live


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_starts_over_in_a_new_session_not_in_another_idle_one(stream: bool) -> None:
    """Two idle sessions hold the same conversation (n = 2 at temperature 0): the one resumed is gone, and the turn
    goes to a new session, not to the other (which could be gone too)."""
    async def main() -> tuple[list[str], Live, int]:
        svc, client = service()
        await svc.complete(ask(FIRST, n=2))
        client.log.clear()
        live = await turn(svc, ask(NEXT, stream=stream))
        return client.log, live, svc.store.idle

    log, live, idle = asyncio.run(main())
    assert log == ["s0 generate checked", "s0 closed", "s2 generate"]
    assert live.usage().prompt_tokens == 10 and live.usage().cached_tokens == 0 and idle == 2  # s1 and s2


@pytest.mark.parametrize("stream", [False, True])
def test_a_name_deleted_during_a_turn_that_starts_over_stays_deleted(stream: bool) -> None:
    async def main() -> tuple[list[str], int, bool]:
        svc, client = service()
        await svc.complete(ask(FIRST, name="conv"))
        held = svc.store.named("alice", "conv")
        assert held is not None
        client.log.clear()
        gate = held.session.gate  # type: ignore[attr-defined]
        gate.clear()  # the resumed turn waits on the worker
        task = asyncio.create_task(turn(svc, ask(NEXT, name="conv", stream=stream)))
        await asyncio.sleep(0.01)
        assert await svc.close_named("alice", "conv")
        gate.set()  # the session is gone: the turn starts over
        await task
        return client.log, svc.store.idle, svc.store.named("alice", "conv") is None

    log, idle, gone = asyncio.run(main())
    assert log == ["s0 generate checked", "s0 closed", "s1 generate", "s1 closed"] and (idle, gone) == (0, True)


def test_a_name_is_busy_while_its_turn_starts_over() -> None:
    async def main() -> tuple[int, str, str]:
        svc, client = service()
        await svc.complete(ask(FIRST, name="conv"))
        client.opening.clear()  # the new session's open takes a while
        first = asyncio.create_task(svc.complete(ask(NEXT, name="conv")))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as busy:
            await svc.complete(ask(NEXT, name="conv"))
        client.opening.set()
        live = await first
        named = svc.store.named("alice", "conv")
        assert named is not None
        return busy.value.status, live.entries[0].session.id, named.session.id

    assert asyncio.run(main()) == (409, "s1", "s1")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("first_turn", [False, True])
def test_a_delete_while_a_named_session_opens_is_done_once_it_is_open(stream: bool, first_turn: bool) -> None:
    """While a named turn's session opens (its first turn, or a start over), the name is in no live session: a DELETE
    then is kept and done when the session is open (it was a 404, and the session kept the name)."""
    async def main() -> tuple[bool, list[str], bool]:
        svc, client = service()
        if not first_turn:
            await svc.complete(ask(FIRST, name="conv"))
        client.log.clear()
        client.opening.clear()  # the session's open takes a while
        task = asyncio.create_task(turn(svc, ask(FIRST if first_turn else NEXT, name="conv", stream=stream)))
        await asyncio.sleep(0.01)
        deleted = await svc.close_named("alice", "conv")
        client.opening.set()
        await task
        return deleted, client.log, svc.store.named("alice", "conv") is None and not svc.store.deleting

    deleted, log, gone = asyncio.run(main())
    opened = "s0" if first_turn else "s1"
    assert deleted and gone and log[-2:] == [f"{opened} generate", f"{opened} closed"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_a_refused_new_part_is_sent_whole_to_the_same_session(stream: bool, n: int) -> None:
    """The worker refuses the new turns alone (prompt_boundary): the same session is sent the whole conversation from
    its start, and keeps its name; no session is closed or opened. Usage counts the whole prompt (the 13 tokens held,
    less the 1 dropped, plus the 10 appended) and as cached the 12 kept."""
    async def main() -> tuple[list[str], Live, str | None]:
        svc, client = service(gone=False)
        await svc.complete(ask(FIRST, name="conv"))
        client.log.clear()
        live = await turn(svc, ask(NEXT, name="conv", stream=stream, n=n))
        named = svc.store.named("alice", "conv")
        return client.log, live, None if named is None else named.session.id

    log, live, named = asyncio.run(main())
    choices = ["s0 generate", "s1 generate"] if n == 2 else []  # n = 2: the prefill's session and its fork
    assert log[:2] == ["s0 generate checked", "s0 generate from_start"] and sorted(log[2:]) == choices
    assert named == "s0"  # (and no session closed)
    usage = live.usage()
    assert (usage.prompt_tokens, usage.cached_tokens) == (22, 12)


@pytest.mark.parametrize("stream", [False, True])
def test_an_edited_conversation_goes_whole_to_its_named_session(stream: bool) -> None:
    """A named session whose conversation the request does not continue (the first message edited) is not replaced:
    it is sent the whole conversation from its start, once, and keeps its name."""
    async def main() -> tuple[list[str], str | None]:
        svc, client = service(gone=False)
        await svc.complete(ask(FIRST, name="conv"))
        client.log.clear()
        edited = [{"role": "user", "content": "Capital of Italy?"}, *NEXT[1:]]
        await turn(svc, ask(edited, name="conv", stream=stream))
        named = svc.store.named("alice", "conv")
        return client.log, None if named is None else named.session.id

    assert asyncio.run(main()) == (["s0 generate from_start"], "s0")


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_asked_again_goes_to_a_fork_of_the_session_that_gave_it(stream: bool) -> None:
    """Without a name: a request that is a session's history less its last answer ("regenerate") goes to a fork of
    that session, sent from its start; the session itself stays idle for its own branch (another user may have
    opened with the same messages), and a request that continues it takes it; another conversation opens a new
    session."""
    async def main() -> tuple[list[str], int]:
        svc, client = service(gone=False)
        await svc.complete(ask(FIRST))  # s0: FIRST + "Hi"
        await turn(svc, ask(FIRST, stream=stream))  # again: s1, a fork of s0, from its start
        await svc.complete(ask([*FIRST, {"role": "assistant", "content": "Hi"}, NEXT[-1]]))  # s0 goes on
        await svc.complete(ask([{"role": "user", "content": "Other?"}]))  # s2
        return client.log, svc.store.idle

    log, idle = asyncio.run(main())
    assert log == ["s0 generate", "s1 generate from_start",
                   "s0 generate checked", "s0 generate from_start",  # (the fake refuses checked turns)
                   "s2 generate"]
    assert idle == 3


@pytest.mark.parametrize("stream", [False, True])
def test_an_edited_earlier_message_goes_to_a_fork_of_the_session_that_shares_the_turns_before_it(stream: bool) -> None:
    """Without a name: a request that shares a session's conversation up to an answer and goes on otherwise (the
    message after that answer edited) goes to a fork of that session, sent from its start, which keeps what the two
    share; the session stays for its own branch."""
    async def main() -> tuple[list[str], int, float]:
        svc, client = service(gone=False)
        await svc.complete(ask(FIRST))  # s0: FIRST + "Hi"
        await svc.complete(ask(NEXT))  # s0: NEXT + "Hi" (resumed: refused checked, then from its start)
        client.log.clear()
        await turn(svc, ask([*NEXT[:2], {"role": "user", "content": "And Italy?"}], stream=stream))  # s1: a fork
        await svc.complete(ask([*NEXT, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More?"}]))
        branches = svc.metrics.opened.labels("branch")._value.get()
        return client.log, svc.store.idle, branches

    log, idle, branches = asyncio.run(main())
    assert log == ["s1 generate from_start", "s0 generate checked", "s0 generate from_start"]
    assert (idle, branches) == (2, 1)


def test_a_regenerate_whose_fork_fails_looks_for_a_branch_only_then() -> None:
    """The regenerate's session is lost when it is forked: it is closed, and the branch lookup that follows (made
    after that fork, not before it) does not find it again: the request opens a new session."""
    async def main() -> tuple[list[str], float]:
        svc, client = service(gone=False)
        await svc.complete(ask(FIRST))  # s0
        await svc.complete(ask(NEXT))  # s0 holds NEXT + "Hi"
        await svc.complete(ask([*NEXT[:2], {"role": "user", "content": "And Italy?"}]))  # s1: a fork of s0
        s0 = next(e for e in svc.store._idle if e.session.id == "s0")
        s1 = next(e for e in svc.store._idle if e.session.id == "s1")
        svc.discard(s0, "ended")  # only s1 left: its history less its answer, and its first answer, match
        s1.session.fork_error = SessionLost("session s1: its hibernated state was lost")  # type: ignore[attr-defined]
        client.log.clear()
        await svc.complete(ask([*NEXT[:2], {"role": "user", "content": "And Italy?"}]))  # asks s1's answer again
        return client.log, svc.metrics.closed.labels("gone")._value.get()

    log, gone = asyncio.run(main())
    assert log == ["s1 fork refused", "s1 closed", "s2 generate"] and gone == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_on_a_worker_older_than_from_start_is_replaced_not_sent_it(stream: bool) -> None:
    """Its worker would ignore from_start and append the whole conversation after the session's tokens: a refused new
    part starts over in a new session, an edited named conversation gets a new session, and no generate goes out with
    from_start."""
    async def main() -> list[str]:
        svc, client = service(gone=False)
        await svc.complete(ask(FIRST, name="conv"))
        held = svc.store.named("alice", "conv")
        assert held is not None
        held.session.takes_from_start = False
        await turn(svc, ask(NEXT, name="conv", stream=stream))  # refused (checked): a new session
        fresh = svc.store.named("alice", "conv")
        assert fresh is not None
        fresh.session.takes_from_start = False
        await turn(svc, ask([{"role": "user", "content": "Capital of Italy?"}], name="conv", stream=stream))  # edited
        return client.log

    log = asyncio.run(main())
    assert not [line for line in log if "from_start" in line]
    assert log == ["s0 generate", "s0 generate checked", "s0 closed", "s1 generate", "s1 closed", "s2 generate"]
