"""The GPU side of the tests: the skip without CUDA, and device memory as the driver counts it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

UNDER_SANITIZER = os.environ.get("GPU_TESTS_UNDER_SANITIZER") == "1"
PAGE_TABLE_SLACK = 2 << 20

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@dataclass
class Loaded:
    engine: object
    free_before: int  # device bytes free before Engine.load (context and cuBLAS already up)
    free_after: int  # ... after it, caching allocator emptied


def device_free_bytes() -> int:
    """Free device memory as the driver reports it (not torch's allocator statistics)."""
    from cuda.bindings import driver

    torch.cuda.synchronize()
    err, free, _ = driver.cuMemGetInfo()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return int(free)
