"""The memory backend contract: reserve virtual addresses, create physical pages, map them.

A backend is the thin layer over one operating-system or driver API (Linux mmap + memfd on the
host, CUDA VMM on the GPU). It knows nothing about requests or KV caches; it only does what it is
told and times it. Bookkeeping (which page is mapped where, reference counts) lives above it in
:class:`~vmkv.memory.pool.PagePool` and :class:`~vmkv.memory.region.VirtualRegion`, so there is
exactly one source of truth for mappings.

Page ids are dense integers ``0 .. max_pages-1``. Pages ``i`` and ``i+1`` are *physically
adjacent* on backends where that matters (the host pool is one memfd), which is what lets a run
of adjacent pages be mapped with one call and occupy one kernel VMA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

import torch

from vmkv.memory.errors import MemoryStateLost, VmmError
from vmkv.memory.faults import FaultInjector
from vmkv.memory.stats import MemoryStats

T = TypeVar("T")


#: attempts at one rollback step (re-mapping a page that was mapped a moment ago) before
#: giving up with MemoryStateLost
ROLLBACK_TRIES = 3


def rolled_back(step: Callable[[], T]) -> T:
    """Run one rollback step, retrying it when the OS/driver refuses; MemoryStateLost when it
    keeps refusing."""
    for _ in range(ROLLBACK_TRIES):
        try:
            return step()
        except VmmError as exc:
            last = exc
    raise MemoryStateLost(f"a rollback was refused {ROLLBACK_TRIES} times: {last}") from last


def _each_or_none(step: Callable[[int], None], undo: Callable[[int], None], first: int,
                  num: int) -> None:
    """``step`` each page ``first .. first+num-1``; when one fails, ``undo`` the pages already
    stepped (each undo retried, :func:`rolled_back`), then raise the failure."""
    done = 0
    try:
        for page in range(first, first + num):
            step(page)
            done += 1
    except BaseException:
        for page in range(first, first + done):
            rolled_back(lambda page=page: undo(page))
        raise


class MemoryBackend(ABC):
    """Reserve / create / map / unmap / release over one API; all sizes in bytes.

    Invariants callers must keep (the backend does not check them, the layers above do):
      * ``map_run`` only onto reserved addresses that are currently unmapped;
      * ``unmap_run`` exactly the pages mapped earlier (CUDA cannot unmap a sub-range of one
        map call, so runs are mapped page by page there);
      * ``unmap_run`` only after every kernel that may read the range has finished
        (:meth:`synchronize` first on asynchronous devices);
      * ``release_page`` only for pages mapped nowhere.
    """

    #: short name used in logs, stats and the CLI ("host", "cuda")
    name: str
    #: bytes per physical page; every size and offset handed to map/unmap is a multiple of it
    page_size: int
    #: the largest page id + 1 this backend can create
    max_pages: int
    #: torch device the mapped memory belongs to
    device: torch.device

    def __init__(self) -> None:
        self.stats = MemoryStats()
        #: failpoints: disarmed unless a test or an operator arms them (vmkv/memory/faults.py)
        self.faults = FaultInjector()

    # -- virtual address space -------------------------------------------------------------
    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (a multiple of ``page_size``) of inaccessible VA; return its base."""

    @abstractmethod
    def free_reservation(self, base: int, nbytes: int) -> None:
        """Give back a whole reservation; nothing may be mapped in it any more."""

    # -- physical pages ----------------------------------------------------------------------
    @abstractmethod
    def create_page(self, page_id: int) -> None:
        """Commit physical memory for ``page_id`` (CUDA ``cuMemCreate``; host ``fallocate``)."""

    def create_pages(self, first: int, num: int) -> None:
        """Create the uncreated pages ``first .. first+num-1`` (all or none: a failure
        releases the ones this call created, then raises). Backends that can commit a range in
        one call override it (host: one ``fallocate``)."""
        _each_or_none(self.create_page, self.release_page, first, num)

    def touch_pages(self, first: int, num: int) -> None:
        """Make the created pages ``first .. first+num-1`` resident now, so that the first
        write to each costs no page fault that must back it with memory. The default does
        nothing: device memory is resident once created (``cuMemCreate``)."""

    def release_pages(self, first: int, num: int) -> None:
        """Release the idle pages ``first .. first+num-1`` (all or none: a failure re-creates
        the ones this call released, then raises). Backends that can free a range in one call
        override it (host: one punch-hole ``fallocate``)."""
        _each_or_none(self.release_page, self.create_page, first, num)

    def populate(self, va: int, nbytes: int) -> None:
        """Make the page-table entries of the mapped range ``[va, va+nbytes)`` present now, so
        that the first access to it takes no fault; its bytes are left as they are. The default
        does nothing: a device mapping is usable as soon as it is mapped (``cuMemMap`` +
        ``cuMemSetAccess``)."""

    @abstractmethod
    def release_page(self, page_id: int) -> None:
        """Return ``page_id``'s memory to the OS/driver; it must be mapped nowhere."""

    # -- mapping -----------------------------------------------------------------------------
    @abstractmethod
    def map_run(self, va: int, first_page: int, num_pages: int) -> None:
        """Map pages ``first_page .. first_page+num_pages-1`` at ``va`` with read/write access."""

    @abstractmethod
    def unmap_run(self, va: int, num_pages: int) -> None:
        """Make ``num_pages`` pages at ``va`` inaccessible again; the reservation stays."""

    @abstractmethod
    def map_anchor(self, va: int, num_pages: int) -> None:
        """Map the backend's *anchor* page at each of ``num_pages`` pages from ``va``.

        The anchor is one physical page the backend owns (created on first use, outside every
        pool, released by :meth:`close`); it holds nothing anyone reads. A region maps it under
        its first pages so that the region's base address is always mapped: kernel launchers
        (Triton's) refuse a tensor argument whose base address has nothing mapped. Unmap it with
        :meth:`unmap_run` like any page.
        """

    # -- access ------------------------------------------------------------------------------
    @abstractmethod
    def as_tensor(self, base: int, nbytes: int) -> torch.Tensor:
        """A zero-copy ``uint8`` tensor over ``[base, base+nbytes)`` on :attr:`device`.

        Only mapped parts may be touched; an op over the whole tensor faults.
        """

    def allocated_bytes(self) -> int | None:
        """Physical memory the OS/driver holds for this backend now (pool pages and the anchor
        page) as the OS counts it; None where the backend cannot tell."""
        return None

    def synchronize(self) -> None:
        """Wait until no queued kernel can still read memory about to be unmapped."""

    def bind_thread(self) -> None:
        """Prepare the calling thread for driver calls (CUDA: make the device's context
        current); a background mapper calls it first on its thread."""

    def close(self) -> None:
        """Release everything the backend itself holds (pool file, handles)."""
