"""HTTP errors in OpenAI's shape, and the broker's error codes mapped onto them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

    bad_request, prompt_boundary                 400 invalid_request_error
    unauthorized (an API key)                    401 authentication_error
    model_not_found (a model nobody serves)      404 invalid_request_error, code model_not_found
    a named session busy with another request    409 invalid_request_error, code session_busy
    capacity_exhausted                           429 rate_limit_error, with Retry-After
    worker_draining, model_not_found (no worker), 503 service_unavailable, with Retry-After
    overloaded, a resumed session gone
    timeout                                      504 timeout
    anything else (internal, version_mismatch,   500 server_error
      the broker refusing the gateway's key)
"""

from __future__ import annotations

import json
from typing import Any

from client.errors import ClientError

RETRY_AFTER_S = 1  # what Retry-After says for capacity and draining: sessions turn over within seconds


class ApiError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, kind="authentication_error", code="invalid_api_key")


def model_not_found(model: str, served: list[str]) -> ApiError:
    known = ", ".join(served) if served else "none"
    return ApiError(404, f"The model `{model}` does not exist (served here: {known})", param="model",
                    code="model_not_found")


def no_worker(message: str) -> ApiError:
    return ApiError(503, message, kind="service_unavailable", code="no_worker", retry_after=RETRY_AFTER_S)


def session_busy(session_id: str) -> ApiError:
    return ApiError(409, f"session {session_id!r} is answering another request: send a conversation's turns one at a "
                         "time", param="session_id", code="session_busy")


def from_client_error(e: ClientError) -> ApiError:
    """The HTTP answer for an error the broker or a worker gave (model_not_found is decided by the caller, which
    knows whether any worker is up)."""
    code = e.code
    if code in ("bad_request", "prompt_boundary"):
        return ApiError(400, e.message, code=code)
    if code == "capacity_exhausted":
        return ApiError(429, f"no session slot is free: {e.message}", kind="rate_limit_error", code="capacity_exhausted",
                        retry_after=RETRY_AFTER_S)
    if code in ("worker_draining", "model_not_found", "session_lost", "session_expired", "session_not_found",
                "overloaded"):
        return ApiError(503, e.message, kind="service_unavailable", code=code, retry_after=RETRY_AFTER_S)
    if code == "timeout":
        return ApiError(504, e.message, kind="timeout", code="timeout")
    return ApiError(500, f"{code}: {e.message}", kind="server_error", code=code)
