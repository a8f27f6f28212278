"""The gateway's live sessions: which conversation each holds, found by name or by prefix.

A session's `history` is exactly what its tokens are made of: for chat, its messages (the worker renders them turn
by turn, and the assistant turns are the tokens it generated); for completions, its prompt and completions as text,
or as token ids. A request resumes a session when its own history starts with the session's: then the session's
tokens are a prefix of the request's, and only the rest is sent and computed.

- Named sessions (`session_id`, per API key) are found by name. A request whose history does not continue the
  named session's (the client edited or cut the conversation, or asks for an answer again) is sent to it whole, from
  its start: the session keeps what the two share.
- Other sessions are found by prefix: chat histories by a chain of digests over their messages (the longest
  prefix of the request that ends with an assistant message and belongs to an idle session of the same key and
  model), completions by comparing the prompt's start with each idle session's text or ids. A chat request that
  asks again what a session's last answer answered (its history less that answer: "regenerate") goes to a fork of
  that session, sent the conversation from its start: it keeps all of it but the answer (where the model's state
  can be cut there), and the session itself stays for its own branch.
- A session serves one request at a time: it is taken out of the indexes while it works, and put back with its
  new history. Where the answer ended in a way its tokens may not be that history's (cut at a stop string, past a
  stop token or an EOS the text leaves out, inside a UTF-8 character, cancelled), it is marked inexact: its next turn
  sends the whole conversation from its start (GENERATE's from_start), and the worker keeps what matches.
- Idle sessions are kept in least-recently-used order: when a new session finds no free slot, the least recently
  used idle session of the same model is closed and the create tried again; `max_idle` caps them too.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from client.aio import AsyncSession

Turn = tuple[str, str]  # (role, content)
_K = TypeVar("_K", tuple[str, str], tuple[str, str, bytes])
Kind = Literal["chat", "text", "ids"]
EMPTY = b""


# A turn with function calls, a tool message's, or an answer sent back with its reasoning is (role, TOOL_MARK + JSON of
# its content, calls, call id and reasoning): one string, so that the digests cover them (all but the reasoning: the
# gateway keeps an answer without it, and the client may send it back with it or without); `message_of` makes the
# message again.
TOOL_MARK = "\x00tools\x00"
Calls = Sequence[tuple[str, str, str]] | Sequence[list[str]]  # (id, name, JSON arguments)


def marked_turn(role: str, text: str, calls: Calls = (), tool_call_id: str | None = None,
                reasoning: str | None = None) -> Turn:
    """A turn as the gateway keeps it (plain where it has none of these)."""
    if not calls and tool_call_id is None and reasoning is None and not text.startswith(TOOL_MARK):
        return role, text
    kept: dict[str, object] = {"content": text, "tool_calls": [list(c) for c in calls], "tool_call_id": tool_call_id}
    if reasoning is not None:
        kept["reasoning"] = reasoning
    return role, TOOL_MARK + json.dumps(kept, ensure_ascii=False, separators=(",", ":"))


def message_of(role: str, text: str) -> dict[str, Any]:
    """A kept turn as the client library's chat message (tool_calls in OpenAI's shape, reasoning_content)."""
    if not text.startswith(TOOL_MARK):
        return {"role": role, "content": text}
    kept = json.loads(text[len(TOOL_MARK):])
    message: dict[str, Any] = {"role": role, "content": kept["content"]}
    if kept["tool_calls"]:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in kept["tool_calls"]]
    if kept["tool_call_id"] is not None:
        message["tool_call_id"] = kept["tool_call_id"]
    if kept.get("reasoning") is not None:
        message["reasoning_content"] = kept["reasoning"]
    return message


def of_tools(text: str) -> bool:
    """Whether a kept turn has function calls, answers one or carries reasoning (rendered whole only)."""
    return text.startswith(TOOL_MARK)


def _matched(content: str) -> str:
    """What a turn's digest covers: a marked turn without its reasoning."""
    if not content.startswith(TOOL_MARK) or '"reasoning":' not in content:
        return content
    kept = json.loads(content[len(TOOL_MARK):])
    return marked_turn("", kept["content"], kept["tool_calls"], kept["tool_call_id"])[1]


def template_start(args: Sequence[tuple[str, object]]) -> bytes:
    """Where a chat's digest chain starts: its chat_template_kwargs change how every turn renders, so a conversation
    with other ones (or none) is another conversation. EMPTY for none."""
    if not args:
        return EMPTY
    return hashlib.blake2b(json.dumps(sorted(args), separators=(",", ":")).encode(), digest_size=16).digest()


def chain(turns: Sequence[Turn], start: bytes = EMPTY) -> list[bytes]:
    """The digest of every prefix of `turns`: out[i] covers turns[:i + 1], each from the one before (a turn's
    reasoning left out: `_matched`)."""
    out = []
    digest = start
    for role, content in turns:
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(role.encode())
        h.update(b"\x00")
        h.update(_matched(content).encode("utf-8", "surrogatepass"))
        digest = h.digest()
        out.append(digest)
    return out


@dataclass(eq=False)
class Entry:
    """One live session and the conversation it holds."""

    session: AsyncSession
    owner: str
    model: str
    kind: Kind
    max_context: int
    history: tuple[Turn, ...] | str | tuple[int, ...] = ()
    digest: bytes = EMPTY  # chat: chain(history)[-1]
    length: int = 0  # the session's tokens
    name: str | None = None
    busy: bool = False
    deleted: bool = False  # its name was deleted while it was busy: closed when its turn ends
    exact: bool = True  # its tokens are its history's (else its next turn is sent whole, from its start)
    asked: bytes | None = None  # chat: the digest of its history less its last answer (None: it ends otherwise)
    branches: tuple[bytes, ...] = ()  # chat: the digests of its history's earlier prefixes that end with an answer
    last_used: float = field(default_factory=time.monotonic)

    def extended_by(self, history: tuple[Turn, ...] | str | tuple[int, ...], digests: Sequence[bytes] = ()) -> bool:
        """Whether `history` starts with this session's (for chat, `digests` = chain(history))."""
        if self.kind == "chat":
            n = len(self.history)
            return n == 0 or (len(digests) >= n and digests[n - 1] == self.digest)
        assert isinstance(history, (str, tuple)) and isinstance(self.history, (str, tuple))
        return type(history) is type(self.history) and len(history) > len(self.history) and history[: len(self.history)] == self.history


class SessionStore:
    def __init__(self, max_idle: int = 0) -> None:
        self.max_idle = max_idle  # 0: no cap but the slots
        self._named: dict[tuple[str, str], Entry] = {}
        self._chat: dict[tuple[str, str, bytes], list[Entry]] = {}
        self._asked: dict[tuple[str, str, bytes], list[Entry]] = {}  # anonymous chat sessions by Entry.asked
        # and by each of Entry.branches (an ordered set: many sessions may share a long preamble's answers)
        self._branches: dict[tuple[str, str, bytes], dict[Entry, None]] = {}
        self._text: dict[tuple[str, str], list[Entry]] = {}
        self._idle: OrderedDict[Entry, None] = OrderedDict()
        self.busy = 0
        self.opening: set[tuple[str, str]] = set()  # (owner, name) of named sessions being opened for their first turn
        self.deleting: set[tuple[str, str]] = set()  # of those, the ones a DELETE named meanwhile

    def __len__(self) -> int:
        return len(self._idle) + self.busy

    @property
    def idle(self) -> int:
        return len(self._idle)

    def named(self, owner: str, name: str) -> Entry | None:
        return self._named.get((owner, name))

    def find_chat(self, owner: str, model: str, turns: Sequence[Turn], digests: Sequence[bytes]) -> Entry | None:
        """The idle anonymous session whose conversation is the longest prefix of `turns` ending with an answer."""
        return _by_answers(self._chat, owner, model, turns, digests)

    def find_asked(self, owner: str, model: str, digest: bytes) -> Entry | None:
        """The idle anonymous session whose history less its last answer has this digest (a request asking that
        answer again)."""
        for entry in self._asked.get((owner, model, digest), ()):
            if not entry.busy:
                return entry
        return None

    def find_branch(self, owner: str, model: str, turns: Sequence[Turn], digests: Sequence[bytes]) -> Entry | None:
        """The idle anonymous session whose conversation went on from the longest prefix of `turns` that ends with an
        answer, otherwise than `turns` do (an earlier message edited, an earlier answer asked again)."""
        return _by_answers(self._branches, owner, model, turns, digests)

    def find_completion(self, owner: str, model: str, prompt: str | tuple[int, ...]) -> Entry | None:
        """The idle anonymous completion session whose text (or ids) the prompt extends the most."""
        best: Entry | None = None
        for entry in self._text.get((owner, model), ()):
            if not entry.busy and entry.extended_by(prompt) and (best is None or len(entry.history) > len(best.history)):
                best = entry
        return best

    def take(self, entry: Entry) -> None:
        """The entry serves a request now: out of the indexes until put back (a named one is under its name, busy, from
        now on: a request for the name meanwhile is refused). Never a busy one: found idle, taken before any await."""
        assert not entry.busy, "a session taken twice"
        self._unindex(entry, keep_name=True)
        if entry.name is not None:
            self._named[(entry.owner, entry.name)] = entry
        entry.busy = True
        self.busy += 1

    def put(self, entry: Entry) -> list[Entry]:
        """A request is done with the entry: indexed with its history, idle. Returns the entries to close (over the
        idle cap, or one its name now replaces)."""
        if entry.busy:
            entry.busy = False
            self.busy -= 1
        entry.last_used = time.monotonic()
        closing: list[Entry] = []
        if entry.name is not None:
            old = self._named.get((entry.owner, entry.name))
            if old is not None and old is not entry:
                self._unindex(old)
                if not old.busy:
                    closing.append(old)
            self._named[(entry.owner, entry.name)] = entry
        elif entry.kind == "chat":
            self._chat.setdefault((entry.owner, entry.model, entry.digest), []).append(entry)
            if entry.asked is not None:
                self._asked.setdefault((entry.owner, entry.model, entry.asked), []).append(entry)
            for digest in entry.branches:
                self._branches.setdefault((entry.owner, entry.model, digest), {})[entry] = None
        else:
            self._text.setdefault((entry.owner, entry.model), []).append(entry)
        self._idle[entry] = None
        while self.max_idle and len(self._idle) > self.max_idle:
            oldest = next(iter(self._idle))
            self._unindex(oldest)
            closing.append(oldest)
        return closing

    def release(self, entry: Entry) -> None:
        """The entry's request failed or its session is to be closed: forget it (the caller closes the session)."""
        if entry.busy:
            entry.busy = False
            self.busy -= 1
        self._unindex(entry)

    def evict(self, model: str) -> Entry | None:
        """The least recently used idle session of `model`, forgotten (for the caller to close), or None."""
        for entry in self._idle:
            if entry.model == model:
                self._unindex(entry)
                return entry
        return None

    def forget_named(self, owner: str, name: str) -> Entry | None:
        entry = self._named.get((owner, name))
        if entry is not None:
            self._unindex(entry)
        return entry

    def drain(self) -> Iterator[Entry]:
        """Every idle entry, forgotten (shutdown)."""
        while self._idle:
            entry = next(iter(self._idle))
            self._unindex(entry)
            yield entry

    def _unindex(self, entry: Entry, keep_name: bool = False) -> None:
        self._idle.pop(entry, None)
        if entry.name is not None:
            if not keep_name and self._named.get((entry.owner, entry.name)) is entry:
                del self._named[(entry.owner, entry.name)]
            return
        if entry.kind == "chat":
            _remove(self._chat, (entry.owner, entry.model, entry.digest), entry)
            for digest in entry.branches:
                key = (entry.owner, entry.model, digest)
                sharing = self._branches.get(key)
                if sharing is not None:
                    sharing.pop(entry, None)
                    if not sharing:
                        del self._branches[key]
        else:
            _remove(self._text, (entry.owner, entry.model), entry)
        if entry.asked is not None:
            _remove(self._asked, (entry.owner, entry.model, entry.asked), entry)


def _by_answers(index: Mapping[tuple[str, str, bytes], Iterable[Entry]], owner: str, model: str, turns: Sequence[Turn],
                digests: Sequence[bytes]) -> Entry | None:
    """The first idle entry `index` holds under the longest prefix of `turns` that ends with an answer."""
    for i in range(len(turns), 0, -1):
        if turns[i - 1][0] != "assistant":
            continue
        for entry in index.get((owner, model, digests[i - 1]), ()):
            if not entry.busy:
                return entry
    return None


def _remove(index: dict[_K, list[Entry]], key: _K, entry: Entry) -> None:
    """`entry` out of `index[key]`, and the key gone with its last entry."""
    entries = index.get(key)
    if entries and entry in entries:
        entries.remove(entry)
        if not entries:
            del index[key]
