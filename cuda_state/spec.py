"""What a model declares about its per-session state: named buffers of fixed shape.

A session's state is the concatenation of its buffers, laid out one after the other inside the
session's slot. Every backend stores the same layout, so a slot is one contiguous byte range and a
clone of the used prefix is a strided 2-D copy per buffer. A buffer either grows with the sequence
(K/V: a clone copies its used prefix) or has a fixed size (a recurrent or convolution state: a clone
copies it whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Offsets of buffers inside a slot are aligned to this many bytes (a cache line, and enough for
# any vectorised load of bf16/fp32 rows).
BUFFER_ALIGN = 256


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class BufferSpec:
    """One named per-session buffer, e.g. the K cache: shape (layers, kv_heads, max_context, head_dim).

    `seq_axis` names the axis that grows with the conversation (None for fixed-size state such as a
    recurrent state); a clone copies only the used prefix along it.
    """

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

    def prefix_copy(self, used: int) -> tuple[int, int, int]:
        """The used prefix as a 2-D copy: (rows, bytes per row, pitch in bytes).

        For (layers, kv_heads, max_context, head_dim) with seq_axis=2 and `used` tokens this is
        layers*kv_heads rows of used*head_dim elements, rows max_context*head_dim elements apart.
        """
        if self.seq_axis is None:
            return 1, self.nbytes, self.nbytes
        used = max(0, min(used, self.shape[self.seq_axis]))
        rows = math.prod(self.shape[: self.seq_axis])
        inner = math.prod(self.shape[self.seq_axis + 1 :]) * self.itemsize
        return rows, used * inner, self.shape[self.seq_axis] * inner


@dataclass(frozen=True)
class StateSpec:
    """All buffers of one session, in slot order."""

    buffers: tuple[BufferSpec, ...]

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        if not names:
            raise ValueError("a StateSpec needs at least one buffer")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate buffer names in {names}")

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each buffer inside a slot."""
        out: dict[str, int] = {}
        pos = 0
        for b in self.buffers:
            out[b.name] = pos
            pos = _align(pos + b.nbytes, BUFFER_ALIGN)
        return out

    @property
    def bytes_per_session(self) -> int:
        """Bytes one session's state takes, buffers aligned, before any backend granularity."""
        last = self.buffers[-1]
        return self.offsets[last.name] + last.nbytes

    @property
    def positional(self) -> bool:
        """Every buffer grows with the sequence (K/V): what a token writes sits at its position, and writing it
        again rewrites it. A fixed-size buffer (a recurrent state) is advanced by every token instead."""
        return all(b.seq_axis is not None for b in self.buffers)

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the fixed-size buffers: what a session holds whatever its length."""
        return sum(b.nbytes for b in self.buffers if b.seq_axis is None)

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def slot_bytes(self, granularity: int) -> int:
        """Bytes a slot takes once rounded up to a backend's allocation granularity."""
        return _align(self.bytes_per_session, granularity)
