"""Choosing a backend: the VMM slab when CUDA with virtual memory management is usable, else host.

`probe_cuda` never raises: on a machine without the NVIDIA driver `cuInit` raises a
library-not-found error instead of returning a code, and that is an answer ("no driver"), not a crash.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from cuda_state.backend import StateBackend
from cuda_state.errors import BackendUnavailable
from cuda_state.host import HOST_PAGE_BYTES, HostBackend
from cuda_state.spec import StateSpec

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Choice:
    kind: str  # "vmm" or "host"
    device: torch.device
    reason: str


def probe_cuda(index: int = 0) -> str | None:
    """None when device `index` supports VMM and torch can use it, else why not."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        return f"cuda-python is not installed ({e})"
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # the bindings raise when libcuda itself cannot be loaded
        return f"no NVIDIA driver ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name}"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device"
    if index >= count:
        return f"CUDA device {index} does not exist ({count} present)"
    err, dev = driver.cuDeviceGet(index)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuDeviceGet({index}) failed: {err.name}"
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, vmm = driver.cuDeviceGetAttribute(attr, dev)
    if err != driver.CUresult.CUDA_SUCCESS or not vmm:
        return f"CUDA device {index} lacks virtual memory management"
    if not torch.cuda.is_available():
        return "torch was built without CUDA"
    return None


def select_backend(device: str = "auto") -> Choice:
    """Resolve "auto" | "cpu" | "cuda" | "cuda:N". An explicit CUDA request that cannot be met raises."""
    if device == "cpu":
        return Choice("host", torch.device("cpu"), "cpu requested")
    if device == "auto":
        why = probe_cuda(0)
        if why is None:
            return Choice("vmm", torch.device("cuda", 0), "CUDA device 0 with virtual memory management")
        return Choice("host", torch.device("cpu"), why)
    if device == "cuda" or device.startswith("cuda:"):
        try:
            index = int(device.split(":", 1)[1]) if ":" in device else 0
        except ValueError as e:
            raise BackendUnavailable(f"bad device {device!r}: expected cuda:N") from e
        why = probe_cuda(index)
        if why is not None:
            raise BackendUnavailable(f"{device} requested but unusable: {why}")
        return Choice("vmm", torch.device("cuda", index), f"{device} requested")
    raise BackendUnavailable(f"unknown device {device!r}: expected auto, cpu, cuda or cuda:N")


def open_backend(choice: Choice, spec: StateSpec, capacity: int, reserve_bytes: int = 0,
                 page_budget: int | None = None, host_page_bytes: int | None = None) -> StateBackend:
    """Build the chosen backend: `capacity` slots, and the pages they may hold together capped by `page_budget`
    (None: every slot backed whole) and, for VMM, by free memory minus `reserve_bytes`. `host_page_bytes`: the host
    backend's page (default: the GPU's 2 MiB granularity; smaller pages let tests grow sessions in a few tokens)."""
    if choice.kind == "host":
        return HostBackend(spec, capacity, page_bytes=host_page_bytes or HOST_PAGE_BYTES, page_budget=page_budget)
    from cuda_state.vmm import VmmBackend  # imported only where CUDA is present

    return VmmBackend(spec, capacity, choice.device, reserve_bytes=reserve_bytes, page_budget=page_budget)

