"""The VMM backend.

On any machine: backend choice, and the backend's driver bookkeeping against a fake driver that
keeps real bytes, checks every access lands in mapped memory and that the calling thread has the
context current (pointer arithmetic, 2-D prefix copies, error mapping, release order, the
wait-before-unmap rule). On a GPU (-m gpu): the same against the real driver, plus memory
accounting measured with cuMemGetInfo.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cuda_state import (
    BackendUnavailable,
    BufferSpec,
    CapacityExhausted,
    CudaDriverError,
    HostBackend,
    SessionTable,
    SlotError,
    StateError,
    StateSpec,
    select_backend,
    vmm,
)
from cuda_state.select import probe_cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def small_spec(context: int = 40, dtype: torch.dtype = torch.float32, block_tokens: int = 1) -> StateSpec:
    """Two growing buffers like a KV cache plus one fixed-size buffer, like a recurrent state. One position a block
    unless asked: these tests count pages by positions."""
    return StateSpec(
        (
            BufferSpec("k", (2, 3, context, 8), dtype, seq_axis=2),
            BufferSpec("v", (2, 3, context, 8), dtype, seq_axis=2),
            BufferSpec("h", (5, 7), torch.float32),
        ),
        block_tokens=block_tokens,
    )


# -- backend choice (any machine) -------------------------------------------------------------------


def _driver_loads() -> bool:
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
    except Exception:
        return False
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_without_cuda_picks_host_and_says_why() -> None:
    choice = select_backend("auto")
    assert choice.kind == "host"
    assert choice.device == torch.device("cpu")
    assert choice.reason == probe_cuda(0)
    if not _driver_loads():
        assert choice.reason.startswith("no NVIDIA driver")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_explicit_cuda_without_cuda_is_refused(device: str) -> None:
    with pytest.raises(BackendUnavailable, match="requested but unusable"):
        select_backend(device)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu:0"])
def test_unknown_devices_are_refused(device: str) -> None:
    with pytest.raises(BackendUnavailable):
        select_backend(device)


def test_cpu_is_always_host() -> None:
    assert select_backend("cpu").kind == "host"


def test_vmm_backend_refuses_a_cpu_device() -> None:
    with pytest.raises(BackendUnavailable):
        vmm.VmmBackend(small_spec(), 2, torch.device("cpu"))


# -- a fake driver: real bytes, strict checks ---------------------------------------------------------

REAL = vmm.driver  # the real bindings module; the fake borrows its structs and enums
R = REAL.CUresult
GRANULARITY = 4096
BASE = 1 << 40  # fake device addresses start here


class FakeDriver:
    """The part of cuda.bindings.driver the backend uses, over host memory, with a call log."""

    CUresult = R
    CUmemAllocationProp = REAL.CUmemAllocationProp
    CUmemAccessDesc = REAL.CUmemAccessDesc
    CUDA_MEMCPY2D = REAL.CUDA_MEMCPY2D
    CUmemAllocationType = REAL.CUmemAllocationType
    CUmemLocationType = REAL.CUmemLocationType
    CUmemAccess_flags = REAL.CUmemAccess_flags
    CUmemAllocationGranularity_flags = REAL.CUmemAllocationGranularity_flags
    CUdevice_attribute = REAL.CUdevice_attribute
    CUmemorytype = REAL.CUmemorytype
    CUevent_flags = REAL.CUevent_flags

    def __init__(self, free: int, max_pitch: int = 1 << 31) -> None:
        self.free = free
        self.total = free
        self.max_pitch = max_pitch
        self.log: list[tuple[Any, ...]] = []
        self.current = threading.local()
        self.ctx_refs = 0
        self.reserved: tuple[int, int] | None = None
        self.memory = torch.zeros(0, dtype=torch.uint8)
        self.handles: dict[int, int] = {}  # handle -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.access: set[int] = set()
        self.events: set[int] = set()
        self.next_id = 1
        self.fail: dict[str, Any] = {}  # call name -> CUresult to return once

    # helpers
    def _ret(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.log.append((name, threading.get_ident()))
        if name in self.fail:
            return (self.fail.pop(name), *([None] * len(values)))
        return (R.CUDA_SUCCESS, *values)

    def _needs_ctx(self, name: str) -> None:
        if getattr(self.current, "ctx", None) != "primary":
            raise AssertionError(f"{name} called on a thread without the primary context current")

    def _span(self, ptr: int, n: int) -> slice:
        """Host slice for [ptr, ptr+n), which must lie in mapped memory with access set (one mapping, or several
        that follow one another, as pages mapped one by one do)."""
        at, end = ptr, ptr + n
        while at < end or n == 0:
            for start, (size, _) in self.mapped.items():
                if start <= at < start + size:
                    assert start in self.access, "access to memory without cuMemSetAccess"
                    at = start + size
                    break
            else:
                raise AssertionError(f"illegal address: [{at:#x}, {end:#x}) is not mapped")
            if n == 0:
                break
        assert self.reserved is not None
        off = ptr - self.reserved[0]
        return slice(off, off + n)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # context and device
    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return self._ret("cuInit")

    def cuDeviceGet(self, index: int) -> tuple[Any, ...]:
        return self._ret("cuDeviceGet", index)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, ...]:
        self.ctx_refs += 1
        return self._ret("cuDevicePrimaryCtxRetain", "primary")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[Any, ...]:
        self.ctx_refs -= 1
        return self._ret("cuDevicePrimaryCtxRelease")

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        self.current.ctx = ctx
        return self._ret("cuCtxSetCurrent")

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        self._needs_ctx("cuCtxSynchronize")
        return self._ret("cuCtxSynchronize")

    def cuDeviceGetAttribute(self, attr: Any, dev: int) -> tuple[Any, ...]:
        assert attr == REAL.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH
        return self._ret("cuDeviceGetAttribute", self.max_pitch)

    def cuGetErrorString(self, result: Any) -> tuple[Any, ...]:
        return (R.CUDA_SUCCESS, b"fake error")

    def cuMemGetInfo(self) -> tuple[Any, ...]:
        self._needs_ctx("cuMemGetInfo")
        return self._ret("cuMemGetInfo", self.free, self.total)

    def cuMemGetAllocationGranularity(self, prop: Any, flag: Any) -> tuple[Any, ...]:
        assert prop.type == REAL.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == REAL.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        return self._ret("cuMemGetAllocationGranularity", GRANULARITY)

    # virtual memory
    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemAddressReserve")
        assert self.reserved is None and size % GRANULARITY == 0 and align == GRANULARITY
        self.reserved = (BASE, size)
        self.memory = torch.full((size,), 0xAB, dtype=torch.uint8)  # "new memory is not zero"
        return self._ret("cuMemAddressReserve", BASE)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[Any, ...]:
        assert self.reserved == (ptr, size), "freeing a range that was not reserved"
        assert not self.mapped, "freeing a range that still has mappings"
        self.reserved = None
        return self._ret("cuMemAddressFree")

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemCreate")
        assert size % GRANULARITY == 0
        if size > self.free:
            self.log.append(("cuMemCreate", threading.get_ident()))
            return (R.CUDA_ERROR_OUT_OF_MEMORY, None)
        handle = self._new_id()
        ret = self._ret("cuMemCreate", handle)
        if ret[0] == R.CUDA_SUCCESS:
            self.handles[handle] = size
            self.free -= size
        return ret

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        assert handle in self.handles, "releasing an unknown handle"
        assert all(h != handle for _, h in self.mapped.values()), "releasing a handle that is still mapped"
        self.free += self.handles.pop(handle)
        return self._ret("cuMemRelease")

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemMap")
        assert self.reserved is not None
        base, total = self.reserved
        assert base <= ptr and ptr + size <= base + total and (ptr - base) % GRANULARITY == 0
        assert all(ptr + size <= s or s + n <= ptr for s, (n, _) in self.mapped.items()), "overlapping map"
        ret = self._ret("cuMemMap")
        if ret[0] == R.CUDA_SUCCESS:
            self.mapped[ptr] = (size, handle)
        return ret

    def cuMemSetAccess(self, ptr: int, size: int, descs: list[Any], count: int) -> tuple[Any, ...]:
        assert ptr in self.mapped and self.mapped[ptr][0] == size and count == len(descs) == 1
        assert descs[0].flags == REAL.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ret = self._ret("cuMemSetAccess")
        if ret[0] == R.CUDA_SUCCESS:
            self.access.add(ptr)
        return ret

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemUnmap")
        assert ptr in self.mapped and self.mapped[ptr][0] == size, "unmapping what is not mapped"
        del self.mapped[ptr]
        self.access.discard(ptr)
        self.memory[self._host_offset(ptr) : self._host_offset(ptr) + size] = 0xCD  # gone
        return self._ret("cuMemUnmap", )

    def _host_offset(self, ptr: int) -> int:
        assert self.reserved is not None
        return ptr - self.reserved[0]

    # stream work (executed at once: the fake stream is synchronous)
    def cuMemsetD8Async(self, ptr: int, value: int, n: int, stream: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemsetD8Async")
        self.memory[self._span(ptr, n)] = value
        return self._ret("cuMemsetD8Async")

    def cuMemcpyDtoDAsync(self, dst: int, src: int, n: int, stream: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemcpyDtoDAsync")
        self.memory[self._span(dst, n)] = self.memory[self._span(src, n)].clone()
        return self._ret("cuMemcpyDtoDAsync")

    def cuMemcpy2DAsync(self, c: Any, stream: int) -> tuple[Any, ...]:
        self._needs_ctx("cuMemcpy2DAsync")
        device = REAL.CUmemorytype.CU_MEMORYTYPE_DEVICE
        assert c.srcMemoryType == device and c.dstMemoryType == device
        assert c.WidthInBytes <= c.srcPitch <= self.max_pitch and c.WidthInBytes <= c.dstPitch <= self.max_pitch
        src, dst = int(c.srcDevice), int(c.dstDevice)
        for r in range(c.Height):
            s = self._span(src + c.srcXInBytes + (c.srcY + r) * c.srcPitch, c.WidthInBytes)
            d = self._span(dst + c.dstXInBytes + (c.dstY + r) * c.dstPitch, c.WidthInBytes)
            self.memory[d] = self.memory[s].clone()
        return self._ret("cuMemcpy2DAsync")

    def cuEventCreate(self, flags: Any) -> tuple[Any, ...]:
        self._needs_ctx("cuEventCreate")
        event = REAL.CUevent(self._new_id())
        self.events.add(int(event))
        return self._ret("cuEventCreate", event)

    def cuEventRecord(self, event: Any, stream: int) -> tuple[Any, ...]:
        assert int(event) in self.events
        self.log.append(("record", int(event)))
        return self._ret("cuEventRecord")

    def cuEventSynchronize(self, event: Any) -> tuple[Any, ...]:
        assert int(event) in self.events
        self.log.append(("sync", int(event)))
        return self._ret("cuEventSynchronize")

    def cuEventDestroy(self, event: Any) -> tuple[Any, ...]:
        self.events.remove(int(event))
        return self._ret("cuEventDestroy")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """Route the backend to a fake driver with 64 MiB free, and to host memory for the slab."""
    drv = FakeDriver(free=64 << 20)
    monkeypatch.setattr(vmm, "driver", drv)
    monkeypatch.setattr(vmm, "_init_torch_cuda", lambda: None)
    monkeypatch.setattr(vmm, "_current_stream", lambda device: 7)
    monkeypatch.setattr(vmm, "_capturing", lambda: False)
    monkeypatch.setattr(vmm, "_wrap", lambda ptr, nbytes, device: drv.memory[: nbytes])
    return drv


def open_fake(spec: StateSpec, capacity: int = 4, reserve: int = 0) -> vmm.VmmBackend:
    return vmm.VmmBackend(spec, capacity, torch.device("cuda", 0), reserve_bytes=reserve)


def calls(drv: FakeDriver) -> list[str]:
    return [entry[0] for entry in drv.log]


def spare_pages(b: vmm.VmmBackend) -> set[int]:
    return {BASE + b.spare_slot * b.slot_bytes + off for off in range(0, b.slot_bytes, GRANULARITY)}


def pages_of(b: vmm.VmmBackend, slot: int) -> list[int]:
    """The fake addresses mapped in a slot, in order."""
    start = BASE + slot * b.slot_bytes
    return sorted(a for a in fake_mapped(b) if start <= a < start + b.slot_bytes)


def fake_mapped(b: vmm.VmmBackend) -> list[int]:
    drv = vmm.driver
    assert isinstance(drv, FakeDriver)
    return list(drv.mapped)


def test_fake_construction_maps_one_page_at_every_page_of_the_spare_and_zeroes_it(fake: FakeDriver) -> None:
    spec = small_spec()
    b = open_fake(spec, capacity=4)
    assert b.granularity == b.page_bytes == GRANULARITY
    assert b.slot_bytes == spec.slot_bytes(GRANULARITY) and b.slot_bytes % GRANULARITY == 0
    assert b.num_slots == 5 and b.spare_slot == 4
    assert b.pages_per_slot == b.slot_bytes // GRANULARITY == 4  # so the spare is 4 mappings of one page
    assert set(fake.mapped) == spare_pages(b) and len({h for _, h in fake.mapped.values()}) == 1
    assert set(fake.access) == spare_pages(b)
    assert b.mapped_bytes() == b.spare_bytes == GRANULARITY and b.mapped_pages == 0
    assert b.page_budget == 4 * 4  # every slot backed whole fits in 64 MiB
    assert fake.free == (64 << 20) - GRANULARITY
    spare = fake.memory[4 * b.slot_bytes : 4 * b.slot_bytes + GRANULARITY]
    assert int(spare.max()) == 0  # zeroed: the page behind the whole spare
    assert int(fake.memory[: 4 * b.slot_bytes].min()) == 0xAB  # session slots untouched
    assert b.views()["k"].shape == (5, 2, 3, 40, 1, 8)
    b.close()


def test_fake_page_budget_is_capped_by_free_memory_minus_reserve_and_spare(fake: FakeDriver) -> None:
    spec = small_spec()
    fake.free = fake.total = 10 * GRANULARITY + GRANULARITY // 2 + (1 << 20)
    b = open_fake(spec, capacity=100, reserve=1 << 20)
    assert b.num_slots - 1 == 100  # slots are virtual: pages bound the sessions
    assert b.page_budget == 9  # 10 whole pages fit after the reserve, one is the spare's
    b.close()
    b = vmm.VmmBackend(spec, 100, torch.device("cuda", 0), reserve_bytes=1 << 20, page_budget=3)
    assert b.page_budget == 3
    b.close()


def test_fake_no_room_for_one_session_raises_and_releases_the_context(fake: FakeDriver) -> None:
    spec = small_spec()
    fake.free = fake.total = GRANULARITY + 100  # the spare's page, no page for a session
    with pytest.raises(CapacityExhausted, match="no room for one session"):
        open_fake(spec, capacity=4)
    assert fake.ctx_refs == 0 and fake.reserved is None and not fake.handles


def test_fake_grow_maps_pages_in_order_zeroed_and_shrink_releases_from_the_end(fake: FakeDriver) -> None:
    spec = small_spec()
    b = open_fake(spec, capacity=4)
    free = fake.free
    b.grow(1, 2)
    assert pages_of(b, 1) == [BASE + b.slot_bytes + i * GRANULARITY for i in range(2)]
    assert b.pages(1) == 2 and b.mapped_pages == 2 and b.mapped_bytes() == 3 * GRANULARITY
    assert fake.free == free - 2 * GRANULARITY and len(fake.handles) == 3  # one allocation per page
    start = b.slot_bytes
    assert int(fake.memory[start : start + 2 * GRANULARITY].max()) == 0  # zeroed
    assert int(fake.memory[start + 2 * GRANULARITY : start + b.slot_bytes].min()) == 0xAB  # not mapped: untouched
    b.grow(1, 1)  # never shrinks
    assert b.pages(1) == 2
    b.grow(1, 99)  # at most a whole slot
    assert b.pages(1) == b.pages_per_slot == 4
    b.shrink(1, 1)
    assert pages_of(b, 1) == [BASE + b.slot_bytes] and b.mapped_pages == 1
    assert fake.free == free - GRANULARITY
    b.shrink(1, 0)
    assert b.pages(1) == 0 and fake.free == free
    b.close()


def test_fake_copy_prefix_and_prefix_match_the_host_backend(fake: FakeDriver) -> None:
    spec = small_spec()
    b = open_fake(spec, capacity=4)
    host = HostBackend(spec, 4, page_bytes=GRANULARITY)
    gen = torch.Generator().manual_seed(0)
    for backend in (b, host):
        for slot in (0, 1):
            backend.grow(slot, backend.pages_per_slot)
    for name, view in b.views().items():
        data = torch.randn(view[0].shape, generator=gen)
        for backend in (b, host):
            backend.views()[name][0].copy_(data)
            backend.views()[name][1].fill_(-1.0)  # sentinel: what the copy must not touch
    for used in (17, 0, 40, 1):
        for backend in (b, host):
            backend.copy_prefix(1, 0, spec.bytes_for(used))
        for name in ("k", "v", "h"):
            assert torch.equal(b.views()[name][1], host.views()[name][1]), (name, used)
        assert torch.equal(b.prefix(1, spec.bytes_for(used)), host.prefix(1, spec.bytes_for(used)))
    assert calls(fake).count("cuMemcpyDtoDAsync") == 4  # one contiguous copy each (used 0: the fixed state only)
    with pytest.raises(SlotError, match="past its mapped pages"):
        b.prefix(2, 1)
    b.close()


def test_fake_out_of_memory_is_capacity_exhausted_and_leaves_no_trace(fake: FakeDriver) -> None:
    spec = small_spec()
    fake.free = fake.total = 6 * GRANULARITY
    b = open_fake(spec, capacity=2)  # a budget of 5 pages + the spare
    assert b.page_budget == 5
    table = SessionTable(b)
    first = table.create(40)  # 4 pages
    assert b.pages(first) == 4
    fake.free -= GRANULARITY  # someone else took the memory meanwhile
    with pytest.raises(CapacityExhausted, match="no memory left"):
        table.create()
    assert b.mapped_bytes() == 5 * GRANULARITY and table.live == 1
    assert len(fake.handles) == 5  # the refused page left nothing
    table.free(first)
    second = table.create(40)  # the freed memory serves the next create
    assert table.live == 1 and b.pages(second) == 4
    with pytest.raises(CapacityExhausted, match="no free page"):
        table.create(40)  # the budget: one page left, four needed
    table.close()
    assert not fake.handles and not fake.mapped and fake.reserved is None


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_fake_a_failed_spare_mapping_releases_everything(fake: FakeDriver, call: str) -> None:
    fake.fail[call] = R.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaDriverError) as info:
        open_fake(small_spec())
    assert info.value.call == call
    assert not fake.handles and not fake.mapped and fake.reserved is None and fake.ctx_refs == 0
    assert fake.free == fake.total


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemsetD8Async"])
def test_fake_other_driver_errors_are_typed_and_release_what_was_taken(fake: FakeDriver, call: str) -> None:
    b = open_fake(small_spec())
    b.grow(0, 1)
    free = fake.free
    fake.fail[call] = R.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaDriverError) as info:
        b.grow(0, 3)  # the first new page fails: nothing of this growth stays, the page before does
    assert info.value.call == call and info.value.result == "CUDA_ERROR_INVALID_VALUE"
    assert fake.free == free and b.pages(0) == 1 and b.mapped_bytes() == 2 * GRANULARITY
    assert set(fake.mapped) == spare_pages(b) | {BASE}
    b.grow(0, 3)  # nothing was left half-done
    assert b.pages(0) == 3
    b.close()


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_fake_a_growth_failing_at_its_third_page_releases_the_two_before(
        fake: FakeDriver, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    backend = open_fake(small_spec())
    table = SessionTable(backend)
    a, b = table.create(), table.create()
    free, handles = fake.free, dict(fake.handles)
    real = getattr(fake, call)
    made = [0]

    def third_fails(*args: Any) -> tuple[Any, ...]:
        made[0] += 1
        if made[0] >= 3:  # the device is full from the third page on
            fake.log.append((call, threading.get_ident()))
            return (R.CUDA_ERROR_OUT_OF_MEMORY,) if call != "cuMemCreate" else (R.CUDA_ERROR_OUT_OF_MEMORY, None)
        return real(*args)

    monkeypatch.setattr(fake, call, third_fails)
    with pytest.raises(CapacityExhausted, match="no memory left"):
        table.ensure(a, 40)  # pages 2-4 of the slot: the first two made, the third refused
    assert table.pages(a) == 1 and table.room(a) == table.spec.tokens_in(1, GRANULARITY)
    assert fake.free == free and fake.handles == handles and table.backend.mapped_bytes() == 3 * GRANULARITY
    assert set(fake.mapped) == spare_pages(backend) | {BASE, BASE + table.slot_bytes}  # b untouched
    monkeypatch.setattr(fake, call, real)
    table.ensure(a, 40)  # nothing was left half-done
    assert table.pages(a) == 4 and table.pages(b) == 1
    table.close()
    assert not fake.handles and not fake.mapped and fake.reserved is None


def test_fake_errors_for_bad_slots(fake: FakeDriver) -> None:
    b = open_fake(small_spec())
    with pytest.raises(SlotError):
        b.grow(99, 1)
    with pytest.raises(SlotError, match="spare"):
        b.grow(b.spare_slot, 1)
    with pytest.raises(SlotError, match="spare"):
        b.shrink(b.spare_slot, 0)
    b.shrink(1, 0)  # nothing mapped: nothing to do
    b.close()


def test_fake_shrink_waits_for_the_slots_last_use_first(fake: FakeDriver) -> None:
    b = open_fake(small_spec())
    b.grow(0, 1)
    b.grow(1, 1)
    b.mark_used([0, 1])
    first = [e for e in fake.log if e[0] == "record"][-1][1]
    b.mark_used([1])
    second = [e for e in fake.log if e[0] == "record"][-1][1]
    fake.log.clear()
    b.shrink(0, 0)
    assert ("sync", first) in fake.log and calls(fake).index("sync") < calls(fake).index("cuMemUnmap")
    fake.log.clear()
    b.shrink(1, 0)
    assert ("sync", second) in fake.log
    b.close()


def test_fake_zero_grow_and_copy_count_as_uses(fake: FakeDriver) -> None:
    b = open_fake(small_spec())
    b.grow(2, 1)  # its memset is queued
    fake.log.clear()
    b.shrink(2, 0)  # a session closed right after create: the memset may still be queued
    assert calls(fake).index("sync") < calls(fake).index("cuMemUnmap")
    b.grow(0, 2)
    b.grow(1, 2)
    b.zero(0)
    b.copy_prefix(1, 0, 300)
    last_record = [e for e in fake.log if e[0] == "record"][-1][1]
    fake.log.clear()
    b.shrink(0, 0)  # the copy read slot 0: wait for it
    assert ("sync", last_record) in fake.log
    b.close()


def test_fake_event_pool_stays_small(fake: FakeDriver) -> None:
    b = open_fake(small_spec(), capacity=4)
    for s in range(4):
        b.grow(s, 1)
    for step in range(500):
        b.mark_used([step % 4, (step + 1) % 4])
    assert len(fake.events) <= b.num_slots + 1
    b.close()
    assert not fake.events


def test_fake_a_mark_older_than_the_event_ring_waits_on_the_oldest_mark_or_the_context(
        fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mark records one event of a ring of num_slots + 1, shared by the slots it marks. A slot whose last
    mark the ring has overwritten waits on the oldest mark the ring holds while every mark went to one stream
    (later on that stream, long done), and on the whole context once marks have gone to two streams."""
    b = open_fake(small_spec(), capacity=4)
    for s in range(3):
        b.grow(s, 1)
    b.mark_used([0, 1])
    fake.log.clear()
    b.mark_used([2])
    latest = [e for e in fake.log if e[0] == "record"][-1][1]
    b.shrink(2, 0)  # its mark is the latest: its own event
    assert ("sync", latest) in fake.log and "cuCtxSynchronize" not in calls(fake)
    fake.log.clear()
    for _ in range(b.num_slots + 1):
        b.mark_used([1])  # slot 0's mark falls out of the ring
    records = [e[1] for e in fake.log if e[0] == "record"]
    fake.log.clear()
    b.shrink(0, 0)
    assert [e for e in fake.log if e[0] == "sync"] == [("sync", records[0])]  # the oldest mark the ring holds
    assert "cuCtxSynchronize" not in calls(fake)
    b.grow(0, 1)
    b.mark_used([0])
    monkeypatch.setattr(vmm, "_current_stream", lambda device: 8)  # a second stream
    for _ in range(b.num_slots + 1):
        b.mark_used([1])
    fake.log.clear()
    b.shrink(0, 0)
    assert "cuCtxSynchronize" in calls(fake) and not [e for e in fake.log if e[0] == "sync"]
    assert len(fake.events) == b.num_slots + 1
    b.close()
    assert not fake.events


def test_fake_a_use_on_another_stream_is_waited_for_too(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step marked on one stream, then a zero (or copy) of the slot on another: the later mark says nothing of the
    step, which may still run. The release waits for the whole context."""
    b = open_fake(small_spec())
    b.grow(0, 1)
    b.mark_used([0])  # a graph replay on the engine's stream
    monkeypatch.setattr(vmm, "_current_stream", lambda device: 8)
    b.zero(0)  # on a second stream: its mark is the slot's latest
    fake.log.clear()
    b.shrink(0, 0)
    assert "cuCtxSynchronize" in calls(fake) and calls(fake).index("cuCtxSynchronize") < calls(fake).index("cuMemUnmap")
    b.close()


def test_fake_refuses_mapping_during_capture(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    b = open_fake(small_spec())
    b.grow(0, 1)
    monkeypatch.setattr(vmm, "_capturing", lambda: True)
    for action in (lambda: b.grow(1, 1), lambda: b.grow(0, 2), lambda: b.shrink(0, 0), lambda: b.zero(0),
                   lambda: b.mark_used([0]), lambda: b.copy_prefix(0, 0, 10)):
        with pytest.raises(StateError, match="capture"):
            action()
    monkeypatch.setattr(vmm, "_capturing", lambda: False)
    assert b.pages(0) == 1 and b.pages(1) == 0
    b.close()


def test_fake_context_is_made_current_on_other_threads(fake: FakeDriver) -> None:
    b = open_fake(small_spec())
    errors: list[BaseException] = []

    def work() -> None:
        try:  # a fresh thread has no current context: the fake fails any call made before binding
            b.grow(0, 2)
            b.zero(0)
            b.shrink(0, 0)
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors
    b.close()


def test_fake_close_releases_everything_in_reverse_order(fake: FakeDriver) -> None:
    b = open_fake(small_spec())
    b.grow(0, 1)
    b.grow(2, 2)
    b.mark_used([0, 2])
    fake.log.clear()
    b.close()
    order = [c for c in calls(fake) if c not in ("cuCtxSetCurrent",)]
    assert order[0] == "cuCtxSynchronize"
    unmaps = [i for i, c in enumerate(order) if c == "cuMemUnmap"]
    assert len(unmaps) == 3 + b.slot_bytes // GRANULARITY  # slot 2's two pages, slot 0's, each page of the spare
    assert order.index("cuMemAddressFree") > max(unmaps)
    assert order.index("cuEventDestroy") > order.index("cuMemAddressFree")
    assert order[-1] == "cuDevicePrimaryCtxRelease"
    assert not fake.handles and not fake.mapped and fake.reserved is None and not fake.events
    assert fake.ctx_refs == 0 and fake.free == fake.total
    b.close()  # idempotent
    with pytest.raises(StateError):
        b.views()


def test_fake_table_grow_close_cycles_return_every_byte(fake: FakeDriver) -> None:
    table = SessionTable(open_fake(small_spec(), capacity=4))
    baseline = fake.free
    parent = table.create(40)
    for i in range(1000):
        a = table.create()
        table.ensure(a, i % 41)
        b = table.clone(parent, used=i % 41)
        assert table.pages(b) == max(1, table.spec.pages_for(i % 41, GRANULARITY))  # what it holds, no more
        table.free(a)
        table.free(b)
    table.free(parent)
    assert fake.free == baseline  # the parent's pages are back too
    assert len(fake.handles) == 1  # the spare
    assert len(fake.events) <= table.capacity + 2
    table.close()
    assert fake.free == fake.total


def test_fake_kept_slots_keep_their_pages_and_trim_waits_then_releases(fake: FakeDriver) -> None:
    table = SessionTable(open_fake(small_spec(), capacity=4), keep_mapped=4)
    baseline = fake.free
    parent = table.create(40)
    first = [table.create(), table.create()]
    for slot in first:
        table.free(slot)
    fake.log.clear()
    for i in range(100):
        a = table.create()
        b = table.clone(parent, used=i % 11)  # within a slot's first page
        table.free(a)
        table.free(b)
    made = calls(fake)
    assert "cuMemCreate" not in made and "cuMemMap" not in made and "cuMemUnmap" not in made
    assert made.count("cuMemsetD8Async") == 200  # every reused slot zeroed: create, and clone before its copy
    assert table.kept == 2 and len(fake.handles) == 1 + 4 + 2  # the spare, the parent's 4 pages, a page per kept
    table.free(parent)  # kept with its 4 pages: nothing released
    assert len(fake.handles) == 1 + 4 + 2
    fake.log.clear()
    assert table.trim() == 3
    made = calls(fake)
    assert made.count("cuMemRelease") == 4 + 1 + 1
    assert made.index("cuEventSynchronize") < made.index("cuMemUnmap")  # the last use is waited for first
    assert fake.free == baseline and len(fake.handles) == 1  # the spare only
    table.close()
    assert fake.free == fake.total


def test_fake_a_device_out_of_memory_takes_the_kept_pages_and_the_surplus_first(fake: FakeDriver) -> None:
    """Within the budget, but another process holds the device's memory: a growth takes the kept slots' pages, then
    the live slots' surplus, rather than refusing while the table itself holds the memory it needs."""
    table = SessionTable(open_fake(small_spec(), capacity=4), keep_mapped=4)
    a, b = table.create(40), table.create()  # 4 pages, 1 page
    table.free(a)  # kept, its 4 pages mapped
    fake.free = 0  # the rest of the device is someone else's now
    table.ensure(b, 40)  # 3 more pages: only the kept slot's can be had
    assert table.pages(b) == 4 and table.kept == 0 and table.live == 1
    assert fake.free == GRANULARITY  # 4 released, 3 taken
    table.free(b)  # kept with 4 pages
    c = table.create()  # reuses them: 1 page claimed, 3 surplus
    assert table.pages(c) == 4 and table.surplus_pages == 3
    fake.free = 0
    d = table.create()  # a fresh slot's page: c's surplus gives it
    assert table.pages(d) == 1 and table.pages(c) == 1 and table.surplus_pages == 0
    assert table.backend.mapped_bytes() == 3 * GRANULARITY and len(fake.handles) == 3
    fake.free = 0
    fake.log.clear()
    with pytest.raises(CapacityExhausted, match="no memory left"):
        table.ensure(d, 40)  # nothing of ours left to give: refused, nothing changed
    creates = [call for call, _ in fake.log if call == "cuMemCreate"]
    assert len(creates) == 1  # asked once: the same pages were asked for again at once (need == want), in vain
    assert table.pages(d) == 1 and table.pages(c) == 1 and table.live == 2
    assert table.backend.mapped_bytes() == 3 * GRANULARITY and len(fake.handles) == 3
    table.close()
    assert not fake.handles and not fake.mapped and fake.reserved is None


# -- the real driver (-m gpu) ----------------------------------------------------------------------


UNDER_SANITIZER = os.environ.get("GPU_TESTS_UNDER_SANITIZER") == "1"
# Mapping new pages can make the driver allocate page-table memory of its own, in small chunks.
PAGE_TABLE_SLACK = 2 << 20


def device_free_bytes() -> int:
    """Free device memory as the driver reports it (not torch's allocator statistics)."""
    from cuda.bindings import driver

    torch.cuda.synchronize()
    err, free, _ = driver.cuMemGetInfo()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return int(free)


def kv_spec(context: int, layers: int = 4, dtype: torch.dtype = torch.bfloat16) -> StateSpec:
    shape = (layers, 2, context, 64)
    return StateSpec((BufferSpec("k", shape, dtype, seq_axis=2), BufferSpec("v", shape, dtype, seq_axis=2)))


@pytest.fixture
def gpu() -> Iterator[torch.device]:
    """The CUDA device, with one backend opened and closed first so that lazily loaded driver
    modules (memset and copy kernels) do not count against a test's baseline."""
    device = torch.device("cuda", 0)
    warm = vmm.VmmBackend(kv_spec(64), 2, device)
    warm.grow(0, 1)
    warm.grow(1, 1)
    warm.copy_prefix(0, 1, 10)
    warm.mark_used([0, 1])
    warm.shrink(0, 0)
    warm.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield device
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda
def test_gpu_slots_follow_the_allocation_granularity(gpu: torch.device) -> None:
    spec = kv_spec(1000)
    b = vmm.VmmBackend(spec, 4, gpu)
    try:
        assert b.granularity >= 2 << 20 and b.granularity & (b.granularity - 1) == 0
        assert b.page_bytes == b.granularity and b.slot_bytes == spec.slot_bytes(b.granularity)
        k = b.views()["k"]
        assert k.device == gpu and k.shape == (5, 4, 2, 63, 16, 64) and k.dtype == torch.bfloat16  # 63 blocks of 16
        assert k[1].data_ptr() - k[0].data_ptr() == b.slot_bytes
        assert k.stride()[3] == spec.block_bytes // 2  # a block steps over 16 positions of every layer's K and V
        assert k.stride()[4] == 64  # a position within its block: the next row of this layer and head
        spare = b.views()["k"][b.spare_slot]
        assert int(torch.count_nonzero(spare)) == 0  # zeroed at construction
    finally:
        b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_spare_is_one_page_mapped_at_each_of_its_pages(gpu: torch.device) -> None:
    spec = kv_spec(8192, layers=8)  # 32 MiB per session: 16 pages of 2 MiB
    baseline = device_free_bytes()
    b = vmm.VmmBackend(spec, 2, gpu)
    try:
        assert abs((baseline - device_free_bytes()) - b.granularity) <= PAGE_TABLE_SLACK
        assert b.spare_bytes == b.granularity and b.mapped_bytes() == b.granularity
        raw = b.views()["k"]
        whole = torch.as_strided(raw, (b.slot_bytes // 2,), (1,), b.spare_slot * b.slot_bytes // 2)
        assert int(torch.count_nonzero(whole)) == 0  # zeroed: every page reads the zeroed one
        whole[0] = 1.0  # one write shows up at the same offset of every page
        per_page = b.granularity // 2
        assert int(torch.count_nonzero(whole)) == whole.numel() // per_page
        assert bool((whole[::per_page] == 1.0).all())
        torch.cuda.synchronize()
    finally:
        b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_grow_copy_and_shrink_one_slot_leaves_others_intact(gpu: torch.device) -> None:
    spec = kv_spec(3000)  # 2 KiB a token, 32 KiB a block of 16: 1,024 tokens (64 blocks) a page, 3 pages a slot
    b = vmm.VmmBackend(spec, 4, gpu)
    try:
        assert spec.token_bytes == 4 * 2 * 64 * 2 * 2 and spec.tokens_in(1, b.page_bytes) == 1024
        for s in range(4):
            b.grow(s, 2)
        k = b.views()["k"]  # (slots, layers, heads, blocks, 16, 64): 2,048 positions are blocks 0-127
        assert int(torch.count_nonzero(k[:4, :, :, :128])) == 0  # mapped pages come zeroed
        patterns = [torch.randn(k[0, :, :, :128].shape, device=gpu, dtype=k.dtype) for _ in range(4)]
        for s in range(4):
            k[s, :, :, :128].copy_(patterns[s])
        b.mark_used([0, 1, 2, 3])  # torch wrote the slots on the stream: a shrink must wait for that
        b.copy_prefix(3, 0, spec.bytes_for(123))  # 123 positions: 8 whole blocks
        b.mark_used([0, 3])
        expected3 = patterns[3].clone()
        expected3[:, :, :8] = patterns[0][:, :, :8]
        assert torch.equal(k[3, :, :, :128], expected3)
        b.shrink(1, 0)
        assert torch.equal(k[0, :, :, :128], patterns[0]) and torch.equal(k[2, :, :, :128], patterns[2])
        b.shrink(2, 1)  # its first 1,024 tokens stay
        assert torch.equal(k[2, :, :, :64], patterns[2][:, :, :64])
        b.grow(2, 3)  # the pages past them come back zeroed
        assert int(torch.count_nonzero(k[2, :, :, 64:])) == 0
        assert torch.equal(k[2, :, :, :64], patterns[2][:, :, :64])
        torch.cuda.synchronize()
    finally:
        b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_memory_is_the_pages_sessions_hold(gpu: torch.device) -> None:
    spec = kv_spec(8192, layers=8)  # 4 KiB a token, 64 KiB a block: 512 tokens a page
    baseline = device_free_bytes()
    b = vmm.VmmBackend(spec, 8, gpu)
    table = SessionTable(b)
    try:
        opened = device_free_bytes()
        assert abs((baseline - opened) - b.granularity) <= PAGE_TABLE_SLACK  # the spare only: one page
        slots = [table.create(tokens) for tokens in (1, 200, 512, 513, 2000, 8192)]
        pages = [b.pages(s) for s in slots]
        assert pages == [1, 1, 1, 2, 4, 16]
        used = opened - device_free_bytes()
        assert abs(used - sum(pages) * b.page_bytes) <= PAGE_TABLE_SLACK
        assert b.mapped_bytes() == (sum(pages) + 1) * b.page_bytes
        for s in slots:
            table.free(s)
        assert abs(device_free_bytes() - opened) <= PAGE_TABLE_SLACK
    finally:
        table.close()
    assert abs(device_free_bytes() - baseline) <= PAGE_TABLE_SLACK


@pytest.mark.gpu
@needs_cuda
def test_gpu_grow_close_cycles_return_to_baseline(gpu: torch.device) -> None:
    table = SessionTable(vmm.VmmBackend(kv_spec(4096), 4, gpu), ahead_tokens=16)
    try:
        parent = table.create(3000)
        for i in range(10):  # first uses (events, driver-internal pools) happen before the baseline
            table.free(table.clone(parent, used=1 + i))
        mapped = table.backend.mapped_bytes()
        baseline = device_free_bytes()
        for i in range(1000):
            a = table.create()
            for tokens in range(0, 1 + (i * 37) % 3000, 256):  # grows page by page, as decoding does
                table.ensure(a, tokens)
            c = table.clone(parent, used=1 + (i * 13) % 3000)
            table.free(a)
            table.free(c)
        assert table.backend.mapped_bytes() == mapped
        if not UNDER_SANITIZER:  # the sanitizer keeps device memory of its own
            assert device_free_bytes() == baseline
    finally:
        table.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_page_budget_is_capped_by_free_memory(gpu: torch.device) -> None:
    spec = kv_spec(8192, layers=32)  # 64 MiB per session
    free = device_free_bytes()
    reserve = free - 5 * (2 << 20) - (2 << 20) - (1 << 20)
    b = vmm.VmmBackend(spec, 1000, gpu, reserve_bytes=reserve)
    try:
        assert b.page_budget == 5 and b.num_slots - 1 == 1000  # 5 pages fit after the reserve, beside the spare
        table = SessionTable(b)
        assert table.free_slots == 5
        slots = [table.create() for _ in range(5)]
        with pytest.raises(CapacityExhausted, match="no free page"):
            table.create()
        with pytest.raises(CapacityExhausted):
            table.ensure(slots[0], 2000)
        assert b.pages(slots[0]) == 1
    finally:
        b.close()
    with pytest.raises(CapacityExhausted):
        vmm.VmmBackend(spec, 4, gpu, reserve_bytes=free)


@pytest.mark.gpu
@needs_cuda
def test_gpu_out_of_memory_is_capacity_exhausted(gpu: torch.device) -> None:
    spec = kv_spec(8192, layers=32)  # 64 MiB per session
    b = vmm.VmmBackend(spec, 4, gpu)
    hog: list[torch.Tensor] = []
    try:
        b.grow(0, 1)
        chunk = 1 << 32
        while chunk >= (1 << 20):  # fill the device until less than one page is left
            try:
                hog.append(torch.empty(chunk, dtype=torch.uint8, device=gpu))
            except torch.cuda.OutOfMemoryError:
                chunk //= 2
        assert device_free_bytes() < 4 * b.page_bytes
        with pytest.raises(CapacityExhausted):
            b.grow(1, 8)
        assert b.pages(1) == 0 and b.mapped_bytes() == 2 * b.page_bytes  # the refused growth left nothing
        hog.clear()
        torch.cuda.empty_cache()
        b.grow(1, 8)  # memory is back
        assert b.mapped_bytes() == 10 * b.page_bytes
    finally:
        hog.clear()
        torch.cuda.empty_cache()
        b.close()


def fill_device(gpu: torch.device) -> list[torch.Tensor]:
    """Allocations that leave less than 1 MiB of the device free, as another process would hold them."""
    hog: list[torch.Tensor] = []
    chunk = 1 << 32
    while chunk >= (1 << 20):
        try:
            hog.append(torch.empty(chunk, dtype=torch.uint8, device=gpu))
        except torch.cuda.OutOfMemoryError:
            chunk //= 2
    return hog


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_full_device_takes_the_kept_slots_pages_before_refusing(gpu: torch.device) -> None:
    spec = kv_spec(8192, layers=32)  # 128 MiB per session: 64 pages of 2 MiB
    table = SessionTable(vmm.VmmBackend(spec, 4, gpu), keep_mapped=4)
    full = spec.pages_for(8192, table.page_bytes)
    hog: list[torch.Tensor] = []
    try:
        a, b = table.create(8192), table.create()  # every page, one page
        table.free(a)  # kept, every page mapped
        mapped = table.backend.mapped_bytes()
        hog = fill_device(gpu)
        assert device_free_bytes() < 4 * table.page_bytes
        table.ensure(b, 8192)  # the rest of its pages, within the budget: only the kept slot's memory can give them
        assert table.pages(b) == full and table.kept == 0 and table.live == 1
        # a's pages released, b grown by full - 1: one page less than before, nothing leaked
        assert table.backend.mapped_bytes() == mapped - table.page_bytes
    finally:
        hog.clear()
        torch.cuda.empty_cache()
        table.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_shrink_while_inflight_waits_for_the_stream(gpu: torch.device) -> None:
    b = vmm.VmmBackend(kv_spec(4096), 2, gpu)
    try:
        b.grow(0, b.pages_per_slot)
        k = b.views()["k"]
        sink = torch.empty((), device=gpu, dtype=torch.float32)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the read
        sink.copy_(k[0].float().sum())  # reads slot 0 after the sleep
        b.mark_used([0])
        start = time.perf_counter()
        b.shrink(0, 0)  # must wait for the read
        waited = time.perf_counter() - start
        assert torch.cuda.current_stream(gpu).query()  # nothing queued is left
        assert float(sink) == 0.0
        if not UNDER_SANITIZER:  # the sanitizer runs every launch to completion: nothing is left to wait for
            assert waited > 0.01
    finally:
        b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_shrink_waits_for_a_use_on_another_stream(gpu: torch.device) -> None:
    b = vmm.VmmBackend(kv_spec(4096), 2, gpu)
    try:
        b.grow(0, b.pages_per_slot)
        k = b.views()["k"]
        sink = torch.empty((), device=gpu, dtype=torch.float32)
        engine = torch.cuda.current_stream(gpu)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the read
        sink.copy_(k[0].float().sum())  # reads slot 0 after the sleep, on the engine's stream
        b.mark_used([0])
        side = torch.cuda.Stream(gpu)
        with torch.cuda.stream(side):
            b.zero(0)  # the slot's last mark, on another stream, done long before the read
        b.shrink(0, 0)  # must wait for the read too
        assert engine.query() and side.query()
        assert float(sink) == 0.0
    finally:
        b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_backend_works_from_another_thread(gpu: torch.device) -> None:
    b = vmm.VmmBackend(kv_spec(256), 2, gpu)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            b.grow(0, 1)
            b.zero(0)
            b.mark_used([0])
            b.shrink(0, 0)
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert not errors, errors
        assert b.mapped_bytes() == b.page_bytes
    finally:
        b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_hybrid_slot_keeps_its_fixed_state_in_the_first_pages(gpu: torch.device) -> None:
    """A hybrid model's slot: a conv state and an fp32 recurrent state of several pages come first, then the K/V of its
    full-attention layers block by block. A clone copies the fixed state whole and the K/V prefix; zero clears them;
    the other slots keep theirs."""
    spec = StateSpec((
        BufferSpec("k", (2, 2, 300, 64), torch.bfloat16, seq_axis=2),
        BufferSpec("v", (2, 2, 300, 64), torch.bfloat16, seq_axis=2),
        BufferSpec("conv", (6, 1000, 3), torch.bfloat16),
        BufferSpec("recurrent", (6, 8, 128, 128), torch.float32),  # 3 MiB: crosses pages
    ))
    assert spec.offsets["conv"] == 0 and spec.token_offset >= spec.fixed_bytes
    b = vmm.VmmBackend(spec, 3, gpu)
    try:
        assert spec.pages_for(0, b.page_bytes) == 2  # the fixed state alone: its first two pages
        for s in range(3):
            b.grow(s, b.pages_per_slot)
        views = b.views()
        patterns = {name: [torch.randn(view[0].shape, device=gpu).to(view.dtype) for _ in range(3)]
                    for name, view in views.items()}
        for name, view in views.items():
            for s in range(3):
                view[s].copy_(patterns[name][s])
        b.mark_used([0, 1, 2])
        b.copy_prefix(2, 0, spec.bytes_for(77))  # 77 positions: 5 whole blocks of 16
        b.mark_used([0, 2])
        for name in ("k", "v"):
            expected = patterns[name][2].clone()
            expected[:, :, :5] = patterns[name][0][:, :, :5]
            assert torch.equal(views[name][2], expected)
        for name in ("conv", "recurrent"):
            assert torch.equal(views[name][2], patterns[name][0])
            assert torch.equal(views[name][1], patterns[name][1])
        b.zero(1)
        assert all(int(torch.count_nonzero(views[name][1])) == 0 for name in views)
        assert torch.equal(views["recurrent"][0], patterns["recurrent"][0])
        torch.cuda.synchronize()
    finally:
        b.close()
