"""Typed client errors: one class per wire error code, all subclasses of ClientError with a stable `code`.

Each docstring says what the caller should do.
"""

from __future__ import annotations

from typing import ClassVar


class ClientError(Exception):
    """Base of every error the client raises. `code` is the wire code; `request_id` names the request."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class BadRequest(ClientError):
    """The request was malformed or out of range (the message names the field). Fix the call."""

    code = "bad_request"


class CapacityExhausted(ClientError):
    """Every session slot that could take this is in use. Close a session, or retry later."""

    code = "capacity_exhausted"


class SessionNotFound(ClientError):
    """No such session: it was never created, or it was closed. Create a new one."""

    code = "session_not_found"


class SessionLost(ClientError):
    """The worker holding the session died; its state is gone. Create a new session and replay the turn."""

    code = "session_lost"


class ModelNotFound(ClientError):
    """No live worker serves the requested model (or none is registered). Check the name or start a worker."""

    code = "model_not_found"


class Timeout(ClientError, TimeoutError):
    """No answer within the call's timeout. The request may still run; a retry with a new call is safe."""

    code = "timeout"


class BrokerUnreachable(Timeout):
    """Nothing accepted a connection at the client's address within its `connect_timeout` (the client never
    reached a broker). Check the address (the broker's client address, e.g. tcp://HOST:5555) and that the broker
    runs. A Timeout too: code `timeout`."""


class StreamCancelled(ClientError):
    """A read of this stream timed out or was cancelled (its `timeout`, asyncio.wait_for, a task cancelled), which
    closed the stream and cancelled its generation: the answer is cut off, and the stream's `result` stays None.
    Every later read of the stream raises this, so that a cut-off answer is never taken for a finished one (a
    stream the caller closed itself ends quietly instead). Start a new generation. The client's own error: no
    server sends it (code `cancelled`, as the finish reason of a cancelled generation)."""

    code = "cancelled"


class WorkerDraining(ClientError):
    """The worker is shutting down and takes no new sessions or generations. Retry: others may take it."""

    code = "worker_draining"


class SessionExpired(ClientError):
    """The worker closed the session after it idled longer than its --session-idle-timeout. Open a new one."""

    code = "session_expired"


class Unauthorized(ClientError):
    """The broker refused this client's key, or the session belongs to another client."""

    code = "unauthorized"


class VersionMismatch(ClientError):
    """Client and broker speak different protocol versions. Upgrade one of them."""

    code = "version_mismatch"


class InternalError(ClientError):
    """The server failed on this request (see its logs). The session may still be usable."""

    code = "internal"


class Overloaded(ClientError):
    """The worker (or the broker's queue for it) has more requests waiting than it keeps: nothing was done, retry
    later."""

    code = "overloaded"


class PromptBoundary(BadRequest):
    """A text sent with boundary_check would change how the session's last tokens tokenize (e.g. "Par" held, "is"
    sent: one token, "Paris"), or chat turns follow an answer the model's template renders otherwise once they follow
    it (Qwen3 drops its reasoning): nothing was appended. The whole text, or conversation, sent with
    `generate(..., from_start=True)` gets its exact tokens (the session keeps what it holds of them)."""

    code = "prompt_boundary"


_BY_CODE: dict[str, type[ClientError]] = {
    c.code: c
    for c in (
        BadRequest, CapacityExhausted, SessionNotFound, SessionLost, ModelNotFound, Timeout, WorkerDraining,
        Unauthorized, VersionMismatch, InternalError, SessionExpired, PromptBoundary, Overloaded,
    )
}


def error_for(code: str, message: str, request_id: str | None = None) -> ClientError:
    """The typed error of a wire code (an unknown code gives InternalError)."""
    return _BY_CODE.get(code, InternalError)(message, request_id=request_id)
