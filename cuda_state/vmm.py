"""VMM backend: one reserved virtual range, physical pages mapped into each slot as its session grows (CUDA driver API).

Slot i is [base + i * slot_bytes, base + (i + 1) * slot_bytes); its virtual range never moves. A session's slot is
backed page by page from its start (a page is the allocation granularity, 2 MiB on the H100): `grow` creates one
physical allocation per page (`cuMemCreate`), maps it after the slot's last page (`cuMemMap`, `cuMemSetAccess`) and
zeroes it; `shrink` unmaps and releases pages from the end once the slot's last queued use is done. The layout
(cuda_state.spec) puts the fixed state and the first tokens of every layer first, so a session of N tokens holds
`spec.pages_for(N, page)` pages. `page_budget`, fixed at construction from free memory minus the workspace reserve,
bounds the pages all sessions hold; a growth past it, or one the driver refuses for memory, is CapacityExhausted.

The last slot is the spare, mapped and zeroed at construction and kept until close, so padding rows of a captured
batch always read mapped memory. Nothing of the spare is ever read back for a session (padding rows' results are
dropped), so one page of physical memory backs it, mapped at every page of its range. The range is wrapped once as
a torch uint8 tensor; its views never move, so captured CUDA graphs stay valid whatever is mapped.

Mapping happens between steps, never during graph capture (refused), and only for pages no queued step touches:
the engine grows a slot before it launches the step whose rows reach into the new pages.

Paired resources, released by `close` in reverse order of acquisition (llama2.c style):
  primary context   cuDevicePrimaryCtxRetain                   / cuDevicePrimaryCtxRelease
  address range     cuMemAddressReserve                        / cuMemAddressFree
  pages             cuMemCreate + cuMemMap + SetAccess, a page / (wait last use) cuMemUnmap + cuMemRelease
  events            cuEventCreate (a ring)                     / cuEventDestroy

Copies and memsets run on the caller's current torch stream (the engine's), so they are ordered
with the steps that read the slots. `mark_used` records an event there; `shrink` waits for the
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
    after seconds idle does not wait for the step in flight). Once marks have gone to more than one
    stream, every wait is a context synchronize: a slot's last mark on one stream says nothing of its
    earlier uses on another. The ring never holds more than `size` events.
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
        if self._mixed:
            # The slot's last mark is on one stream; an earlier use on another (a step replayed on the engine's
            # stream, then a copy on a second one) may still be running, and no event of the ring orders the two.
            _ok("cuCtxSynchronize", driver.cuCtxSynchronize())
        elif self._seq - seq <= self._size:  # its event has not been recorded again since
            _ok("cuEventSynchronize", driver.cuEventSynchronize(self._events[seq % self._size]))
        else:  # the oldest mark held, later on the same stream
            _ok("cuEventSynchronize", driver.cuEventSynchronize(self._events[self._seq % self._size]))

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
    """Session slots in one reserved virtual range on one CUDA device, backed page by page. See the module docstring."""

    def __init__(self, spec: StateSpec, capacity: int, device: torch.device, reserve_bytes: int = 0,
                 page_budget: int | None = None) -> None:
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
        self._pages: dict[int, list[Any]] = {}  # slot -> its pages' CUmemGenericAllocationHandles, in order
        self._mapped = 0  # session pages
        self._spare: Any = None  # the spare's one page
        self._events = _EventRing(1)  # sized in _open, once the slots are counted
        self._views: dict[str, torch.Tensor] = {}
        self._slab: torch.Tensor | None = None
        try:
            self._open(index, capacity, reserve_bytes, page_budget)
        except BaseException:
            self.close()
            raise

    # -- construction ---------------------------------------------------------------------------

    def _open(self, index: int, capacity: int, reserve_bytes: int, page_budget: int | None) -> None:
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
        self.page_bytes = self.granularity
        self.slot_bytes = self.spec.slot_bytes(self.granularity)
        self.pages_per_slot = self.slot_bytes // self.page_bytes
        self.num_slots = capacity + 1
        self.page_budget = self._fit(capacity, reserve_bytes, page_budget)
        self._events = _EventRing(self.num_slots + 1)
        self._reserve_range()
        self._map_spare()
        self._slab = _wrap(self._base, self._reserved, self.device)
        self._views = slab_views(self._slab, self.spec, self.num_slots, self.slot_bytes)

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

    def _fit(self, capacity: int, reserve_bytes: int, page_budget: int | None) -> int:
        """Pages the sessions may hold: free memory minus the reserve and the spare's page, capped by `page_budget`
        and by every slot backed whole."""
        free, total = _ok("cuMemGetInfo", driver.cuMemGetInfo())
        fits = (int(free) - reserve_bytes - self.page_bytes) // self.page_bytes
        budget = min(fits, capacity * self.pages_per_slot)
        if page_budget is not None:
            budget = min(budget, page_budget)
        first = max(1, self.spec.pages_for(0, self.page_bytes))
        log.info(
            "vmm_capacity", device=str(self.device), slots=capacity, page_budget=max(budget, 0),
            pages_in_memory=max(fits, 0), page_bytes=self.page_bytes, pages_per_slot=self.pages_per_slot,
            free_bytes=int(free), total_bytes=int(total), reserve_bytes=reserve_bytes, slot_bytes=self.slot_bytes,
            bytes_per_session=self.spec.bytes_per_session, token_bytes=self.spec.token_bytes,
        )
        if budget < first:
            raise CapacityExhausted(
                f"no room for one session on {self.device}: {int(free)} bytes free, {reserve_bytes} reserved "
                f"for the workspace, {first} pages of {self.page_bytes} bytes for a session plus one for the spare"
            )
        return budget

    def _reserve_range(self) -> None:
        size = self.num_slots * self.slot_bytes
        try:
            self._base = int(_ok("cuMemAddressReserve", driver.cuMemAddressReserve(size, self.granularity, 0, 0)))
        except CudaDriverError as e:
            raise CudaDriverError(e.call, e.result, f"{self.num_slots} slots of {self.slot_bytes} bytes: {size} bytes "
                                  "of virtual addresses; lower --max-sessions or --max-context") from e
        self._reserved = size

    def _map_spare(self) -> None:
        """One page, mapped at every page of the spare's range, zeroed."""
        self._refuse_during_capture("map")
        handle = self._create_handle(self.page_bytes)
        ptr = self._slot_ptr(self.spare_slot)
        mapped: list[int] = []
        try:
            for offset in range(0, self.slot_bytes, self.page_bytes):
                self._checked_map("cuMemMap", driver.cuMemMap(ptr + offset, self.page_bytes, 0, handle, 0))
                mapped.append(offset)
                self._checked_map("cuMemSetAccess",
                                  driver.cuMemSetAccess(ptr + offset, self.page_bytes, [self._access], 1))
        except BaseException:
            for offset in mapped:
                _ok("cuMemUnmap", driver.cuMemUnmap(ptr + offset, self.page_bytes))
            _ok("cuMemRelease", driver.cuMemRelease(handle))
            raise
        self._spare = handle
        stream = self._stream()
        _ok("cuMemsetD8Async", driver.cuMemsetD8Async(ptr, 0, self.page_bytes, stream))
        self._events.record([self.spare_slot], stream)

    # -- the StateBackend interface -------------------------------------------------------------

    @property
    def spare_slot(self) -> int:
        return self.num_slots - 1

    def views(self) -> dict[str, torch.Tensor]:
        if self._closed:
            raise StateError("the VMM backend is closed")
        return self._views

    def prefix(self, slot: int, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._check_slot(slot)
            if slot == self.spare_slot or nbytes > self.pages(slot) * self.page_bytes:
                raise SlotError(f"slot {slot}: {nbytes} bytes reach past its mapped pages")
            assert self._slab is not None
            start = slot * self.slot_bytes
            return self._slab[start : start + nbytes]

    def pages(self, slot: int) -> int:
        return len(self._pages.get(slot, ()))

    @property
    def mapped_pages(self) -> int:
        return self._mapped

    def grow(self, slot: int, pages: int) -> None:
        """Map pages after the slot's current ones until it has `pages` (one allocation each), zeroed on the current
        stream. CapacityExhausted past the budget or when the device is full, CudaDriverError naming the call on
        any other driver error; either way nothing of this growth is left mapped."""
        with self._lock:
            self._check_slot(slot)
            if slot == self.spare_slot:
                raise SlotError("the spare slot is mapped whole at construction")
            held = self._pages.setdefault(slot, [])
            have = len(held)
            pages = min(pages, self.pages_per_slot)
            if pages <= have:
                return
            more = pages - have
            if self._mapped + more > self.page_budget:
                raise CapacityExhausted(f"no free page on {self.device} for {more} more: {self._mapped} of "
                                        f"{self.page_budget} pages of {self.page_bytes} bytes are held")
            self._refuse_during_capture("grow")
            self._bind()
            ptr = self._slot_ptr(slot)
            page = self.page_bytes
            try:
                for i in range(have, pages):
                    handle = self._create_handle(page)
                    try:
                        self._checked_map("cuMemMap", driver.cuMemMap(ptr + i * page, page, 0, handle, 0))
                    except BaseException:
                        _ok("cuMemRelease", driver.cuMemRelease(handle))
                        raise
                    held.append(handle)  # mapped: released by _release_pages from here on
                    self._mapped += 1
                    self._checked_map("cuMemSetAccess", driver.cuMemSetAccess(ptr + i * page, page, [self._access], 1))
                stream = self._stream()
                # Inside the try: a memset that could not be queued leaves the pages unzeroed, so they go back (no
                # queued work touches them) rather than stay mapped and counted for a growth that failed.
                _ok("cuMemsetD8Async", driver.cuMemsetD8Async(ptr + have * page, 0, more * page, stream))
            except BaseException:
                self._release_pages(slot, have)
                raise
            self._events.record([slot], stream)

    def shrink(self, slot: int, pages: int) -> None:
        """Wait for the last queued work that used `slot`, then unmap and release its pages past the first `pages`."""
        with self._lock:
            self._check_slot(slot)
            if slot == self.spare_slot:
                raise SlotError("the spare slot stays mapped until close")
            if self.pages(slot) <= max(0, pages):
                return
            self._refuse_during_capture("shrink")
            self._bind()
            self._events.wait(slot)
            self._release_pages(slot, max(0, pages))

    def zero(self, slot: int) -> None:
        with self._lock:
            self._check_slot(slot)
            self._refuse_during_capture("zero")
            self._bind()
            stream = self._stream()
            # The spare: its one page is what every part of its range reads.
            nbytes = self.page_bytes if slot == self.spare_slot else self.pages(slot) * self.page_bytes
            if nbytes:
                _ok("cuMemsetD8Async", driver.cuMemsetD8Async(self._slot_ptr(slot), 0, nbytes, stream))
                self._events.record([slot], stream)

    def copy_prefix(self, dst: int, src: int, nbytes: int) -> None:
        """Copy the first `nbytes` of `src` into `dst`, on the current stream: one copy (the layout keeps a
        session's state in its slot's first bytes)."""
        with self._lock:
            for slot in (dst, src):
                self._check_slot(slot)
                if nbytes > self.pages(slot) * self.page_bytes:
                    raise SlotError(f"slot {slot}: {nbytes} bytes reach past its mapped pages")
            self._refuse_during_capture("copy_prefix")
            self._bind()
            stream = self._stream()
            if nbytes:
                _ok("cuMemcpyDtoDAsync",
                    driver.cuMemcpyDtoDAsync(self._slot_ptr(dst), self._slot_ptr(src), nbytes, stream))
            self._events.record([dst, src], stream)

    def mark_used(self, slots: list[int]) -> None:
        with self._lock:
            live = [s for s in slots if self._pages.get(s)]
            if not live:
                return
            self._refuse_during_capture("mark_used")  # an event recorded into a capture marks nothing
            self._bind()
            self._events.record(live, self._stream())

    def mapped_bytes(self) -> int:
        return (self._mapped + (self._spare is not None)) * self.page_bytes

    @property
    def spare_bytes(self) -> int:
        """Physical memory behind the spare slot: one page."""
        return self.page_bytes if self._spare is not None else 0

    def close(self) -> None:
        """Release everything in reverse order of acquisition. Safe on a half-built backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._views = {}
            self._slab = None
            if self._ctx is None:
                return
            first: BaseException | None = None
            try:
                self._bind()
                # Padding rows of captured steps touch the spare without a mark: wait for everything.
                _ok("cuCtxSynchronize", driver.cuCtxSynchronize())
            except CudaDriverError as e:
                first = e
            for slot in sorted(self._pages, reverse=True):
                try:
                    self._release_pages(slot, 0)
                except CudaDriverError as e:
                    first = first or e
            try:
                self._release_spare()
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

    def _create_handle(self, nbytes: int) -> Any:
        result, handle = driver.cuMemCreate(nbytes, self._prop, 0)
        if result == _OUT_OF_MEMORY:
            raise CapacityExhausted(f"{self.device} has no memory left for another page ({nbytes} bytes)")
        _ok("cuMemCreate", (result,))
        return handle

    def _checked_map(self, call: str, out: tuple[Any, ...]) -> None:
        if out[0] == _OUT_OF_MEMORY:  # page tables for the mapping did not fit: the device is full too
            raise CapacityExhausted(f"{self.device} has no memory left to map another page ({call})")
        _ok(call, out)

    def _release_pages(self, slot: int, keep: int) -> None:
        """Unmap and release the slot's pages past the first `keep`, last first (no wait: the caller's)."""
        held = self._pages.get(slot, [])
        page = self.page_bytes
        while len(held) > keep:
            i = len(held) - 1
            _ok("cuMemUnmap", driver.cuMemUnmap(self._slot_ptr(slot) + i * page, page))
            handle = held.pop()
            self._mapped -= 1
            _ok("cuMemRelease", driver.cuMemRelease(handle))
        if not held:
            self._pages.pop(slot, None)

    def _release_spare(self) -> None:
        if self._spare is None:
            return
        ptr = self._slot_ptr(self.spare_slot)
        for offset in range(0, self.slot_bytes, self.page_bytes):
            _ok("cuMemUnmap", driver.cuMemUnmap(ptr + offset, self.page_bytes))
        handle, self._spare = self._spare, None
        _ok("cuMemRelease", driver.cuMemRelease(handle))

    def _check_slot(self, slot: int) -> None:
        if self._closed:
            raise StateError("the VMM backend is closed")
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} is outside 0..{self.num_slots - 1}")

    def _refuse_during_capture(self, what: str) -> None:
        if _capturing():
            raise StateError(f"{what} during CUDA graph capture would corrupt the capture; do it between steps")
