"""Where a new session goes: the worker serving the model with the most free slots.

Free slots count the creates already sent and not yet answered, so a burst of creates spreads over
the workers instead of piling onto the one that looked emptiest when the burst began.
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.common.protocol import ErrorCode
from broker.registry import WorkerRecord


class NoPlacement(Exception):
    """No worker can take the session; `code` says why (model_not_found, worker_draining, capacity_exhausted)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def place(workers: Iterable[WorkerRecord], model: str | None) -> WorkerRecord:
    serving = [w for w in workers if w.serves(model)]
    if not serving:
        what = "no worker is registered" if model is None else f"no worker serves model {model!r}"
        raise NoPlacement(ErrorCode.MODEL_NOT_FOUND, what)
    open_ = [w for w in serving if not w.closed]
    if not open_:
        raise NoPlacement(ErrorCode.WORKER_DRAINING, "every worker serving this model is draining")
    # Most free slots first; then the emptier worker; then a stable order.
    best = max(open_, key=lambda w: (w.free, -len(w.sessions), w.identity))
    if best.free <= 0:
        total = sum(w.capacity for w in open_)
        raise NoPlacement(ErrorCode.CAPACITY_EXHAUSTED, f"all {total} session slots are taken: close a session first")
    return best
