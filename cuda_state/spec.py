"""What a model declares about its per-session state: named buffers of fixed shape, and how a slot lays them out.

A buffer either grows with the sequence (K/V: its `seq_axis` is the position) or has a fixed size (a recurrent or
convolution state). A slot is one contiguous byte range laid out so that a session's memory is its tokens rounded
up to a page:

    [fixed-size buffers, one after the other] [block 0: positions 0..C-1] [block 1: positions C..2C-1] ...

The fixed-size state comes first, then blocks of C = `block_tokens` positions. A block holds each growing buffer's
slice for its C positions, laid out as the buffer itself with its position axis cut to C (for a Llama's K of shape
(layers, kv_heads, max_context, head_dim): (layers, kv_heads, C, head_dim), then V the same). So:

- the first N tokens of every layer are the slot's first `bytes_for(N)` bytes: backing a slot page by page from its
  start as the session grows backs what it holds (rounded to a block, then to a page), and a clone, a hibernation
  or a restore of a session is one contiguous copy of that prefix;
- one layer and head's keys for C consecutive positions are contiguous (C x head_dim elements), so attention reads
  K/V in runs of C rows, not row by row.

Each buffer is a strided view over the slab (`view_shape`, `strides`) with its position axis split in two, (blocks,
C): a position p is at block p // C, row p % C. The kernels (worker.kernels) address K/V that way; the plain-torch
paths index the two axes (`store_positions`, `positions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

# Offsets of fixed-size buffers, and the start of the blocks, are aligned to this many bytes (a cache line,
# and enough for any vectorised load of bf16/fp32 rows).
BUFFER_ALIGN = 256
# Each growing buffer's slice inside a block, and the block itself, are aligned to this many bytes.
TOKEN_ALIGN = 16
# Positions per block (a power of two): one layer and head's K for 16 positions is 2-8 KiB contiguous (head_dim 64
# to 256, bf16), and a block of an 8B Llama (128 KiB a position) is one 2 MiB page.
BLOCK_TOKENS = 16


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
    block_tokens: int = BLOCK_TOKENS  # positions per block (fewer when max_context is smaller)

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
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
        """(offset of each buffer's element 0 in a slot, where the blocks start, bytes per block)."""
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
                inner += b.bytes_per_token * self.block
        return offsets, token_offset, _align(inner, TOKEN_ALIGN) if inner else 0

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each buffer's first element inside a slot (a growing buffer: its slice of position 0)."""
        return dict(self._layout[0])

    @property
    def token_offset(self) -> int:
        """Where the blocks start: the fixed-size state's bytes, aligned."""
        return self._layout[1]

    @property
    def block(self) -> int:
        """Positions per block: `block_tokens`, or max_context when that is smaller (0 when nothing grows)."""
        return min(self.block_tokens, self.max_context)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: `block` positions of every growing buffer (0 when nothing grows)."""
        return self._layout[2]

    @property
    def blocks(self) -> int:
        """Blocks of a slot: max_context positions, the last block possibly part used."""
        return -(-self.max_context // self.block) if self.block else 0

    @property
    def token_bytes(self) -> int:
        """Bytes of one position of every growing buffer together (0 when nothing grows)."""
        return sum(b.bytes_per_token for b in self.buffers)

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
        if self.block_bytes:
            return self.token_offset + self.blocks * self.block_bytes
        last = [b for b in self.buffers if b.seq_axis is None][-1]
        return self._layout[0][last.name] + last.nbytes

    def bytes_for(self, tokens: int) -> int:
        """Bytes of a slot's prefix that hold the fixed-size state and the first `tokens` positions (whole blocks)."""
        if not self.block_bytes:
            return self.bytes_per_session
        tokens = max(0, min(tokens, self.max_context))
        return self.token_offset + -(-tokens // self.block) * self.block_bytes

    def pages_for(self, tokens: int, page_bytes: int) -> int:
        """Pages of `page_bytes` that back the first `tokens` positions (and the fixed-size state)."""
        return -(-self.bytes_for(tokens) // page_bytes)

    def tokens_in(self, pages: int, page_bytes: int) -> int:
        """Positions that `pages` pages hold whole (max_context at most)."""
        if not self.block_bytes:
            return 0
        room = pages * page_bytes - self.token_offset
        return max(0, min(self.max_context, room // self.block_bytes * self.block))

    def view_shape(self, name: str) -> tuple[int, ...]:
        """A buffer's shape in a slot's view: a growing buffer's position axis split into (blocks, block)."""
        b = self.buffer(name)
        if b.seq_axis is None:
            return b.shape
        return (*b.shape[: b.seq_axis], self.blocks, self.block, *b.shape[b.seq_axis + 1 :])

    def strides(self, name: str) -> tuple[int, ...]:
        """Element strides of `view_shape(name)` inside one slot. A fixed buffer: C order. A growing one: its slice
        of a block in C order (position axis cut to `block`), and its block axis steps over a whole block."""
        b = self.buffer(name)
        if b.seq_axis is None:
            shape = b.shape
        else:
            shape = (*b.shape[: b.seq_axis], self.block, *b.shape[b.seq_axis + 1 :])
        out = [0] * len(shape)
        step = 1
        for axis in range(len(shape) - 1, -1, -1):
            out[axis] = step
            step *= shape[axis]
        if b.seq_axis is not None:
            out.insert(b.seq_axis, self.block_bytes // b.itemsize)
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
        """The layout in one line: a stored state is only read back into the same layout. A growing buffer's length
        (max_context) is left out, as `*`: a slot's prefix (the fixed-size state, then whole blocks) is the same bytes
        at any context, so a state fits any table whose context holds its tokens (checked apart)."""
        def shape(b: BufferSpec) -> str:
            return "x".join("*" if axis == b.seq_axis else str(n) for axis, n in enumerate(b.shape))

        parts = [f"{b.name}:{shape(b)}:{str(b.dtype).removeprefix('torch.')}:{b.seq_axis}" for b in self.buffers]
        return ";".join(parts) + f";blocks@{self.token_offset}+{self.block}x{self.block_bytes}"

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def slot_bytes(self, granularity: int) -> int:
        """Bytes a slot takes once rounded up to a backend's allocation granularity."""
        return _align(self.bytes_per_session, granularity)


def store_positions(cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots[t], :, positions[t]] = values[t] for a layer's K or V view (slots, heads, blocks, block, dim)."""
    block = cache.shape[3]
    cache[slots, :, positions // block, positions % block] = values


def positions(cache: torch.Tensor, slot: int, end: int) -> torch.Tensor:
    """Positions 0..end-1 of one slot of a layer's K or V view: (heads, end, dim), a copy unless one block holds
    them all."""
    block = cache.shape[3]
    return cache[slot, :, : -(-end // block)].flatten(1, 2)[:, :end]
