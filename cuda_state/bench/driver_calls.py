"""What a page costs in driver calls: `python -m cuda_state.bench.driver_calls [--pages N]`.

Over one reserved range, page by page (the allocation granularity, 2 MiB on an H100): cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap, cuMemRelease, and a kept handle mapped again (what reusing a page without releasing it
would cost); then one cuMemSetAccess and one cuMemUnmap over groups of adjacent pages, to show whether batching them
saves anything. Medians in microseconds of host time. This is what a slot's growth and release cost the host
(cuda_state.vmm); the device pays too, since steps running while pages are mapped or unmapped are slower (see
docs/performance.md, "Session table").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch


def _ok(out: tuple[Any, ...]) -> Any:
    from cuda.bindings import driver

    if out[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {out[0]}")
    return out[1] if len(out) == 2 else None


def _us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


class Range:
    """A reserved virtual range of `pages` pages on device 0 and the properties to back it."""

    def __init__(self, pages: int) -> None:
        from cuda.bindings import driver as d

        torch.zeros(1, device="cuda")  # the primary context torch uses
        dev = _ok(d.cuDeviceGet(0))
        _ok(d.cuCtxSetCurrent(_ok(d.cuDevicePrimaryCtxRetain(dev))))
        self.prop = d.CUmemAllocationProp()
        self.prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = 0
        self.access = d.CUmemAccessDesc()
        self.access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = 0
        self.access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.page = int(_ok(d.cuMemGetAllocationGranularity(self.prop, flag)))
        self.pages = pages
        self.base = int(_ok(d.cuMemAddressReserve(pages * self.page, self.page, 0, 0)))

    def at(self, i: int) -> int:
        return self.base + i * self.page

    def free(self) -> None:
        from cuda.bindings import driver as d

        _ok(d.cuMemAddressFree(self.base, self.pages * self.page))


def per_page(r: Range) -> dict[str, float]:
    from cuda.bindings import driver as d

    t: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release", "map_kept",
                                                 "set_access_kept", "unmap_kept")}
    handles = []

    def clock(key: str, call: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = _ok(call(*args))
        t[key].append(time.perf_counter() - start)
        return out

    for i in range(r.pages):
        handles.append(clock("create", d.cuMemCreate, r.page, r.prop, 0))
        clock("map", d.cuMemMap, r.at(i), r.page, 0, handles[i], 0)
        clock("set_access", d.cuMemSetAccess, r.at(i), r.page, [r.access], 1)
    for i in reversed(range(r.pages)):
        clock("unmap", d.cuMemUnmap, r.at(i), r.page)
    for i in range(r.pages):
        clock("map_kept", d.cuMemMap, r.at(i), r.page, 0, handles[i], 0)
        clock("set_access_kept", d.cuMemSetAccess, r.at(i), r.page, [r.access], 1)
    for i in reversed(range(r.pages)):
        clock("unmap_kept", d.cuMemUnmap, r.at(i), r.page)
    for h in handles:
        clock("release", d.cuMemRelease, h)
    return {k: _us(v) for k, v in t.items()}


def grouped(r: Range, group: int) -> dict[str, float]:
    """Pages mapped one by one; one cuMemSetAccess and one cuMemUnmap over each group of `group` adjacent pages."""
    from cuda.bindings import driver as d

    handles = [_ok(d.cuMemCreate(r.page, r.prop, 0)) for _ in range(r.pages)]
    access: list[float] = []
    unmap: list[float] = []
    starts = range(0, r.pages - group + 1, group)
    for s in starts:
        for i in range(s, s + group):
            _ok(d.cuMemMap(r.at(i), r.page, 0, handles[i], 0))
        start = time.perf_counter()
        _ok(d.cuMemSetAccess(r.at(s), group * r.page, [r.access], 1))
        access.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    for s in starts:
        start = time.perf_counter()
        _ok(d.cuMemUnmap(r.at(s), group * r.page))
        unmap.append(time.perf_counter() - start)
    for h in handles:
        _ok(d.cuMemRelease(h))
    return {"set_access_per_page": round(_us(access) / group, 1), "unmap_per_page": round(_us(unmap) / group, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=288, help="pages per measurement (default %(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("needs a CUDA device\n")
        return 2
    r = Range(args.pages)
    try:
        per_page(r)  # first use: the driver's own pools
        out = sys.stdout
        out.write(f"{torch.cuda.get_device_name(0)}, pages of {r.page >> 20} MiB, medians of {r.pages} (us)\n")
        out.write("per page: " + ", ".join(f"{k} {v}" for k, v in per_page(r).items()) + "\n")
        for group in (2, 9, 24):
            g = grouped(r, group)
            out.write(f"groups of {group}: one cuMemSetAccess {g['set_access_per_page']} a page, "
                      f"one cuMemUnmap {g['unmap_per_page']} a page\n")
    finally:
        r.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
