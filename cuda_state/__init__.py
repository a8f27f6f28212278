"""Per-session state buffers at fixed addresses: the session table and its backends."""

from .errors import BackendUnavailable, CapacityExhausted, CudaDriverError, SlotError, StateError
from .host import HostBackend
from .select import select_backend
from .spec import BufferSpec, StateSpec
from .table import SessionTable

__all__ = [
    "BackendUnavailable",
    "BufferSpec",
    "CapacityExhausted",
    "CudaDriverError",
    "HostBackend",
    "SessionTable",
    "SlotError",
    "StateError",
    "StateSpec",
    "select_backend",
]
