"""Per-session state buffers at fixed addresses: the session table and its backends."""

from cuda_state.errors import BackendUnavailable, CapacityExhausted, CudaDriverError, SlotError, StateError
from cuda_state.host import HostBackend
from cuda_state.select import select_backend
from cuda_state.spec import BufferSpec, StateSpec, positions, store_positions
from cuda_state.table import SessionTable

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
    "positions",
    "select_backend",
    "store_positions",
]
