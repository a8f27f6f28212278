"""What the broker's and the worker's Prometheus metrics share: the name prefix and bounded counter labels.

Names follow vLLM's where one exists (`vllm:num_requests_running` -> `sessionserve:num_requests_running`);
ours take the same `sessionserve:` prefix. A counter keyed by what a peer sends (a command, an error code)
keeps at most MAX_LABEL_VALUES distinct keys, so a peer that sends ever new values cannot grow the
exposition without bound.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

PREFIX = "sessionserve:"
MAX_LABEL_VALUES = 64  # distinct values one counter keeps; later new ones count under OTHER (one more)
OTHER = "other"

T = TypeVar("T")


def label(value: object) -> str:
    """A label value: an enum's string value (ErrorCode) or its lower-case name (Command), a string as is."""
    if isinstance(value, Enum):
        return value.value if isinstance(value.value, str) else value.name.lower()
    return value if isinstance(value, str) else str(value)


def bump(counts: dict[T, int], key: T, other: T) -> None:
    """counts[key] += 1. Once MAX_LABEL_VALUES keys exist, a new key counts as `other` (so a peer that sends
    ever new values cannot grow the exposition without bound)."""
    n = counts.get(key)
    if n is None:
        if len(counts) >= MAX_LABEL_VALUES:
            key = other
            n = counts.get(other, 0)
        else:
            n = 0
    counts[key] = n + 1
