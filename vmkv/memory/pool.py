"""Physical page pool: lazily created pages, reference counts, elastic release.

Every page is in exactly one state:

    uncreated --allocate--> in use (ref_cnt >= 1) --last release--> idle --trim--> uncreated
                               ^                                       |
                               +---------------allocate----------------+

``ref_cnt`` counts the virtual mappings of a page (see :class:`~vmkv.memory.region.VirtualRegion`)
plus explicit holders (a prefix cache, say). A page mapped at two virtual addresses has
``ref_cnt == 2``: that is how sharing and copy-on-write are expressed.

Allocation prefers the page after ``hint`` (physically adjacent to what the caller mapped last).
A new run starts at the lowest free page that has ``GROW_ROOM`` free pages between it and the end
of any run before it (else at the lowest free page), so the many slots that grow at once each
extend their own physically contiguous run (one VMA each on the host) instead of taking the page
right after a neighbour's.

With ``partitions=P`` the ids are split into P equal contiguous ranges and each allocation names
its partition. Layouts whose regions grow in lockstep (the per-layer layout: one page in each of
2L regions per growth) give each region its own partition, so a region's pages stay physically
adjacent instead of interleaving with the other regions' (one run per page otherwise).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

import numpy as np

from vmkv.memory.base import MemoryBackend
from vmkv.memory.errors import VmmError

logger = logging.getLogger("vmkv")

#: free pages a new run leaves after the end of another run, so that run can keep growing in
#: place (many slots grow at once; starting right after a neighbour would cut its run short)
GROW_ROOM = 8


class PagePool:
    """Pages ``0 .. num_pages-1`` of one backend.

    Args:
        backend: the memory backend that creates, maps and releases the pages.
        num_pages: the cap on pages in use at once (the physical KV budget).
        precreate: pages created at start-up and made resident (the engines' default: the hot
            path only maps, and no first write faults to back a fresh page).
        max_idle_pages: idle (created, unreferenced) pages kept for reuse; beyond this low-water
            mark :meth:`trim` releases the highest ones, so memory held tracks live data.
            ``None`` keeps every created page.
        max_vmas: budget on the VMAs of all regions (host mapped runs + unmapped stretches);
            ``None`` for no budget.
        partitions: split the ids into this many equal ranges (``num_pages`` is rounded down
            to a multiple); :meth:`allocate` then takes the partition to draw from.
        create_chunk: when an allocation needs an uncreated page, create up to this many
            uncreated pages from it on (same partition) in one backend call; the extra ones
            become idle. 1 creates exactly what is taken.
    """

    def __init__(
        self,
        backend: MemoryBackend,
        num_pages: int,
        *,
        precreate: int = 0,
        max_idle_pages: int | None = None,
        max_vmas: int | None = None,
        partitions: int = 1,
        create_chunk: int = 1,
    ) -> None:
        if not 0 < num_pages <= backend.max_pages:
            raise ValueError(
                f"num_pages must be in 1..{backend.max_pages} for this backend, got {num_pages}"
            )
        if not 0 <= precreate <= num_pages:
            raise ValueError(f"precreate must be in 0..{num_pages}, got {precreate}")
        if not 1 <= partitions <= num_pages:
            raise ValueError(f"partitions must be in 1..{num_pages}, got {partitions}")
        if create_chunk < 1:
            raise ValueError(f"create_chunk must be >= 1, got {create_chunk}")
        self.create_chunk = create_chunk
        num_pages -= num_pages % partitions
        precreate = min(precreate, num_pages)  # "every page" survives the rounding
        if max_idle_pages is not None and max_idle_pages < 0:
            raise ValueError(f"max_idle_pages must be >= 0 or None, got {max_idle_pages}")
        self.backend = backend
        self.page_size = backend.page_size
        self.num_pages = num_pages
        self.max_idle_pages = max_idle_pages
        self.max_vmas = max_vmas
        self.num_vmas = 0  # maintained by the regions (mapped runs + unmapped stretches)
        self.ref_cnt = [0] * num_pages
        self._created = bytearray(num_pages)
        self.partitions = partitions
        self.partition_size = num_pages // partitions
        self._idle: set[int] = set()
        self._idle_heaps: list[list[int]] = [[] for _ in range(partitions)]
        self._uncreated: set[int] = set(range(num_pages))
        self._uncreated_heaps = [list(range(p * self.partition_size,
                                            (p + 1) * self.partition_size))
                                 for p in range(partitions)]
        self._free_in = [self.partition_size] * partitions
        self._free_mask = np.ones(num_pages, dtype=bool)
        # per partition: the smallest run length ``_run_start`` found no room for since a page
        # of it last became free (None: unknown). Taking pages cannot make room, so a larger or
        # equal search fails without scanning: a nearly full pool (every growth of a slot whose
        # room is gone) then costs a heap pop, not a scan of the partition.
        self._no_room: list[int | None] = [None] * partitions
        self.num_in_use = 0
        self.peak_in_use = 0
        if precreate:  # one backend call for the range (host: one fallocate), then resident
            self._create_run(0, precreate)
            self.backend.touch_pages(0, precreate)

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that :meth:`allocate` can hand out now (idle + uncreated)."""
        return self.num_pages - self.num_in_use

    @property
    def num_created(self) -> int:
        return self.num_in_use + len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def is_shared(self, page: int) -> bool:
        return self.ref_cnt[page] > 1

    # -- allocation ---------------------------------------------------------------------------
    def num_free_in(self, partition: int) -> int:
        """Free pages of one partition (``num_free / partitions`` when used in lockstep)."""
        return self._free_in[partition]

    def allocate(self, num: int, hint: int | None = None, partition: int = 0
                 ) -> list[int] | None:
        """Take ``num`` free pages (``ref_cnt`` 1 each, owned by the caller) of ``partition``,
        or None if it is short.

        Pages come in physically adjacent runs where possible, starting at ``hint``.
        """
        if num > self.num_free or (self.partitions > 1 and num > self.num_free_in(partition)):
            return None
        lo = partition * self.partition_size
        hi = lo + self.partition_size
        pages: list[int] = []
        nxt = hint
        try:
            while len(pages) < num:
                if nxt is None or not lo <= nxt < hi or not self._is_free(nxt):
                    nxt = self._run_start(lo, hi, num - len(pages))
                    if nxt is None:
                        nxt = self._lowest_free(partition)
                self._take(nxt)
                pages.append(nxt)
                nxt += 1
        except BaseException:
            for page in pages:  # all or nothing, even when the backend fails midway
                self.release(page)
            raise
        return pages

    def take(self, pages: list[int]) -> None:
        """Take exactly ``pages`` (``ref_cnt`` 1 each): a follower repeating the allocation a
        leader pool with the same history made. ValueError (nothing taken) if one is not
        free."""
        taken: list[int] = []
        try:
            for page in pages:
                if not 0 <= page < self.num_pages or not self._is_free(page):
                    raise ValueError(f"take of page {page}, which is not free")
                self._take(page)
                taken.append(page)
        except BaseException:
            for page in taken:
                self.release(page)
            raise

    def take_if_free(self, pages: np.ndarray) -> bool:
        """Take exactly ``pages`` (distinct ids, ``ref_cnt`` 1 each) if every one is free now;
        False (nothing taken) if one is not. One vectorised update when all are created (the
        lockstep growth of many regions at once), else :meth:`take`'s page-by-page path."""
        if not self._free_mask[pages].all():
            return False
        ids = pages.tolist()
        created = self._created
        if not all(created[page] for page in ids):
            self.take(ids)
            return True
        self._idle.difference_update(ids)
        ref_cnt = self.ref_cnt
        for page in ids:
            ref_cnt[page] = 1
        self.num_in_use += len(ids)
        taken = np.bincount(pages // self.partition_size, minlength=self.partitions)
        for part in np.flatnonzero(taken).tolist():
            self._free_in[part] -= int(taken[part])
        self._free_mask[pages] = False
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        return True

    def retain(self, page: int) -> None:
        """Add a reference to a page already in use."""
        if self.ref_cnt[page] <= 0:
            raise ValueError(f"retain of page {page} which is not in use")
        self.ref_cnt[page] += 1

    def release(self, page: int) -> None:
        """Drop a reference; the last one makes the page idle (still created, reusable)."""
        cnt = self.ref_cnt[page]
        if cnt <= 0:
            raise ValueError(f"release of page {page} which is not in use (double free)")
        self.ref_cnt[page] = cnt - 1
        if cnt == 1:
            self.num_in_use -= 1
            self._free_in[page // self.partition_size] += 1
            self._free_mask[page] = True
            self._no_room[page // self.partition_size] = None
            self._make_idle(page)

    def trim(self, keep: int | None = None) -> int:
        """Release idle pages beyond ``keep`` (default ``max_idle_pages``; None: keep all),
        highest ids first, a run of adjacent ids per backend call; return how many.

        A release the backend refuses (``VmmError``) leaves that run idle, stops the trim and
        is logged: memory is returned later, accounting stays exact.
        """
        keep = self.max_idle_pages if keep is None else keep
        if keep is None:
            return 0
        excess = len(self._idle) - keep
        if excess <= 0:
            return 0
        released = 0
        chosen = sorted(heapq.nlargest(excess, self._idle))
        for _, first, num in reversed(runs_of(0, chosen)):  # highest run first
            try:
                self.backend.release_pages(first, num)
            except VmmError as exc:
                logger.warning("could not return idle pages %d..%d to the OS/driver: %s",
                               first, first + num - 1, exc)
                break
            for page in range(first, first + num):
                self._idle.discard(page)
                self._created[page] = 0
                self._uncreated.add(page)
                heapq.heappush(self._uncreated_heaps[page // self.partition_size], page)
            released += num
        return released

    def release_all_idle(self) -> None:
        """Return every idle page to the backend (used on shutdown and by tests)."""
        self.trim(keep=0)

    # -- internals ----------------------------------------------------------------------------
    def _run_start(self, lo: int, hi: int, num: int) -> int | None:
        """Where a new run of ``num`` pages should start in ``[lo, hi)`` (None: no such room)."""
        free = self._free_mask[lo:hi]
        if free[:num].all():
            return lo  # nothing before it to leave room for
        need = GROW_ROOM + num
        part = lo // self.partition_size
        no_room = self._no_room[part]
        if len(free) < need or (no_room is not None and need >= no_room):
            return None
        counts = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
        windows = np.flatnonzero(counts[need:] - counts[:-need] == need)
        if not windows.size:
            self._no_room[part] = need if no_room is None else min(no_room, need)
            return None
        return lo + int(windows[0]) + GROW_ROOM

    def _is_free(self, page: int) -> bool:
        return page in self._idle or page in self._uncreated

    def _lowest_free(self, partition: int) -> int:
        idle, uncreated = self._idle_heaps[partition], self._uncreated_heaps[partition]
        while idle:
            page = heapq.heappop(idle)
            if page in self._idle:
                return page
        while uncreated:
            page = heapq.heappop(uncreated)
            if page in self._uncreated:
                return page
        raise AssertionError("page pool accounting is broken: no free page although num_free > 0")

    def _take(self, page: int) -> None:
        if page not in self._idle:
            # create a chunk from `page` on: uncreated pages of its partition (one call)
            end = min(page + self.create_chunk, (page // self.partition_size + 1)
                      * self.partition_size)
            last = page + 1
            while last < end and last in self._uncreated:
                last += 1
            try:
                self._create_run(page, last)
            except BaseException:
                heapq.heappush(self._uncreated_heaps[page // self.partition_size], page)
                raise
        self._idle.discard(page)
        self.ref_cnt[page] = 1
        self.num_in_use += 1
        self._free_in[page // self.partition_size] -= 1
        self._free_mask[page] = False
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)

    def _create_run(self, first: int, last: int) -> None:
        """Create the uncreated pages ``first .. last-1`` in one backend call; they are idle."""
        self.backend.create_pages(first, last - first)
        for page in range(first, last):
            self._created[page] = 1
            self._uncreated.discard(page)
            self._make_idle(page)

    def _make_idle(self, page: int) -> None:
        self._idle.add(page)
        heapq.heappush(self._idle_heaps[page // self.partition_size], page)

    def check(self) -> None:
        """Raise AssertionError if the pool's own accounting is inconsistent (tests)."""
        in_use = [p for p, c in enumerate(self.ref_cnt) if c > 0]
        assert len(in_use) == self.num_in_use, (len(in_use), self.num_in_use)
        assert not self._idle & self._uncreated
        assert all(self._created[p] for p in self._idle)
        assert not any(self._created[p] for p in self._uncreated)
        for p in in_use:
            assert self._created[p] and p not in self._idle and p not in self._uncreated
        assert len(in_use) + len(self._idle) + len(self._uncreated) == self.num_pages
        for part in range(self.partitions):
            lo = part * self.partition_size
            free = sum(1 for p in range(lo, lo + self.partition_size) if self.ref_cnt[p] == 0)
            assert free == self._free_in[part], (part, free, self._free_in[part])
        assert (self._free_mask == (np.array(self.ref_cnt) == 0)).all()


def runs_of(va_page: int, pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a page list into (va_page, first_phys_page, count) physically contiguous runs."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and page == runs[-1][1] + runs[-1][2]:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((va_page + i, page, 1))
    return runs
