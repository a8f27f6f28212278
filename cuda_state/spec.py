"""What a model declares about its per-session state: named buffers of fixed shape, and how a slot lays them out.

A buffer either grows with the sequence (K/V: its `seq_axis` is the position) or has a fixed size (a recurrent or
convolution state). A slot is one contiguous byte range laid out so that a session's memory is its tokens rounded
up to a page:

    [fixed-size buffers, one after the other] [token 0: every growing buffer's slice] [token 1: ...] ...

The fixed-size state comes first, then one block per position holding that position's slice of every growing
buffer (for a Llama: the K of every layer and head, then the V of every layer and head). The first N tokens of
every layer are therefore the slot's first `bytes_for(N)` bytes, so backing a slot page by page from its start
as the session grows backs exactly what it holds, and a clone, a hibernation or a restore of a session is one
contiguous copy of that prefix.

Each buffer is still a plain strided view over the slab (`strides`): the position axis of a growing buffer
steps over a whole token block (`token_bytes`), its other axes are contiguous among themselves. So every
kernel that takes a buffer's strides (all of worker.kernels do) reads the new layout unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

# Offsets of fixed-size buffers, and the start of the token blocks, are aligned to this many bytes (a cache line,
# and enough for any vectorised load of bf16/fp32 rows).
BUFFER_ALIGN = 256
# Each growing buffer's slice inside a token block, and the block itself, are aligned to this many bytes.
TOKEN_ALIGN = 16


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class BufferSpec:
    """One named per-session buffer, e.g. the K cache: shape (layers, kv_heads, max_context, head_dim).

    `seq_axis` names the axis that grows with the conversation (None for fixed-size state such as a
    recurrent state)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    seq_axis: int | None = None

    def __post_init__(self) -> None:
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"buffer {self.name!r}: shape must be non-empty and positive, got {self.shape}")
        if self.seq_axis is not None and not 0 <= self.seq_axis < len(self.shape):
            raise ValueError(f"buffer {self.name!r}: seq_axis {self.seq_axis} outside shape {self.shape}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one position of a growing buffer (every axis but the position); a fixed one: 0."""
        if self.seq_axis is None:
            return 0
        return self.nbytes // self.shape[self.seq_axis]


@dataclass(frozen=True)
class StateSpec:
    """All buffers of one session and their layout in a slot (see the module docstring)."""

    buffers: tuple[BufferSpec, ...]

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        if not names:
            raise ValueError("a StateSpec needs at least one buffer")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate buffer names in {names}")
        contexts = {b.shape[b.seq_axis] for b in self.buffers if b.seq_axis is not None}
        if len(contexts) > 1:
            raise ValueError(f"growing buffers must share one max_context, got {sorted(contexts)}")

    @cached_property
    def _layout(self) -> tuple[dict[str, int], int, int]:
        """(offset of each buffer's element 0 in a slot, where the token blocks start, bytes per token block)."""
        offsets: dict[str, int] = {}
        pos = 0
        for b in self.buffers:
            if b.seq_axis is None:
                offsets[b.name] = pos
                pos = _align(pos + b.nbytes, BUFFER_ALIGN)
        token_offset = pos
        inner = 0
        for b in self.buffers:
            if b.seq_axis is not None:
                inner = _align(inner, max(TOKEN_ALIGN, b.itemsize))
                offsets[b.name] = token_offset + inner
                inner += b.bytes_per_token
        return offsets, token_offset, _align(inner, TOKEN_ALIGN) if inner else 0

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each buffer's first element inside a slot (a growing buffer: its slice of token 0)."""
        return dict(self._layout[0])

    @property
    def token_offset(self) -> int:
        """Where the token blocks start: the fixed-size state's bytes, aligned."""
        return self._layout[1]

    @property
    def token_bytes(self) -> int:
        """Bytes of one position of every growing buffer together (0 when nothing grows)."""
        return self._layout[2]

    @property
    def max_context(self) -> int:
        """Positions of the growing buffers (0 when nothing grows)."""
        for b in self.buffers:
            if b.seq_axis is not None:
                return b.shape[b.seq_axis]
        return 0

    @property
    def bytes_per_session(self) -> int:
        """Bytes one session's state takes at max_context, before any backend granularity."""
        if self.token_bytes:
            return self.token_offset + self.max_context * self.token_bytes
        last = [b for b in self.buffers if b.seq_axis is None][-1]
        return self._layout[0][last.name] + last.nbytes

    def bytes_for(self, tokens: int) -> int:
        """Bytes of a slot's prefix that hold the fixed-size state and the first `tokens` positions."""
        if not self.token_bytes:
            return self.bytes_per_session
        return self.token_offset + max(0, min(tokens, self.max_context)) * self.token_bytes

    def pages_for(self, tokens: int, page_bytes: int) -> int:
        """Pages of `page_bytes` that back the first `tokens` positions (and the fixed-size state)."""
        return -(-self.bytes_for(tokens) // page_bytes)

    def tokens_in(self, pages: int, page_bytes: int) -> int:
        """Positions that `pages` pages hold whole (max_context at most)."""
        if not self.token_bytes:
            return 0
        room = pages * page_bytes - self.token_offset
        return max(0, min(self.max_context, room // self.token_bytes))

    def strides(self, name: str) -> tuple[int, ...]:
        """Element strides of a buffer inside one slot: its position axis steps over a token block, its other axes
        are contiguous among themselves (C order with the position axis taken out)."""
        b = self.buffer(name)
        out = [0] * len(b.shape)
        step = 1
        for axis in range(len(b.shape) - 1, -1, -1):
            if axis == b.seq_axis:
                continue
            out[axis] = step
            step *= b.shape[axis]
        if b.seq_axis is not None:
            out[b.seq_axis] = self.token_bytes // b.itemsize
        return tuple(out)

    @property
    def positional(self) -> bool:
        """Every buffer grows with the sequence (K/V): what a token writes sits at its position, and writing it
        again rewrites it. A fixed-size buffer (a recurrent state) is advanced by every token instead."""
        return all(b.seq_axis is not None for b in self.buffers)

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the fixed-size buffers: what a session holds whatever its length."""
        return sum(b.nbytes for b in self.buffers if b.seq_axis is None)

    def fingerprint(self) -> str:
        """The layout in one line: a stored state is only read back into the same layout."""
        parts = [f"{b.name}:{'x'.join(map(str, b.shape))}:{str(b.dtype).removeprefix('torch.')}:{b.seq_axis}"
                 for b in self.buffers]
        return ";".join(parts) + f";tokens@{self.token_offset}+{self.token_bytes}"

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def slot_bytes(self, granularity: int) -> int:
        """Bytes a slot takes once rounded up to a backend's allocation granularity."""
        return _align(self.bytes_per_session, granularity)
