"""The garbage collector and the GIL in long-running serving processes (broker, worker, load-test clients).

A full (generation 2) collection of CPython's cyclic collector walks every tracked object. In a worker
that holds torch, a tokenizer and a model that walk took 64-93 ms on the GPU machine, once every second
or two under load: a pause in which no step is launched and no request answered. `settle()`, called once
start-up is over, moves everything alive then into the permanent generation that collections skip
(`gc.freeze`); what is allocated later is collected as usual.

The worker runs two threads (compute and socket I/O). The compute thread gives the GIL up at every CUDA
call; to take it back from a thread running Python it may wait a whole switch interval, 5 ms by default
(several decode steps). `SWITCH_INTERVAL_S` bounds that wait. Measured at 64 sessions on the GPU machine
(median of 5 full-stack runs each): 45.8k tokens/s at 0.2 ms, 44.5k at 1 ms, 45.2k at 5 ms, within the
run-to-run spread; it is kept for the bound, not for a measured gain.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable

SWITCH_INTERVAL_S = 0.0002


def settle(switch_interval_s: float | None = None) -> None:
    """Collect once, then freeze what survives; optionally set the GIL switch interval."""
    gc.collect()
    gc.freeze()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)


def release_free_memory() -> bool:
    """Give the memory the C heap holds free back to the system (glibc's malloc_trim): after a large request (a long
    text's tokenization allocates hundreds of MB in Rust and frees it, and glibc keeps it) the process's resident
    memory goes back to what it was. ctypes releases the GIL for the call. False where there is no glibc."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


_TRIM: list[Callable[[int], int] | None] = []


def _malloc_trim() -> Callable[[int], int] | None:
    if not _TRIM:
        try:
            _TRIM.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _TRIM.append(None)
    return _TRIM[0]
