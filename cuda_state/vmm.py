"""VMM backend: one reserved virtual range, one physical allocation per live slot (CUDA driver API).

Slot i is [base + i * slot_bytes, base + (i + 1) * slot_bytes); the last slot is the spare, mapped
and zeroed at construction and kept until close, so padding rows of a captured batch always read
mapped memory. Nothing of the spare is ever read back for a session (padding rows' results are
dropped), so one page of physical memory backs it, mapped at every page of its range: it costs one
granule (2 MiB) instead of a slot (~46 MiB for SmolLM2 at 2048 tokens). The range is wrapped once as
a torch uint8 tensor; its views never move.

Paired resources, released by `close` in reverse order of acquisition (llama2.c style):
  primary context   cuDevicePrimaryCtxRetain          / cuDevicePrimaryCtxRelease
  address range     cuMemAddressReserve               / cuMemAddressFree
  slot memory       cuMemCreate + cuMemMap + SetAccess / (wait last use) cuMemUnmap + cuMemRelease
  events            cuEventCreate (a ring)            / cuEventDestroy

Copies and memsets run on the caller's current torch stream (the engine's), so they are ordered
with the steps that read the slots. `mark_used` records an event there; `unmap` waits for the
slot's last event before giving its memory back. Every driver call's CUresult is checked.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog
import torch
from cuda.bindings import driver

from cuda_state.backend import slab_views
from cuda_state.errors import BackendUnavailable, CapacityExhausted, CudaDriverError, SlotError, StateError
from cuda_state.spec import StateSpec

log = structlog.get_logger(__name__)

_SUCCESS = driver.CUresult.CUDA_SUCCESS
_OUT_OF_MEMORY = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY


def _name(result: Any) -> str:
    return str(getattr(result, "name", result))


def _detail(result: Any) -> str:
    try:
        err, text = driver.cuGetErrorString(result)
    except Exception:  # the description is a courtesy; never mask the real error
        return ""
    return text.decode() if err == _SUCCESS and isinstance(text, bytes) else ""


def _ok(call: str, out: tuple[Any, ...]) -> Any:
    """What a driver call returned after its CUresult (None, one value or a tuple); raises on error."""
    result, *values = out
    if result != _SUCCESS:
        raise CudaDriverError(call, _name(result), _detail(result))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _DeviceRange:
    """A device address range as a 1-D uint8 array, for torch.as_tensor (zero copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # stream None: nothing to synchronise, the memory holds no pending writes of ours.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "strides": None,
                "version": 3, "stream": None}


def _init_torch_cuda() -> None:
    """Start torch's CUDA (it shares the primary context the backend retains) and hand its cached,
    unused blocks back to the driver, so that free memory is measured as it really is."""
    torch.cuda.init()
    torch.cuda.empty_cache()


def _current_stream(device: torch.device) -> int:
    """The caller's current torch stream on `device` (the engine's stream) as a raw handle."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def _capturing() -> bool:
    return bool(torch.cuda.is_current_stream_capturing())


def _wrap(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The range as one uint8 tensor. The explicit device index matters: without it torch asks the
    driver which device owns `ptr`, and that fails while parts of the range are unmapped."""
    return torch.as_tensor(_DeviceRange(ptr, nbytes), device=device)


class _EventRing:
    """Events marking each slot's last queued use: one event per mark, shared by every slot it marks, from
    a ring of `size` events reused in turn. A slot remembers the sequence number of its last mark.

    A mark costs one cuEventRecord and one dict store per slot (a 64-row step marks 64 slots). Waiting
    for a slot syncs its mark's event while the ring still holds that mark. An older mark's event has
    been recorded again since: while every mark so far went to one stream, the oldest mark the ring
    holds comes after it on that stream, and the wait syncs that (long done, typically: a slot released
    after seconds idle does not wait for the step in flight); once marks have gone to more than one
    stream, the wait falls back to a context synchronize. The ring never holds more than `size` events.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._events: list[Any] = []  # created on first use, up to `size`
        self._seq = 0  # marks made so far
        self._last: dict[int, int] = {}  # slot -> sequence number of its last mark
        self._stream: int | None = None  # the stream of the first mark
        self._mixed = False  # a mark has gone to another stream than the first

    def record(self, slots: list[int], stream: int) -> None:
        seq = self._seq
        index = seq % self._size
        if index == len(self._events):
            flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
            self._events.append(_ok("cuEventCreate", driver.cuEventCreate(flags)))
        _ok("cuEventRecord", driver.cuEventRecord(self._events[index], stream))
        if self._stream is None:
            self._stream = stream
        elif stream != self._stream:
            self._mixed = True
        self._seq = seq + 1
        last = self._last
        for slot in slots:
            last[slot] = seq

    def wait(self, slot: int) -> None:
        """Block until the slot's last queued use has finished; forget it."""
        seq = self._last.pop(slot, None)
        if seq is None:
            return
        if self._seq - seq <= self._size:  # its event has not been recorded again since
            _ok("cuEventSynchronize", driver.cuEventSynchronize(self._events[seq % self._size]))
        elif not self._mixed:  # the oldest mark held, later on the same stream
            _ok("cuEventSynchronize", driver.cuEventSynchronize(self._events[self._seq % self._size]))
        else:
            _ok("cuCtxSynchronize", driver.cuCtxSynchronize())

    def destroy(self) -> None:
        first: BaseException | None = None
        for event in reversed(self._events):
            try:
                _ok("cuEventDestroy", driver.cuEventDestroy(event))
            except CudaDriverError as e:
                first = first or e
        self._events.clear()
        self._last.clear()
        if first is not None:
            raise first


class VmmBackend:
    """Session slots in one reserved virtual range on one CUDA device. See the module docstring."""

    def __init__(self, spec: StateSpec, capacity: int, device: torch.device, reserve_bytes: int = 0) -> None:
        if device.type != "cuda":
            raise BackendUnavailable(f"the VMM backend needs a CUDA device, got {device}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.spec = spec
        self.device = torch.device("cuda", index)
        self._lock = threading.RLock()
        self._closed = False
        self._ctx: Any = None
        self._base = 0
        self._reserved = 0
        self._handles: dict[int, Any] = {}  # slot -> CUmemGenericAllocationHandle
        self._events = _EventRing(1)  # sized in _open, once the slots are counted
        self._views: dict[str, torch.Tensor] = {}
        try:
            self._open(index, capacity, reserve_bytes)
        except BaseException:
            self.close()
            raise

    # -- construction ---------------------------------------------------------------------------

    def _open(self, index: int, capacity: int, reserve_bytes: int) -> None:
        _init_torch_cuda()
        _ok("cuInit", driver.cuInit(0))
        self._dev = _ok("cuDeviceGet", driver.cuDeviceGet(index))
        self._ctx = _ok("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(self._dev))
        self._bind()
        self._prop = self._allocation_prop(index)
        self._access = self._access_desc(index)
        recommended = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(_ok("cuMemGetAllocationGranularity",
                                   driver.cuMemGetAllocationGranularity(self._prop, recommended)))
        self.slot_bytes = self.spec.slot_bytes(self.granularity)
        pitch_attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH
        self._max_pitch = int(_ok("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(pitch_attr, self._dev)))
        self.num_slots = self._fit(capacity, reserve_bytes) + 1
        self._events = _EventRing(self.num_slots + 1)
        self._reserve_range()
        self.map(self.spare_slot)
        self.zero(self.spare_slot)
        self._views = slab_views(_wrap(self._base, self._reserved, self.device), self.spec, self.num_slots, self.slot_bytes)

    @staticmethod
    def _allocation_prop(index: int) -> Any:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        return prop

    @staticmethod
    def _access_desc(index: int) -> Any:
        desc = driver.CUmemAccessDesc()
        desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _fit(self, requested: int, reserve_bytes: int) -> int:
        """Session slots: the requested number, capped by free memory minus the reserve and the spare."""
        free, total = _ok("cuMemGetInfo", driver.cuMemGetInfo())
        fits = (int(free) - reserve_bytes - self.granularity) // self.slot_bytes  # the spare: one granule
        capacity = min(requested, fits)
        log.info(
            "vmm_capacity", device=str(self.device), requested=requested, fits_in_memory=max(fits, 0),
            capacity=max(capacity, 0), free_bytes=int(free), total_bytes=int(total), reserve_bytes=reserve_bytes,
            slot_bytes=self.slot_bytes, bytes_per_session=self.spec.bytes_per_session, granularity=self.granularity,
        )
        if capacity < 1:
            raise CapacityExhausted(
                f"no room for one session on {self.device}: {int(free)} bytes free, {reserve_bytes} reserved "
                f"for the workspace, {self.slot_bytes} per slot plus {self.granularity} for the spare"
            )
        return capacity

    def _reserve_range(self) -> None:
        size = self.num_slots * self.slot_bytes
        self._base = int(_ok("cuMemAddressReserve", driver.cuMemAddressReserve(size, self.granularity, 0, 0)))
        self._reserved = size

    # -- the StateBackend interface -------------------------------------------------------------

    @property
    def spare_slot(self) -> int:
        return self.num_slots - 1

    def views(self) -> dict[str, torch.Tensor]:
        if self._closed:
            raise StateError("the VMM backend is closed")
        return self._views

    def map(self, slot: int) -> None:
        """Back `slot` with its own physical allocation (the spare: one granule, mapped at each of its
        granules). CapacityExhausted when the device is full."""
        with self._lock:
            self._check_slot(slot)
            if slot in self._handles:
                raise SlotError(f"slot {slot} is already mapped")
            self._refuse_during_capture("map")
            self._bind()
            size = self._backing_bytes(slot)
            handle = self._create_handle(size)
            ptr = self._slot_ptr(slot)
            mapped: list[int] = []
            try:
                for offset in range(0, self.slot_bytes, size):
                    self._checked_map("cuMemMap", driver.cuMemMap(ptr + offset, size, 0, handle, 0))
                    mapped.append(offset)
                    self._checked_map("cuMemSetAccess", driver.cuMemSetAccess(ptr + offset, size, [self._access], 1))
            except BaseException:
                for offset in mapped:
                    _ok("cuMemUnmap", driver.cuMemUnmap(ptr + offset, size))
                _ok("cuMemRelease", driver.cuMemRelease(handle))
                raise
            self._handles[slot] = handle

    def unmap(self, slot: int) -> None:
        """Wait for the last queued work that used `slot`, then unmap and release its memory."""
        with self._lock:
            self._check_mapped(slot)
            if slot == self.spare_slot:
                raise SlotError("the spare slot stays mapped until close")
            self._refuse_during_capture("unmap")
            self._bind()
            self._events.wait(slot)
            self._release(slot)

    def zero(self, slot: int) -> None:
        with self._lock:
            self._check_mapped(slot)
            self._refuse_during_capture("zero")
            self._bind()
            stream = self._stream()
            # The whole backing: for the spare, its one granule is what every part of its range reads.
            _ok("cuMemsetD8Async", driver.cuMemsetD8Async(self._slot_ptr(slot), 0, self._backing_bytes(slot), stream))
            self._events.record([slot], stream)

    def copy_prefix(self, dst: int, src: int, used: int) -> None:
        """Copy the first `used` positions of every buffer of `src` into `dst`, on the current stream."""
        with self._lock:
            self._check_mapped(dst)
            self._check_mapped(src)
            self._refuse_during_capture("copy_prefix")
            self._bind()
            stream = self._stream()
            for buf in self.spec.buffers:
                offset = self.spec.offsets[buf.name]
                rows, width, pitch = buf.prefix_copy(used)
                self._copy_rows(self._slot_ptr(dst) + offset, self._slot_ptr(src) + offset, rows, width, pitch, stream)
            self._events.record([dst, src], stream)

    def mark_used(self, slots: list[int]) -> None:
        with self._lock:
            live = [s for s in slots if s in self._handles]
            if not live:
                return
            self._refuse_during_capture("mark_used")  # an event recorded into a capture marks nothing
            self._bind()
            self._events.record(live, self._stream())

    def mapped_bytes(self) -> int:
        return sum(self._backing_bytes(slot) for slot in self._handles)

    @property
    def spare_bytes(self) -> int:
        """Physical memory behind the spare slot: one granule."""
        return self._backing_bytes(self.spare_slot) if self.spare_slot in self._handles else 0

    def close(self) -> None:
        """Release everything in reverse order of acquisition. Safe on a half-built backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._views = {}
            if self._ctx is None:
                return
            first: BaseException | None = None
            try:
                self._bind()
                # Padding rows of captured steps touch the spare without a mark: wait for everything.
                _ok("cuCtxSynchronize", driver.cuCtxSynchronize())
            except CudaDriverError as e:
                first = e
            for slot in sorted(self._handles, reverse=True):
                try:
                    self._release(slot)
                except CudaDriverError as e:
                    first = first or e
            try:
                if self._reserved:
                    _ok("cuMemAddressFree", driver.cuMemAddressFree(self._base, self._reserved))
                    self._reserved = 0
            except CudaDriverError as e:
                first = first or e
            try:
                self._events.destroy()
            except CudaDriverError as e:
                first = first or e
            try:
                _ok("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(self._dev))
            except CudaDriverError as e:
                first = first or e
            self._ctx = None
            log.info("vmm_closed", device=str(self.device), errors=str(first) if first else None)
            if first is not None:
                raise first

    # -- internals ------------------------------------------------------------------------------

    def _bind(self) -> None:
        """Make the primary context (the one torch uses) current on the calling thread."""
        _ok("cuCtxSetCurrent", driver.cuCtxSetCurrent(self._ctx))

    def _stream(self) -> int:
        return _current_stream(self.device)

    def _slot_ptr(self, slot: int) -> int:
        return self._base + slot * self.slot_bytes

    def _backing_bytes(self, slot: int) -> int:
        """Physical memory behind a mapped slot, and the size of each of its mappings."""
        return self.granularity if slot == self.spare_slot else self.slot_bytes

    def _create_handle(self, nbytes: int) -> Any:
        result, handle = driver.cuMemCreate(nbytes, self._prop, 0)
        if result == _OUT_OF_MEMORY:
            raise CapacityExhausted(f"{self.device} has no memory left for another session ({nbytes} bytes)")
        _ok("cuMemCreate", (result,))
        return handle

    def _checked_map(self, call: str, out: tuple[Any, ...]) -> None:
        if out[0] == _OUT_OF_MEMORY:  # page tables for the mapping did not fit: the device is full too
            raise CapacityExhausted(f"{self.device} has no memory left to map another session ({call})")
        _ok(call, out)

    def _release(self, slot: int) -> None:
        size = self._backing_bytes(slot)
        for offset in range(0, self.slot_bytes, size):
            _ok("cuMemUnmap", driver.cuMemUnmap(self._slot_ptr(slot) + offset, size))
        handle = self._handles.pop(slot)
        _ok("cuMemRelease", driver.cuMemRelease(handle))

    def _copy_rows(self, dst: int, src: int, rows: int, width: int, pitch: int, stream: int) -> None:
        """rows x width bytes, rows `pitch` apart, at the same offsets in src and dst."""
        if width == 0:
            return
        if rows == 1 or width == pitch:
            nbytes = width if rows == 1 else rows * pitch
            _ok("cuMemcpyDtoDAsync", driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream))
            return
        if pitch > self._max_pitch:  # beyond what a 2-D copy accepts: one copy per row
            for r in range(rows):
                _ok("cuMemcpyDtoDAsync", driver.cuMemcpyDtoDAsync(dst + r * pitch, src + r * pitch, width, stream))
            return
        copy = driver.CUDA_MEMCPY2D()
        copy.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice = src
        copy.srcPitch = pitch
        copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.dstDevice = dst
        copy.dstPitch = pitch
        copy.WidthInBytes = width
        copy.Height = rows
        _ok("cuMemcpy2DAsync", driver.cuMemcpy2DAsync(copy, stream))

    def _check_slot(self, slot: int) -> None:
        if self._closed:
            raise StateError("the VMM backend is closed")
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} is outside 0..{self.num_slots - 1}")

    def _check_mapped(self, slot: int) -> None:
        self._check_slot(slot)
        if slot not in self._handles:
            raise SlotError(f"slot {slot} is not mapped")

    def _refuse_during_capture(self, what: str) -> None:
        if _capturing():
            raise StateError(f"{what} during CUDA graph capture would corrupt the capture; do it between steps")
