"""The blocking client: Client -> Session -> append / chat / generate / fork / close.

    with Client("tcp://127.0.0.1:5555") as client, client.session() as s:
        print(s.chat("What is the capital of France?", max_tokens=24).text)
        for chunk in s.chat("And of Italy?", max_tokens=24, stream=True):
            print(chunk.text, end="")

(`chat` renders the model's chat template; `append(text=...)` and `generate()` take raw text and tokens.)
Timeouts: `timeout` (seconds) bounds the wait for an answer; for a stream, the wait for each chunk (a Timeout cancels
the generation: reading the stream on raises StreamCancelled); a client that never reached a broker raises
BrokerUnreachable after `connect_timeout`.
A Client and its sessions belong to one thread; use AsyncClient, or one Client per thread, for more.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

from broker.common import protocol as p
from broker.common.keys import CurveClient
from client import calls
from client.calls import build, items, new_request_id
from client.errors import BadRequest, ClientError, SessionExpired, SessionLost, SessionNotFound, Timeout
from client.results import Chunk, Generation, SessionInfo, WorkerInfo
from client.transport import Transport

M = TypeVar("M", bound=p.Message)


class Client:
    def __init__(
        self,
        address: str = "tcp://127.0.0.1:5555",
        *,
        timeout: float = calls.DEFAULT_TIMEOUT_S,
        resend_after: float = calls.RESEND_AFTER_S,
        broker_key: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        connect_timeout: float = calls.CONNECT_TIMEOUT_S,
    ) -> None:
        """`broker_key`, `key`: with a broker that authenticates (`broker start --keys`), the broker's public key
        file and this client's key pair file (NAME.key_secret, from `broker keygen`). `connect_timeout`: a call
        raises BrokerUnreachable after this many seconds when the client has never reached a broker.

        close() (or leaving the `with` block) releases the socket; a Client dropped unclosed releases it too."""
        self.address = address
        self.timeout = timeout
        self._transport = Transport(address, resend_after, CurveClient.from_files(broker_key, key), connect_timeout)

    def session(self, model: str | None = None, *, timeout: float | None = None) -> Session:
        """A new session on the least-loaded worker serving `model` (None: any model)."""
        request = build(p.CreateSession, request_id=new_request_id(), model=model)
        created = self._call(request, p.Created, timeout)
        return Session(self, created.session_id, model=created.model, worker=created.worker,
                       max_context=created.max_context, takes_from_start=created.from_start)

    def attach(self, session_id: str) -> Session:
        """A handle on an existing session by id (no round trip; the next call finds out if it exists)."""
        if not p.is_session_id(session_id):
            raise BadRequest(f"not a session id: {session_id!r}")
        return Session(self, session_id)

    def status(self, *, timeout: float | None = None) -> list[WorkerInfo]:
        """The broker's live workers."""
        return calls.worker_infos(self._call(p.Status(request_id=new_request_id()), p.StatusReport, timeout))

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing for Session --

    def _call(self, request: p.Message, kind: type[M], timeout: float | None) -> M:
        return self._answer(self._transport.start(request), kind, timeout)

    def _answer(self, call: calls.Call, kind: type[M], timeout: float | None) -> M:
        try:
            answer = self._transport.next(call, self._timeout(timeout))
        except BaseException:  # a Timeout, an interrupt (a retry may follow)
            self._transport.orphans.given_up(call, self._transport.oneway)
            raise
        finally:
            self._transport.finish(call)
        return calls.expect(answer, kind)

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout


class Session:
    def __init__(self, client: Client, session_id: str, *, model: str = "", worker: str = "", max_context: int = 0,
                 takes_from_start: bool | None = None):
        self.client = client
        self.id = session_id
        self.model = model
        self.worker = worker  # the worker's name as the create answered it ("" for attach())
        self.max_context = max_context
        self.takes_from_start = takes_from_start  # its worker takes generate(from_start=True) (None: not known)

    def __repr__(self) -> str:
        return f"Session({self.id!r}, worker={self.worker!r})"

    def append(
        self, text: str | None = None, *, token_ids: Sequence[int] | None = None, boundary_check: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Add prompt text or token ids; returns the session's length in tokens.

        A text is tokenized on its own (the model's BOS only on an empty session). `boundary_check=True` takes it as
        the continuation of the session's text instead: PromptBoundary, nothing appended, where the tokenizer would
        merge across the boundary (e.g. the session ends in "Par", the text starts with "is": one token "Paris"), so
        that the session's tokens are always those of its whole text tokenized at once."""
        request = build(p.Append, request_id=new_request_id(), session_id=self.id,
                        token_ids=None if token_ids is None else items("token_ids", token_ids), text=text,
                        boundary_check=boundary_check)
        return self.client._call(request, p.Appended, timeout).length

    def append_chat(self, content: str, *, role: str = "user", timeout: float | None = None) -> int:
        """Add one chat turn rendered with the model's chat template (by the worker) and the assistant prompt."""
        request = build(p.Chat, request_id=new_request_id(), session_id=self.id, content=content, role=role)
        return self.client._call(request, p.Appended, timeout).length

    @overload
    def chat(self, content: str, *, role: str = ..., max_tokens: int = ..., temperature: float = ...,
             top_p: float = ..., top_k: int = ..., seed: int | None = ..., stop: str | Sequence[str] | None = ...,
             stop_token_ids: Sequence[int] = ..., ignore_eos: bool = ..., stream: Literal[False] = ...,
             chat_template_kwargs: Mapping[str, Any] | None = ..., timeout: float | None = ...) -> Generation: ...
    @overload
    def chat(self, content: str, *, role: str = ..., max_tokens: int = ..., temperature: float = ...,
             top_p: float = ..., top_k: int = ..., seed: int | None = ..., stop: str | Sequence[str] | None = ...,
             stop_token_ids: Sequence[int] = ..., ignore_eos: bool = ..., stream: Literal[True],
             chat_template_kwargs: Mapping[str, Any] | None = ..., timeout: float | None = ...) -> Stream: ...

    def chat(
        self, content: str, *, role: str = "user", max_tokens: int = 256, temperature: float = 0.0,
        top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, stream: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None, timeout: float | None = None,
    ) -> Generation | Stream:
        """One chat turn: the message rendered with the model's chat template, then the assistant's answer
        (generated, or streamed), in one request: if any part is refused, the session is left as it was."""
        params = calls.sampling(max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos)
        request = calls.generate_request(self.id, params, stream, messages=[{"role": role, "content": content}],
                                         chat_template_kwargs=chat_template_kwargs)
        return self._send_generate(request, timeout)

    @overload
    def generate(self, max_tokens: int = ..., temperature: float = ..., top_p: float = ..., top_k: int = ...,
                 seed: int | None = ..., stop: str | Sequence[str] | None = ..., stream: Literal[False] = ..., *,
                 stop_token_ids: Sequence[int] = ..., ignore_eos: bool = ..., prompt: str | None = ...,
                 boundary_check: bool = ..., from_start: bool = ...,
                 prompt_ids: Sequence[int] | None = ..., messages: Sequence[Mapping[str, Any]] | None = ...,
                 chat_template_kwargs: Mapping[str, Any] | None = ...,
                 tools: Sequence[Mapping[str, Any]] | None = ..., logprobs: int | None = ...,
                 logit_bias: Mapping[int, float] | None = ...,
                 repetition_penalty: float = ..., frequency_penalty: float = ..., presence_penalty: float = ...,
                 min_p: float = ..., min_tokens: int = ...,
                 timeout: float | None = ...) -> Generation: ...
    @overload
    def generate(self, max_tokens: int = ..., temperature: float = ..., top_p: float = ..., top_k: int = ...,
                 seed: int | None = ..., stop: str | Sequence[str] | None = ..., *, stream: Literal[True],
                 stop_token_ids: Sequence[int] = ..., ignore_eos: bool = ..., prompt: str | None = ...,
                 boundary_check: bool = ..., from_start: bool = ...,
                 prompt_ids: Sequence[int] | None = ..., messages: Sequence[Mapping[str, Any]] | None = ...,
                 chat_template_kwargs: Mapping[str, Any] | None = ...,
                 tools: Sequence[Mapping[str, Any]] | None = ..., logprobs: int | None = ...,
                 logit_bias: Mapping[int, float] | None = ...,
                 repetition_penalty: float = ..., frequency_penalty: float = ..., presence_penalty: float = ...,
                 min_p: float = ..., min_tokens: int = ...,
                 timeout: float | None = ...) -> Stream: ...

    def generate(
        self, max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        seed: int | None = None, stop: str | Sequence[str] | None = None, stream: bool = False, *,
        stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, prompt: str | None = None,
        boundary_check: bool = False, from_start: bool = False,
        prompt_ids: Sequence[int] | None = None, messages: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
        logprobs: int | None = None, logit_bias: Mapping[int, float] | None = None, repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0, min_p: float = 0.0, min_tokens: int = 0, timeout: float | None = None,
    ) -> Generation | Stream:
        """Continue the session. The generated tokens become part of it, so the next turn follows on.

        `prompt` (text) or `prompt_ids` is appended first in the same request, as `append` would (`boundary_check`
        too): a turn
        in one round trip. If either part is refused, neither happens. Or `messages`, chat turns
        ({"role", "content"} maps) rendered by the worker with the model's chat template, then the assistant
        prompt (on a session holding a conversation: what the template puts after its last answer).
        `tools` (OpenAI's list of {"type": "function", "function": {...}}) gives the template the functions the model
        may call; an assistant message may carry its `tool_calls` (OpenAI's) and a "tool" message its `tool_call_id`.
        These are rendered with the whole conversation only: on a new session, or with `from_start`. The answer is the
        model's text: the OpenAI gateway's --tool-call-parser reads the calls in it.
        `logprobs=k`: each token's log-probability and the k most likely (0 <= k <= 20) in the result's
        `logprobs`. max_tokens 0 only computes the prompt (then fork it: each child computes one token).
        `logit_bias` ({token id: number in [-100, 100]}, at most 300) is added to the logits, then
        `repetition_penalty` (> 1 discourages the context's and the answer's tokens), `frequency_penalty` and
        `presence_penalty` (in [-2, 2], over the answer so far) apply, as vLLM and OpenAI define them; log-probabilities
        stay the model's. `min_p` (vLLM's) keeps, when sampling, the tokens at least min_p times as likely as the
        likeliest; `min_tokens`: EOS, `stop_token_ids` and stop strings do not end the answer before that many tokens.
        `from_start=True`: the prompt (or messages) is the session's whole context from its start, not a continuation:
        the session keeps what it holds that the prompt starts with, not computed again, and drops the rest, so that
        it holds exactly what a new session given that prompt would (edit a conversation, generate an answer again).
        The result's `rewound` counts the tokens dropped, `appended` those added after what was kept, and `cached` the
        prompt tokens whose state was kept. A model with a recurrent state (Qwen3.5) can only keep everything its
        state has taken in, with the context going on past it: otherwise the session is computed again from its start.
        """
        params = calls.sampling(max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, logprobs,
                                logit_bias=logit_bias, repetition_penalty=repetition_penalty,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, min_p=min_p,
                                min_tokens=min_tokens)
        request = calls.generate_request(self.id, params, stream, prompt, prompt_ids, messages, boundary_check,
                                         chat_template_kwargs, from_start, tools)
        return self._send_generate(request, timeout)

    def _send_generate(self, request: p.Generate, timeout: float | None) -> Generation | Stream:
        chat = bool(request.messages) and not request.from_start  # (which may append nothing)
        if not request.stream:
            return calls.generation(self.client._call(request, p.Generated, timeout), chat, request.from_start)
        transport = self.client._transport
        return Stream(transport, transport.start(request), self.id, self.client._timeout(timeout), chat,
                     request.from_start)

    def fork(self, *, timeout: float | None = None) -> Session:
        """A new session on the same worker that continues exactly as this one would."""
        forked = self.client._call(build(p.Fork, request_id=new_request_id(), session_id=self.id), p.Forked, timeout)
        return Session(self.client, forked.child_id, model=self.model, worker=forked.worker,
                       max_context=self.max_context, takes_from_start=forked.from_start)

    def info(self, *, timeout: float | None = None) -> SessionInfo:
        info = self.client._call(build(p.Info, request_id=new_request_id(), session_id=self.id), p.SessionInfo, timeout)
        return calls.session_info(info)

    def close(self, *, timeout: float | None = None) -> None:
        """Free the session's slot. Closing a session that is already gone (closed, lost, expired) is not an error."""
        self.close_soon(timeout=timeout).wait()

    def close_soon(self, *, timeout: float | None = None) -> PendingClose:
        """Send the close now and return without waiting for its answer: wait() on the result for it.

        The broker counts a session whose close is on its way as a free slot of its worker, which handles the
        close before anything sent after it: a session opened right after this call may take this one's slot,
        even on a full worker. Dropping the result unwaited drops the answer (nothing resends the close then)."""
        request = build(p.Close, request_id=new_request_id(), session_id=self.id)
        return PendingClose(self.client, self.client._transport.start(request), timeout)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.client._transport.closed:
            return
        try:
            self.close()
        except ClientError:
            if exc is None:
                raise  # otherwise the error that ended the block matters more than a failed close


class PendingClose:
    """A close sent by Session.close_soon. wait() takes its answer; a session already gone (not found, lost,
    expired) closes without an error, as with Session.close."""

    def __init__(self, client: Client, call: calls.Call, timeout: float | None) -> None:
        self._client = client
        self._call = call
        self._timeout = timeout
        self._waited = False
        self._error: ClientError | None = None

    def wait(self) -> None:
        """Block until the close is answered (Timeout after the timeout close_soon was given). The answer is taken
        once: later calls return at once, or raise the first call's error again (after a Timeout, whether the
        session closed is not known here)."""
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        self._waited = True
        try:
            self._client._answer(self._call, p.Closed, self._timeout)
        except (SessionNotFound, SessionLost, SessionExpired):
            pass
        except ClientError as e:
            self._error = e
            raise

    def __del__(self) -> None:
        if not self._waited:  # nobody will read the answer: the transport drops it when it comes
            self._client._transport.finish(self._call)


class Stream:
    """An iterator of Chunks; the last has finish_reason set. Closing it early cancels the generation.

    Each token comes once and in order, and the chunks' texts add up to `result.text` exactly (chunks lost on the
    way, e.g. while the broker restarted, are asked for again). `timeout` bounds the wait for each chunk; a Timeout
    closes the stream and cancels the generation, and every later read raises StreamCancelled (the answer is cut off),
    never a quiet end. Closed by its caller (close(), `with`), it ends quietly.

    A `for` loop left early (break, an exception) cancels the generation at once only when the loop held the stream
    alone (`for chunk in s.generate(..., stream=True):`): CPython frees it there and __del__ closes it. A stream
    kept in a variable generates on, holding the session, until it is closed or dropped: read it in a `with` block,
    or close() it.
    """

    def __init__(self, transport: Transport, call: calls.Call, session_id: str, timeout_s: float,
                 chat: bool = False, from_start: bool = False) -> None:
        self._transport = transport
        self._call = call
        self._session_id = session_id
        self._timeout_s = timeout_s
        self._state = calls.StreamState(call, chat, from_start)
        self._open = True

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        if not self._open:
            raise self._state.closed_error(self._call.request_id) or StopIteration
        while True:
            try:
                message = self._transport.next(self._call, self._timeout_s)
            except Timeout:
                self.close()  # the worker may still be generating: stop it, so the session is free again
                self._state.cut_off("timed out")
                raise
            try:
                chunk = self._state.take(message)
            except ClientError:
                self._end()  # the server ended the request with an error
                raise
            if chunk is not None:
                break
            if self._state.ask(time.monotonic(), self._transport.resend_after_s):  # a gap: ask for what is missing
                self._transport.resend(self._call)
        if chunk.finish_reason is not None:
            self._end()
        return chunk

    @property
    def result(self) -> Generation | None:
        """The whole generation, once the last chunk has been read."""
        return self._state.result

    def close(self) -> None:
        """Stop reading; a generation still running is cancelled so the session is free again. Later reads end the
        iteration (StopIteration); a stream whose read timed out already stays cut off (StreamCancelled)."""
        if self._open:
            self._end()
            cancel = self._call.cancel()
            if cancel is not None:
                self._transport.oneway(cancel)

    def _end(self) -> None:
        self._open = False
        self._transport.finish(self._call)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the socket may already be gone
            pass
