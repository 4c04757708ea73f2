"""Host backend: the CUDA VMM calls' real Linux analogue (ctypes on libc, no copies).

    cuMemAddressReserve  ->  mmap(NULL, n, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)
    cuMemCreate          ->  fallocate(memfd, 0, page_off, page)         (commits the memory)
    cuMemMap+SetAccess   ->  mmap(va, n, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, memfd, off)
    cuMemUnmap           ->  mmap(va, n, PROT_NONE, MAP_PRIVATE|MAP_ANON|MAP_NORESERVE|MAP_FIXED)
                             (an atomic replace: nothing else can land in the hole)
    cuMemRelease         ->  fallocate(memfd, PUNCH_HOLE|KEEP_SIZE, page_off, page)
    cuMemAddressFree     ->  munmap(va, n)
    (anchor page)        ->  the page after the pool's last one in the same memfd
    (populate a mapping) ->  madvise(va, n, MADV_POPULATE_WRITE)     (page-table entries now)

The physical pool is one memfd of ``max_pages * page_size`` bytes (sparse until pages are
created), so page ``i`` lives at file offset ``i * page_size`` and a run of adjacent page ids maps
with one call into one VMA. Touching an address that is reserved but not mapped raises SIGSEGV
and kills the process: that is the point (tests prove it in a child process).
"""

from __future__ import annotations

import ctypes
import errno
import mmap as _mmap
import os
import time

import torch

from vmkv.memory.base import MemoryBackend
from vmkv.memory.errors import VmmError
from vmkv.memory.faults import os_failure

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_POPULATE = 0x8000
MADV_POPULATE_WRITE = 23  # Linux 5.14+
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
OS_PAGE = _mmap.PAGESIZE

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _os_error(call: str) -> VmmError:
    return os_failure(call, ctypes.get_errno())


def max_map_count() -> int:
    """The kernel's per-process VMA limit (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530


def current_vma_count() -> int:
    """VMAs this process holds now (lines of ``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


class HostMemoryBackend(MemoryBackend):
    """Pages of ``page_size`` bytes in one memfd, mapped under PROT_NONE reservations."""

    name = "host"

    def __init__(self, page_size: int, max_pages: int) -> None:
        super().__init__()
        if page_size <= 0 or page_size % OS_PAGE:
            raise ValueError(
                f"page_size must be a positive multiple of the OS page ({OS_PAGE} B), "
                f"got {page_size}"
            )
        if max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {max_pages}")
        self.page_size = page_size
        self.max_pages = max_pages
        self.device = torch.device("cpu")
        self._fd = os.memfd_create("vmkv-kv-pool", os.MFD_CLOEXEC)
        # pages 0 .. max_pages-1, then the anchor page; sparse: costs nothing until touched
        os.ftruncate(self._fd, page_size * (max_pages + 1))

    # -- virtual address space -------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        self._check_multiple(nbytes, "reservation size")
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        base = _libc.mmap(None, nbytes, PROT_NONE, flags, -1, 0)
        if base == _MAP_FAILED or base is None:
            raise _os_error(f"mmap(reserve {nbytes} B)")
        return int(base)

    def free_reservation(self, base: int, nbytes: int) -> None:
        if _libc.munmap(base, nbytes) != 0:
            raise _os_error("munmap")

    # -- physical pages ----------------------------------------------------------------------
    def create_page(self, page_id: int) -> None:
        call = f"fallocate(create page {page_id})"
        self.faults.check("create", call)
        with self.stats.timed("create", 1):
            if _libc.fallocate(self._fd, 0, page_id * self.page_size, self.page_size) != 0:
                raise _os_error(call)

    def create_pages(self, first: int, num: int) -> None:
        if num == 1:
            self.create_page(first)
            return
        call = f"fallocate(create pages {first}..{first + num - 1})"
        self.faults.check("create", call)
        offset, n = first * self.page_size, num * self.page_size
        with self.stats.timed("create", num):
            if _libc.fallocate(self._fd, 0, offset, n) != 0:
                error = _os_error(call)  # all or none: drop whatever part did land
                _libc.fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, n)
                raise error

    def touch_pages(self, first: int, num: int) -> None:
        """Fault the pages in through one temporary ``MAP_POPULATE`` mapping: the kernel zeroes
        and backs each (in a VM, the host backs the guest's page too) in one call, instead of
        in a fault on the first write to each 4 KiB page while a step runs."""
        offset, n = first * self.page_size, num * self.page_size
        with self.stats.timed("touch", num):
            va = _libc.mmap(None, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                            self._fd, offset)
            if va == _MAP_FAILED or va is None:
                raise _os_error(f"mmap(touch pages {first}..{first + num - 1})")
            if _libc.munmap(va, n) != 0:
                raise _os_error("munmap(touched pages)")

    def populate(self, va: int, nbytes: int) -> None:
        """One ``madvise(MADV_POPULATE_WRITE)``: the kernel faults the range's page-table
        entries in, writable, in one call (Linux 5.14+; older kernels: one read and rewrite of
        a byte per OS page does it)."""
        with self.stats.timed("populate", nbytes // self.page_size):
            if _libc.madvise(va, nbytes, MADV_POPULATE_WRITE) == 0:
                return
            if ctypes.get_errno() != errno.EINVAL:
                raise _os_error(f"madvise(populate {nbytes} B at {va:#x})")
            firsts = self.as_tensor(va, nbytes)[::OS_PAGE]  # one byte per OS page
            firsts.copy_(firsts.clone())

    def release_page(self, page_id: int) -> None:
        self.release_pages(page_id, 1)

    def release_pages(self, first: int, num: int) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        call = f"fallocate(punch pages {first}..{first + num - 1})"
        self.faults.check("release", call)
        with self.stats.timed("release", num):
            if _libc.fallocate(self._fd, mode, first * self.page_size,
                               num * self.page_size) != 0:
                raise _os_error(call)

    def file_bytes(self) -> int:
        """Bytes the pool file really holds (``st_blocks``; RSS would miscount shared pages)."""
        return os.fstat(self._fd).st_blocks * 512

    def allocated_bytes(self) -> int:
        return self.file_bytes()

    # -- mapping -----------------------------------------------------------------------------
    def map_run(self, va: int, first_page: int, num_pages: int) -> None:
        # the hot path of every growth (one call per region): timed inline, and the message
        # is formatted only when needed
        if self.faults.armed:
            self.faults.check("map", f"mmap(map {num_pages} pages at {va:#x})")
        start = time.perf_counter_ns()
        got = _libc.mmap(va, num_pages * self.page_size, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_FIXED, self._fd, first_page * self.page_size)
        if got != va:
            raise _os_error(f"mmap(map {num_pages} pages at {va:#x})")
        self.stats.ops["map"].record(num_pages, time.perf_counter_ns() - start)

    def map_anchor(self, va: int, num_pages: int) -> None:
        ps, anchor = self.page_size, self.max_pages * self.page_size
        for i in range(num_pages):  # the same file page at each address: one VMA each
            if _libc.mmap(va + i * ps, ps, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                          self._fd, anchor) != va + i * ps:
                raise _os_error(f"mmap(anchor at {va + i * ps:#x})")

    def unmap_run(self, va: int, num_pages: int) -> None:
        start = time.perf_counter_ns()
        if _libc.mmap(va, num_pages * self.page_size, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != va:
            raise _os_error(f"mmap(unmap {num_pages} pages at {va:#x})")
        self.stats.ops["unmap"].record(num_pages, time.perf_counter_ns() - start)

    # -- access ------------------------------------------------------------------------------
    def as_tensor(self, base: int, nbytes: int) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(base)
        return torch.frombuffer(buf, dtype=torch.uint8)  # aliases the VA; touches nothing

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_multiple(self, nbytes: int, what: str) -> None:
        if nbytes <= 0 or nbytes % self.page_size:
            raise ValueError(f"{what} must be a positive multiple of page_size "
                             f"({self.page_size} B), got {nbytes}")
