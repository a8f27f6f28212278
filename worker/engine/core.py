"""The engine: one model, many sessions, one loop of batched steps.

A step is `schedule -> execute -> update` (the vLLM v1 shape): the scheduler (worker.engine.scheduler) picks one
token for every generating session plus chunks of pending prompt tokens within a token budget, the executor runs
them as one batch through the model (worker.engine.executor, worker.engine.graphs), and the update samples,
appends and reports.

On a GPU the host runs one step ahead (vLLM's async scheduling): the next step is launched before the host has
read the current one, its generating sessions decoding the token ids the current step samples on the device,
beside whatever else the scheduler picks (new requests' prompt chunks, further chunks of a long prompt); then the
host reads the current step's tokens and does its bookkeeping (detokenizing, stop checks, the daemon's messages)
while the GPU computes the next. A session that turns out to have stopped (or is cancelled meanwhile) wastes one
row; its result is dropped. Rows do not depend on what else is in their step (worker.engine.graphs), so the tokens
are exactly those of one step at a time. With nothing in flight (the first request after idling) a step is
launched afresh and read in the next call, not in the one that launched it, so the caller can take requests
while the device runs it.

Requests (create, close, generate, cancel) are calls between steps; the caller owns the loop. A step that computes
prompt tokens takes milliseconds on a GPU: `step(wait=False)` returns without reading it until the device is done,
so the caller (the worker's compute loop) takes the requests that arrive meanwhile and calls again.

Not thread-safe: one thread owns an engine (the daemon's compute loop, or the caller of the sync API).
"""

from __future__ import annotations

import dataclasses
import heapq
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from cuda_state import CapacityExhausted, SessionTable
from worker.engine import migration
from worker.engine.budget import PREFILL_CHUNK
from worker.engine.build import build_parts
from worker.engine.checkpoints import Checkpoints
from worker.engine.detokenizer import Detokenizer
from worker.engine.executor import Executor
from worker.engine.hibernation import Hibernation, SessionLost, Stored
from worker.engine.options import EngineOptions
from worker.engine.penalties import Penalties
from worker.engine.sampling import RowRandom, SamplingParams, sample_ids, step_logprobs, upload
from worker.engine.scheduler import StepPlan, schedule
from worker.engine.session import NO_SLOT, Chunk, Generation, Launched, Request, Session, TokenLogprob, common_prefix
from worker.errors import (
    BadRequest,
    ContextOverflow,
    EngineError,
    PromptBoundary,
    SessionBusy,
    SessionExists,
    SessionNotFound,
)
from worker.model.llama import Llama
from worker.model.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["Chunk", "Engine", "Generation", "Launched", "SamplingParams"]

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

MAX_APPEND_TOKENS = 1 << 20
# Pinned host buffers (and their events) the sampled ids of a step are copied into, used in turn: at most two
# launched steps are unread at a time (the one in flight and the one being launched), so a buffer is free again
# long before its turn comes back.
ID_COPIES = 4
MAX_LOST_REMEMBERED = 1 << 16  # sessions whose stored state was lost, answered session_lost (oldest forgotten first)


# A chat message's keys the template is given: role and content; an assistant's tool_calls and reasoning_content (its
# reasoning), a tool result's tool_call_id (rendered with the whole conversation only: Engine.chat_text).
TURN_KEYS = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")


class Engine:
    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        table: SessionTable,
        executor: Executor,
        model_name: str,
        step_tokens: int,
        overlap: bool | None = None,
        weights_id: str = "",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.table = table
        self.executor = executor
        self.model_name = model_name
        self.weights_id = weights_id  # which weights (LoadedModel.weights_id): part of the state's layout below
        self.max_context = model.max_context
        self.step_tokens = step_tokens
        self.prefill_chunk = min(step_tokens, PREFILL_CHUNK[model.device.type])
        self._sessions: dict[str, Session] = {}
        self._active: dict[str, Request] = {}  # request id -> request, in arrival order
        self._finished: list[Chunk] = []  # final chunks produced outside a step (cancel, close)
        self._mailboxes: dict[str, deque[Chunk]] = {}  # for the sync helpers
        self.steps = 0
        self.last_rows = 0  # requests in the step the last call launched (0: it launched none)
        self.last_prefill_tokens = 0  # prompt tokens that step computes in prefill chunks
        self.last_prompt_tokens = 0  # prompt tokens it computes, those in decode rows too (a prompt's lone last token)
        self.last_read = False  # whether the last call read a step's tokens
        # Launch the next decode step before reading the last (executors that take ids from the device).
        self.overlap = executor.overlaps if overlap is None else overlap
        self._unread: Launched | None = None  # the step the next call reads
        self._ahead: Launched | None = None  # the step launched after it, before it was read
        self._id_copies: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None  # host copies of sampled ids, a ring
        # Whether a token run twice into a session's state does no harm: K/V are written at its position, and a rerun
        # rewrites them. A state that is not laid out by position (a recurrent state, seq_axis None) is advanced by
        # every token run into it, so `computed` must always say what the launched steps leave there (see _retire).
        self._rewritable = table.spec.positional
        # A recurrent state's checkpoints before each generation's last prompt token (worker.engine.checkpoints).
        self.checkpoints = None if self._rewritable else Checkpoints(table)
        self.penalties: Penalties | None = None  # logit bias and penalties' rows: made for the first request asking
        self.sampling_extras = True  # logit bias, penalties, min_p, min_tokens (READY says so: see protocol.Sampling)
        self._starved: list[Request] = []  # requests whose session could not get its next pages: they end "capacity"
        self.hibernation: Hibernation | None = None  # set by enable_hibernation
        self._lost: OrderedDict[str, None] = OrderedDict()  # sessions whose stored state was lost
        self.on_restore: Callable[[float, str], None] | None = None  # (seconds, "host" | "disk") of each restore
        self.hibernated = self.restored = 0  # counts, for the metrics

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model: str | None = None,
        device: str = "auto",
        max_sessions: int = 8,
        max_context: int = 2048,
        step_tokens: int | None = None,
        cuda_graphs: bool = True,
        options: EngineOptions | None = None,
        state_pages: int | None = None,
        host_cache_bytes: int = 0,
        session_store: str | Path | None = None,
        host_page_bytes: int | None = None,
    ) -> Engine:
        """Load weights once and open the session table. model None = the bundled SmolLM2.

        `options`: the GPU path's switches (None: read from the WORKER_* variables, EngineOptions.from_env);
        cuda_graphs False turns graphs off whatever they say. `state_pages`: the pages all sessions may hold together
        (None: as many as fit). `host_cache_bytes`, `session_store`: where hibernated sessions go (see
        enable_hibernation); sessions found in the store are served again. `host_page_bytes`: the CPU backend's page
        (default 2 MiB, the GPU's); the GPU's is its allocation granularity."""
        options = EngineOptions.from_env() if options is None else options
        if not cuda_graphs:
            options = dataclasses.replace(options, cuda_graphs=False)
        parts = build_parts(model, device, max_sessions, max_context, step_tokens, options, state_pages,
                            host_page_bytes)
        engine = cls(parts.model, parts.tokenizer, parts.table, parts.executor, parts.model_name, parts.step_tokens,
                     weights_id=parts.weights_id)
        if host_cache_bytes > 0 or session_store is not None:
            engine.enable_hibernation(host_cache_bytes, session_store)
        table = engine.table
        log.info("engine_ready", model=engine.model_name, device=engine.device, capacity=table.capacity,
                 bytes_per_session=table.bytes_per_session, max_context=engine.max_context, page_bytes=table.page_bytes,
                 page_budget=table.page_budget, token_bytes=table.spec.token_bytes,
                 tokens_per_page=table.spec.tokens_in(1, table.page_bytes), block_tokens=table.spec.block)
        return engine

    def enable_hibernation(self, host_cache_bytes: int, session_store: str | Path | None) -> list[str]:
        """Idle sessions may hibernate: their state copied to host memory (at most `host_cache_bytes`, pinned on a
        GPU) and, with `session_store`, on to checksummed files there, and their pages released. Sessions the store
        already holds (a worker stopped cleanly) are served again: their ids, oldest first."""
        self.hibernation = Hibernation(self.model_name, self.state_layout, host_cache_bytes, session_store,
                                       pin=self.model.device.type == "cuda", max_context=self.max_context,
                                       checkpoint_bytes=0 if self.checkpoints is None else self.table.spec.bytes_for(0))
        found = self.hibernation.index()
        for stored in found:
            if stored.session_id in self._sessions:
                continue
            self._sessions[stored.session_id] = Session(stored.session_id, NO_SLOT, stored.tokens, stored.computed,
                                                        owner=stored.owner)
        if found:
            log.info("sessions_found_in_store", sessions=len(found), store=str(session_store))
        return [s.session_id for s in found]

    def unload(self) -> None:
        """Free what load() built, in reverse: the steps in flight end, then the executor's graphs, the session
        table (every slot; sessions are gone) and the model's weights. The engine is unusable afterwards."""
        for request in list(self._active.values()):
            self._cancel(request)
        self._unread = self._ahead = None
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self._sessions.clear()
        self._mailboxes.clear()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.hibernation is not None:
            self.hibernation.close()
        self.penalties = None
        self.executor = _Closed()
        self.table.close()
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- facts --------------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def capacity(self) -> int:
        return self.table.capacity

    @property
    def free_slots(self) -> int:
        """Sessions a create can admit now: free slots as far as free pages go, and, with hibernation on, every idle
        session in a slot (the least recently used one hibernates for a create that finds no page). What the broker
        places sessions by."""
        free = self.table.free_slots + (len(self.checkpoints) if self.checkpoints is not None else 0)  # dropped first
        h = self.hibernation
        if h is None or not h.enabled:
            return free
        idle = [(s.id, self.table.spec.bytes_for(s.computed)) for s in self._sessions.values()
                if s.resident and s.request is None]
        return free + h.admissible(idle)

    @property
    def state_layout(self) -> str:
        """What a stored or moved state must have been written under to be read back here: the table's layout and
        the weights that computed it (K/V of other weights under the same model name would be read as this model's)."""
        fingerprint = self.table.spec.fingerprint()
        return f"{fingerprint};weights@{self.weights_id}" if self.weights_id else fingerprint

    @property
    def bytes_per_session(self) -> int:
        return self.table.bytes_per_session

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def session_owner(self, session_id: str) -> str:
        return self._session(session_id).owner

    def set_owner(self, session_id: str, owner: str) -> None:
        """The client a session belongs to: kept with its state when it hibernates, and given back after a restart."""
        self._session(session_id).owner = owner

    def residency(self) -> tuple[int, int, int]:
        """Sessions (resident in a slot, hibernated in host memory, hibernated on disk)."""
        h = self.hibernation
        host, disk = (0, 0) if h is None else (len(h.host), len(h.disk))
        return len(self._sessions) - host - disk, host, disk

    def is_resident(self, session_id: str) -> bool:
        return self._session(session_id).resident

    def session_length(self, session_id: str) -> int:
        return len(self._session(session_id).tokens)

    def session_tokens(self, session_id: str) -> list[int]:
        return list(self._session(session_id).tokens)

    def text_context(self, session_id: str, boundary_check: bool = False,
                     from_start: bool = False) -> tuple[bool | None, list[int] | None]:
        """How a text appended to the session is tokenized: `tokenize`'s add_bos (the tokenizer's own choice for a
        session's first text, no BOS after) and `after` (with boundary_check on a session that holds tokens, its last
        ones: Tokenizer.boundary_tail; a first text has none to check). `from_start`: the text is the session's whole
        context (start_generate's from_start), tokenized as a first text."""
        return self._text_context(self._session(session_id), boundary_check, from_start)

    def _text_context(self, session: Session, boundary_check: bool,
                      from_start: bool = False) -> tuple[bool | None, list[int] | None]:
        if not session.tokens or from_start:
            return None, None
        return False, self.tokenizer.boundary_tail(session.tokens) if boundary_check else None

    # -- sessions -----------------------------------------------------------------------------

    def create_session(self, session_id: str | None = None, owner: str = "") -> str:
        """A new empty session. Raises CapacityExhausted when no slot or page is left (after hibernating idle sessions
        when that is enabled)."""
        sid = self._new_id(session_id)
        slot = self._with_room(self.table.create)
        self._lost.pop(sid, None)
        self._sessions[sid] = Session(sid, slot, owner=owner)
        log.debug("session_created", session=sid, slot=slot)
        return sid

    def release_idle_slots(self, older_than_s: float) -> int:
        """Unmap the slots of sessions closed at least `older_than_s` ago and not reused since (see
        cuda_state.table). Returns how many were released."""
        return self.table.trim(older_than_s)

    def fork(self, session_id: str, child_id: str | None = None) -> str:
        """A new session that continues exactly as `session_id` would (its computed state is copied)."""
        parent = self._session(session_id)
        if parent.request is not None:
            raise SessionBusy(f"session {session_id} is generating: fork it after the generation ends")
        sid = self._new_id(child_id)
        self._resident(parent)
        slot = self._with_room(lambda: self.table.clone(parent.slot, parent.computed), keep=parent, spare=parent.id)
        parent.used_at = time.monotonic()
        self._lost.pop(sid, None)
        self._sessions[sid] = Session(sid, slot, list(parent.tokens), parent.computed, owner=parent.owner)
        if self.checkpoints is not None:
            self.checkpoints.fork(session_id, sid, parent.computed)
        log.debug("session_forked", session=sid, parent=session_id, slot=slot, copied=parent.computed)
        return sid

    def close(self, session_id: str) -> None:
        """Free the session's slot. An in-flight generation on it ends with finish_reason "cancelled"."""
        if session_id in self._lost and session_id not in self._sessions:
            del self._lost[session_id]  # its state was lost: nothing is left of it
            return
        session = self._session(session_id)
        if session.request is not None:
            self._cancel(session.request)
        del self._sessions[session_id]
        if self.checkpoints is not None:
            self.checkpoints.drop(session_id)
        if session.resident:
            self.table.free(session.slot)  # waits for device work that used the slot
        elif self.hibernation is not None:
            self.hibernation.drop(session_id)
        log.debug("session_closed", session=session_id)

    def append(self, session_id: str, token_ids: Sequence[int] | None = None, text: str | None = None, *,
               boundary_check: bool = False) -> int:
        """Add prompt tokens (or text) to the session; returns its length in tokens.

        A text is tokenized on its own, with the tokenizer's BOS only on an empty session. With `boundary_check` it
        is taken as the continuation of the session's text: its ids are those a tokenization of the session's last
        tokens and the text together gives after theirs, and PromptBoundary is raised, nothing appended, where the
        text would change how those last tokens tokenize ("Par" held, "is" appended: one token, "Paris")."""
        session = self._session(session_id)
        ids = self._prompt(session, token_ids, text, boundary_check)
        if session.request is not None:
            raise SessionBusy(f"session {session_id} is generating: append after the generation ends")
        self._resident(session)  # a hibernated copy holds the session's tokens too: it comes back before they change
        session.tokens.extend(ids)
        session.used_at = time.monotonic()
        return len(session.tokens)

    def prompt_ids(self, session_id: str, token_ids: Sequence[int] | None = None, text: str | None = None, *,
                   boundary_check: bool = False, from_start: bool = False) -> list[int]:
        """The ids that appending `token_ids` or `text` to the session would add, or (`from_start`) that would be its
        whole context, checked as append and start_generate check them (nothing is changed)."""
        return self._prompt(self._session(session_id), token_ids, text, boundary_check, from_start)

    def _prompt(self, session: Session, token_ids: Sequence[int] | None, text: str | None,
                boundary_check: bool = False, from_start: bool = False) -> list[int]:
        """The ids that appending `token_ids` or `text` would add (`from_start`: that would be the session's whole
        context, the text tokenized as a first text), checked (nothing is changed)."""
        if (token_ids is None) == (text is None):
            raise BadRequest("append takes exactly one of token_ids or text")
        if text is not None:
            if not isinstance(text, str):
                raise BadRequest("text must be a string")
            self._check_text_fits(session, text, from_start)
            ids = self.tokenize(text, *self._text_context(session, boundary_check, from_start))
        else:
            if token_ids is not None and not isinstance(token_ids, (str, bytes)):
                self._check_fits(session, len(token_ids), from_start)  # before the per-id checks of a long list
            ids = self._check_ids(token_ids)
        if not ids:
            raise BadRequest("append needs at least one token (empty text or token_ids)")
        self._check_fits(session, len(ids), from_start)
        return ids

    def tokenize(self, text: str, add_bos: bool | None = None, after: Sequence[int] | None = None) -> list[int]:
        """The ids of `text` as an append of it makes them; `after`: the last tokens of the session it continues
        (`text_context`), for an append with boundary_check (PromptBoundary where the text re-tokenizes them). Reads
        only the tokenizer: safe on another thread than the engine's (the worker tokenizes long texts off its compute
        loop), and releases the GIL for long texts."""
        try:
            if after is None:
                ids = self.tokenizer.encode(text, add_bos)
            else:
                found = self.tokenizer.encode_after(after, text)
                if found is None:
                    raise PromptBoundary(
                        f"the text changes how the session's last tokens tokenize ({self.tokenizer.decode(after)[-24:]!r} "
                        f"then {text[:24]!r}): appended on its own it would give other tokens than the whole text does")
                ids = found
        except ValueError as e:
            raise BadRequest(str(e)) from e
        vocab = self.model.config.vocab_size
        if ids and max(ids) >= vocab:  # a tokenizer with more tokens than the model's embedding (a mismatched folder)
            raise BadRequest(f"the text encodes to token id {max(ids)}, past the model's vocabulary of {vocab}")
        return ids

    def check_text_fits(self, session_id: str, text: str, from_start: bool = False) -> None:
        """ContextOverflow at once when `text` cannot fit the session whatever its tokenization (a lower bound on its
        tokens, known without tokenizing it: `Tokenizer.min_tokens`), so that a huge text is refused without the
        seconds and memory its tokenization would take (`from_start`: as the session's whole context). SessionNotFound
        for an unknown session."""
        self._check_text_fits(self._session(session_id), text, from_start)

    def _check_text_fits(self, session: Session, text: str, from_start: bool = False) -> None:
        least = self.tokenizer.min_tokens(text)
        held = 0 if from_start else len(session.tokens)
        if held + least > self.max_context:
            raise ContextOverflow(
                f"session {session.id} holds {held} tokens; a text of {len(text)} characters is at "
                f"least {least} tokens (a token holds at most {self.tokenizer.max_token_bytes} bytes), which exceed "
                f"max_context {self.max_context}"
            )

    def _check_fits(self, session: Session, tokens: int, from_start: bool = False) -> None:
        if from_start:
            if tokens > self.max_context:
                raise ContextOverflow(f"a context of {tokens} tokens exceeds max_context {self.max_context}")
        elif len(session.tokens) + tokens > self.max_context:
            raise ContextOverflow(
                f"session {session.id} holds {len(session.tokens)} tokens; {tokens} more exceed "
                f"max_context {self.max_context}"
            )

    def chat(self, session_id: str, content: str, role: str = "user") -> int:
        """Append one chat turn, rendered with the model's template, plus the assistant prompt (see chat_text)."""
        if not isinstance(content, str) or not isinstance(role, str):
            raise BadRequest("chat content and role must be strings")
        text = self.chat_text(session_id, [{"role": role, "content": content}])
        self._check_text_fits(self._session(session_id), text)
        return self.append(session_id, token_ids=self.tokenize(text, add_bos=False))

    def chat_ids(self, session_id: str, messages: Sequence[dict[str, Any]], boundary_check: bool = False,
                 template_args: Mapping[str, Any] | None = None, from_start: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The token ids that appending these chat turns adds to the session (see chat_text; nothing is changed)."""
        return self.tokenize(self.chat_text(session_id, messages, boundary_check, template_args, from_start, tools),
                             add_bos=False)

    def chat_text(self, session_id: str, messages: Sequence[dict[str, Any]], boundary_check: bool = False,
                  template_args: Mapping[str, Any] | None = None, from_start: bool = False,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The text that appending these chat turns, rendered with the model's template, plus the assistant prompt,
        adds to the session (tokenized without a BOS; nothing is changed). Cheap next to tokenizing it: the worker
        renders on its compute loop and tokenizes a long text on another thread.

        On an empty session the template is rendered from the start (system prompt included). On a session that
        holds a conversation, only what the template puts after the last assistant answer is rendered: the EOS the
        model ended with is already in the history (one is added when the answer was cut short), so the session's
        tokens stay exactly those of its turns, one after the other. No turns on such a session: just the assistant
        prompt. Where the template renders that answer otherwise once more turns follow it (Qwen3 drops its reasoning,
        Llama 3 trims its spaces: `Tokenizer.chat_continuation`), the session keeps the answer as the model gave it and
        the turns follow it (`Tokenizer.chat_after_answer`): its tokens are then not those of the whole conversation
        rendered at once. With `boundary_check` that is refused instead: PromptBoundary, nothing appended, and the
        whole conversation sent from its start (`from_start`) gets its tokens (the gateway's way). `template_args`: more variables for
        the template (Qwen3's enable_thinking), for the turns' rendering on a session that holds some too.
        `from_start`: the turns are the whole conversation (start_generate's from_start), rendered as on an empty
        session. `tools` (the functions the model may call) and messages with `tool_calls` or `tool_call_id` are
        rendered only so, the whole conversation at once (a template renders tools in its system turn)."""
        session = self._session(session_id)
        if isinstance(messages, (str, bytes)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise BadRequest("chat messages must be maps with string role and content")
        turns: list[dict[str, Any]] = [{k: m[k] for k in TURN_KEYS if k in m} for m in messages]
        if (not session.tokens or from_start) and not turns:
            raise BadRequest(f"session {session_id} is empty: its first chat turn needs a message" if not from_start
                             else "from_start needs the whole conversation: at least one message")
        whole = not session.tokens or from_start
        if not whole and (tools or any(len(t) > 2 for t in turns)):
            raise BadRequest("tools, function calls and reasoning are rendered with the whole conversation only: send it "
                             "from its start (from_start) or to a new session")
        try:
            if whole:
                first: str = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                                variables=template_args, tools=tools)
                return first
            if not boundary_check:
                kept: str = self.tokenizer.chat_after_answer(session.tokens, turns, template_args)
                return kept
            text = self.tokenizer.chat_continuation(session.tokens, turns, template_args)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if text is None:
            raise PromptBoundary(f"session {session_id}: the model's chat template renders the session's last answer "
                                 "otherwise once more turns follow it; only the whole conversation, sent from its "
                                 "start (from_start), gives its tokens")
        return text

    # -- generation: the step-driven core ---------------------------------------------------------

    def start_generate(self, session_id: str, params: SamplingParams, request_id: str | None = None, *,
                       prompt_ids: Sequence[int] | None = None, prompt: str | None = None,
                       boundary_check: bool = False, from_start: bool = False, turn_tail: int = 0) -> str:
        """Queue a generation; it runs in the following steps. Validates everything now.

        With `prompt_ids` or `prompt` (text), that prompt is appended first, as by `append` (`boundary_check` too): one call for a
        turn. Either both happen or, when anything is refused, neither. max_tokens 0 only prefills: the prompt is
        computed but for its last token, which stays pending as after a generation (so forks of the session then
        each compute one token, not the prompt), and the request ends "length" with no tokens.

        `from_start`: the prompt is the session's whole context from its start, not a continuation (a text is
        tokenized as a first text): the session then holds exactly its tokens, as a new session given it would. What
        it held that the prompt starts with is kept, not computed again (`kept`); the rest of what it held is dropped
        (an edited or cut conversation, an answer generated again, a template that renders earlier turns otherwise).

        `turn_tail` (`turn_tail()` of a chat prompt): the prompt's last tokens that a later turn renders otherwise; a
        recurrent state's checkpoint holds the session's tokens before them (else before the prompt's last token).
        """
        session = self._session(session_id)
        params.validate(self.model.config.vocab_size)
        if params.max_tokens > self.max_context:
            raise BadRequest(f"max_tokens {params.max_tokens} exceeds the context of {self.max_context} tokens "
                             "(worker --max-context)")
        if session.request is not None:
            raise SessionBusy(f"session {session_id} already has a generation in flight")
        if from_start and (boundary_check or (prompt_ids is None and prompt is None)):
            raise BadRequest("from_start takes the session's whole context as the prompt, without boundary_check")
        ids = [] if prompt_ids is None and prompt is None else self._prompt(session, prompt_ids, prompt, boundary_check,
                                                                          from_start)
        length = (0 if from_start else len(session.tokens)) + len(ids)
        if not length:
            raise BadRequest(f"session {session_id} is empty: append a prompt before generating")
        if length >= self.max_context:
            raise ContextOverflow(f"session {session_id} is full ({self.max_context} tokens): no room to generate")
        rid = request_id or secrets.token_hex(8)
        if rid in self._active:
            raise BadRequest(f"request id {rid} is already in flight")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.stop_ids)
        request = Request(rid, session, params, RowRandom.for_params(params),
                          Detokenizer(self.tokenizer, params.stop, params.min_tokens), stop_ids)
        self._resident(session)  # a hibernated session is restored first: refused whole if it cannot be
        if params.penalized and params.max_tokens:  # (the last refusal: nothing is changed before it)
            if self.penalties is None:
                self.penalties = Penalties(self.model.config.vocab_size, self.model.device)
            request.penalty_row = self.penalties.open(params, ids if from_start else [*session.tokens, *ids])
        session.used_at = time.monotonic()
        if from_start:
            same = common_prefix(session.tokens, ids)
            if same < session.computed:
                session.computed = same if self._rewritable else 0
            if self.checkpoints is not None:
                self.checkpoints.keep_within(session.id, same)
            session.tokens[:] = ids
        else:
            session.tokens.extend(ids)
        if session.computed >= len(session.tokens):
            # The state holds every token (a step run ahead fed the last sample of the generation before): the first
            # sample needs a token run again. A state a rerun rewrites runs the last one again; a recurrent one, which
            # cannot take a token back, is computed again from the session's history (or its checkpoint, below).
            session.computed = len(session.tokens) - 1 if self._rewritable else 0
        if self.checkpoints is not None:
            self._from_checkpoint(session)
            at = len(session.tokens) - max(1, turn_tail)
            if session.computed < at:  # a prompt to compute: its chunks stop there, and the state there is kept
                request.checkpoint_at, request.checkpoint = at, self.checkpoints.reserve(session.id, at)
        if params.max_tokens == 0 and session.computed >= len(session.tokens) - 1:
            self._finished.append(Chunk(rid, session.id, [], "", "length"))  # nothing to prefill
            return rid
        session.request = request
        self._active[rid] = request
        return rid

    def kept(self, session_id: str, ids: Sequence[int]) -> int:
        """How many of the session's tokens a from_start prompt of `ids` keeps: those `ids` starts with. Their state is
        kept as far as it can be (`session_computed` after start_generate): a state laid out by position is cut
        there; a recurrent one, which cannot take tokens back, keeps all it has taken in or, where `ids` leaves one of
        those out, its checkpoint's tokens when `ids` keeps them (worker.engine.checkpoints), else none (the session
        is computed again from its start)."""
        return common_prefix(self._session(session_id).tokens, ids)

    def turn_tail(self, prompt_ids: Sequence[int], template_args: Mapping[str, Any] | None = None) -> int:
        """How many of a chat prompt's last tokens (`prompt_ids`, ending with the template's assistant prompt) the
        template renders otherwise once the answer is an earlier turn (Qwen3.5's "<think>\n"): start_generate's
        `turn_tail`, so that the next turn, sent whole from its start, finds a recurrent state's checkpoint within
        what it keeps. 0 for a model without a recurrent state, and where the prompt does not end with that text's
        tokens."""
        if self.checkpoints is None:
            return 0
        try:
            tail = self.tokenizer.answer_prompt_tail(template_args)
        except ChatTemplateError:
            return 0
        ids = self.tokenize(tail, add_bos=False) if tail else []
        return len(ids) if ids and list(prompt_ids[-len(ids):]) == ids else 0

    def _from_checkpoint(self, session: Session) -> None:
        """A recurrent session whose state holds fewer of its tokens than a checkpoint of it starts from its latest such
        checkpoint that leaves a token after it to sample from (queued on the stream, after the steps that still hold
        rows of it)."""
        assert self.checkpoints is not None
        cp = self.checkpoints.within(session.id, len(session.tokens) - 1)
        if cp is not None and session.computed < cp.at:
            session.computed = self.checkpoints.put_back(cp, session.slot)

    def session_computed(self, session_id: str) -> int:
        """The session's tokens whose state it holds (the rest are computed by its next generation)."""
        return self._session(session_id).computed

    def cancel(self, request_id: str) -> None:
        """End a generation early; its final chunk (finish_reason "cancelled") comes from the next step."""
        request = self._active.get(request_id)
        if request is not None:
            self._cancel(request)

    def has_work(self) -> bool:
        return bool(self._active or self._finished or self._unread)

    @property
    def prefill_running(self) -> bool:
        """The step the next call reads computes prompt tokens and the device has not finished it: a caller with
        other work (the worker taking requests) may do it first; step(wait=False) would return without reading."""
        unread = self._unread
        return unread is not None and unread.prefill_tokens > 0 and not unread.done()

    def step(self, wait: bool = True) -> list[Chunk]:
        """One step: schedule -> execute -> update. Returns one chunk per request that moved.

        With overlap, the step read here may have been launched by the previous call, and the next one is left
        running on the device when this returns (see the module's docstring); a call that launches a step afresh
        returns without reading it (only chunks made outside a step). wait False: a step with prompt tokens is read
        only once the device has made its tokens (`prefill_running`); until then the call launches what it can and
        returns. Decode steps (about a millisecond) are always waited for."""
        outside, self._finished = self._finished, []  # final chunks made between steps (cancels, closes)
        chunks = list(outside)
        self.last_rows = self.last_prefill_tokens = self.last_prompt_tokens = 0  # what this call launches (or none)
        self.last_read = False
        try:
            if self._unread is None:
                self._unread = self._launch(self._plan(None))
                if self._unread is None or self.overlap:
                    return chunks + self._end_starved()  # read in the next call: meanwhile the caller takes requests
            elif self.overlap and self._ahead is None:
                self._ahead = self._launch_after(self._unread)
            launched = self._unread
            if not wait and launched.prefill_tokens and not launched.done():
                return chunks
            self._unread, self._ahead = self._ahead, None
            self.last_read = True
            chunks += self._update(launched)
            chunks += self._end_starved()
        except BaseException:
            if not self._rewritable:  # the failed steps may have advanced their sessions' state: rebuild it
                self._forget_state([*self._active.values(), *self._rows_of(self._unread), *self._rows_of(self._ahead)])
            self._unread = self._ahead = None  # nothing of a failed step is kept: its requests run it again
            self._recount()  # nor its samples' counts
            # The ends made between steps belong to no step: they come with the next call, not lost with this one.
            self._finished = outside + self._finished
            raise
        return chunks

    def _plan(self, last: Launched | None) -> StepPlan:
        """The next step, every session in it backed for its rows (pages mapped here, between steps, never under a
        step that reads them). A request whose session cannot get its pages, even after idle sessions hibernate, is
        starved: the step is planned again without it, and it ends "capacity" once no launched step holds it."""
        while True:
            plan = schedule(self._active.values(), last, self.step_tokens, self.prefill_chunk, self.max_context)
            starved = self._back(plan)
            if not starved:
                return plan
            for request in starved:
                request.starved = True
                self._starved.append(request)
            log.info("generations_out_of_pages", requests=len(starved), free_pages=self.table.free_pages)

    def _back(self, plan: StepPlan) -> list[Request]:
        """Map the pages the plan's rows reach into; the requests whose sessions could not get them."""
        table = self.table
        starved: list[Request] = []
        for request, tokens in plan.reach:
            slot = request.session.slot
            if table.covers(slot, tokens):
                continue
            try:
                self._with_room(lambda: table.ensure(slot, tokens), keep=request.session)  # noqa: B023  (called now)
            except CapacityExhausted:
                starved.append(request)
        return starved

    def _end_starved(self) -> list[Chunk]:
        """The starved requests that no launched step holds any more end "capacity": their sessions keep every token
        accepted so far, the last one pending, as after any generation."""
        if not self._starved:
            return []
        in_flight = {id(r) for r in (*self._rows_of(self._unread), *self._rows_of(self._ahead))}
        chunks: list[Chunk] = []
        waiting: list[Request] = []
        for request in self._starved:
            if request.finish_reason is not None:
                continue
            if id(request) in in_flight:
                waiting.append(request)
                continue
            request.finish_reason = "capacity"
            request.detok.flush()
            self._retire(request)
            chunks.append(Chunk(request.id, request.session.id, [], request.detok.take(True), "capacity"))
        self._starved = waiting
        return chunks

    def _launch_after(self, last: Launched) -> Launched | None:
        """The step after `last`, queued before `last` is read: what the scheduler will pick once it is read.

        A new arrival does not make the host read first and leave the device idle: it rides in this step.
        Requests that `last` ends by length are left out; one that it ends by a stop token or string runs a
        wasted row, dropped when read. None when nothing is left to run or the decode rows exceed one replay."""
        plan = self._plan(last)
        if plan.decode_rows > self.executor.max_decode_rows:
            return None
        return self._launch(plan, last)

    def _launch(self, plan: StepPlan, after: Launched | None = None) -> Launched | None:
        """Execute one planned step and queue its sampling and the copy of its ids to the host (`after`: the step
        launched before it and not read yet)."""
        self.last_rows = len(plan)
        self.last_prefill_tokens = plan.prefill_tokens
        self.last_prompt_tokens = plan.prefill_tokens + plan.decode_prompt_tokens
        if not self.last_rows:
            return None
        logits = self.executor.execute(plan.rows(), copy_logits=False)
        if self.checkpoints is not None:
            for request, start, n in plan.partial:  # the state holds a generation's prompt but its last token (or tail)
                cp = request.checkpoint
                if cp is not None and start + n == request.checkpoint_at:
                    self.checkpoints.take(cp, request.session.slot, start + n)
        sampled, positions = plan.sampled()
        params = [r.params for r in sampled]
        penalized = [(i, r.penalty_row) for i, r in enumerate(sampled) if r.penalty_row is not None]
        scores = logits  # what sampling reads: the model's logits changed for the requests that ask (logprobs: these)
        pool, rows = self.penalties, None
        if penalized and pool is not None:
            rows = pool.rows_of([i for i, _ in penalized], [row for _, row in penalized])
            scores = pool.apply(logits, rows)
        scores = self._before_min_tokens(scores, logits, sampled, after)
        ids = sample_ids(scores, params, [r.random for r in sampled])
        if pool is not None and rows is not None:
            pool.count(ids, rows)  # before the step launched next samples
        logprobs = step_logprobs(logits, ids, params)  # None unless a request asked: nothing more per step
        step, self.steps = self.steps, self.steps + 1
        if ids.device.type != "cuda":
            return Launched(plan.partial, sampled, positions, ids, ids, None, plan.prefill_tokens, logprobs)
        if self._id_copies is None:  # pinned memory and events made once, not per step
            self._id_copies = [(torch.empty(self.table.capacity, dtype=torch.long, pin_memory=True), torch.cuda.Event())
                               for _ in range(ID_COPIES)]
        buffer, copied = self._id_copies[step % ID_COPIES]
        host = buffer[: len(sampled)]
        host.copy_(ids, non_blocking=True)
        host_logprobs = None if logprobs is None else logprobs.to_host()  # queued before the event: it covers them
        copied.record(torch.cuda.current_stream(ids.device))  # named: current_stream() alone looks the device up
        return Launched(plan.partial, sampled, positions, ids, host, copied, plan.prefill_tokens, host_logprobs)

    @staticmethod
    def _before_min_tokens(scores: torch.Tensor, logits: torch.Tensor, sampled: Sequence[Request],
                           after: Launched | None) -> torch.Tensor:
        """`scores` with EOS and the stop ids out of reach (-inf) in the rows of requests that have sampled fewer than
        their min_tokens before this step (those accepted, and one in the step launched before it, not read yet)."""
        rows: list[int] = []
        cols: list[int] = []
        width = scores.shape[1]
        in_flight: set[int] | None = None  # the requests sampled in `after` (made once, when a row needs it)
        for i, request in enumerate(sampled):
            if request.params.min_tokens and request.stop_ids:
                if in_flight is None:
                    in_flight = {id(r) for r in after.sampled} if after is not None else set()
                before = request.generated + (id(request) in in_flight)
                if before < request.params.min_tokens:
                    ids = sorted(t for t in request.stop_ids if 0 <= t < width)  # (a model's config may name others)
                    rows += [i] * len(ids)
                    cols += ids
        if not rows:
            return scores
        if scores is logits:
            scores = logits.clone()
        at = (upload(rows, torch.long, scores.device), upload(cols, torch.long, scores.device))
        return scores.index_put_(at, scores.new_full((len(rows),), float("-inf")))  # (a fill: no copy that waits)

    def _update(self, launched: Launched) -> list[Chunk]:
        """Read a launched step's tokens and apply them to the requests still running (only once the step has
        succeeded: a failed one runs again). A request that ended meanwhile keeps its `computed`: the K/V the
        step wrote past it are simply rewritten."""
        new_ids = launched.read()
        chunks = []
        for request, position, n in launched.partial:
            if request.finish_reason is None:
                request.session.computed = position + n
                if request.params.max_tokens == 0 and request.session.computed >= len(request.session.tokens) - 1:
                    chunks.append(self._prefilled(request))
        logprobs = launched.read_logprobs()
        for row, (request, position, token) in enumerate(zip(launched.sampled, launched.positions, new_ids, strict=True)):
            if request.finish_reason is None:
                request.session.computed = position + 1
                chunks.append(self._accept(request, token, logprobs.get(row)))
        return chunks

    # -- generation: sync helpers -------------------------------------------------------------

    def stream(self, session_id: str, **kwargs: object) -> Generator[Chunk, None, None]:
        """Generate, yielding a chunk per step. Closing the iterator early cancels the generation."""
        params = _params(kwargs)
        rid = self.start_generate(session_id, params)
        box: deque[Chunk] = deque()
        self._mailboxes[rid] = box
        try:
            while True:
                while not box:
                    self._pump()
                chunk = box.popleft()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            self._forget(rid)

    def generate(self, session_id: str, **kwargs: object) -> Generation:
        """Generate to the end and return everything (token_ids, text, finish_reason)."""
        return self.generate_many([(session_id, kwargs)])[0]

    def generate_many(self, requests: Sequence[tuple[str, dict[str, object]]]) -> list[Generation]:
        """Run several sessions' generations together, all started before the first step (so they share every step
        from the first); results in the order given. A request that cannot start cancels the ones started before it."""
        rids: list[str] = []
        boxes: list[deque[Chunk]] = []
        try:
            for sid, kw in requests:
                rids.append(self.start_generate(sid, _params(kw)))
                boxes.append(deque())
                self._mailboxes[rids[-1]] = boxes[-1]
            results = [Generation([], "", "length") for _ in rids]
            live = set(range(len(rids)))
            while live:
                self._pump()
                for i in sorted(live):
                    while boxes[i]:
                        chunk = boxes[i].popleft()
                        result = results[i]
                        result.token_ids += chunk.token_ids
                        result.text += chunk.text
                        result.finish_reason = chunk.finish_reason or result.finish_reason
                        if chunk.logprobs is not None:
                            result.logprobs = (result.logprobs or []) + chunk.logprobs
                        if chunk.finish_reason is not None:
                            live.discard(i)
            return results
        finally:
            for rid in rids:
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        """The sync helpers are done with request `rid`: its mailbox goes; if it still runs (the caller stopped early
        or failed) it is cancelled and its chunks not yet taken are dropped."""
        self._mailboxes.pop(rid, None)
        if rid in self._active:
            self.cancel(rid)
            self._finished = [c for c in self._finished if c.request_id != rid]

    # -- internals ----------------------------------------------------------------------------

    def _accept(self, request: Request, token: int,
                logprob: tuple[float, list[int], list[float]] | None = None) -> Chunk:
        """Append a sampled token to the session and decide whether the request is done."""
        session = request.session
        session.tokens.append(token)
        request.generated += 1
        new_ids: list[int] = []
        logprobs: list[TokenLogprob] | None = None if request.params.logprobs is None else []
        if token in request.stop_ids:
            request.finish_reason = "stop"
        else:
            new_ids.append(token)
            if logprobs is not None and logprob is not None:
                logprobs.append(self._token_logprob(token, logprob, request.params.logprobs or 0))
            request.token_ids.append(token)
            request.detok.add(token)
            if request.detok.stopped:
                request.finish_reason = "stop"
            elif request.generated >= request.params.max_tokens or len(session.tokens) >= self.max_context:
                request.finish_reason = "length"
        if request.finish_reason is not None:
            request.detok.flush()
            self._retire(request)
        return Chunk(request.id, session.id, new_ids, request.detok.take(request.finish_reason is not None),
                     request.finish_reason, logprobs)

    def _token_logprob(self, token: int, logprob: tuple[float, list[int], list[float]], k: int) -> TokenLogprob:
        value, top_ids, top_values = logprob
        top = tuple((i, v, self._token_bytes(i)) for i, v in zip(top_ids[:k], top_values[:k], strict=True))
        return value, self._token_bytes(token), top

    def _token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a special token: its name, e.g. b"<|im_end|>")."""
        table = self.tokenizer.token_bytes
        if table is not None and 0 <= token < len(table) and table[token]:
            return table[token]
        return self.tokenizer.decode([token]).encode("utf-8", "replace")

    def _prefilled(self, request: Request) -> Chunk:
        """A prefill-only request (max_tokens 0) whose prompt is computed: it ends, with no tokens."""
        request.finish_reason = "length"
        self._retire(request)
        return Chunk(request.id, request.session.id, [], "", "length")

    def _cancel(self, request: Request) -> None:
        request.finish_reason = "cancelled"
        request.detok.flush()
        self._retire(request)
        self._finished.append(Chunk(request.id, request.session.id, [], request.detok.take(True), "cancelled"))

    def _retire(self, request: Request) -> None:
        if request.penalty_row is not None and self.penalties is not None:
            self.penalties.close(request.penalty_row)
            request.penalty_row = None
        request.session.request = None
        request.session.used_at = time.monotonic()
        self._active.pop(request.id, None)
        if not self._rewritable:
            end = self._state_after(request, sample_dropped=request.finish_reason == "cancelled")
            request.session.computed = 0 if end is None else end

    def _state_after(self, request: Request, sample_dropped: bool) -> int | None:
        """Where the steps launched and not read yet leave the state of an ending request's session: after their last
        row of it, or None when one of them ran a token that is not in the session's history into it.

        The engine runs ahead: when a request ends (read from a step, or cancelled between steps), the steps after it
        may already hold rows of it. Each such row ran a token of the history (a prompt token, or a sample the engine
        has accepted), except a row that took a sample of the step before it that is then dropped (`sample_dropped`:
        the request is cancelled, and the samples of its unread steps are never accepted). A state a rerun rewrites
        does not care; a recurrent one has taken those tokens in, so `computed` moves to their end (the next turn
        starts after them) or, after a dropped sample, to 0: the session is computed again from its history."""
        end = request.session.computed
        fed_dropped = False  # the step before this one sampled for the request, and the sample is dropped
        for launched in (self._unread, self._ahead):  # in launch order
            if launched is None:
                continue
            for r, position, n in launched.partial:
                if r is request:
                    end = position + n
            for r, position in zip(launched.sampled, launched.positions, strict=True):
                if r is request:
                    if fed_dropped:
                        return None
                    end = position + 1
                    fed_dropped = sample_dropped
        return end

    def _recount(self) -> None:
        """The penalized requests' rows from the tokens accepted (after a failed step: its samples are not)."""
        if self.penalties is None:
            return
        for request in self._active.values():
            if request.penalty_row is not None:
                tokens = request.session.tokens
                start = len(tokens) - request.generated
                self.penalties.rebuild(request.penalty_row, tokens[:start], tokens[start:])

    @staticmethod
    def _rows_of(launched: Launched | None) -> list[Request]:
        return [] if launched is None else [r for r, _, _ in launched.partial] + launched.sampled

    def _forget_state(self, requests: Sequence[Request]) -> None:
        """Their sessions' state is in doubt: each is computed again from its history (a run from position 0 starts
        from zero state whatever its slot holds), and its checkpoint, which a failed step may have left, dropped."""
        for request in requests:
            request.session.computed = 0
            if self.checkpoints is not None:
                self.checkpoints.drop(request.session.id)

    def _pump(self) -> None:
        if not self.has_work():
            raise EngineError("internal: waiting for output with no work in flight")
        for chunk in self.step():
            box = self._mailboxes.get(chunk.request_id)
            if box is not None:
                box.append(chunk)

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            if isinstance(session_id, str) and session_id in self._lost:
                raise SessionLost(f"session {session_id}: its hibernated state was lost")
            raise SessionNotFound(f"no session {session_id!r} on this worker")
        return session

    # -- hibernation ----------------------------------------------------------------------------

    def hibernate(self, session_id: str) -> bool:
        """Copy an idle session's state to host memory (or disk) and release its pages. False when it cannot now
        (generating, in a step still running, hibernation off or full); its next request restores it."""
        return self._hibernate(self._session(session_id))

    def hibernate_idle(self, older_than_s: float) -> int:
        """Hibernate the sessions no request has touched for `older_than_s`. Returns how many hibernated."""
        cutoff = time.monotonic() - older_than_s
        idle = sorted((s for s in self._sessions.values() if s.resident and s.request is None and s.used_at <= cutoff),
                      key=lambda s: s.used_at)
        return sum(self._hibernate(s) for s in idle)

    def persist(self) -> int:
        """Write every session to the session store (a clean stop): resident ones hibernate, host copies go to disk.
        Returns how many sessions the store holds; those that could not be written are logged."""
        h = self.hibernation
        if h is None or h.store is None:
            return 0
        for session in list(self._sessions.values()):
            if session.resident and not self._hibernate(session):
                log.warning("session_not_persisted", session=session.id)
        h.persist()
        return len(h.disk)

    def restore(self, session_id: str) -> None:
        """Bring a hibernated session back into a slot (a no-op for a resident one)."""
        self._resident(self._session(session_id))

    # -- moving sessions between workers (worker.engine.migration) --------------------------------

    def export_session(self, session_id: str, checkpoint: bool = False) -> migration.Snapshot | None:
        """An idle session's snapshot (it stays here), with its latest checkpoint where `checkpoint` asks and it has
        one; None while a step launched ahead holds a row of it."""
        return migration.export_session(self, session_id, checkpoint)

    def check_import(self, session_id: str, tokens: list[int], computed: int, nbytes: int, model: str,
                     layout: str, checkpoint_at: int = 0, checkpoint_bytes: int = 0) -> None:
        """MoveRefused unless a snapshot with these fields fits this engine (before any byte of it is taken)."""
        migration.check_snapshot(self, session_id, tokens, computed, nbytes, model, layout, checkpoint_at,
                                 checkpoint_bytes)

    def import_session(self, snapshot: migration.Snapshot, digest: bytes) -> str:
        """A moved session, checked against `digest`, into a slot of its own; refused whole on any mismatch."""
        return migration.import_session(self, snapshot, digest)

    def _in_flight(self) -> set[int]:
        return {id(r.session) for r in (*self._rows_of(self._unread), *self._rows_of(self._ahead))}

    def _hibernate(self, session: Session, in_flight: set[int] | None = None) -> bool:
        h = self.hibernation
        if h is None or not h.enabled or not session.resident or session.request is not None:
            return False
        if id(session) in (self._in_flight() if in_flight is None else in_flight):
            return False  # a step still running holds a row of it: its state is not final yet
        nbytes = self.table.spec.bytes_for(session.computed)
        # Its checkpoint goes with it where the store has room for both (it would be dropped here anyway).
        checkpoints = self.checkpoints
        cp = None if checkpoints is None else checkpoints.within(session.id, session.computed)
        extra = 0 if cp is None else self.table.spec.bytes_for(0)
        if extra and not h.admits(nbytes + extra, session.id):
            cp, extra = None, 0
        if not h.admits(nbytes, session.id):
            return False
        state = h.buffer(nbytes)
        self.table.save_prefix(session.slot, session.computed, state)  # ordered after the steps
        stored = Stored(session.id, session.owner, list(session.tokens), session.computed, nbytes, state)
        if checkpoints is not None and cp is not None:
            stored.checkpoint_at, stored.checkpoint_bytes, stored.checkpoint = cp.at, extra, h.buffer(extra)
            checkpoints.save(cp, stored.checkpoint)
        try:
            h.put(stored)
        except (OSError, SessionLost) as e:
            log.warning("hibernation_failed", session=session.id, error=str(e))
            return False
        if checkpoints is not None:
            checkpoints.drop(session.id)
        self.table.free(session.slot)
        session.slot = NO_SLOT
        self.hibernated += 1
        log.debug("session_hibernated", session=session.id, tokens=session.computed, bytes=nbytes,
                  checkpoint=stored.checkpoint_at)
        return True

    def _resident(self, session: Session) -> None:
        """Restore a hibernated session into a slot: refused with CapacityExhausted (it stays hibernated) when no
        slot or page can be had, SessionLost (it is gone) when its stored state is missing or corrupt."""
        if session.resident:
            return
        h = self.hibernation
        if h is None:
            raise SessionLost(f"session {session.id} has no slot and no stored state")
        start = time.perf_counter()
        source = "host" if session.id in h.host else "disk"
        try:
            stored = h.take(session.id)
        except SessionLost:
            self._lose(session)
            raise
        # Held here: making room may hibernate another session and spill this very copy to disk (its state let go).
        state, checkpoint = stored.state, stored.checkpoint
        assert state is not None
        computed, nbytes, checkpoint_at = stored.computed, stored.nbytes, stored.checkpoint_at
        if nbytes != self.table.spec.bytes_for(computed):  # a file checksummed, but not of this layout
            self._lose(session)
            raise SessionLost(f"session {session.id}: its stored state is {stored.nbytes} bytes, not the "
                              f"{self.table.spec.bytes_for(computed)} of {computed} tokens")
        try:
            slot = self._with_room(lambda: self.table.create(computed), keep=session)
        except CapacityExhausted:
            if source == "disk" and stored.session_id in h.disk:
                stored.state = stored.checkpoint = None  # read again next time: the files stay the truth
            raise
        try:
            self.table.load_prefix(slot, computed, state)  # the host copy (or file) is released below
        except BaseException:
            self.table.free(slot)
            raise
        session.slot, session.computed = slot, computed
        if checkpoint is not None and self.checkpoints is not None:  # where one is taken (Checkpoints.reserve)
            self.checkpoints.load(session.id, checkpoint_at, checkpoint)
        h.drop(session.id)
        self.restored += 1
        seconds = time.perf_counter() - start
        if self.on_restore is not None:
            self.on_restore(seconds, source)
        log.debug("session_restored", session=session.id, source=source, tokens=stored.computed,
                  ms=round(seconds * 1e3, 3))

    def _lose(self, session: Session) -> None:
        """A hibernated session whose state cannot be read back: gone, answered session_lost from now on."""
        log.warning("session_lost", session=session.id, reason="stored state missing or corrupt")
        self._sessions.pop(session.id, None)
        if self.hibernation is not None:
            self.hibernation.forget(session.id)
        self._lost[session.id] = None
        if len(self._lost) > MAX_LOST_REMEMBERED:
            self._lost.popitem(last=False)

    def _with_room(self, make: Callable[[], _T], keep: Session | None = None, spare: str | None = None) -> _T:
        """make(), dropping the least recently used checkpoint, then hibernating the least recently used idle session
        (never `keep`), while it finds no slot or page. `spare`'s checkpoints (a fork's parent's: its child shares
        them) go last, after the hibernations."""
        in_flight: set[int] | None = None
        while True:
            try:
                return make()
            except CapacityExhausted:
                if self.checkpoints is not None and self.checkpoints.drop_oldest(spare):
                    continue
                if in_flight is None:
                    in_flight = self._in_flight()
                if self._evict_one(keep, in_flight):
                    continue
                if self.checkpoints is not None and self.checkpoints.drop_oldest():
                    continue
                raise

    def _evict_one(self, keep: Session | None, in_flight: set[int]) -> bool:
        h = self.hibernation
        if h is None or not h.enabled:
            return False
        idle = [(s.used_at, i, s) for i, s in enumerate(self._sessions.values())
                if s.resident and s.request is None and s is not keep and id(s) not in in_flight]
        heapq.heapify(idle)  # the least recently used first, without sorting tens of thousands for the first one
        while idle:
            if self._hibernate(heapq.heappop(idle)[2], in_flight):
                return True
        return False

    def _new_id(self, session_id: str | None) -> str:
        if session_id is None:
            return secrets.token_hex(16)
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest("session id must be a non-empty string")
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id} already exists")
        return session_id

    def _check_ids(self, token_ids: Sequence[int] | None) -> list[int]:
        if token_ids is None or isinstance(token_ids, (str, bytes)):
            raise BadRequest("token_ids must be a list of integers")
        if len(token_ids) > MAX_APPEND_TOKENS:
            raise BadRequest(f"at most {MAX_APPEND_TOKENS} tokens per append")
        ids = list(token_ids)
        vocab = self.model.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise BadRequest(f"token id {t!r} is out of range [0, {vocab})")
        return ids


def _params(kwargs: dict[str, object]) -> SamplingParams:
    stop = kwargs.pop("stop", None)
    if isinstance(stop, str):
        stop = (stop,)
    bias = kwargs.get("logit_bias")
    if isinstance(bias, Mapping):  # {token id: bias}, as OpenAI's logit_bias
        kwargs["logit_bias"] = tuple(bias.items())
    elif isinstance(bias, (list, tuple)):  # (token id, bias) pairs
        kwargs["logit_bias"] = tuple(tuple(e) if isinstance(e, (list, tuple)) else e for e in bias)
    try:
        return SamplingParams(stop=tuple(stop or ()), **kwargs)  # type: ignore[arg-type]
    except TypeError as e:
        raise BadRequest(str(e)) from e


class _Closed:
    """The executor of a closed engine: every step is refused."""

    overlaps = False
    max_decode_rows = 0

    def execute(self, rows: object, copy_logits: bool = True) -> torch.Tensor:
        raise EngineError("the engine is closed")
