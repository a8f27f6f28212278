"""Typed engine errors. `code` is the stable wire code (see broker.common.protocol.ErrorCode).

Every one of these is recoverable: the request fails, the engine and every session stay usable.
CapacityExhausted is cuda_state's own class, re-exported so callers need one import.
"""

from __future__ import annotations

from cuda_state import CapacityExhausted


class EngineError(Exception):
    code = "internal"


class BadRequest(EngineError):
    """The request is malformed or out of range (the message names the field or limit)."""

    code = "bad_request"


class ContextOverflow(BadRequest):
    """The session has no room for these tokens within max_context."""


class SessionBusy(BadRequest):
    """The session already has a generation in flight; wait for it or cancel it."""


class PromptBoundary(BadRequest):
    """A text appended with boundary_check would change how the session's last tokens tokenize (the tokenizer merges
    across the boundary): appended on its own it would give other tokens than the whole text. Or chat turns follow an
    answer that the model's template renders otherwise once they follow it (Qwen3 drops its reasoning). Nothing was
    appended; the whole text, or conversation, sent from its start (GENERATE's from_start) is exact."""

    code = "prompt_boundary"


class SessionNotFound(EngineError):
    code = "session_not_found"


class SessionExists(BadRequest):
    """A session with this id already exists on this engine."""


__all__ = [
    "BadRequest",
    "CapacityExhausted",
    "ContextOverflow",
    "EngineError",
    "PromptBoundary",
    "SessionBusy",
    "SessionExists",
    "SessionNotFound",
]
