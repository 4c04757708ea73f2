"""A reserved virtual range with pool pages mapped under it: the one table of mappings.

    region: | page 0 | page 1 | page 2 | ... | page num_pages-1 |
              phys 7   phys 8   -        ...    -                   (- = PROT_NONE / unmapped)

Each mapping holds one reference on its physical page (``PagePool.ref_cnt``), so mapping the
same physical page at two addresses (sharing, copy-on-write) is just two references. A *run* is
a maximal stretch of mapped virtual pages whose physical ids are consecutive; on the host each
run is one kernel VMA, and so is each maximal unmapped (PROT_NONE) stretch between them. The
region counts both exactly (``num_vmas``), and the pool's budget on their sum keeps the process
under ``vm.max_map_count``.

An *anchored* region keeps its first ``anchor_pages`` pages mapped to the backend's anchor page
for its whole life (they are not in the table and never hold data): the region's base address,
where every tensor view of it starts, is then always mapped, as kernel launchers require.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vmkv.memory.base import rolled_back
from vmkv.memory.errors import MappingBudgetExceeded
from vmkv.memory.pool import PagePool, runs_of

UNMAPPED = -1


class VirtualRegion:
    """``num_pages`` pages of reserved virtual address space over a :class:`PagePool`."""

    def __init__(self, pool: PagePool, nbytes: int, name: str = "", partition: int = 0,
                 anchor_pages: int = 0, page_at: np.ndarray | None = None) -> None:
        """``page_at``: the ``int64`` va page -> physical page table to keep (all UNMAPPED; a
        row of a :class:`~vmkv.kv.regions.RegionGroup`'s table), or None for a new one."""
        ps = pool.page_size
        if nbytes <= 0 or nbytes % ps:
            raise ValueError(
                f"region size must be a positive multiple of the page size ({ps} B), got {nbytes}"
            )
        if not 0 <= anchor_pages < nbytes // ps:
            raise ValueError(f"anchor_pages must be in 0..{nbytes // ps - 1}, got {anchor_pages}")
        self.pool = pool
        self.backend = pool.backend
        self.name = name
        self.partition = partition  # the pool partition new pages come from
        self.nbytes = nbytes
        self.num_pages = nbytes // ps
        self.base = self.backend.reserve(nbytes)
        if page_at is None:
            page_at = np.full(self.num_pages, UNMAPPED, dtype=np.int64)
        elif page_at.shape != (self.num_pages,) or (page_at != UNMAPPED).any():
            raise ValueError(f"page_at must be {self.num_pages} UNMAPPED entries")
        self.page_at = page_at  # va page -> phys page
        self.num_mapped = 0
        self.anchor_pages = anchor_pages
        if anchor_pages:
            try:
                self.backend.map_anchor(self.base, anchor_pages)
            except BaseException:
                self.backend.free_reservation(self.base, nbytes)
                raise
        # the reservation: one PROT_NONE stretch, after one VMA per anchored page
        self.num_vmas = anchor_pages + 1
        pool.num_vmas += self.num_vmas
        self._bytes: torch.Tensor | None = None

    # -- views --------------------------------------------------------------------------------
    def as_bytes(self) -> torch.Tensor:
        """Zero-copy ``uint8`` tensor over the whole range (touch only mapped parts)."""
        if self._bytes is None:
            self._bytes = self.backend.as_tensor(self.base, self.nbytes)
        return self._bytes

    def va_of(self, va_page: int) -> int:
        return self.base + va_page * self.pool.page_size

    # -- mapping ------------------------------------------------------------------------------
    def map_new(self, va_page: int, num: int, pages: list[int] | None = None
                ) -> list[int] | None:
        """Allocate ``num`` fresh pages (exactly ``pages`` if given: see
        :meth:`PagePool.take`) and map them at ``va_page``; None if the pool is short.

        Raises MappingBudgetExceeded (nothing changed) if the run budget would be exceeded.
        """
        if num == 0:
            return []
        self._check_unmapped(va_page, num)
        if pages is not None:
            self.pool.take(pages)
        else:
            prev = int(self.page_at[va_page - 1]) if va_page > 0 else UNMAPPED
            hint = prev + 1 if prev != UNMAPPED else None  # continue the run to the left
            pages = self.pool.allocate(num, hint, self.partition)
        if pages is None:
            return None
        try:
            self._map(va_page, pages)
        except BaseException:
            for page in pages:
                self.pool.release(page)
            raise
        return pages

    def map_shared(self, va_page: int, pages: Sequence[int]) -> None:
        """Map pages that are already in use elsewhere at ``va_page`` (one more reference each)."""
        self._check_unmapped(va_page, len(pages))
        self._map(va_page, list(pages))
        for page in pages:
            self.pool.retain(page)

    def unmap(self, va_page: int, num: int) -> list[int]:
        """Unmap ``num`` mapped pages at ``va_page``, drop their references; return their ids.

        The caller must have synchronised the device if a queued kernel may read the range.
        """
        if num == 0:
            return []
        pages = self.page_at[va_page : va_page + num]
        if len(pages) != num or (pages == UNMAPPED).any():
            raise ValueError(f"{self.name}: unmap of pages {va_page}..{va_page + num - 1} "
                             "which are not all mapped")
        old = [int(p) for p in pages]
        delta = self._vmas_delta(va_page, num, None)
        for start, _, count in runs_of(va_page, old):
            self.backend.unmap_run(self.va_of(start), count)
            self.page_at[start : start + count] = UNMAPPED
        self.num_mapped -= num
        self._add_vmas(delta)
        for page in old:
            self.pool.release(page)
        return old

    def replace(self, va_page: int, new_page: int) -> int:
        """Point one mapped virtual page at ``new_page`` (already referenced by the caller,
        whose reference the mapping takes over); return the old physical page, released.

        All or nothing: if mapping ``new_page`` fails, the old page is mapped back, the error
        raised, and ``new_page`` stays the caller's (MemoryStateLost if even that is refused).
        """
        old = int(self.page_at[va_page])
        self.pool.retain(old)  # keep it alive across the swap, to put it back on failure
        self.unmap(va_page, 1)
        try:
            self._map(va_page, [new_page])
        except BaseException:
            rolled_back(lambda: self._map(va_page, [old]))  # the mapping takes over the hold
            raise
        self.pool.release(old)
        return old

    def close(self) -> None:
        """Unmap everything and free the reservation."""
        mapped = np.flatnonzero(self.page_at != UNMAPPED)
        if len(mapped):
            self.backend.synchronize()
        for run in np.split(mapped, np.flatnonzero(np.diff(mapped) != 1) + 1):
            if len(run):  # one unmap per stretch of mapped virtual pages
                self.unmap(int(run[0]), len(run))
        if self.anchor_pages:
            self.backend.synchronize()
            self.backend.unmap_run(self.base, self.anchor_pages)
        self._bytes = None
        self.backend.free_reservation(self.base, self.nbytes)
        self._add_vmas(-self.num_vmas)

    # -- internals ----------------------------------------------------------------------------
    def _check_unmapped(self, va_page: int, num: int) -> None:
        if va_page < self.anchor_pages or va_page + num > self.num_pages:
            raise ValueError(f"{self.name}: pages {va_page}..{va_page + num - 1} are outside "
                             f"the pages {self.anchor_pages}..{self.num_pages - 1} that can be "
                             "mapped")
        if (self.page_at[va_page : va_page + num] != UNMAPPED).any():
            raise ValueError(f"{self.name}: pages {va_page}..{va_page + num - 1} are already "
                             "(partly) mapped")

    def _map(self, va_page: int, pages: list[int]) -> None:
        delta = self._vmas_delta(va_page, len(pages), pages)
        budget = self.pool.max_vmas
        if budget is not None and delta > 0 and self.pool.num_vmas + delta > budget:
            raise MappingBudgetExceeded(
                f"mapping {len(pages)} pages would need {self.pool.num_vmas + delta} VMAs, "
                f"over the budget of {budget}; use larger pages, the all-layers layout, "
                "fewer slots, or raise vm.max_map_count"
            )
        done = 0
        try:
            for start, first, count in runs_of(va_page, pages):
                self.backend.map_run(self.va_of(start), first, count)
                self.page_at[start : start + count] = np.arange(first, first + count)
                done += count
        except BaseException:
            if done:  # undo the part that landed so the table matches the backend
                for start, _, count in runs_of(va_page, pages[:done]):
                    self.backend.unmap_run(self.va_of(start), count)
                self.page_at[va_page : va_page + done] = UNMAPPED
            raise
        self.num_mapped += len(pages)
        self._add_vmas(delta)

    def add_vmas(self, delta: int) -> None:
        """Count ``delta`` more VMAs here and in the pool (a group that mapped pages itself)."""
        self._add_vmas(delta)

    def _add_vmas(self, delta: int) -> None:
        self.num_vmas += delta
        self.pool.num_vmas += delta

    def _vmas_delta(self, va_page: int, num: int, new: list[int] | None) -> int:
        """Change in VMAs if ``[va_page, va_page+num)`` became ``new`` (None: unmapped)."""
        lo, hi = max(va_page - 1, 0), min(va_page + num + 1, self.num_pages)
        before = self.page_at[lo:hi].copy()
        anchored = min(hi, self.anchor_pages) - lo
        if anchored > 0:  # each anchored page is a mapping (a VMA) of its own
            before[:anchored] = -2 - np.arange(lo, lo + anchored)
        after = before.copy()
        after[va_page - lo : va_page - lo + num] = UNMAPPED if new is None else new
        return _count_vmas(after) - _count_vmas(before)


def _count_vmas(pages: np.ndarray) -> int:
    """Maximal mapped runs (consecutive physical ids) plus maximal unmapped stretches."""
    if len(pages) <= 16:  # the hot path (a few pages around a mapping): plain Python is faster
        count, prev = 0, None
        for page in pages.tolist():
            if prev is None or (page == UNMAPPED) != (prev == UNMAPPED) or (
                    page != UNMAPPED and page != prev + 1):
                count += 1
            prev = page
        return count
    return int(count_vmas_rows(pages[None])[0])


def count_vmas_rows(pages: np.ndarray) -> np.ndarray:
    """:func:`_count_vmas` of each row of ``pages`` ``[rows, n]``; returns ``[rows]``."""
    mapped = pages != UNMAPPED
    adjacent = pages[:, 1:] == pages[:, :-1] + 1
    same = (mapped[:, 1:] == mapped[:, :-1]) & (~mapped[:, 1:] | adjacent)
    return pages.shape[1] - same.sum(axis=1)
