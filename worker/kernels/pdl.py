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

Weights do not depend on the kernel before, so a PDL kernel may ask for them before its wait: `prefetch_share`
asks the L2 cache for a share of a span of bytes (cp.async.bulk.prefetch: a hint; nothing comes back, nothing
waits), so that the weights of a product stream in while the kernels before it finish. A launcher passes the span
as `ahead_span(tensor)` (its weights, or the next product's: the kernels before a product are short and read little,
and the memory would idle under them).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

_allowed = True  # configure(): the process's choice, made once at start-up
# Experiment switches for the L2 prefetches (WORKER_PREFETCH_*; "0" off): a product's own weights before its wait,
# the next product's weights from the kernels before it, a one-token step's chosen experts from its routing (1: their
# gate|up, 2: and down), and the most bytes of a weight asked for ahead (the L2 cache holds 50 MiB).
PREFETCH_SELF = int(os.environ.get("WORKER_PREFETCH_SELF", "0"))  # programs an SM that ask for their own tiles
PREFETCH_AHEAD = os.environ.get("WORKER_PREFETCH_AHEAD", "0") == "1"
PREFETCH_EXPERTS = int(os.environ.get("WORKER_PREFETCH_EXPERTS", "0"))
LIGHT = os.environ.get("WORKER_PREFETCH_LIGHT", "0") == "1"  # only the short kernels ask ahead, after their wait
AHEAD_BYTES = int(os.environ.get("WORKER_PREFETCH_AHEAD_BYTES", str(16 << 20)))

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


PREFETCH_LANES: tl.constexpr = tl.constexpr(128)  # a program's share in at most as many bulk prefetches
PREFETCH_LINES: tl.constexpr = tl.constexpr(os.environ.get("WORKER_PREFETCH_LINES", "0") == "1")
PREFETCH_ACTIVE: tl.constexpr = tl.constexpr(int(os.environ.get("WORKER_PREFETCH_ACTIVE", "1")))  # of them used


@triton.jit
def prefetch_share(Span, nbytes, part, parts, PDL: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads it
    """Asks the L2 cache for the part-th of `parts` equal shares of the nbytes at Span (16-byte aligned, nbytes a
    multiple of 16; 0: nothing), in PREFETCH_ACTIVE bulk prefetches. Only where PDL is on (Hopper and later: a kernel
    without PDL starts when the one before has finished, and would only delay its own loads)."""
    if PDL:
        share = tl.cdiv(tl.cdiv(nbytes, parts), 16) * 16
        chunk = tl.cdiv(share, 16 * PREFETCH_ACTIVE) * 16  # bytes a lane, a multiple of 16
        lane = tl.arange(0, PREFETCH_LANES)
        first = part.to(tl.int64) * share
        start = first + lane.to(tl.int64) * chunk
        end = tl.minimum(first + share, nbytes)
        if PREFETCH_LINES:
            base = Span.to(tl.pointer_type(tl.int8))
            for i in range(tl.cdiv(end - first, 128 * PREFETCH_LANES)):
                off = first + (i * PREFETCH_LANES + lane).to(tl.int64) * 128
                at = base + tl.where(off < end, off, first)
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [at], dtype=tl.int32,
                                          is_pure=False, pack=1)
        else:
            size = tl.where(lane < PREFETCH_ACTIVE, tl.minimum(tl.maximum(end - start, 0), chunk), 0).to(tl.int32)
            at = Span.to(tl.pointer_type(tl.int8)) + tl.where(size > 0, start, 0)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1)


def ahead_span(t: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """(t, the bytes of it a kernel asks the L2 cache for: at most AHEAD_BYTES) as a kernel's prefetch span, or
    (None, 0) where there is none to ask for: no tensor, not on a PDL device, not contiguous, or not 16-byte aligned.
    Launchers pass the tensor, or any tensor of theirs in its place, with the bytes."""
    if t is None or not PREFETCH_AHEAD or not can_prefetch(t):
        return None, 0
    return t, min(t.numel() * t.element_size(), AHEAD_BYTES) // 16 * 16


def can_prefetch(t: torch.Tensor) -> bool:
    """Whether kernels may ask the L2 cache for spans of t: on a PDL device, contiguous, 16-byte aligned."""
    return enabled(t) and t.is_contiguous() and t.data_ptr() % 16 == 0


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
