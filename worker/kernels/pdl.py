"""Programmatic dependent launch (PDL) for the worker's Triton kernels, on Hopper and later GPUs.

In a CUDA graph each kernel starts only once the one before it has finished: its programs are then
launched, scheduled and warmed up while the GPU idles. A decode step is ~220 small kernels of a few
microseconds each, so those gaps are a good part of it. Launched with PDL, a kernel's programs may be
scheduled as soon as every program of the kernel before it has started; each one first waits
(griddepcontrol.wait: the kernel before has finished and its writes are visible), then lets the next
kernel launch (griddepcontrol.launch_dependents). Only launching and scheduling overlap: no kernel reads
or writes memory before its predecessor is done, and since every PDL kernel waits first, the order
holds transitively (a kernel launched without PDL waits for the whole kernel before it, as always).

Kernels take a `PDL: tl.constexpr` and start with `wait_then_release(PDL)`; launchers pass
`**launch_options(tensor)`. Off in Triton's interpreter and before Hopper; `configure(False)` turns it off for the
process (the engine's `pdl` option, WORKER_PDL=0: A/B runs).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

_allowed = True  # configure(): the process's choice, made once at start-up

try:
    import triton.language.extra.cuda as _cuda

    HAVE_GDC = hasattr(_cuda, "gdc_wait") and hasattr(_cuda, "gdc_launch_dependents")  # not in older Tritons
except ImportError:
    HAVE_GDC = False


@triton.jit
def wait_then_release(PDL: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
    """A PDL kernel's first statement: wait for the kernel before it, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def configure(allowed: bool) -> None:
    """Whether kernels may launch with PDL at all (where the device has it). Before the first launch."""
    global _allowed
    _allowed = allowed
    _enabled.cache_clear()


@functools.cache
def _enabled(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not _allowed or not HAVE_GDC:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    if t.device.type != "cuda":
        return False
    return _enabled(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(t: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of a PDL-aware kernel's launch for tensors on t's device."""
    on = enabled(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
