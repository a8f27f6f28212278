"""Incremental detokenization with stop strings, for streaming.

Text is produced token by token without decoding the whole output each time: for byte-level
vocabularies each id's bytes go through an incremental UTF-8 decoder (O(1) per token); otherwise a
window of a few tokens is decoded, as in vLLM/TGI. Bytes of an unfinished UTF-8 character are held
back, and so is any tail that could still turn into a stop string, so a streamed client never sees
text that is later taken back. Stop strings are looked for only once `min_tokens` tokens have come (vLLM's
min_tokens), from the text those tokens end with: a stop string that ends before then does not count.
"""

from __future__ import annotations

import codecs

from worker.model.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self._tok = tokenizer
        # Byte-level vocabularies: each id is a fixed byte string, and an incremental UTF-8 decoder
        # holds back an unfinished character by itself. Others: decode a window of ids.
        self._bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start: text of ids[_prefix:_read] is already in self.text
        self._read = 0
        self._stop = stop
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text so far (cut at a stop string once one is found)
        self._emitted = 0  # chars of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Feed one generated token. Sets `stopped` when a stop string appears."""
        self._ids.append(token_id)
        if self._bytes is not None:
            delta = self._utf8.decode(self._bytes[token_id]) if 0 <= token_id < len(self._bytes) else ""
            if delta:
                self._append(delta)
            return
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._append(after[len(before) :])
            self._prefix, self._read = self._read, len(self._ids)

    def flush(self) -> None:
        """At the end: whatever is left undecoded (e.g. a cut-off UTF-8 sequence) joins the text."""
        if self._bytes is not None:
            self._append(self._utf8.decode(b"", final=True))
            return
        if self._read < len(self._ids) and not self.stopped:
            before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
            after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
            self._append(after[len(before) :])
            self._read = len(self._ids)

    def take(self, final: bool) -> str:
        """Text not yet handed out; before the end, a possible stop-string prefix is held back."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def _append(self, delta: str) -> None:
        if self.stopped:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        if not self._stop or len(self._ids) < self._min_tokens:
            return
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
