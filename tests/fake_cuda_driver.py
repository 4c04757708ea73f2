"""A stand-in for ``cuda.bindings.driver`` that enforces the VMM rules (tests only).

The development and CI machines have no GPU driver, so the CUDA backend's call pattern is
checked against this fake, which models the driver's documented rules:
  * sizes and offsets are multiples of the granularity;
  * ``cuMemMap`` only onto reserved, unmapped addresses;
  * ``cuMemSetAccess`` only over fully mapped ranges;
  * ``cuMemUnmap`` exactly the range of one earlier ``cuMemMap`` (no sub-ranges);
  * ``cuMemRelease`` only of handles mapped nowhere; ``cuMemAddressFree`` of empty ranges.
A violation returns ``CUDA_ERROR_INVALID_VALUE`` like the driver does. Real behaviour on a GPU
is proven by the ``gpu`` tests and ``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace


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
    CUdeviceptr = CUdeviceptr
    CUmemAllocationProp = staticmethod(CUmemAllocationProp)
    CUmemAccessDesc = staticmethod(CUmemAccessDesc)

    def __init__(self, granularity: int = 2 << 20, memory_bytes: int = 1 << 34) -> None:
        self.granularity = granularity
        self.memory_left = memory_bytes
        self.next_va = 1 << 40
        self.reservations: dict[int, int] = {}  # base -> size
        self.handles: dict[int, int] = {}  # handle -> size
        self.maps: dict[int, tuple[int, int]] = {}  # va -> (size, handle)
        self.accessible: set[int] = set()  # granule addresses with access set
        self.calls: list[str] = []
        self._next_handle = 1
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
        base = self.next_va
        self.next_va += size + self.granularity
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
        return self._ok()

    def cuMemCreate(self, size: int, prop: object, flags: int) -> tuple:  # noqa: N802
        if size % self.granularity:
            return self._bad()
        if size > self.memory_left:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        self.memory_left -= size
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = size
        self._log("cuMemCreate")
        return self._ok(handle)

    def cuMemRelease(self, handle: int) -> tuple:  # noqa: N802
        if handle not in self.handles or any(h == handle for _, h in self.maps.values()):
            return self._bad()
        self.memory_left += self.handles.pop(handle)
        self._log("cuMemRelease")
        return self._ok()

    def _reserved(self, va: int, size: int) -> bool:
        return any(b <= va and va + size <= b + s for b, s in self.reservations.items())

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple:  # noqa: N802
        va = int(ptr)
        if (va % self.granularity or size % self.granularity or handle not in self.handles
                or offset + size > self.handles[handle] or not self._reserved(va, size)):
            return self._bad()
        for g in range(va, va + size, self.granularity):
            if any(m <= g < m + s for m, (s, _) in self.maps.items()):
                return self._bad()
        self.maps[va] = (size, handle)
        self._log("cuMemMap")
        return self._ok()

    def cuMemSetAccess(self, ptr: int, size: int, descs: list, count: int) -> tuple:  # noqa: N802
        va = int(ptr)
        for g in range(va, va + size, self.granularity):
            if not any(m <= g < m + s for m, (s, _) in self.maps.items()):
                return self._bad()
        self.accessible.update(range(va, va + size, self.granularity))
        self._log("cuMemSetAccess")
        return self._ok()

    def cuMemUnmap(self, ptr: int, size: int) -> tuple:  # noqa: N802
        va = int(ptr)
        if self.maps.get(va, (None,))[0] != size:
            return self._bad()  # a sub-range (or an unmapped range): the driver refuses
        del self.maps[va]
        self.accessible.difference_update(range(va, va + size, self.granularity))
        self._log("cuMemUnmap")
        return self._ok()
