"""A request's turn on the broker: find or open its session, append only what the session lacks, generate.

One AsyncClient for the whole gateway (one asyncio client of the broker). A turn is one GENERATE that appends the
new part of the conversation (chat messages rendered by the worker, text or token ids) and generates, streamed or
not. n > 1 choices are forks of the prompt's session: a prefill-only GENERATE (max_tokens 0) computes the prompt
once, then n - 1 forks and the session itself each generate one choice, each computing one token of the prompt.

A resumed session whose worker refuses the new part (prompt_boundary: the model's template renders the last answer
otherwise once turns follow it, as Qwen3 drops its reasoning, or the text's tokens would merge across the boundary) is
sent the whole conversation instead, from its start (GENERATE's from_start): the worker keeps the tokens the session
holds that the whole conversation's start with and computes the rest (a model with a recurrent state computes it all
again, unless it kept everything). A session that is gone (lost, expired) is replaced by a new one given the whole
conversation.

Token accounting (usage): a session's tokens after a turn are the prompt's (`session_length` before, less the
`rewound` tokens a from_start turn dropped, plus `appended`), the generated ones, and the stop token when one ended
it. `cached_tokens`: the prompt tokens whose state the session already held, as the worker answers (`cached`); a
resumed session usually had `length - 1` (the last token of a generation stays uncomputed until the next turn,
worker.engine), fewer after a cancelled prefill or where a recurrent state could not be cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from broker.common.protocol import TokenLogprob
from client.aio import AsyncClient, AsyncSession, AsyncStream
from client.errors import (
    CapacityExhausted,
    ClientError,
    PromptBoundary,
    SessionExpired,
    SessionLost,
    SessionNotFound,
)
from client.gateway import schema
from client.gateway.errors import bad_request, from_client_error, session_busy
from client.gateway.metrics import GatewayMetrics
from client.gateway.models import Models
from client.gateway.reasoning import Reasoner, Splitter
from client.gateway.sessions import (
    EMPTY,
    Entry,
    Kind,
    SessionStore,
    Turn,
    chain,
    marked_turn,
    message_of,
    of_tools,
    template_start,
)
from client.gateway.tool_calls import Call, CallStream, ToolParser, id_prefix
from client.results import Chunk, Generation

log = structlog.get_logger()

MAX_EVICTIONS = 8  # idle sessions closed to make room for one new session before answering 429
GONE = (SessionLost, SessionNotFound, SessionExpired)
# A resumed session cannot take the turn (gone, or its new part would not give the whole conversation's tokens): the
# request holds the whole conversation, which the session (or, gone, a new one) is given from its start.
START_OVER = (*GONE, PromptBoundary)


@dataclass(frozen=True)
class Ask:
    """What a request asks, whichever endpoint: its whole conversation and how to answer it."""

    owner: str
    model: str
    kind: Kind
    history: tuple[Turn, ...] | str | tuple[int, ...]  # the whole conversation (chat) or prompt (completions)
    sampling: schema.Sampling
    n: int = 1
    name: str | None = None  # session_id
    stream: bool = False
    digests: tuple[bytes, ...] = ()  # chat: chain(history, template_start(template_args))
    template_args: tuple[tuple[str, Any], ...] = ()  # chat: chat_template_kwargs, in the order given
    reasoner: Reasoner | None = None  # chat with --reasoning-parser: how its answers split into reasoning and content
    tools: str = ""  # chat: the functions the model may call (JSON text for the template), "" for none
    tool_parser: ToolParser | None = None  # chat with tools and --tool-call-parser: how its answers' calls are read

    @property
    def of_tools(self) -> bool:
        """Whether the turn gives tools or its conversation has function calls, their results or an answer's
        reasoning sent back: rendered whole only (the worker's rule), so its session's next turn is sent whole."""
        if self.tools:
            return True
        return self.kind == "chat" and any(of_tools(turn[1]) for turn in self.history)  # type: ignore[index]


@dataclass
class Answer:
    """One choice, finished."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str | None = None  # with a reasoning parser: the reasoning (then `text` is the content, "" for none)
    tool_calls: list[Call] = field(default_factory=list)  # with a tool call parser: the calls read in the answer


@dataclass
class SplitStream:
    """A streamed answer's reasoning, content and function calls, as `Live._split` reads the whole answer: the
    reasoning split off first, the calls read in the content."""

    reasoning: Splitter | None
    calls: CallStream | None

    def feed(self, text: str, last: bool) -> tuple[str, str, list[Call]]:
        """(reasoning, content, calls) that this piece lets go; `last`: the answer's last piece (all goes)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if last:
                held = self.reasoning.flush()
                reasoning, content = reasoning + held[0], content + held[1]
        made: list[Call] = []
        if self.calls is not None:
            content = self.calls.feed(content)
            if last:
                rest, made = self.calls.finish()
                content += rest
        return reasoning, content, made


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class Delta:
    """Streamed: choice `index` moved (chunk), or ended (chunk.finish_reason set)."""

    index: int
    chunk: Chunk


class Live:
    """A turn in progress: its sessions, what they held before, and (streamed) the choices' streams."""

    def __init__(self, service: Service, ask: Ask, entries: list[Entry], before: int, resumed: bool,
                 appended: int | None, started: float, pending: NewPart | None = None) -> None:
        self.service = service
        self.pending = pending  # what choice 0's GENERATE appends first (n == 1; n > 1: the prefill did)
        self.ask = ask
        self.entries = entries
        self.before = before  # the session's tokens before the turn
        self.resumed = resumed
        self.appended = appended  # the prompt tokens appended (known once a generation or the prefill answered)
        self.rewound = 0  # a from_start turn's: the session's tokens it dropped first
        self.reported_cached: int | None = None  # the prompt tokens whose state the session held, as its worker says
        self.started = started
        self.results: list[Generation | None] = [None] * len(entries)
        self.first_token_at: float | None = None
        self.sent_tokens = 0  # streamed: the tokens of the chunks handed on so far, every choice's
        self.settled = False
        self._call_ids = id_prefix()
        self._streams: dict[int, SplitStream] = {}  # streamed, with a reasoning or tool call parser: each choice's

    @property
    def from_start(self) -> bool:
        """Whether the turn sends the whole conversation to a resumed session (its new part was refused)."""
        return self.pending is not None and self.pending.from_start

    @property
    def cached(self) -> int:
        if not self.resumed:
            return 0
        if self.reported_cached is not None:
            return self.reported_cached
        # (A worker that does not say, older than from_start:) all but the last generated one, which is pending.
        return max(0, self.before - 1)

    def took(self, result: Generation | None) -> None:
        """What choice 0's GENERATE (or the prefill) appended, dropped and found computed, from its answer."""
        if self.appended is None and result is not None:
            self.appended, self.rewound, self.reported_cached = result.appended, result.rewound, result.cached

    def usage(self) -> Usage:
        completion = sum(len(r.token_ids) for r in self.results if r is not None)
        return Usage(self.before - self.rewound + (self.appended or 0), completion, self.cached)

    def answers(self) -> list[Answer]:
        out = []
        for i, r in enumerate(self.results):
            if r is not None:
                reasoning, content, calls = self._split(r.text, i)
                finish = "tool_calls" if calls else _finish(r.finish_reason)
                out.append(Answer(i, list(r.token_ids), content, finish, list(r.logprobs), reasoning, calls))
        return out

    def _split(self, text: str, index: int) -> tuple[str | None, str, list[Call]]:
        """(reasoning, content, function calls) of an answer's text: no reasoning without a reasoning parser, no calls
        without tools and a tool call parser."""
        reasoning, content = None, text
        if self.ask.reasoner is not None:
            reasoning, split = self.ask.reasoner.split(text)
            content = split or ""
        if self.ask.tool_parser is None:
            return reasoning, content, []
        content, calls = self.ask.tool_parser.parse(content, self.call_ids(index))
        return reasoning, content, calls

    def split_stream(self, index: int) -> SplitStream:
        """Choice `index`'s streamed text split as `_split` splits the whole answer (one per choice: it holds text)."""
        split = self._streams.get(index)
        if split is None:
            split = self._streams[index] = SplitStream(
                None if self.ask.reasoner is None else self.ask.reasoner.splitter(),
                None if self.ask.tool_parser is None else CallStream(self.ask.tool_parser, self.call_ids(index)))
        return split

    def call_ids(self, index: int) -> str:
        """Choice `index`'s function calls' id prefix: the same calls, read again (whole, streamed, kept), get the same
        ids."""
        return f"{self._call_ids}{index}-"

    def finish(self) -> None:
        """Every choice answered: keep the sessions with their new history, marked inexact where their tokens may not
        be that history's (an answer cut at a stop string, past a stop token the text leaves out...): their next turn
        is sent whole from its start, and keeps what matches."""
        if self.settled:
            return
        self.settled = True
        service, ask = self.service, self.ask
        usage = self.usage()
        for index, (entry, result) in enumerate(zip(self.entries, self.results, strict=True)):
            if result is None:
                service.discard(entry, "ended")
                continue
            stop_token = result.session_length - usage.prompt_tokens - len(result.token_ids)
            cut = result.finish_reason == "cancelled" or (result.finish_reason == "stop" and stop_token == 0)
            if ask.kind != "chat" and stop_token:
                cut = True  # the text the client holds has no stop token: it no longer starts with the session's
            if ask.kind != "ids" and not _text_is_tokens(ask.kind, ask.sampling, result, stop_token):
                cut = True
            reasoning, content, calls = self._split(result.text, index)
            if reasoning is not None or ask.of_tools:
                # The client holds the content alone and the session the reasoning too; or the conversation is rendered
                # whole only: its next turn is sent whole
                cut = True
            if entry.deleted or result.session_length == 0 or (cut and not _takes_from_start(entry)):
                service.discard(entry, "ended")  # (0: its session was closed while it generated)
                continue
            entry.exact = not cut
            entry.length = result.session_length
            entry.model = ask.model
            if ask.kind == "chat":
                assert isinstance(ask.history, tuple)
                turn = marked_turn("assistant", content, [(c.id, c.name, c.arguments) for c in calls])
                entry.history = (*ask.history, turn)
                entry.asked = ask.digests[-1] if ask.digests else None
                turns: tuple[Turn, ...] = ask.history  # type: ignore[assignment]  # (chat: turns, checked above)
                entry.branches = tuple(d for (role, _), d in zip(turns, ask.digests, strict=True) if role == "assistant")
                entry.digest = chain([turn], ask.digests[-1] if ask.digests else EMPTY)[-1]
            elif ask.kind == "text":
                assert isinstance(ask.history, str)
                entry.history = ask.history + result.text
            else:
                assert isinstance(ask.history, tuple)
                entry.history = (*ask.history, *result.token_ids)
            service.keep(entry)
        m = service.metrics
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        m.generation_tokens.inc(usage.completion_tokens)

    def fail(self) -> None:
        """The turn did not finish: its sessions hold something the client never saw. Close them. The tokens a stream
        cut short handed on still count as generated."""
        if not self.settled:
            self.settled = True
            for entry in self.entries:
                self.service.discard(entry, "ended")
            self.service.metrics.generation_tokens.inc(self.sent_tokens)

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.service.metrics.ttft.observe(self.first_token_at - self.started)


class Service:
    def __init__(self, client: AsyncClient, store: SessionStore, models: Models, metrics: GatewayMetrics) -> None:
        self.client = client
        self.store = store
        self.models = models
        self.metrics = metrics
        self._closing: set[asyncio.Task[None]] = set()

    # -- a turn ------------------------------------------------------------------------------------------

    async def complete(self, ask: Ask) -> Live:
        """The whole turn, not streamed."""
        live = await self._start(ask)
        try:
            if len(live.entries) == 1 and live.results[0] is not None:
                pass  # answered by the turn's own GENERATE
            else:
                gens = await asyncio.gather(*(self._generate(live, i) for i in range(len(live.entries))))
                live.results = list(gens)
        except ClientError as e:
            live.fail()
            raise from_client_error(e) from e
        except BaseException:
            live.fail()
            raise
        if live.results:
            live.first_token()
        live.finish()
        return live

    async def stream(self, ask: Ask) -> tuple[Live, AsyncGenerator[Delta, None]]:
        """The turn streamed: every choice's first chunk is awaited here (so that errors come before the answer's
        status is sent), then the iterator yields each choice's chunks as they come. A resumed session that cannot
        take the turn is given the whole conversation from its start (refusing its new part: prompt_boundary) or
        replaced (gone) once, as for a turn not streamed."""
        live = await self._start(ask)
        while True:
            streams: list[AsyncStream] = []
            try:
                for i in range(len(live.entries)):
                    streams.append(await self._open_stream(live, i))
                firsts = [await s.__anext__() for s in streams]
                break
            except START_OVER as e:
                for s in streams:
                    s.close()
                if not live.resumed:
                    live.fail()
                    raise from_client_error(e) from e
                live.settled = True  # its sessions go here: the first to the turn again, the forks closed
                for child in live.entries[1:]:
                    self.discard(child, "ended")
                live = await self._again(ask, live.entries[0], e, live.started, live.from_start)
            except ClientError as e:
                for s in streams:
                    s.close()
                live.fail()
                raise from_client_error(e) from e
            except BaseException:
                for s in streams:
                    s.close()
                live.fail()
                raise
        live.first_token()
        return live, self._deltas(live, streams, firsts)

    async def _deltas(self, live: Live, streams: list[AsyncStream], firsts: list[Chunk]) -> AsyncGenerator[Delta, None]:
        try:
            if len(streams) == 1:
                async for delta in self._one(live, 0, streams[0], firsts[0]):
                    yield delta
            else:
                async for delta in self._merged(live, streams, firsts):
                    yield delta
        except BaseException:
            for s in streams:
                s.close()
            live.fail()
            raise
        live.finish()

    async def _one(self, live: Live, index: int, stream: AsyncStream, first: Chunk) -> AsyncIterator[Delta]:
        chunk = first
        while True:
            # Chunks that arrived while the last was being sent go out as one: under load, fewer events to format,
            # write and parse, and nothing waits longer for it.
            while chunk.finish_reason is None and stream.ready:
                more = await stream.__anext__()
                chunk = Chunk(chunk.token_ids + more.token_ids, chunk.text + more.text, more.finish_reason,
                              chunk.logprobs + more.logprobs)
            live.sent_tokens += len(chunk.token_ids)
            yield Delta(index, chunk)
            if chunk.finish_reason is not None:
                live.results[index] = stream.result
                live.took(stream.result)
                return
            chunk = await stream.__anext__()

    async def _merged(self, live: Live, streams: list[AsyncStream], firsts: list[Chunk]) -> AsyncIterator[Delta]:
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta in self._one(live, i, streams[i], firsts[i]):
                    queue.put_nowait(delta)
                queue.put_nowait(None)
            except BaseException as e:  # handed to the reader, which raises it
                queue.put_nowait(e)

        tasks = [asyncio.get_running_loop().create_task(pump(i)) for i in range(len(streams))]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    # -- starting a turn -----------------------------------------------------------------------------------

    async def _start(self, ask: Ask) -> Live:
        """The turn's session found or opened, and (n > 1) its prompt computed and forked; n == 1 not streamed: the
        turn's GENERATE answered too."""
        await self.models.check(ask.model)
        started = time.perf_counter()
        entry, resumed = await self._session_for(ask)
        # (a conversation with tools, calls or reasoning is rendered whole only, even on a session that holds its start)
        from_start = resumed and (not entry.exact or ask.of_tools)
        with self._ended_on_failure(entry):
            try:
                return await self._begin(ask, entry, resumed, started, from_start)
            except START_OVER as e:
                refused = e
        if not resumed:
            self.discard(entry, _closed_why(refused))
            raise from_client_error(refused) from refused
        return await self._again(ask, entry, refused, started, from_start)

    async def _again(self, ask: Ask, entry: Entry, e: ClientError, started: float, from_start: bool) -> Live:
        """The turn again after its resumed `entry` could not take it: given the whole conversation from its start
        where it refused the new part (prompt_boundary), else (gone, or refusing even that) in a new session."""
        if not isinstance(e, PromptBoundary) or from_start or not _takes_from_start(entry):
            return await self._start_over(ask, entry, e, started)
        with self._ended_on_failure(entry):
            try:
                return await self._begin(ask, entry, True, started, from_start=True)
            except GONE as e2:
                gone = e2
        return await self._start_over(ask, entry, gone, started)

    async def _start_over(self, ask: Ask, entry: Entry, e: ClientError, started: float) -> Live:
        """The turn again in a new session given the whole conversation: its resumed `entry` could not take it (gone,
        or refusing its new part: prompt_boundary), and is closed. A named one's name is held meanwhile (a request
        naming it is refused as busy, as while a first turn opens its session), unless it was deleted during the
        turn: then the new session has no name, and is closed when the turn ends."""
        log.info("session_replayed", session=entry.session.id, code=e.code)
        name = None if entry.deleted else ask.name
        if name is not None:
            self.store.opening.add((ask.owner, name))  # before the close frees the name
        self.discard(entry, _closed_why(e))
        if name is not None:
            fresh = await self._open_named(ask)
        else:
            fresh = await self._new_entry(dataclasses.replace(ask, name=None))
            fresh.deleted = entry.deleted  # (closed at the turn's end, as the session it replaces would have been)
        with self._ended_on_failure(fresh):
            return await self._begin(ask, fresh, False, started)

    @contextlib.contextmanager
    def _ended_on_failure(self, entry: Entry) -> Iterator[None]:
        """A turn's start on `entry`: any failure that leaves the block closes the session (the turn ended), a
        worker's error raised as the API's. The caller catches inside the block what it answers otherwise."""
        try:
            yield
        except ClientError as e:
            self.discard(entry, "ended")
            raise from_client_error(e) from e
        except BaseException:
            self.discard(entry, "ended")
            raise

    async def _begin(self, ask: Ask, entry: Entry, resumed: bool, started: float, from_start: bool = False) -> Live:
        before = entry.length if resumed else 0
        if from_start:
            log.debug("turn_from_start", session=entry.session.id)
            self.metrics.rewritten.inc()
        new_part = self._new_part(ask, entry, resumed, from_start)
        if ask.n == 1:
            live = Live(self, ask, [entry], before, resumed, None, started, new_part)
            if not ask.stream:
                result = await self._generate(live, 0)
                live.results[0] = result
            return live
        prefill = await self._generate_on(entry.session, ask.sampling, entry.max_context, 0, new_part, max_tokens=0)
        children: list[Entry] = []
        try:
            for _ in range(ask.n - 1):
                child = await self._fork(entry)
                children.append(Entry(child, ask.owner, ask.model, ask.kind, entry.max_context))
        except BaseException:
            for c in children:
                self.discard(c, "ended")
            raise
        for c in children:
            self.store.take(c)
        live = Live(self, ask, [entry, *children], before, resumed, None, started)
        live.took(prefill)
        return live

    async def _generate(self, live: Live, index: int) -> Generation:
        entry = live.entries[index]
        new_part = live.pending if index == 0 else None
        result = await self._generate_on(entry.session, live.ask.sampling, entry.max_context, index, new_part)
        if index == 0:
            live.took(result)
        return result

    async def _open_stream(self, live: Live, index: int) -> AsyncStream:
        entry = live.entries[index]
        new_part = live.pending if index == 0 else None
        params = live.ask.sampling.params(entry.max_context, index)
        return await entry.session.generate(
            stream=True, **_call_args(params, new_part))

    async def _generate_on(self, session: AsyncSession, sampling: schema.Sampling, max_context: int, index: int,
                           new_part: NewPart | None, max_tokens: int | None = None) -> Generation:
        params = sampling.params(max_context, index)
        if max_tokens is not None:
            params = _with_max_tokens(params, max_tokens)
        if params.max_tokens == 0:  # the prompt only: one answer
            return await session.generate(stream=False, **_call_args(params, new_part))
        # Streamed from the worker even when the HTTP answer is whole: --timeout bounds the wait for each token, not
        # the whole generation (a long answer from a busy worker is not a 504), and a cancelled turn stops at once.
        stream = await session.generate(stream=True, **_call_args(params, new_part))
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()  # (nothing to stop once the last chunk came)
        assert stream.result is not None
        return stream.result

    def _new_part(self, ask: Ask, entry: Entry, resumed: bool, from_start: bool = False) -> NewPart:
        held = entry.history if resumed and not from_start else _empty(ask.kind)
        checked = resumed and not from_start
        if ask.kind == "chat":
            assert isinstance(ask.history, tuple)
            # A resumed session's turns are checked against its last answer: where the model's template renders it
            # otherwise once turns follow (Qwen3 drops its reasoning), the worker refuses them (PromptBoundary) and
            # the session is given the whole conversation from its start.
            return NewPart("messages", [message_of(r, c) for r, c in ask.history[len(held):]],  # type: ignore[misc]
                           checked, dict(ask.template_args), from_start, ask.tools)
        if ask.kind == "text":
            assert isinstance(ask.history, str)
            # A resumed session's new text is checked against the tokens the session ends with: where the tokenizer
            # would merge across the boundary the worker refuses it (PromptBoundary) and the session is given the
            # whole prompt from its start, so that its tokens are the whole prompt's.
            return NewPart("prompt", ask.history[len(held):], checked, from_start=from_start)
        assert isinstance(ask.history, tuple)
        return NewPart("prompt_ids", list(ask.history[len(held):]), from_start=from_start)

    # -- sessions ------------------------------------------------------------------------------------------

    async def _session_for(self, ask: Ask) -> tuple[Entry, bool]:
        """(the session to use, taken; whether it is resumed)."""
        store = self.store
        if ask.name is not None:
            if (ask.owner, ask.name) in store.opening:
                raise session_busy(ask.name)
            entry = store.named(ask.owner, ask.name)
            if entry is not None:
                if entry.busy:
                    raise session_busy(ask.name)
                extended = entry.extended_by(ask.history, ask.digests)
                if entry.model == ask.model and entry.kind == ask.kind and (extended or _takes_from_start(entry)):
                    store.take(entry)
                    self.metrics.opened.labels("session_id").inc()
                    if not extended:
                        entry.exact = False  # edited, cut or asked again: sent whole, it keeps what they share
                    return entry, True
                store.forget_named(ask.owner, ask.name)
                self._close(entry, "replaced")
            store.opening.add((ask.owner, ask.name))  # until its new session is taken under the name
            return await self._open_named(ask), False
        else:
            found = (store.find_chat(ask.owner, ask.model, ask.history, ask.digests)  # type: ignore[arg-type]
                     if ask.kind == "chat" else store.find_completion(ask.owner, ask.model, ask.history))  # type: ignore[arg-type]
            if found is not None and (found.exact or _takes_from_start(found)):
                store.take(found)
                self.metrics.opened.labels("prefix").inc()
                return found, True
            if ask.kind == "chat" and ask.digests:
                # A regenerate (the history less a session's last answer), else a branch from an earlier answer. Each
                # looked up right before its fork (the store changes while a fork is awaited), a parent tried once.
                asked = store.find_asked(ask.owner, ask.model, ask.digests[-1])
                if asked is not None and _takes_from_start(asked):
                    again = await self._fork_for(ask, asked, "asked_again")
                    if again is not None:
                        return again, True
                branch = store.find_branch(ask.owner, ask.model, ask.history, ask.digests)  # type: ignore[arg-type]
                if branch is not None and branch is not asked and _takes_from_start(branch):
                    again = await self._fork_for(ask, branch, "branch")
                    if again is not None:
                        return again, True
        return await self._new_entry(ask), False

    async def _fork_for(self, ask: Ask, parent: Entry, how: str) -> Entry | None:
        """A request that shares a part of `parent`'s conversation and goes on otherwise (asks its last answer again:
        its history less that answer; or an earlier message edited): a fork of it, sent the request whole from its
        start, keeps what the two share; `parent` goes on serving its own branch of the conversation (another user may
        have opened with the same messages). None when the fork cannot be made."""
        self.store.take(parent)  # (not evicted for the fork's room, nor taken meanwhile)
        try:
            child = await self._fork(parent)
        except GONE:
            self.discard(parent, "gone")
            return None
        except ClientError:
            self.keep(parent)
            return None
        except BaseException:
            self.keep(parent)
            raise
        self.keep(parent)
        entry = Entry(child, ask.owner, ask.model, ask.kind, parent.max_context, parent.history, parent.digest,
                      parent.length, exact=False)
        self.store.take(entry)
        self.metrics.opened.labels(how).inc()
        return entry

    async def _open_named(self, ask: Ask) -> Entry:
        """A new session under the request's name, which the caller put in store.opening (a request naming it
        meanwhile is refused as busy). A DELETE of the name meanwhile is kept (store.deleting) and done here: the
        session serves the turn without the name and is closed when the turn ends."""
        key = (ask.owner, ask.name or "")
        try:
            entry = await self._new_entry(ask)
        finally:
            self.store.opening.discard(key)
            deleted = key in self.store.deleting
            self.store.deleting.discard(key)
        if deleted:
            self.store.forget_named(*key)
            entry.deleted = True
        return entry

    async def _new_entry(self, ask: Ask) -> Entry:
        session = await self._open(ask.model)
        entry = Entry(session, ask.owner, ask.model, ask.kind, session.max_context, name=ask.name)
        self.store.take(entry)
        self.metrics.opened.labels("new").inc()
        return entry

    async def _open(self, model: str) -> AsyncSession:
        """A new session; when no slot is free, close our least recently used idle session of the model and retry."""
        for _ in range(MAX_EVICTIONS):
            try:
                return await self.client.session(model)
            except CapacityExhausted as e:
                victim = self.store.evict(model)
                if victim is None:
                    raise from_client_error(e) from e
                self._close(victim, "evicted")
            except ClientError as e:
                raise from_client_error(e) from e
        try:
            return await self.client.session(model)
        except ClientError as e:
            raise from_client_error(e) from e

    async def _fork(self, entry: Entry) -> AsyncSession:
        for _ in range(MAX_EVICTIONS):
            try:
                return await entry.session.fork()
            except CapacityExhausted:
                victim = self.store.evict(entry.model)
                if victim is None:
                    raise
                self._close(victim, "evicted")
        return await entry.session.fork()

    def keep(self, entry: Entry) -> None:
        for old in self.store.put(entry):
            self._close(old, "evicted" if old.name is None or old.name != entry.name else "replaced")

    def discard(self, entry: Entry, why: str) -> None:
        self.store.release(entry)
        self._close(entry, why)

    def _close(self, entry: Entry, why: str) -> None:
        self.metrics.closed.labels(why).inc()
        if self.client._transport.closed:
            return
        task = entry.session.close_soon()
        self._closing.add(task)
        task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("session_close_failed", error=str(task.exception()))

    async def close_named(self, owner: str, name: str) -> bool:
        entry = self.store.named(owner, name)
        if entry is None:
            if (owner, name) in self.store.opening:  # its session is being opened: deleted once it is (_open_named)
                self.store.deleting.add((owner, name))
                return True
            return False
        self.store.forget_named(owner, name)  # the name is free now: a request naming it gets a new session
        if entry.busy:
            entry.deleted = True  # its turn goes on for the request that runs it; the session is closed after it
        else:
            self._close(entry, "ended")
        return True

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Close every idle session and wait (a while) for the answers."""
        for entry in list(self.store.drain()):
            self._close(entry, "ended")
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=timeout)


@dataclass(frozen=True)
class NewPart:
    """What a turn's GENERATE appends first: its generate() keyword and value, and how."""

    key: Literal["messages", "prompt", "prompt_ids"]
    value: Any
    boundary_check: bool = False  # a resumed session's: PromptBoundary where it would not give the whole's tokens
    template_args: dict[str, Any] | None = None  # messages: chat_template_kwargs
    from_start: bool = False  # the value is the whole conversation, for a resumed session that refused its new part
    tools: str = ""  # messages: the functions the model may call (JSON text)


def _takes_from_start(entry: Entry) -> bool:
    """Whether the session's worker takes GENERATE's from_start (one older than it ignores the field and appends the
    whole conversation after the session's tokens: such a session is replaced by a new one instead)."""
    return getattr(entry.session, "takes_from_start", None) is not False


def _empty(kind: Kind) -> tuple[Turn, ...] | str | tuple[int, ...]:
    return "" if kind == "text" else ()


def _call_args(params: Any, new_part: NewPart | None) -> dict[str, Any]:
    args: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                            "top_k": params.top_k, "seed": params.seed, "stop": list(params.stop),
                            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
                            "logprobs": params.logprobs, "logit_bias": {b.token: b.bias for b in params.logit_bias},
                            "repetition_penalty": params.repetition_penalty,
                            "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
                            "min_p": params.min_p, "min_tokens": params.min_tokens}
    if new_part is not None:
        if new_part.key != "messages" and not new_part.value:
            return args
        args[new_part.key] = new_part.value
        if new_part.boundary_check:
            args["boundary_check"] = True
        if new_part.from_start:
            args["from_start"] = True
        if new_part.template_args:
            args["chat_template_kwargs"] = new_part.template_args
        if new_part.tools:
            args["tools"] = json.loads(new_part.tools)
    return args


def _with_max_tokens(params: Any, max_tokens: int) -> Any:
    """The same sampling with another max_tokens (n choices' prefill: 0), min_tokens within it."""
    return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))


def _text_is_tokens(kind: Kind, sampling: schema.Sampling, result: Generation, stop_token: int) -> bool:
    """Whether the answer's text, resent by the client, stands for exactly the tokens the session holds.

    Not when the text replaced an unfinished UTF-8 character (an answer cut by max_tokens mid-character) with U+FFFD:
    the session holds the character's first bytes. Not with `ignore_eos`: the model may have generated its stop
    tokens (<|im_end|>, then <|im_start|> for a turn of its own, or an EOS inside a text completion), which the text
    leaves out. Not (chat) when the answer ended on a token of `stop_token_ids`: the session holds that token, the text
    does not, and the next turn would follow it (the model's own EOS is part of the template, but the gateway cannot
    tell one from the other)."""
    if "\ufffd" in result.text or sampling.ignore_eos:
        return False
    return kind != "chat" or not (stop_token and sampling.stop_token_ids)


def _closed_why(e: ClientError) -> str:
    """sessions_closed_total's `why` for a session closed because it could not take a turn (START_OVER)."""
    return "replaced" if isinstance(e, PromptBoundary) else "gone"


def _finish(reason: str) -> str:
    return "length" if reason in ("length", "capacity") else "stop"


def chat_ask(request: schema.ChatRequest, owner: str, name: str | None, reasoning_parser: str | None = None,
             tool_call_parser: str | None = None) -> Ask:
    """`reasoning_parser`, `tool_call_parser`: the gateway's --reasoning-parser and --tool-call-parser (None: answers are
    content alone). The sampling is the request's alone: the model's recommended sampling goes in once the model is
    known to be served (app.recommended)."""
    if reasoning_parser is None and request.has_reasoning():
        raise bad_request("an assistant message's reasoning is taken only by a gateway started with "
                          "--reasoning-parser", "messages")
    tools = request.tools_json()
    if tools and tool_call_parser is None:
        raise bad_request("tools are taken only by a gateway started with --tool-call-parser", "tools")
    turns = request.turns()
    args = tuple((request.chat_template_kwargs or {}).items())
    start = template_start((*args, (TOOLS_ARG, tools)) if tools else args)  # other tools: another conversation
    return Ask(owner, request.model, "chat", turns, schema.sampling(request), request.n, name,
               request.stream, tuple(chain(turns, start)), args, Reasoner.for_request(reasoning_parser, dict(args)),
               tools, ToolParser(tool_call_parser, request.tool_schemas()) if tools and tool_call_parser else None)


TOOLS_ARG = "\x00tools"  # the tools' place in a conversation's digest start (no template argument has this name)


def completion_ask(request: schema.CompletionRequest, owner: str, name: str | None) -> Ask:
    prompt = request.prompt_value()
    kind: Kind = "text" if isinstance(prompt, str) else "ids"
    return Ask(owner, request.model, kind, prompt, schema.sampling(request), request.n, name, request.stream)

