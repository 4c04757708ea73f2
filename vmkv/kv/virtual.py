"""Virtual mode (vAttention): one contiguous virtual slot per request, pages mapped as it grows.

    region (one per layout tensor), slot s = pages [s*slot_pages, (s+1)*slot_pages):
    | slot 0: anchor | slot 1 | slot 2 | ... | slot num_slots |
    slot s >= 1:  | mapped: pages_for(len) | mapped surplus (deferred / pre-mapped) | PROT_NONE |

Slot 0 is the *anchor slot*: never given to a request, its first ``pages_for(1)`` pages are
mapped to the backend's anchor page for the cache's lifetime. Every layer's K/V view starts
there, so no tensor handed to a kernel ever has an unmapped base address (Triton refuses such a
launch), whichever requests run; padding entries of a CUDA graph's batch point at it too.

Invariants:
  * a slot's mapped pages are always a prefix ``[0, mapped[s])`` of the slot, identical in
    number in every region;
  * a running request's slot has at least ``pages_for(num_tokens)`` pages mapped, so attention
    may read ``[slot, :num_tokens]`` and nothing past the mapped prefix;
  * a physical page mapped more than once is shared by forks at the same page index of the
    same region; the first write into it copies it (copy-on-write);
  * pages are unmapped only after ``backend.synchronize()`` (no queued kernel can read them).

Latency hiding: the pool may be pre-created; growth maps ``premap_pages`` extra pages when free
pages exist (fewer, larger map calls); finished slots keep their pages (deferred reclamation)
and a new request takes the idle slot that fits best, often needing no map call at all. Pages
kept this way are reclaimed on demand, and beyond ``max_idle_pages`` eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from vmkv.kv.base import KVCacheManager, KVUsage, SwappedKV
from vmkv.kv.prefix import PrefixCachingMixin
from vmkv.kv.spec import KVSpec, VirtualLayout
from vmkv.memory.base import MappingBudgetExceeded
from vmkv.memory.pool import PagePool
from vmkv.memory.region import UNMAPPED, VirtualRegion

if TYPE_CHECKING:
    from vmkv.memory.mapper import BackgroundMapper

#: the slot that anchors every region's base address (never handed to a request)
ANCHOR_SLOT = 0


class VirtualKVCache(PrefixCachingMixin, KVCacheManager):
    """vAttention-style KV cache over a :class:`PagePool` (host or CUDA pages)."""

    kv_mode = "virtual"

    def __init__(
        self,
        spec: KVSpec,
        *,
        pool: PagePool,
        num_slots: int,
        max_model_len: int,
        layout: str = "all-layers",
        premap_pages: int = 0,
        max_idle_pages: int | None = None,
        enable_prefix_caching: bool = False,
        prefix_cache_hash: str = "sha256",
    ) -> None:
        """Args:
        spec: per-token KV shape.
        pool: physical pages (its page size sets the layout's page size).
        num_slots: the most requests that can hold KV at once.
        max_model_len: the longest request (slots are this long, rounded up to whole pages).
        layout: "all-layers" or "per-layer" (see :mod:`vmkv.kv.spec`).
        premap_pages: extra pages (per region) mapped ahead of need when the pool has them free.
        max_idle_pages: pages idle slots may keep mapped for reuse (None: no limit; they are
            reclaimed on demand either way).
        enable_prefix_caching: share pages of common prefixes across requests (the unit is a
            page; its hash covers every token overlapping it, see :mod:`vmkv.kv.prefix`).
        prefix_cache_hash: "sha256" or "builtin".
        """
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if premap_pages < 0:
            raise ValueError(f"premap_pages must be >= 0, got {premap_pages}")
        self.spec = spec
        self.pool = pool
        self.backend = pool.backend
        self.device = self.backend.device
        self.layout = VirtualLayout(layout, spec, pool.page_size, max_model_len)
        self.max_model_len = max_model_len
        self.num_slots = num_slots
        self.premap_pages = premap_pages
        self.max_idle_pages = max_idle_pages
        slot_bytes = self.layout.slot_bytes
        va_slots = num_slots + 1  # request slots 1..num_slots after the anchor slot
        if slot_bytes * va_slots >= 1 << 46:
            raise ValueError(
                f"{num_slots} slots of {slot_bytes} B exceed the 64 TiB of virtual address "
                "space vmkv allows itself; lower max_num_seqs or max_model_len")
        # regions grow in lockstep; a pool split into one partition per region keeps each
        # region's pages physically adjacent (long runs, few VMAs)
        per_region = pool.partitions == self.layout.num_regions
        self.regions = [
            VirtualRegion(pool, va_slots * slot_bytes, name=f"kv-region-{i}",
                          partition=i if per_region else 0,
                          anchor_pages=self.layout.pages_for(1))  # every view's base row
            for i in range(self.layout.num_regions)
        ]
        self._layer_views = self.layout.layer_views(
            [r.as_bytes() for r in self.regions], va_slots
        )
        self._mapped = [0] * va_slots  # the anchor slot's pages are the regions' own
        self._idle_slots = set(range(ANCHOR_SLOT + 1, va_slots))
        self._slot_of: dict[str, int] = {}
        self._num_tokens: dict[str, int] = {}
        self._mapper: BackgroundMapper | None = None
        self._init_prefix_cache(enable_prefix_caching, prefix_cache_hash)

    # -- background pre-mapping (vmkv.memory.mapper) ------------------------------------------
    def attach_mapper(self, mapper: BackgroundMapper | None) -> None:
        """Let ``mapper`` pre-map pages (:meth:`premap_ahead`); from now on every public method
        first waits for it, so the manager is never used while a unit runs."""
        self._quiesce()
        self._mapper = mapper

    def _quiesce(self) -> None:
        if self._mapper is not None:
            self._mapper.wait()

    def premap_ahead(self, lookahead_tokens: int) -> list[Callable[[], int]]:
        """Units for a :class:`~vmkv.memory.mapper.BackgroundMapper`: one per running request
        whose slot lacks the pages its next ``lookahead_tokens`` tokens need. A unit maps free
        pool pages only (it never reclaims or evicts, and never unmaps) and returns the pages it
        mapped per region; it does nothing if the request is gone or the pool is short when it
        runs. Pages mapped ahead are surplus: reclaimable, and counted in ``bytes_held``."""
        self._quiesce()
        units: list[Callable[[], int]] = []
        for rid, slot in self._slot_of.items():
            want = min(self.layout.pages_for(self._num_tokens[rid] + lookahead_tokens),
                       self.layout.slot_pages)
            if want > self._mapped[slot]:
                units.append(functools.partial(self._premap_slot, rid, slot, want))
        return units

    def _premap_slot(self, request_id: str, slot: int, want: int) -> int:
        """Map ``slot`` up to ``want`` pages per region if the pool has them free (mapper
        thread; the engine waits in :meth:`_quiesce` before touching the manager)."""
        grow = want - self._mapped[slot]
        if self._slot_of.get(request_id) != slot or grow <= 0:
            return 0
        regions = len(self.regions)
        budget = self.pool.max_vmas
        if grow * regions > self.pool.num_free or (
                budget is not None and self.pool.num_vmas + grow * regions > budget):
            return 0  # checked first, so _grow never rolls back (unmaps) on this thread
        return grow if self._grow(slot, grow) else 0

    # -- addressing ---------------------------------------------------------------------------
    def slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_slots + 1, slot_tokens, kv_head, head_dim]`` strided K and V views of
        ``layer`` (index 0 is the anchor slot; its base is always mapped)."""
        return self._layer_views[layer]

    def num_tokens(self, request_id: str) -> int:
        return self._num_tokens.get(request_id, 0)

    def request_ids(self) -> list[str]:
        return list(self._slot_of)

    @property
    def capacity_tokens(self) -> int:
        return self.layout.tokens_in(self.pool.num_pages // len(self.regions))

    def mapped_pages(self, slot: int) -> int:
        self._quiesce()
        return self._mapped[slot]

    def _first_va_page(self, slot: int) -> int:
        return slot * self.layout.slot_pages

    # -- planning -----------------------------------------------------------------------------
    def _pick_slot(self, need: int) -> int | None:
        """Best fit among idle slots: the fewest mapped pages that still cover ``need``, else
        the most mapped pages (fewest new maps)."""
        if not self._idle_slots:
            return None
        covering = [s for s in self._idle_slots if self._mapped[s] >= need]
        if covering:
            return min(covering, key=lambda s: (self._mapped[s], s))
        return max(self._idle_slots, key=lambda s: (self._mapped[s], -s))

    def _plan(self, request_id: str, num_new_tokens: int) -> tuple[int | None, int, list[int]]:
        """(slot, pages to grow per region, slot page indices to copy before writing)."""
        cur = self.num_tokens(request_id)
        new_len = cur + num_new_tokens
        self._check_length(request_id, new_len)
        need = self.layout.pages_for(new_len)
        slot = self._slot_of.get(request_id)
        if slot is None:
            slot = self._pick_slot(need)
            if slot is None:
                return None, 0, []
        mapped = self._mapped[slot]
        cow = []
        if num_new_tokens:
            first = self._first_va_page(slot)
            region = self.regions[0]
            for p in range(self.layout.first_page_of(cur), min(need, mapped)):
                if self.pool.is_shared(int(region.page_at[first + p])):
                    cow.append(p)
        return slot, max(0, need - mapped), cow

    def _reclaimable(self, exclude: int) -> int:
        """Pages (all regions) that unmapping idle slots and surplus tails, and evicting pages
        only the prefix cache holds, would free."""
        total = sum(self._mapped[s] for s in self._idle_slots if s != exclude)
        for rid, slot in self._slot_of.items():
            if slot != exclude:
                total += self._mapped[slot] - self.layout.pages_for(self._num_tokens[rid])
        return total * len(self.regions) + self._num_evictable()

    def units_needed(self, request_id: str, num_new_tokens: int) -> int | None:
        self._quiesce()
        slot, grow, cow = self._plan(request_id, num_new_tokens)
        return None if slot is None else (grow + len(cow)) * len(self.regions)

    @property
    def free_units(self) -> int:
        self._quiesce()
        return self.pool.num_free + self._reclaimable(exclude=-1)

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        self._quiesce()
        slot, grow, cow = self._plan(request_id, num_new_tokens)
        if slot is None:
            return False
        need = (grow + len(cow)) * len(self.regions)
        return need <= self.pool.num_free + self._reclaimable(slot)

    # -- growth -------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        self._quiesce()
        slot, grow, cow = self._plan(request_id, num_new_tokens)
        if slot is None:
            return False
        regions = len(self.regions)
        need = (grow + len(cow)) * regions
        if need > self.pool.num_free:
            self._reclaim(need - self.pool.num_free, exclude=slot)
            if need > self.pool.num_free:
                return False
        if grow:
            extra = min(self.premap_pages, self.layout.slot_pages - self._mapped[slot] - grow,
                        (self.pool.num_free - need) // regions)
            if not self._grow(slot, grow + max(0, extra)) and not (
                extra > 0 and self._grow(slot, grow)
            ):
                return False
        for page in cow:
            self._copy_on_write(slot, page)
        self._slot_of[request_id] = slot
        self._idle_slots.discard(slot)
        self._num_tokens[request_id] = self.num_tokens(request_id) + num_new_tokens
        return True

    def _grow(self, slot: int, num: int) -> bool:
        """Map ``num`` more pages at the end of ``slot``'s prefix in every region."""
        va_page = self._first_va_page(slot) + self._mapped[slot]
        done: list[VirtualRegion] = []
        try:
            for region in self.regions:
                if region.map_new(va_page, num) is None:
                    raise MappingBudgetExceeded("pool ran short while growing")
                done.append(region)
        except MappingBudgetExceeded:
            for region in done:  # all or nothing across regions
                region.unmap(va_page, num)
            return False
        self._mapped[slot] += num
        return True

    def _copy_on_write(self, slot: int, page: int) -> None:
        """Give ``slot`` a private copy of its shared page ``page`` in every region."""
        va_page = self._first_va_page(slot) + page
        ps = self.pool.page_size
        for region in self.regions:
            data = region.as_bytes()[va_page * ps : (va_page + 1) * ps]
            saved = data.clone()
            (new_page,) = self.pool.allocate(1, None, region.partition)  # room was checked
            self.backend.synchronize()  # the clone (and any reader) must finish before remap
            region.replace(va_page, new_page)
            data.copy_(saved)

    # -- shrinking ----------------------------------------------------------------------------
    def _unmap_tail(self, slot: int, num: int) -> None:
        """Unmap the last ``num`` mapped pages of ``slot`` in every region."""
        if num <= 0:
            return
        self.backend.synchronize()
        self._mapped[slot] -= num
        va_page = self._first_va_page(slot) + self._mapped[slot]
        for region in self.regions:
            region.unmap(va_page, num)

    def _reclaim(self, pages_wanted: int, exclude: int) -> None:
        """Unmap idle slots (largest first), then surplus tails of running slots."""
        regions = len(self.regions)
        for slot in sorted(self._idle_slots, key=lambda s: -self._mapped[s]):
            if pages_wanted <= 0:
                return
            if slot != exclude and self._mapped[slot]:
                take = min(self._mapped[slot], -(-pages_wanted // regions))
                self._unmap_tail(slot, take)
                pages_wanted -= take * regions
        for rid, slot in self._slot_of.items():
            if pages_wanted <= 0:
                return
            surplus = self._mapped[slot] - self.layout.pages_for(self._num_tokens[rid])
            if slot != exclude and surplus > 0:
                take = min(surplus, -(-pages_wanted // regions))
                self._unmap_tail(slot, take)
                pages_wanted -= take * regions
        if pages_wanted > 0:
            self._evict_cached(pages_wanted)

    def _trim_idle(self) -> None:
        """Keep at most ``max_idle_pages`` mapped in idle slots; let the pool trim the rest."""
        if self.max_idle_pages is not None:
            idle = sum(self._mapped[s] for s in self._idle_slots) * len(self.regions)
            if idle > self.max_idle_pages:
                self._reclaim(idle - self.max_idle_pages, exclude=-1)
        self.pool.trim()

    def free(self, request_id: str) -> None:
        self._quiesce()
        slot = self._slot_of.pop(request_id)
        del self._num_tokens[request_id]
        first = self._first_va_page(slot)
        shared = any(
            self.pool.is_shared(int(p))
            for p in self.regions[0].page_at[first : first + self._mapped[slot]]
        )
        if shared:  # keep no shared page in an idle slot: its owner would copy it needlessly
            self._unmap_tail(slot, self._mapped[slot])
        self._idle_slots.add(slot)
        self._forget_prefix(request_id)
        self._trim_idle()

    # -- swapping -----------------------------------------------------------------------------
    def _slot_bytes(self, region: VirtualRegion, slot: int, num_pages: int) -> torch.Tensor:
        ps = self.pool.page_size
        first = self._first_va_page(slot)
        return region.as_bytes()[first * ps : (first + num_pages) * ps]

    def swap_out(self, request_id: str) -> SwappedKV:
        """Copy the request's mapped pages (page-granular) to host memory, then free it."""
        self._quiesce()
        slot, n = self._slot_of[request_id], self._num_tokens[request_id]
        need = self.layout.pages_for(n)
        data = [self._host_copy(self._slot_bytes(r, slot, need)) for r in self.regions]
        self.backend.synchronize()
        self.free(request_id)
        return SwappedKV(n, data)

    def swap_in(self, request_id: str, swapped: SwappedKV) -> bool:
        """Map fresh pages in a slot and copy the saved pages back under them."""
        self._quiesce()
        if request_id in self._slot_of:
            raise ValueError(f"swap_in of {request_id!r} which already holds KV")
        if not self.allocate(request_id, swapped.num_tokens):
            return False
        slot = self._slot_of[request_id]
        need = self.layout.pages_for(swapped.num_tokens)
        for region, saved in zip(self.regions, swapped.data, strict=True):
            self._slot_bytes(region, slot, need).copy_(saved, non_blocking=True)
        return True

    # -- sharing ------------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> bool:
        self._quiesce()
        if child_id in self._slot_of:
            raise ValueError(f"fork target {child_id!r} already holds KV")
        parent_slot = self._slot_of[parent_id]
        length = self._num_tokens[parent_id]
        share = self.layout.pages_for(length)
        idle = [s for s in self._idle_slots]
        if not idle:
            return False
        slot = min(idle, key=lambda s: (self._mapped[s], s))
        own = self._mapped[slot]
        if own:  # the child's slot must be empty where the parent's pages go
            self._unmap_tail(slot, own)
        src, dst = self._first_va_page(parent_slot), self._first_va_page(slot)
        done: list[VirtualRegion] = []
        try:
            for region in self.regions:
                region.map_shared(dst, [int(p) for p in region.page_at[src : src + share]])
                done.append(region)
        except MappingBudgetExceeded:
            for region in done:
                region.unmap(dst, share)
            return False
        self._mapped[slot] = share
        self._slot_of[child_id] = slot
        self._idle_slots.discard(slot)
        self._num_tokens[child_id] = length
        self._inherit_prefix(parent_id, child_id)
        return True

    # -- prefix-caching hooks (see vmkv.kv.prefix): the unit is a page index, all regions ----
    def _unit_span(self, page: int) -> tuple[int, int]:
        ps, row = self.pool.page_size, self.layout.row_bytes
        return page * ps // row, -(-(page + 1) * ps // row)

    def _unit_payload(self, request_id: str, page: int) -> tuple[int, ...]:
        va_page = self._first_va_page(self._slot_of[request_id]) + page
        return tuple(int(r.page_at[va_page]) for r in self.regions)

    def _hold(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            self.pool.retain(page)

    def _unhold(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            self.pool.release(page)

    def _is_cache_only(self, pages: tuple[int, ...]) -> bool:
        # the regions are mapped, shared, copied and unmapped in lockstep, so one page index
        # has the same reference count in every region (asserted by check()): look at one
        return self.pool.ref_cnt[pages[0]] == 1

    def _payload_units(self, pages: tuple[int, ...]) -> int:
        return len(pages)

    def _adopt(self, request_id: str, payloads: list[tuple[int, ...]]) -> int | None:
        """Map the hit pages at the start of an empty slot (like a fork of the cache)."""
        if request_id in self._slot_of:
            raise ValueError(f"match_prefix for {request_id!r}, which already holds KV")
        tokens = self.layout.tokens_in(len(payloads))
        if not self._idle_slots or tokens == 0:
            return None
        slot = min(self._idle_slots, key=lambda s: (self._mapped[s], s))
        self._unmap_tail(slot, self._mapped[slot])
        dst = self._first_va_page(slot)
        done: list[VirtualRegion] = []
        try:
            for r, region in enumerate(self.regions):
                region.map_shared(dst, [pages[r] for pages in payloads])
                done.append(region)
        except MappingBudgetExceeded:
            for region in done:
                region.unmap(dst, len(payloads))
            return None
        self._mapped[slot] = len(payloads)
        self._slot_of[request_id] = slot
        self._idle_slots.discard(slot)
        self._num_tokens[request_id] = tokens
        return tokens

    # -- accounting ---------------------------------------------------------------------------
    @property
    def usage(self) -> KVUsage:
        self._quiesce()
        ps, row = self.pool.page_size, self.layout.row_bytes
        useful = np.zeros(self.pool.num_pages, dtype=np.int64)  # live bytes per physical page
        for rid, slot in self._slot_of.items():
            n = self._num_tokens[rid]
            need = self.layout.pages_for(n)
            if not need:
                continue
            live = np.minimum(ps, n * row - np.arange(need) * ps)
            first = self._first_va_page(slot)
            for region in self.regions:
                pages = region.page_at[first : first + need]
                np.maximum.at(useful, pages, live)
        return KVUsage(
            num_requests=len(self._slot_of),
            num_tokens=sum(self._num_tokens.values()),
            capacity_bytes=self.pool.num_pages * ps,
            bytes_in_use=int(np.count_nonzero(useful)) * ps,
            bytes_held=self.pool.num_in_use * ps,
            bytes_created=self.pool.num_created * ps,
            token_bytes=int(useful.sum()),
            virt_reserved_bytes=sum(r.nbytes for r in self.regions),
            bytes_cached=sum(len(p) for p in self._cache_holds() if self._is_cache_only(p)) * ps,
        )

    def check(self) -> None:
        self._quiesce()
        pool, layout = self.pool, self.layout
        pool.check()
        assert set(self._slot_of.values()).isdisjoint(self._idle_slots)
        assert len(self._slot_of) + len(self._idle_slots) == self.num_slots
        assert len(set(self._slot_of.values())) == len(self._slot_of), "slot given twice"
        for rid, slot in self._slot_of.items():
            assert self._mapped[slot] >= layout.pages_for(self._num_tokens[rid]), rid
        refs = np.zeros(pool.num_pages, dtype=np.int64)
        where: dict[int, tuple[int, int]] = {}
        runs = 0
        assert ANCHOR_SLOT not in self._idle_slots and ANCHOR_SLOT not in self._slot_of.values()
        for r, region in enumerate(self.regions):
            table = region.page_at.reshape(len(self._mapped), layout.slot_pages)
            for slot in range(len(self._mapped)):
                m = self._mapped[slot]
                assert (table[slot, :m] != UNMAPPED).all(), f"hole in slot {slot} region {r}"
                assert (table[slot, m:] == UNMAPPED).all(), f"stray page in slot {slot}"
                for p, page in enumerate(table[slot, :m]):
                    # a page mapped twice must be a fork share: same region, same page index
                    assert where.setdefault(int(page), (r, p)) == (r, p), f"page {page} aliased"
            mapped = region.page_at[region.page_at != UNMAPPED]
            np.add.at(refs, mapped, 1)
            assert region.num_mapped == len(mapped)
            runs += region.num_vmas
        for pages in self._cache_holds():
            for page in pages:
                refs[page] += 1
            assert len({pool.ref_cnt[p] for p in pages}) == 1, "regions out of lockstep"
        assert refs.tolist() == pool.ref_cnt, "page ref counts disagree with mappings + cache"
        assert runs == pool.num_vmas

    def close(self) -> None:
        self._quiesce()
        for rid in list(self._slot_of):
            self.free(rid)
        self._evict_cached(self.pool.num_pages)
        self._layer_views = []
        for region in self.regions:
            region.close()
        self.pool.release_all_idle()
