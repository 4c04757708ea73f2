"""The regions of one virtual KV cache, mapped in lockstep.

    region r (one per layout tensor):  | anchor slot | slot 1 | slot 2 | ... |
    va page p means the same slot position in every region; a growth, share or unmap at p
    happens in all regions or in none (:meth:`RegionGroup._lockstep` is the one rollback)

Each region is a :class:`~vmkv.memory.region.VirtualRegion` whose first ``anchor_pages`` pages
are mapped to the backend's anchor page for its lifetime. The regions past
``layout.num_full_regions`` are sliding-window layers': they give back a slot's head pages
(:meth:`RegionGroup.drop`) and then map ``[dropped, mapped)`` of it only. Their va -> physical
tables are the rows of one ``[regions, pages]`` array, so a lockstep growth is read and written
in one go.

With one pool partition per region (the per-layer layout), a growth is *mirrored*: region 0's
allocation decides, and region ``r`` takes the same pages of its own partition (page ``p`` of
region 0 is page ``p + r * partition_size`` there), with one VMA count and one table write for
all regions; when one of those pages is not free the regions allocate one by one instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from vmkv.kv.spec import VirtualLayout
from vmkv.memory.base import rolled_back
from vmkv.memory.errors import MappingBudgetExceeded, VmmError
from vmkv.memory.pool import PagePool, runs_of
from vmkv.memory.region import UNMAPPED, VirtualRegion, count_vmas_rows


class RegionGroup:
    """``layout.num_regions`` regions of ``num_va_slots`` slots each over one pool."""

    def __init__(self, pool: PagePool, layout: VirtualLayout, num_va_slots: int) -> None:
        self.pool = pool
        self.layout = layout
        # a pool split into one partition per region keeps each region's pages physically
        # adjacent (long runs, few VMAs)
        per_region = pool.partitions == layout.num_regions
        region_bytes = num_va_slots * layout.slot_bytes
        #: [regions, va pages] physical page per va page (UNMAPPED: none); row r is region r's
        self.table = np.full((layout.num_regions, region_bytes // pool.page_size), UNMAPPED,
                             dtype=np.int64)
        self.regions = [
            VirtualRegion(pool, region_bytes, name=f"kv-region-{i}",
                          partition=i if per_region else 0,
                          anchor_pages=layout.pages_for(1),  # every view's base row
                          page_at=self.table[i])
            for i in range(layout.num_regions)
        ]
        #: regions [keep:] are the sliding-window layers' (they may drop a slot's head pages)
        self.keep = layout.num_full_regions
        # [regions] what a mirrored growth adds to region 0's page ids (None: not mirrored)
        self._mirror = (np.arange(layout.num_regions, dtype=np.int64) * pool.partition_size
                        if per_region and layout.num_regions > 1 else None)

    def __len__(self) -> int:
        return len(self.regions)

    def __iter__(self) -> Iterator[VirtualRegion]:
        return iter(self.regions)

    def __getitem__(self, r: int) -> VirtualRegion:
        return self.regions[r]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    # -- mapping, all regions or none -----------------------------------------------------------
    def map_new(self, va_page: int, num: int,
                pages: Sequence[Sequence[int]] | None = None) -> bool:
        """Fresh pool pages at ``[va_page, va_page+num)`` of every region (exactly
        ``pages[r]`` in region ``r`` if given); False (nothing changed) when the pool or the
        VMA budget is short."""
        def map_one(r: int, region: VirtualRegion) -> bool:
            exact = None if pages is None else list(pages[r])
            return region.map_new(va_page, num, exact) is not None

        mapped = self._map_mirrored(va_page, num) if pages is None else None
        if mapped is None:
            mapped = self._lockstep(va_page, num, map_one)
        return mapped

    def _map_mirrored(self, va_page: int, num: int) -> bool | None:
        """:meth:`map_new` as one mirrored growth (module docstring); None (nothing changed)
        where it does not apply: no mirror, anchored neighbours, a mirrored page not free or
        the range not unmapped (the region-by-region path then decides, or raises)."""
        lead, mirror, pool = self.regions[0], self._mirror, self.pool
        lo, hi = va_page - 1, min(va_page + num + 1, lead.num_pages)
        if mirror is None or num <= 0 or lo < lead.anchor_pages or va_page + num > hi:
            return None
        window = self.table[:, lo:hi]  # [R, w] the range and its neighbours
        if (window[:, 1 : 1 + num] != UNMAPPED).any():
            return None
        prev = int(window[0, 0])
        first = pool.allocate(num, prev + 1 if prev != UNMAPPED else None, lead.partition)
        if first is None:
            return False
        new = np.asarray(first, dtype=np.int64)[None, :] + mirror[:, None]  # [R, num]
        try:
            mirrored = pool.take_if_free(new[1:].ravel())
        except BaseException:  # a page could not be created: region 0's go back too
            mirrored = False
            raise
        finally:
            if not mirrored:
                for page in first:
                    pool.release(page)
        if not mirrored:
            return None
        after = window.copy()
        after[:, 1 : 1 + num] = new
        delta = count_vmas_rows(after) - count_vmas_rows(window)  # [R] VMAs each region gains
        total = int(delta.sum())
        budget = pool.max_vmas
        try:
            if budget is not None and total > 0 and pool.num_vmas + total > budget:
                raise MappingBudgetExceeded(f"a growth would need {pool.num_vmas + total} "
                                            f"VMAs, over the budget of {budget}")
            self._map_runs(runs_of(va_page, first), mirror.tolist())
        except BaseException as exc:
            for page in new.ravel().tolist():
                pool.release(page)
            if isinstance(exc, MappingBudgetExceeded):
                return False
            raise
        window[:, 1 : 1 + num] = new
        for region, gained in zip(self.regions, delta.tolist(), strict=True):
            region.num_mapped += num
            region.add_vmas(gained)
        return True

    def _map_runs(self, runs: list[tuple[int, int, int]], shifts: list[int]) -> None:
        """Map region 0's ``runs`` (va page, first physical page, count) in every region ``r``,
        its pages shifted by ``shifts[r]``; all or nothing (what landed is unmapped again
        before raising)."""
        backend, ps = self.pool.backend, self.pool.page_size
        done: list[tuple[int, int]] = []  # (va, pages) mapped so far
        try:
            for region, shift in zip(self.regions, shifts, strict=True):
                for start, first, count in runs:
                    va = region.base + start * ps
                    backend.map_run(va, first + shift, count)
                    done.append((va, count))
        except BaseException:
            for va, count in done:  # nothing read them yet: no synchronize needed
                rolled_back(lambda va=va, count=count: backend.unmap_run(va, count))
            raise

    def map_shared(self, va_page: int, pages: Sequence[Sequence[int]]) -> bool:
        """Map ``pages[r]`` (pages already in use) at ``va_page`` of region ``r``, from its
        first page that is not ``UNMAPPED`` on (a sliding region's dropped head stays
        unmapped); False (nothing changed) when the VMA budget is short."""
        num = len(pages[0])
        heads = [head_of(row) for row in pages]

        def share(r: int, region: VirtualRegion) -> bool:
            if heads[r] < num:
                region.map_shared(va_page + heads[r], list(pages[r])[heads[r]:])
            return True

        return self._lockstep(va_page, num, share, heads)

    def _lockstep(self, va_page: int, num: int,
                  map_one: Callable[[int, VirtualRegion], bool],
                  heads: Sequence[int] | None = None) -> bool:
        """``map_one(r, region)`` on every region; if one cannot (False or
        MappingBudgetExceeded), unmap what the others mapped at ``[va_page + heads[r],
        va_page+num)`` and return False. Any other ``VmmError`` (the OS or driver refused) is
        raised after the same rollback."""
        done: list[tuple[VirtualRegion, int]] = []
        try:
            for r, region in enumerate(self.regions):
                if not map_one(r, region):
                    raise MappingBudgetExceeded("the pool ran short")
                done.append((region, heads[r] if heads is not None else 0))
        except VmmError as exc:
            for region, head in done:  # nothing new was read yet: no synchronize needed
                if head < num:
                    rolled_back(lambda region=region, head=head: region.unmap(va_page + head,
                                                                              num - head))
            if isinstance(exc, MappingBudgetExceeded):
                return False
            raise
        return True

    def unmap(self, va_page: int, num: int, head: int = 0) -> None:
        """Unmap ``num`` pages at ``va_page`` everywhere, in the sliding regions only from
        va page ``head`` on (what they still map; the caller synchronized)."""
        end = va_page + num
        for r, region in enumerate(self.regions):
            lo = max(va_page, head) if r >= self.keep else va_page
            if lo < end:
                region.unmap(lo, end - lo)

    def drop(self, va_page: int, num: int) -> None:
        """Unmap ``num`` pages at ``va_page`` in the sliding regions only: pages behind their
        window, back to the pool (the caller synchronized)."""
        for region in self.regions[self.keep :]:
            region.unmap(va_page, num)

    def copy_on_write(self, va_page: int, pages: Sequence[int] | None = None
                      ) -> tuple[int, ...]:
        """Give ``va_page`` a private copy of its (shared) page in every region; the pool must
        have a free page per region (exactly ``pages[r]`` in region ``r`` if given). Returns
        the fresh pages.

        All regions or none: if the OS/driver refuses a page or a mapping (``VmmError``,
        ``MappingBudgetExceeded``), every region keeps its shared page and the error is raised
        (MemoryStateLost if even putting the shared pages back is refused).
        """
        ps = self.pool.page_size
        fresh: list[int] = []
        try:
            for r, region in enumerate(self.regions):
                if pages is None:
                    (page,) = self.pool.allocate(1, None, region.partition)
                else:
                    page = pages[r]
                    self.pool.take([page])
                fresh.append(page)
        except BaseException:
            for page in fresh:
                self.pool.release(page)
            raise
        self.pool.backend.synchronize()  # any reader of the shared pages must finish first
        done: list[tuple[VirtualRegion, int]] = []  # (region, its shared page)
        try:
            for region, page in zip(self.regions, fresh, strict=True):
                data = region.as_bytes()[va_page * ps : (va_page + 1) * ps]
                saved = data.clone()
                shared = int(region.page_at[va_page])
                region.replace(va_page, page)
                done.append((region, shared))
                data.copy_(saved)
        except BaseException:
            for region, shared in done:  # share again; the private copies go back to the pool
                self.pool.retain(shared)
                rolled_back(lambda region=region, shared=shared: region.replace(va_page, shared))
            for page in fresh[len(done):]:
                self.pool.release(page)
            raise
        return tuple(fresh)

    # -- reading ----------------------------------------------------------------------------------
    def pages_at(self, va_page: int) -> tuple[int, ...]:
        """The physical page at ``va_page`` of each region."""
        return tuple(self.table[:, va_page].tolist())

    def pages(self, va_page: int, num: int) -> list[list[int]]:
        """Per region, the physical pages of ``[va_page, va_page+num)``."""
        return self.table[:, va_page : va_page + num].tolist()

    def byte_views(self, va_page: int, num: int, dropped: int = 0) -> list[torch.Tensor]:
        """Per region, the bytes of ``num`` pages at ``va_page``, in the sliding regions from
        ``dropped`` pages later on (touch only mapped pages)."""
        ps, end = self.pool.page_size, va_page + num
        return [region.as_bytes()[(va_page + (dropped if r >= self.keep else 0)) * ps : end * ps]
                for r, region in enumerate(self.regions)]

    def layer_views(self, num_va_slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``[num_va_slots, slot_tokens, kv_head, head_dim]`` K and V views."""
        return self.layout.layer_views([r.as_bytes() for r in self.regions], num_va_slots)

    # -- checks and teardown --------------------------------------------------------------------
    def check(self, mapped: Sequence[int], dropped: Sequence[int]) -> np.ndarray:
        """Assert that slot ``s`` has exactly its pages ``[0, mapped[s])`` mapped in every full
        region and ``[dropped[s], mapped[s])`` in every sliding one, and that a page mapped
        twice is a share at one region and page index; returns the mapping references per
        physical page."""
        refs = np.zeros(self.pool.num_pages, dtype=np.int64)
        where: dict[int, tuple[int, int]] = {}
        for r, region in enumerate(self.regions):
            table = region.page_at.reshape(len(mapped), self.layout.slot_pages)
            for slot, m in enumerate(mapped):
                d = dropped[slot] if r >= self.keep else 0
                assert (table[slot, d:m] != UNMAPPED).all(), f"hole in slot {slot} region {r}"
                assert (table[slot, m:] == UNMAPPED).all(), f"stray page in slot {slot}"
                assert (table[slot, :d] == UNMAPPED).all(), f"a dropped page mapped, slot {slot}"
                for p, page in enumerate(table[slot, d:m], start=d):
                    # a page mapped twice must be a fork share: same region, same page index
                    assert where.setdefault(int(page), (r, p)) == (r, p), f"page {page} aliased"
            pages = region.page_at[region.page_at != UNMAPPED]
            np.add.at(refs, pages, 1)
            assert region.num_mapped == len(pages)
        assert sum(r.num_vmas for r in self.regions) == self.pool.num_vmas
        return refs

    def close(self) -> None:
        for region in self.regions:
            region.close()


def head_of(pages: Sequence[int]) -> int:
    """Leading ``UNMAPPED`` entries of a region's page list (a sliding region's dropped head)."""
    return next((i for i, page in enumerate(pages) if page != UNMAPPED), len(pages))
