"""CUDA backend: driver VMM through cuda-bindings, wrapped as torch CUDA tensors without copies.

    reserve   cuMemAddressReserve(size, alignment=page, addr=0, flags=0)
    create    cuMemCreate(page, prop{PINNED, DEVICE dev})          (one handle per page)
    map       cuMemMap(va + i*page, page, 0, handle[i], 0) per page, then one
              cuMemSetAccess(va, run, [READWRITE on dev]) over the whole run
    unmap     cuMemUnmap(va + i*page, page) per page (a sub-range of one map call cannot be
              unmapped, so every page is its own map call)
    release   cuMemRelease(handle)
    free      cuMemAddressFree(base, size)
    anchor    one extra handle (cuMemCreate on first use) mapped under regions' first pages

Map, set-access and unmap are synchronous host calls, not stream-ordered: the caller must map
before launching kernels that read the pages and call :meth:`synchronize` before unmapping.
Every driver error becomes :class:`~vmkv.memory.base.VmmError` carrying the ``CUresult`` name;
nothing here calls ``exit``. The module imports without a driver; constructing the backend
without one raises :class:`~vmkv.memory.base.BackendUnavailable` ("CUDA VMM unavailable: ...").
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from vmkv.memory.base import MemoryBackend
from vmkv.memory.errors import BackendUnavailable, VmmError


def _load_driver() -> ModuleType:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailable(
            "CUDA VMM unavailable: cuda-bindings is not installed (pip install 'vmkv[cuda]')"
        ) from exc
    return driver


class _DevicePointer:
    """A CUDA Array Interface view of raw device bytes (no bf16 typestr exists: bytes + view)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class CudaMemoryBackend(MemoryBackend):
    """Pages of ``page_size`` bytes (a multiple of the driver granularity) on one CUDA device."""

    name = "cuda"

    def __init__(
        self,
        page_size: int | None,
        max_pages: int,
        device: int | str | torch.device = 0,
        *,
        driver: ModuleType | None = None,
    ) -> None:
        """Args:
        page_size: bytes per page; None means the driver's minimum granularity (2 MiB on
            Hopper). Must be a multiple of that granularity.
        max_pages: the most pages this backend may create.
        device: CUDA device ordinal or torch device.
        driver: the ``cuda.bindings.driver`` module; tests without a GPU pass a fake one.
        """
        super().__init__()
        self.cu = driver if driver is not None else _load_driver()
        self.device = torch.device("cuda", _ordinal(device))
        try:
            self._call("cuInit", 0)  # no libcuda: cuda.pathfinder raises a RuntimeError subclass
        except RuntimeError as exc:
            raise BackendUnavailable(f"CUDA VMM unavailable: {exc}") from exc
        self._torch_owned = driver is None  # a fake driver (tests) has no torch context
        if self._torch_owned:
            _init_torch_context(self.device)
        self._dev = self._call("cuDeviceGet", self.device.index)
        self._ensure_context()
        self._prop = self._allocation_prop()
        self.granularity = int(
            self._call(
                "cuMemGetAllocationGranularity",
                self._prop,
                self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        )
        page_size = self.granularity if page_size is None else page_size
        if page_size <= 0 or page_size % self.granularity:
            raise ValueError(
                f"page_size must be a positive multiple of the CUDA allocation granularity "
                f"({self.granularity} B), got {page_size}"
            )
        if max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {max_pages}")
        self.page_size = page_size
        self.max_pages = max_pages
        self._access = self._access_desc()
        self._handles: list[Any] = [None] * max_pages
        self._anchor: Any = None  # the anchor page's handle (see map_anchor)

    # -- driver plumbing ----------------------------------------------------------------------
    def _call(self, fn: str, *args: Any) -> Any:
        result = getattr(self.cu, fn)(*args)
        err = result[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = getattr(err, "name", str(err))
            raise VmmError(f"{fn} failed: {name}")
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def _ensure_context(self) -> None:
        """Make the device's primary context current in the calling thread (mapper threads)."""
        ctx = self._call("cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            primary = self._call("cuDevicePrimaryCtxRetain", self._dev)
            self._call("cuCtxSetCurrent", primary)

    def _allocation_prop(self) -> Any:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        return prop

    def _access_desc(self) -> Any:
        cu = self.cu
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = self.device.index
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return acc

    def _ptr(self, va: int) -> Any:
        return self.cu.CUdeviceptr(va)

    # -- virtual address space -------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes % self.page_size:
            raise ValueError(f"reservation size must be a positive multiple of page_size "
                             f"({self.page_size} B), got {nbytes}")
        self._ensure_context()
        return int(self._call("cuMemAddressReserve", nbytes, self.page_size, self._ptr(0), 0))

    def free_reservation(self, base: int, nbytes: int) -> None:
        self._call("cuMemAddressFree", self._ptr(base), nbytes)

    # -- physical pages ----------------------------------------------------------------------
    def create_page(self, page_id: int) -> None:
        self._ensure_context()
        self.faults.check("create", "cuMemCreate", cuda=True)
        with self.stats.timed("create", 1):
            self._handles[page_id] = self._call("cuMemCreate", self.page_size, self._prop, 0)

    def release_page(self, page_id: int) -> None:
        handle = self._handles[page_id]
        if handle is None:
            raise ValueError(f"release of page {page_id} which was never created")
        self.faults.check("release", "cuMemRelease", cuda=True)
        with self.stats.timed("release", 1):
            self._call("cuMemRelease", handle)
        self._handles[page_id] = None

    def allocated_bytes(self) -> int:
        handles = sum(h is not None for h in self._handles) + (self._anchor is not None)
        return handles * self.page_size

    # -- mapping -----------------------------------------------------------------------------
    def map_run(self, va: int, first_page: int, num_pages: int) -> None:
        self.faults.check("map", "cuMemMap", cuda=True)
        with self.stats.timed("map", num_pages):
            self._map_handles(va, self._handles[first_page : first_page + num_pages])

    def map_anchor(self, va: int, num_pages: int) -> None:
        self._ensure_context()
        if self._anchor is None:
            self._anchor = self._call("cuMemCreate", self.page_size, self._prop, 0)
        self._map_handles(va, [self._anchor] * num_pages)  # one handle at many addresses

    def _map_handles(self, va: int, handles: list[Any]) -> None:
        """cuMemMap each handle at its page from ``va``, then one cuMemSetAccess over all."""
        ps = self.page_size
        self._ensure_context()
        mapped = 0
        try:
            for i, handle in enumerate(handles):
                self._call("cuMemMap", self._ptr(va + i * ps), ps, 0, handle, 0)
                mapped += 1
            self._call("cuMemSetAccess", self._ptr(va), len(handles) * ps, [self._access], 1)
        except BaseException:
            for i in range(mapped):  # leave no half-mapped run behind
                self.cu.cuMemUnmap(self._ptr(va + i * ps), ps)
            raise

    def unmap_run(self, va: int, num_pages: int) -> None:
        ps = self.page_size
        self._ensure_context()
        with self.stats.timed("unmap", num_pages):
            for i in range(num_pages):
                self._call("cuMemUnmap", self._ptr(va + i * ps), ps)

    # -- access ------------------------------------------------------------------------------
    def as_tensor(self, base: int, nbytes: int) -> torch.Tensor:
        """Wrap ``[base, base+nbytes)`` (``base`` page-aligned) as a CUDA ``uint8`` tensor.

        torch asks the driver which device owns ``base`` (``cudaPointerGetAttributes``), and
        an address with nothing mapped belongs to no device: the query fails. So when the
        plain wrap fails, a scratch page is mapped at ``base`` just for the wrap (create, map,
        set access, wrap, unmap, release). The region's mapping table never sees it and no
        kernel can run meanwhile (nothing reads a range before its pages are mapped).
        """
        try:
            return self._wrap(base, nbytes)
        except RuntimeError as first:
            if base % self.page_size:
                raise
            try:
                anchor = self._call("cuMemCreate", self.page_size, self._prop, 0)
            except VmmError:
                raise first from None
            try:
                self._call("cuMemMap", self._ptr(base), self.page_size, 0, anchor, 0)
                try:
                    self._call("cuMemSetAccess", self._ptr(base), self.page_size,
                               [self._access], 1)
                    return self._wrap(base, nbytes)
                finally:
                    self._call("cuMemUnmap", self._ptr(base), self.page_size)
            finally:
                self._call("cuMemRelease", anchor)

    def _wrap(self, base: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_DevicePointer(base, nbytes), device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def bind_thread(self) -> None:
        """Make the device's primary context current in this thread (torch's runtime calls
        and these driver calls then share it; pitfall 6 of reference/gpu.md)."""
        if self._torch_owned:
            torch.cuda.set_device(self.device)
        self._ensure_context()

    def close(self) -> None:
        for page_id, handle in enumerate(self._handles):
            if handle is not None:
                self.release_page(page_id)
        if self._anchor is not None:
            self._call("cuMemRelease", self._anchor)
            self._anchor = None


def _ordinal(device: int | str | torch.device) -> int:
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"CudaMemoryBackend needs a CUDA device, got {dev}")
    return dev.index or 0


def _init_torch_context(device: torch.device) -> None:
    """Create torch's primary context first, so driver calls and torch kernels share it."""
    if not torch.cuda.is_available():
        raise BackendUnavailable("CUDA VMM unavailable: torch sees no CUDA device "
                                 f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    torch.cuda.init()
    torch.empty(1, device=device)
