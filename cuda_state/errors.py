"""Typed errors of the session table. `code` is the stable wire code (see broker.common.protocol)."""

from __future__ import annotations


class StateError(Exception):
    """Base of every error raised by cuda_state."""

    code = "internal"


class CapacityExhausted(StateError):
    """Every session slot is taken (or the device has no memory for one more): close a session first."""

    code = "capacity_exhausted"


class SlotError(StateError):
    """A slot number that is not live was used: a bookkeeping bug in the caller, never user input."""


class BackendUnavailable(StateError):
    """The requested backend cannot run here (no driver, no device, no virtual memory support)."""


class CudaDriverError(StateError):
    """A CUDA driver call returned an error. `call` names it, `result` is the CUresult name."""

    def __init__(self, call: str, result: str, detail: str = "") -> None:
        self.call = call
        self.result = result
        super().__init__(f"{call} failed: {result}" + (f" ({detail})" if detail else ""))
