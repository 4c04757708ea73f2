"""A stand-in for ``cuda.bindings.driver`` as strict as ``cuda.h`` (CUDA 13), for tests only.

The development and CI machines have no GPU driver, so the CUDA backend's call pattern is
checked against this fake. Every call below returns the ``CUresult`` the real driver documents
for a misuse (``cuda.h``'s comments; "UB" marks what ``cuda.h`` leaves undefined and the fake
refuses so that a test sees it):

  * before ``cuInit(0)`` every call fails with ``CUDA_ERROR_NOT_INITIALIZED``; ``cuInit``'s
    flags must be 0;
  * ``cuDeviceGet(ordinal)`` and every device named later (``cuDevicePrimaryCtxRetain``, a
    prop's or an access descriptor's location id) must be a device that exists
    (``CUDA_ERROR_INVALID_DEVICE``; ``device_count`` devices, 1 by default);
  * the current context is **per thread** (``cuCtxSetCurrent`` binds it to the calling thread
    only; a new thread has none; an unknown context is ``CUDA_ERROR_INVALID_CONTEXT``), and
    ``cuPointerGetAttribute`` fails with ``CUDA_ERROR_INVALID_CONTEXT`` on a thread without
    one. The VMM calls take their device from their arguments and need no current context
    (``cuda.h`` lists no ``CUDA_ERROR_INVALID_CONTEXT`` for them), so the fake needs none;
  * ``cuMemCreate`` and ``cuMemGetAllocationGranularity`` check the prop: type
    ``CU_MEM_ALLOCATION_TYPE_PINNED``, location type ``CU_MEM_LOCATION_TYPE_DEVICE`` with an
    existing ordinal, no requested handle types (host and shareable allocations are not
    modelled: refused); the granularity option is MINIMUM or RECOMMENDED; ``cuMemCreate``'s
    flags must be 0 and its size a multiple of the granularity;
  * ``cuMemAddressReserve``: size and address a multiple of the host page size, alignment 0 or
    a power of two, flags 0 (the base is aligned to max(alignment, granularity));
  * ``cuMemMap`` only onto reserved, unmapped addresses, size and address multiples of the
    granularity, ``offset + size`` within the handle, **offset and flags 0** ("currently must
    be zero"), a live handle;
  * ``cuMemSetAccess`` only over a fully mapped range that contains whole mappings; its first
    ``count`` descriptors (at least one, at most ``len(desc)``) are each checked (location
    type DEVICE, an existing ordinal, flags NONE, READ or READWRITE) and **applied**: the
    simulated memory of device 0 is ``mprotect``-ed to what its descriptor grants (checked:
    a refused ``mprotect`` raises ``OSError``); a new mapping starts inaccessible;
  * ``cuMemUnmap`` exactly the range of one earlier ``cuMemMap`` (no sub-ranges);
  * ``cuMemRelease`` of a handle still mapped somewhere succeeds and **defers** the free: the
    memory stays mapped and readable until its last mapping is unmapped, as the driver
    documents; a handle released twice or never created is refused (UB);
  * ``cuMemAddressFree`` exactly a reservation, with nothing mapped inside it (UB);
  * ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, p)`` fails with
    ``CUDA_ERROR_INVALID_VALUE`` when, inside a reservation, nothing readable by the device is
    mapped at ``p`` (the query Triton's launcher makes for every pointer argument, see
    :func:`triton_pointer_guard`); an address outside every reservation stands for an ordinary
    allocation (``cudaMalloc``), which the driver knows.

The memory is real: reservations are host ``PROT_NONE`` ranges, a handle is a stretch of one
memfd, ``cuMemMap`` maps it (still inaccessible) and ``cuMemSetAccess`` opens it, so
:class:`SimulatedCudaBackend` hands out (CPU) tensors at the very addresses the driver manages:
data written through one mapping is seen through another, and touching unmapped or
inaccessible VA faults (SIGSEGV) as a GPU kernel would (illegal address). Real behaviour on a
GPU is proven by the ``gpu`` tests and ``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import threading
from collections.abc import Callable
from types import SimpleNamespace

import torch

from vmkv.memory.cuda import CudaMemoryBackend
from vmkv.memory.host import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    MAP_ANONYMOUS,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    _libc,
)

_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
HOST_PAGE = mmap.PAGESIZE


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1
    CU_MEM_ALLOCATION_TYPE_MANAGED = 2


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 3


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUpointer_attribute(enum.IntEnum):  # noqa: N801
    CU_POINTER_ATTRIBUTE_CONTEXT = 1
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 6


class CUdeviceptr(int):
    pass


class CUdevice(int):
    pass


class CUcontext(int):
    pass


def CUmemAllocationProp() -> SimpleNamespace:  # noqa: N802
    """Zero-initialised, like the bindings' struct."""
    return SimpleNamespace(type=0, requestedHandleTypes=0,
                           location=SimpleNamespace(type=0, id=0), win32HandleMetaData=0)


def CUmemAccessDesc() -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(location=SimpleNamespace(type=0, id=0), flags=0)


#: host protection of device 0's simulated memory for each access flag
_PROTECTION = {CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE: PROT_NONE,
               CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ: PROT_READ,
               CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE: PROT_READ | PROT_WRITE}


class DriverRefusal(Exception):
    """An error return of a fake driver call (turned into its ``(CUresult, None)`` tuple)."""

    def __init__(self, result: CUresult) -> None:
        super().__init__(result.name)
        self.result = result


def _driver_call(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """Refuse every call but ``cuInit`` before ``cuInit``; turn a refusal into its tuple."""

    def call(self: FakeDriver, *args: object) -> tuple:
        try:
            if not self.initialized and fn.__name__ != "cuInit":
                raise DriverRefusal(CUresult.CUDA_ERROR_NOT_INITIALIZED)
            return fn(self, *args)
        except DriverRefusal as refusal:
            return (refusal.result, None)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


def _check(ok: object, result: CUresult = CUresult.CUDA_ERROR_INVALID_VALUE) -> None:
    if not ok:
        raise DriverRefusal(result)


class FakeDriver:
    """Module-like fake: attribute access mirrors ``cuda.bindings.driver``.

    State the tests read: ``reservations`` (base -> size), ``handles`` (live handle -> (size,
    memfd offset)), ``maps`` (va -> (size, handle)), ``accessible`` (granules device 0 may
    read), ``calls`` (successful VMM calls, in order).
    """

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUpointer_attribute = CUpointer_attribute
    CUdeviceptr = CUdeviceptr
    CUdevice = CUdevice
    CUcontext = CUcontext
    CUmemAllocationProp = staticmethod(CUmemAllocationProp)
    CUmemAccessDesc = staticmethod(CUmemAccessDesc)

    def __init__(self, granularity: int = 2 << 20, memory_bytes: int = 1 << 34, *,
                 device_count: int = 1) -> None:
        self.granularity = granularity
        self.device_count = device_count
        self.memory_left = memory_bytes
        self.initialized = False
        self.reservations: dict[int, int] = {}  # base -> size
        self.handles: dict[int, tuple[int, int]] = {}  # live handle -> (size, memfd offset)
        self.released: dict[int, tuple[int, int]] = {}  # released, still mapped: freed later
        self.maps: dict[int, tuple[int, int]] = {}  # va -> (size, handle)
        self.access: dict[int, int] = {}  # granule address -> device 0's access flags
        self.calls: list[str] = []
        self._primary = {d: CUcontext(0x7700 + d) for d in range(device_count)}
        self._retained: set[int] = set()  # primary contexts retained at least once
        self._thread = threading.local()  # .ctx: the calling thread's current context
        self._next_handle = 1
        self._fd = os.memfd_create("fake-cuda-device-memory", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, memory_bytes)  # sparse: device memory costs nothing untouched
        self._free_offsets: dict[int, list[int]] = {}  # size -> released memfd offsets
        self._file_end = 0

    @property
    def accessible(self) -> set[int]:
        """Granule addresses device 0 may read (access READ or READWRITE)."""
        return {g for g, flags in self.access.items()
                if flags != CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE}

    def _ok(self, *values: object) -> tuple:
        return (CUresult.CUDA_SUCCESS, *values)

    def _log(self, name: str) -> None:
        self.calls.append(name)

    # -- devices and contexts ------------------------------------------------------------------
    def _ordinal(self, device: object) -> int:
        """The ordinal of an existing device, else CUDA_ERROR_INVALID_DEVICE."""
        _check(isinstance(device, int) and 0 <= int(device) < self.device_count,
               CUresult.CUDA_ERROR_INVALID_DEVICE)
        return int(device)  # type: ignore[arg-type]

    @_driver_call
    def cuInit(self, flags: int) -> tuple:  # noqa: N802
        _check(flags == 0)
        self.initialized = True
        self._log("cuInit")
        return self._ok()

    @_driver_call
    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        return self._ok(CUdevice(self._ordinal(ordinal)))

    @_driver_call
    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:  # noqa: N802
        ctx = self._primary[self._ordinal(dev)]
        self._retained.add(ctx)
        return self._ok(ctx)

    @_driver_call
    def cuCtxGetCurrent(self) -> tuple:  # noqa: N802
        return self._ok(getattr(self._thread, "ctx", CUcontext(0)))

    @_driver_call
    def cuCtxSetCurrent(self, ctx: object) -> tuple:  # noqa: N802
        """Bind ``ctx`` to the calling thread (None or 0: unbind)."""
        if ctx is None or int(ctx) == 0:  # type: ignore[call-overload]
            self._thread.ctx = CUcontext(0)
            return self._ok()
        _check(int(ctx) in self._retained, CUresult.CUDA_ERROR_INVALID_CONTEXT)  # type: ignore
        self._thread.ctx = CUcontext(int(ctx))  # type: ignore[call-overload]
        return self._ok()

    def _current_device(self) -> int:
        """The device of the calling thread's context, else CUDA_ERROR_INVALID_CONTEXT."""
        ctx = int(getattr(self._thread, "ctx", 0))
        _check(ctx != 0, CUresult.CUDA_ERROR_INVALID_CONTEXT)
        return next(d for d, c in self._primary.items() if c == ctx)

    # -- allocations ---------------------------------------------------------------------------
    def _check_prop(self, prop: SimpleNamespace) -> None:
        """Pinned device memory on an existing device, no shareable handle types."""
        _check(prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED)
        _check(prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE)
        _check(prop.requestedHandleTypes == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE)
        self._ordinal(prop.location.id)

    @_driver_call
    def cuMemGetAllocationGranularity(self, prop: SimpleNamespace,  # noqa: N802
                                      option: int) -> tuple:
        self._check_prop(prop)
        _check(option in tuple(CUmemAllocationGranularity_flags))
        return self._ok(self.granularity)

    @_driver_call
    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple:  # noqa: N802
        _check(size > 0 and size % HOST_PAGE == 0 and int(addr) % HOST_PAGE == 0 and flags == 0)
        _check(align >= 0 and align & (align - 1) == 0)  # 0 (default) or a power of two
        align = max(int(align), self.granularity)
        raw = _libc.mmap(None, size + align, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        _check(raw not in (None, _MAP_FAILED), CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        base = -(-raw // align) * align  # aligned like the driver's reservations
        if base > raw:
            _libc.munmap(raw, base - raw)
        _libc.munmap(base + size, raw + align - base)
        self.reservations[base] = size
        self._log("cuMemAddressReserve")
        return self._ok(CUdeviceptr(base))

    @_driver_call
    def cuMemAddressFree(self, ptr: int, size: int) -> tuple:  # noqa: N802
        base = int(ptr)
        _check(self.reservations.get(base) == size)
        _check(not any(base <= va < base + size for va in self.maps))  # UB: refused
        del self.reservations[base]
        _libc.munmap(base, size)
        return self._ok()

    @_driver_call
    def cuMemCreate(self, size: int, prop: SimpleNamespace, flags: int) -> tuple:  # noqa: N802
        self._check_prop(prop)
        _check(flags == 0 and size > 0 and size % self.granularity == 0)
        _check(size <= self.memory_left, CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        self.memory_left -= size
        free = self._free_offsets.get(size)
        if free:
            offset = free.pop()
        else:
            offset, self._file_end = self._file_end, self._file_end + size
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = (size, offset)
        self._log("cuMemCreate")
        return self._ok(handle)

    @_driver_call
    def cuMemRelease(self, handle: int) -> tuple:  # noqa: N802
        """Release ``handle``; its memory is freed once no mapping of it remains."""
        _check(handle in self.handles)  # UB for a handle that is not valid: refused
        self.released[handle] = self.handles.pop(handle)
        self._free_if_unused(handle)
        self._log("cuMemRelease")
        return self._ok()

    def _free_if_unused(self, handle: int) -> None:
        if handle in self.released and all(h != handle for _, h in self.maps.values()):
            size, offset = self.released.pop(handle)
            _libc.fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, size)
            self._free_offsets.setdefault(size, []).append(offset)
            self.memory_left += size

    # -- mappings ------------------------------------------------------------------------------
    def _reserved(self, va: int, size: int) -> bool:
        return any(b <= va and va + size <= b + s for b, s in self.reservations.items())

    def _mapping_at(self, addr: int) -> int | None:
        """The base of the mapping covering ``addr`` (None: nothing mapped there)."""
        for m, (s, _) in self.maps.items():
            if m <= addr < m + s:
                return m
        return None

    @_driver_call
    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple:  # noqa: N802
        va = int(ptr)
        _check(offset == 0 and flags == 0)  # "currently must be zero" / "must be zero now"
        _check(handle in self.handles and va % self.granularity == 0 and size > 0
               and size % self.granularity == 0 and size <= self.handles[handle][0]
               and self._reserved(va, size))
        _check(all(self._mapping_at(g) is None
                   for g in range(va, va + size, self.granularity)))
        file_offset = self.handles[handle][1]
        _check(_libc.mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, self._fd,
                          file_offset) == va, CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        self.maps[va] = (size, handle)
        self.access.update(dict.fromkeys(range(va, va + size, self.granularity),
                                         CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE))
        self._log("cuMemMap")
        return self._ok()

    @_driver_call
    def cuMemSetAccess(self, ptr: int, size: int, descs: list, count: int) -> tuple:  # noqa: N802
        va = int(ptr)
        _check(1 <= count <= len(descs) and size > 0)
        flags_of: dict[int, CUmemAccess_flags] = {}
        for desc in descs[:count]:
            _check(desc.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE)
            _check(desc.flags in _PROTECTION)
            flags_of[self._ordinal(desc.location.id)] = CUmemAccess_flags(desc.flags)
        bases = {self._mapping_at(g) for g in range(va, va + size, self.granularity)}
        _check(None not in bases)  # fully mapped ...
        _check(all(va <= m and m + self.maps[m][0] <= va + size for m in bases))  # whole maps
        if 0 in flags_of:  # the simulated memory is device 0's
            if _libc.mprotect(va, size, _PROTECTION[flags_of[0]]) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mprotect of a mapped range failed: {os.strerror(err)}")
            self.access.update(dict.fromkeys(range(va, va + size, self.granularity),
                                             flags_of[0]))
        self._log("cuMemSetAccess")
        return self._ok()

    @_driver_call
    def cuMemUnmap(self, ptr: int, size: int) -> tuple:  # noqa: N802
        va = int(ptr)
        _check(self.maps.get(va, (None,))[0] == size)  # a sub-range (or nothing mapped)
        _, handle = self.maps.pop(va)
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        _libc.mmap(va, size, PROT_NONE, flags, -1, 0)  # back to reserved, inaccessible
        for g in range(va, va + size, self.granularity):
            del self.access[g]
        self._free_if_unused(handle)
        self._log("cuMemUnmap")
        return self._ok()

    @_driver_call
    def cuPointerGetAttribute(self, attribute: object, ptr: int) -> tuple:  # noqa: N802
        """Addresses inside a reservation answer only where the device may read a mapped
        page; an address outside every reservation stands for an ordinary device allocation
        (cudaMalloc), which the real driver knows. Needs a current context."""
        _check(attribute == CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER)
        self._current_device()
        p = int(ptr)
        if any(b <= p < b + s for b, s in self.reservations.items()):
            granule = p - p % self.granularity
            _check(self._mapping_at(p) is not None and granule in self.accessible)
        return self._ok(CUdeviceptr(p))


class SimulatedCudaBackend(CudaMemoryBackend):
    """The real CUDA backend over :class:`FakeDriver`, with torch's side simulated: a wrap
    makes the device's primary context current in the calling thread if none is (what the CUDA
    runtime does on a thread's first call), asks the driver about the base pointer (torch's
    ``cudaPointerGetAttributes`` refuses unmapped VA) and returns a CPU tensor at the very
    address, over the fake's real host memory."""

    def __init__(self, page_size: int | None = None, max_pages: int = 64, *,
                 driver: FakeDriver | None = None) -> None:
        super().__init__(page_size, max_pages, 0, driver=driver or FakeDriver())

    def _wrap(self, base: int, nbytes: int) -> torch.Tensor:
        self._ensure_context()  # the runtime's lazy binding of the primary context
        attr = self.cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        if self.cu.cuPointerGetAttribute(attr, base)[0] != CUresult.CUDA_SUCCESS:
            raise RuntimeError("CUDA error: invalid argument (cudaPointerGetAttributes)")
        buf = (ctypes.c_uint8 * nbytes).from_address(base)
        return torch.frombuffer(buf, dtype=torch.uint8)  # aliases the VA; touches nothing

    def synchronize(self) -> None:  # the "device" is the CPU: nothing runs asynchronously
        self.cu.calls.append("synchronize")


def triton_pointer_guard(driver: FakeDriver) -> Callable[[int, torch.Tensor], None]:
    """What Triton's launcher does for every tensor argument (``extractPointer`` in
    ``third_party/nvidia/backend/driver.c``): query the driver, refuse the launch with its
    exact message when the pointer is not device-accessible, and raise any other driver error
    (no current context, for one)."""

    def check(index: int, tensor: torch.Tensor) -> None:
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        result = driver.cuPointerGetAttribute(attr, tensor.data_ptr())[0]
        if result == CUresult.CUDA_ERROR_INVALID_VALUE:
            raise ValueError(f"Pointer argument (at {index}) cannot be accessed from Triton "
                             "(cpu tensor?)")
        if result != CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"Triton Error [CUDA]: {result.name}")

    return check
