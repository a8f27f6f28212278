"""A reasoning model's answer split into its reasoning and its content, as vLLM's reasoning parsers split it
(`gateway --reasoning-parser`): the chat answer's `content` without the reasoning, which goes in `reasoning` (vLLM's
name) and `reasoning_content` (its older name, DeepSeek's API's).

Both parsers read `<think> ... </think>`:
    qwen3        Qwen3, Qwen3.5 (whose template opens <think> in the prompt: the answer holds only </think>), QwQ.
                 A request with chat_template_kwargs {"enable_thinking": false} has no reasoning: all is content.
    deepseek_r1  DeepSeek-R1 and its distilled Qwen and Llama models: always reasoning first.

The answer's text up to the first </think> is the reasoning (a <think> it starts with left out), the rest the content;
an answer without </think> was cut short while reasoning (max_tokens): all reasoning, no content. With qwen3, a
function call (<tool_call> then <function=...>, Qwen3.5's format) also ends the reasoning where it comes first (Qwen3.5
may call without closing its reasoning, as vLLM's parser allows): the call starts the content. A streamed answer
is split the same way as its text arrives: what could still be the start of </think> is held back until the next
text says, so the reasoning deltas put together are the whole answer's reasoning and the content deltas its content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
TOOL_CALL, FUNCTION = "<tool_call>", "<function"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")  # vLLM's test of a genuine call


@dataclass(frozen=True)
class Reasoner:
    """How one request's answers split: `thinking` False (qwen3 with enable_thinking false): no reasoning at all."""

    parser: str
    thinking: bool = True

    @classmethod
    def for_request(cls, parser: str | None, template_args: dict[str, object]) -> Reasoner | None:
        if parser is None:
            return None
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: one of {', '.join(PARSERS)}")
        thinking = parser != "qwen3" or template_args.get("enable_thinking", True) is not False
        return cls(parser, thinking)

    @property
    def calls_end(self) -> bool:
        """Whether a function call ends the reasoning (qwen3's, for Qwen3.5)."""
        return self.parser == "qwen3"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None where there is none."""
        if not self.thinking:
            return None, text
        text = text.removeprefix(START)
        cut = _cut(text, self.calls_end, final=True)
        if not isinstance(cut, tuple):
            return text, None
        at, tag = cut
        return text[:at], text[at + tag:] or None

    def splitter(self) -> Splitter:
        return Splitter(self.thinking, self.calls_end)


@dataclass
class Splitter:
    """A streamed answer's split: `feed` each piece of text as it comes, `flush` at its end; each returns the
    (reasoning, content) it lets go."""

    reasoning: bool  # still in the reasoning (before </think>)
    calls_end: bool = False  # a function call ends it too (Reasoner.calls_end)
    _held: str = ""
    _started: bool = field(default=False)  # past the answer's first characters (where a <think> is left out)

    def __post_init__(self) -> None:
        self._started = not self.reasoning

    def feed(self, text: str) -> tuple[str, str]:
        held = self._held + text
        self._held = ""
        if not self._started:
            if START.startswith(held) and len(held) < len(START):
                self._held = held  # maybe the answer's opening <think>: wait
                return "", ""
            self._started = True
            held = held.removeprefix(START)
        return self._split(held, final=False)

    def flush(self) -> tuple[str, str]:
        """What is held at the answer's end: reasoning cut short (or the start of an answer too short to tell)."""
        held, self._held = self._held, ""
        self._started = True
        return self._split(held, final=True)

    def _split(self, held: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that `held` lets go; what it does not tell yet is held again (never at the end)."""
        if not self.reasoning:
            return "", held
        cut = _cut(held, self.calls_end, final)
        if isinstance(cut, tuple):
            at, tag = cut
            self.reasoning = False
            return held[:at], held[at + tag:]
        self._held = held[cut:]
        return held[:cut], ""


def _cut(text: str, calls_end: bool, final: bool) -> tuple[int, int] | int:
    """Where the reasoning in `text` ends: (where, the length of the tag there that neither part keeps); or, where the
    text does not tell yet, how many of its first characters are reasoning for sure (the rest is held). `final`: the
    answer's whole text (what is undecided is not an end)."""
    end = text.find(END)
    limit = len(text) if end < 0 else end
    if calls_end:
        at = text.find(TOOL_CALL)
        while 0 <= at < limit:
            after = text[at + len(TOOL_CALL):].lstrip()
            if _FUNCTION_OPEN.match(after):
                return at, 0
            if not final and FUNCTION.startswith(after):  # (nothing after it yet, or "<function" not yet followed)
                return at
            at = text.find(TOOL_CALL, at + 1)
    if end >= 0:
        return end, len(END)
    if final:
        return len(text)
    return len(text) - max(tag_start(text, END), tag_start(text, TOOL_CALL) if calls_end else 0)


def tag_start(text: str, tag: str) -> int:
    """How many of text's last characters could be the start of `tag` (a stream holds them until the next text
    says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
