"""A stand-in for ``cuda.bindings.driver`` that enforces the VMM rules (tests only).

The development and CI machines have no GPU driver, so the CUDA backend's call pattern is
checked against this fake, which models the driver's documented rules:
  * sizes and offsets are multiples of the granularity;
  * ``cuMemMap`` only onto reserved, unmapped addresses;
  * ``cuMemSetAccess`` only over fully mapped ranges;
  * ``cuMemUnmap`` exactly the range of one earlier ``cuMemMap`` (no sub-ranges);
  * ``cuMemRelease`` only of handles mapped nowhere; ``cuMemAddressFree`` of empty ranges;
  * ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, p)`` fails with
    ``CUDA_ERROR_INVALID_VALUE`` when nothing is mapped at ``p`` inside a reservation (the query
    Triton's launcher makes for every pointer argument, see :func:`triton_pointer_guard`).
A violation returns ``CUDA_ERROR_INVALID_VALUE`` like the driver does.

The memory is real: reservations are host ``PROT_NONE`` ranges, a handle is a stretch of one
memfd, ``cuMemMap`` maps it (still inaccessible) and ``cuMemSetAccess`` makes it read/write, so
:class:`SimulatedCudaBackend` hands out (CPU) tensors at the very addresses the driver manages:
data written through one mapping is seen through another, and touching unmapped VA faults
(SIGSEGV) as a GPU kernel would (illegal address). Real behaviour on a GPU is proven by the
``gpu`` tests and ``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import ctypes
import enum
import os
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


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUpointer_attribute(enum.IntEnum):  # noqa: N801
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 6


class CUdeviceptr(int):
    pass


def CUmemAllocationProp() -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))


def CUmemAccessDesc() -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None)


class FakeDriver:
    """Module-like fake: attribute access mirrors ``cuda.bindings.driver``."""

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUpointer_attribute = CUpointer_attribute
    CUdeviceptr = CUdeviceptr
    CUmemAllocationProp = staticmethod(CUmemAllocationProp)
    CUmemAccessDesc = staticmethod(CUmemAccessDesc)

    def __init__(self, granularity: int = 2 << 20, memory_bytes: int = 1 << 34) -> None:
        self.granularity = granularity
        self.memory_left = memory_bytes
        self.reservations: dict[int, int] = {}  # base -> size
        self.handles: dict[int, tuple[int, int]] = {}  # handle -> (size, memfd offset)
        self.maps: dict[int, tuple[int, int]] = {}  # va -> (size, handle)
        self.accessible: set[int] = set()  # granule addresses with access set
        self.calls: list[str] = []
        self._next_handle = 1
        self._fd = os.memfd_create("fake-cuda-device-memory", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, memory_bytes)  # sparse: device memory costs nothing untouched
        self._free_offsets: dict[int, list[int]] = {}  # size -> released memfd offsets
        self._file_end = 0
        self.ctx = 0

    def _ok(self, *values: object) -> tuple:
        return (CUresult.CUDA_SUCCESS, *values)

    def _bad(self) -> tuple:
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    def _log(self, name: str) -> None:
        self.calls.append(name)

    def cuInit(self, flags: int) -> tuple:  # noqa: N802
        self._log("cuInit")
        return self._ok()

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        return self._ok(ordinal)

    def cuCtxGetCurrent(self) -> tuple:  # noqa: N802
        return self._ok(self.ctx)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:  # noqa: N802
        return self._ok(77)

    def cuCtxSetCurrent(self, ctx: int) -> tuple:  # noqa: N802
        self.ctx = ctx
        return self._ok()

    def cuMemGetAllocationGranularity(self, prop: object, flags: object) -> tuple:  # noqa: N802
        return self._ok(self.granularity)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple:  # noqa: N802
        if size % self.granularity:
            return self._bad()
        align = max(int(align), self.granularity)
        raw = _libc.mmap(None, size + align, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if raw in (None, _MAP_FAILED):
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        base = -(-raw // align) * align  # aligned like the driver's reservations
        if base > raw:
            _libc.munmap(raw, base - raw)
        _libc.munmap(base + size, raw + align - base)
        self.reservations[base] = size
        self._log("cuMemAddressReserve")
        return self._ok(CUdeviceptr(base))

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple:  # noqa: N802
        base = int(ptr)
        if self.reservations.get(base) != size:
            return self._bad()
        if any(base <= va < base + size for va in self.maps):
            return self._bad()
        del self.reservations[base]
        _libc.munmap(base, size)
        return self._ok()

    def cuMemCreate(self, size: int, prop: object, flags: int) -> tuple:  # noqa: N802
        if size % self.granularity:
            return self._bad()
        if size > self.memory_left:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
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

    def cuMemRelease(self, handle: int) -> tuple:  # noqa: N802
        if handle not in self.handles or any(h == handle for _, h in self.maps.values()):
            return self._bad()
        size, offset = self.handles.pop(handle)
        _libc.fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, size)
        self._free_offsets.setdefault(size, []).append(offset)
        self.memory_left += size
        self._log("cuMemRelease")
        return self._ok()

    def _reserved(self, va: int, size: int) -> bool:
        return any(b <= va and va + size <= b + s for b, s in self.reservations.items())

    def _mapping_at(self, addr: int) -> int | None:
        """The base of the mapping covering ``addr`` (None: nothing mapped there)."""
        for m, (s, _) in self.maps.items():
            if m <= addr < m + s:
                return m
        return None

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple:  # noqa: N802
        va = int(ptr)
        if (va % self.granularity or size % self.granularity or handle not in self.handles
                or offset + size > self.handles[handle][0] or not self._reserved(va, size)):
            return self._bad()
        for g in range(va, va + size, self.granularity):
            if self._mapping_at(g) is not None:
                return self._bad()
        file_offset = self.handles[handle][1] + offset
        if _libc.mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, self._fd, file_offset) != va:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        self.maps[va] = (size, handle)
        self._log("cuMemMap")
        return self._ok()

    def cuMemSetAccess(self, ptr: int, size: int, descs: list, count: int) -> tuple:  # noqa: N802
        va = int(ptr)
        for g in range(va, va + size, self.granularity):
            if self._mapping_at(g) is None:
                return self._bad()
        _libc.mprotect(va, size, PROT_READ | PROT_WRITE)
        self.accessible.update(range(va, va + size, self.granularity))
        self._log("cuMemSetAccess")
        return self._ok()

    def cuMemUnmap(self, ptr: int, size: int) -> tuple:  # noqa: N802
        va = int(ptr)
        if self.maps.get(va, (None,))[0] != size:
            return self._bad()  # a sub-range (or an unmapped range): the driver refuses
        del self.maps[va]
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        _libc.mmap(va, size, PROT_NONE, flags, -1, 0)  # back to reserved, inaccessible
        self.accessible.difference_update(range(va, va + size, self.granularity))
        self._log("cuMemUnmap")
        return self._ok()

    def cuPointerGetAttribute(self, attribute: object, ptr: int) -> tuple:  # noqa: N802
        """Addresses inside a reservation answer only where a page is mapped; an address
        outside every reservation stands for an ordinary device allocation (cudaMalloc),
        which the real driver knows."""
        p = int(ptr)
        inside = any(b <= p < b + s for b, s in self.reservations.items())
        if inside and self._mapping_at(p) is None:
            return self._bad()
        return self._ok(CUdeviceptr(p))


class SimulatedCudaBackend(CudaMemoryBackend):
    """The real CUDA backend over :class:`FakeDriver`, with torch's side simulated: a wrap asks
    the driver about the base pointer (torch's ``cudaPointerGetAttributes`` refuses unmapped VA)
    and returns a CPU tensor at the very address, over the fake's real host memory."""

    def __init__(self, page_size: int | None = None, max_pages: int = 64, *,
                 driver: FakeDriver | None = None) -> None:
        super().__init__(page_size, max_pages, 0, driver=driver or FakeDriver())

    def _wrap(self, base: int, nbytes: int) -> torch.Tensor:
        attr = self.cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        if self.cu.cuPointerGetAttribute(attr, base)[0] != CUresult.CUDA_SUCCESS:
            raise RuntimeError("CUDA error: invalid argument (cudaPointerGetAttributes)")
        buf = (ctypes.c_uint8 * nbytes).from_address(base)
        return torch.frombuffer(buf, dtype=torch.uint8)  # aliases the VA; touches nothing

    def synchronize(self) -> None:  # the "device" is the CPU: nothing runs asynchronously
        self.cu.calls.append("synchronize")


def triton_pointer_guard(driver: FakeDriver) -> Callable[[int, torch.Tensor], None]:
    """What Triton's launcher does for every tensor argument (``extractPointer`` in
    ``third_party/nvidia/backend/driver.c``): query the driver and refuse the launch with its
    exact message when the pointer is not device-accessible."""

    def check(index: int, tensor: torch.Tensor) -> None:
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        if driver.cuPointerGetAttribute(attr, tensor.data_ptr())[0] == (
                CUresult.CUDA_ERROR_INVALID_VALUE):
            raise ValueError(f"Pointer argument (at {index}) cannot be accessed from Triton "
                             "(cpu tensor?)")

    return check
