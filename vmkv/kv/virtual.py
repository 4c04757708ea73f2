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

Parts: :class:`~vmkv.kv.slots.SlotTable` (who holds which slot, mapped pages per slot),
:class:`~vmkv.kv.regions.RegionGroup` (the regions, mapped in lockstep) and, when enabled,
:class:`~vmkv.kv.prefix.PrefixCaching` over this module's :class:`PageUnits`. A background mapper
(CUDA) may run units of :meth:`VirtualKVCache.premap_ahead` between steps; every public method
first waits for it (:func:`_waits_for_mapper`, applied once to the class).

Latency hiding: the pool may be pre-created, and half of it then mapped into the idle slots at
start-up with page-table entries present (:meth:`VirtualKVCache.warm_idle_slots`, the host
engine's default: paged mode's pre-zeroed tensor, here); growth maps ``premap_pages`` extra
pages when free pages exist (fewer, larger map calls); finished slots keep their pages
(deferred reclamation), also those the prefix cache holds, and a new request takes the idle
slot that fits best and reuses its pages in place (the cache gives up the ones it held): often
no map call, no page fault at all. Pages kept this way are reclaimed on demand, and beyond
``max_idle_pages`` eagerly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from vmkv.kv.addressing import SlotAddressing
from vmkv.kv.base import KVCacheManager, KVUsage, SwappedKV
from vmkv.kv.changes import (
    CopyPage,
    DropSwapped,
    Forget,
    HoldPages,
    KVChange,
    MapPages,
    Place,
    SwapIn,
    SwapOut,
    Tokens,
    TrimPool,
    UnmapPages,
)
from vmkv.kv.prefix import PrefixCaching
from vmkv.kv.regions import RegionGroup
from vmkv.kv.slots import SlotTable
from vmkv.kv.spec import KVSpec, VirtualLayout
from vmkv.memory.errors import MappingBudgetExceeded, VmmError
from vmkv.memory.pool import PagePool

if TYPE_CHECKING:
    from vmkv.memory.mapper import BackgroundMapper

C = TypeVar("C", bound=type)


def _waits_for_mapper(cls: C) -> C:
    """Make every public method and property of ``cls`` (inherited ones included) wait for
    the attached background mapper first, so the manager is never read or changed while a
    mapper unit runs. Private methods are not wrapped: the mapper's units call them."""

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: VirtualKVCache, *args: Any, **kwargs: Any) -> Any:
            if self.mapper is not None:
                self.mapper.wait()
            return fn(self, *args, **kwargs)

        return wrapper

    for name, member in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            setattr(cls, name, property(guarded(member.fget)))
        elif inspect.isfunction(member):
            setattr(cls, name, guarded(member))
    return cls


@_waits_for_mapper
class VirtualKVCache(KVCacheManager):
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
        max_idle_pages: pages kept for reuse when no running request needs them, idle slots'
            mappings, pages only the prefix cache holds and idle pool pages together; beyond it
            they are unmapped, evicted and returned to the OS/driver as requests finish (None:
            no limit; they are reclaimed on demand either way).
        enable_prefix_caching: share pages of common prefixes across requests (the unit is a
            page; its hash covers every token overlapping it, see :mod:`vmkv.kv.prefix`).
        prefix_cache_hash: "sha256" or "builtin".
        """
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
        self.slots = SlotTable(num_slots)
        if self.layout.slot_bytes * self.slots.num_va_slots >= 1 << 46:
            raise ValueError(
                f"{num_slots} slots of {self.layout.slot_bytes} B exceed the 64 TiB of virtual "
                "address space vmkv allows itself; lower max_num_seqs or max_model_len")
        self.regions = RegionGroup(pool, self.layout, self.slots.num_va_slots, self._record)
        self._layer_views = self.regions.layer_views(self.slots.num_va_slots)
        self._num_tokens: dict[str, int] = {}
        self._saved: dict[str, list[torch.Tensor]] = {}  # a follower's swapped-out KV
        self.mapper: BackgroundMapper | None = None
        self.warm_pages = 0  # pages per slot and region mapped at start-up (warm_idle_slots)
        if enable_prefix_caching:
            self.prefix = PrefixCaching(PageUnits(self), prefix_cache_hash)

    # -- background pre-mapping (vmkv.memory.mapper) ------------------------------------------
    def attach_mapper(self, mapper: BackgroundMapper | None) -> None:
        """Let ``mapper`` pre-map pages (:meth:`premap_ahead`); from now on every public method
        first waits for it, so the manager is never used while a unit runs. The manager owns
        it: :meth:`close` closes it."""
        self.mapper = mapper

    def start_background_mapper(self) -> BackgroundMapper | None:
        """A mapper thread attached to this cache when its pages live on a GPU (there map calls
        overlap the kernels); None on the host, where nothing runs asynchronously."""
        if self.device.type != "cuda":
            return None
        from vmkv.memory.mapper import BackgroundMapper

        mapper = BackgroundMapper(self.backend)
        self.attach_mapper(mapper)
        return mapper

    def premap_ahead(self, lookahead_tokens: int) -> list[Callable[[], int]]:
        """Units for a :class:`~vmkv.memory.mapper.BackgroundMapper`: one per running request
        whose slot lacks the pages its next ``lookahead_tokens`` tokens need. A unit maps free
        pool pages only (it never reclaims or evicts, and never unmaps) and returns the pages it
        mapped per region; it does nothing if the request is gone or the pool is short when it
        runs. Pages mapped ahead are surplus: reclaimable, and counted in ``bytes_held``."""
        units: list[Callable[[], int]] = []
        for rid, slot in self.slots.slot_of.items():
            want = min(self.layout.pages_for(self._num_tokens[rid] + lookahead_tokens),
                       self.layout.slot_pages)
            if want > self.slots.mapped[slot]:
                units.append(functools.partial(self._premap_slot, rid, slot, want))
        return units

    def _premap_slot(self, request_id: str, slot: int, want: int) -> int:
        """Map ``slot`` up to ``want`` pages per region if the pool has them free (mapper
        thread; the engine waits for it before touching the manager)."""
        grow = want - self.slots.mapped[slot]
        if self.slots.slot_of.get(request_id) != slot or grow <= 0:
            return 0
        regions = len(self.regions)
        budget = self.pool.max_vmas
        if grow * regions > self.pool.num_free or (
                budget is not None and self.pool.num_vmas + grow * regions > budget):
            return 0  # checked first, so the growth never rolls back (unmaps) on this thread
        return grow if self._grow(slot, grow) else 0

    @property
    def vma_budget(self) -> int | None:
        return self.pool.max_vmas

    def limit_vma_budget(self, budget: int) -> None:
        if self.pool.max_vmas is not None:
            self.pool.max_vmas = min(self.pool.max_vmas, budget)

    # -- addressing ---------------------------------------------------------------------------
    def slot(self, request_id: str) -> int:
        return self.slots.slot_of[request_id]

    def addressing(self, request_ids: Sequence[str], context_lens: Sequence[int], *,
                   full_width: bool = False) -> SlotAddressing:
        slot_of = self.slots.slot_of
        ids = np.fromiter((slot_of[r] for r in request_ids), np.int64, len(request_ids))
        return SlotAddressing(ids, self.layout.slot_tokens)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_slots + 1, slot_tokens, kv_head, head_dim]`` strided K and V views of
        ``layer`` (index 0 is the anchor slot; its base is always mapped)."""
        return self._layer_views[layer]

    def num_tokens(self, request_id: str) -> int:
        return self._num_tokens.get(request_id, 0)

    def request_ids(self) -> list[str]:
        return list(self.slots.slot_of)

    @property
    def capacity_tokens(self) -> int:
        return self.layout.tokens_in(self.pool.num_pages // len(self.regions))

    def mapped_pages(self, slot: int) -> int:
        return self.slots.mapped[slot]

    def units_of(self, request_id: str) -> list[int]:
        slot = self.slots.slot_of[request_id]
        first = self._first_va_page(slot)
        return self.regions[0].page_at[first : first + self.slots.mapped[slot]].tolist()

    def describe(self) -> str:
        lay = self.layout
        return (f"virtual: {self.regions.nbytes / 2**30:,.1f} GiB reserved ({self.num_slots} "
                f"slots x {lay.slot_tokens:,} tokens), layout {lay.name}, page "
                f"{lay.page_size // 1024} KiB = {lay.page_size / lay.row_bytes:.2f} tokens, "
                f"{self.pool.num_created} pages pre-created, {self.warm_pages} per slot and "
                "region mapped at start-up")

    def memory_stats(self) -> dict[str, dict[str, float]]:
        return self.backend.stats.as_dict()

    def _first_va_page(self, slot: int) -> int:
        return slot * self.layout.slot_pages

    # -- planning -----------------------------------------------------------------------------
    def _plan(self, request_id: str, num_new_tokens: int) -> tuple[int | None, int, list[int]]:
        """(slot, pages to grow per region, slot page indices to copy before writing)."""
        cur = self.num_tokens(request_id)
        new_len = cur + num_new_tokens
        self._check_length(request_id, new_len)
        need = self.layout.pages_for(new_len)
        slot = self.slots.slot_of.get(request_id)
        if slot is None:
            slot = self.slots.best_fit(need)
            if slot is None:
                return None, 0, []
        if request_id not in self.slots.slot_of:  # an idle slot: its own pages up to the
            return slot, max(0, need - self._first_cached(slot)), []  # first one cached
        mapped = self.slots.mapped[slot]
        cow = []
        if num_new_tokens:
            first = self._first_va_page(slot)
            for p in range(self.layout.first_page_of(cur), min(need, mapped)):
                if self._shared(first + p):
                    cow.append(p)
        return slot, max(0, need - mapped), cow

    def _shared(self, va_page: int) -> bool:
        """Whether the page at ``va_page`` has another holder (a mapping or the cache)."""
        return self.pool.is_shared(int(self.regions[0].page_at[va_page]))

    def _cached(self, va_page: int) -> bool:
        return self.prefix is not None and self.prefix.holds_payload(
            self.regions.pages_at(va_page))

    def _mapped_elsewhere(self, va_page: int) -> bool:
        """Whether the page at ``va_page`` is mapped somewhere else too (a fork, a prefix
        hit); a page also held by the prefix cache alone is not."""
        refs = self.pool.ref_cnt[int(self.regions[0].page_at[va_page])]
        return refs - self._cached(va_page) > 1

    def _first_cached(self, slot: int) -> int:
        """Index of the first of ``slot``'s mapped pages the prefix cache holds (its mapped
        count if none)."""
        first = self._first_va_page(slot)
        return next((p for p in range(self.slots.mapped[slot]) if self._cached(first + p)),
                    self.slots.mapped[slot])

    def _surplus(self) -> list[tuple[int, int]]:
        """(slot, pages beyond what its tokens need) of every running request."""
        return [(slot, self.slots.mapped[slot] - self.layout.pages_for(self._num_tokens[rid]))
                for rid, slot in self.slots.slot_of.items()]

    def _reclaimable(self, exclude: int) -> int:
        """Pages (all regions) that unmapping idle slots and surplus tails, and evicting pages
        only the prefix cache holds, would free."""
        total = sum(self.slots.mapped[s] for s in self.slots.idle if s != exclude)
        if exclude in self.slots.idle:  # a newcomer's idle slot: the cached pages it gives up
            total += self.slots.mapped[exclude] - self._first_cached(exclude)
        total += sum(n for slot, n in self._surplus() if slot != exclude)
        evictable = self.prefix.num_evictable() if self.prefix is not None else 0
        return total * len(self.regions) + evictable

    def units_needed(self, request_id: str, num_new_tokens: int) -> int | None:
        slot, grow, cow = self._plan(request_id, num_new_tokens)
        return None if slot is None else (grow + len(cow)) * len(self.regions)

    @property
    def free_units(self) -> int:
        return self.pool.num_free + self._reclaimable(exclude=-1)

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        slot, grow, cow = self._plan(request_id, num_new_tokens)
        if slot is None:
            return False
        need = (grow + len(cow)) * len(self.regions)
        return need <= self.pool.num_free + self._reclaimable(slot)

    # -- growth -------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        slot, grow, cow = self._plan(request_id, num_new_tokens)
        if slot is None:
            return False
        regions = len(self.regions)
        need = (grow + len(cow)) * regions
        if request_id not in self.slots.slot_of:
            # an idle slot may still map pages the cache holds (its last request's prefix):
            # they stay the cache's (unmapped here, not overwritten, evictable if need be);
            # fresh pages replace them
            self._unmap_tail(slot, self.slots.mapped[slot] - self._first_cached(slot))
        if need > self.pool.num_free:
            self._reclaim(need - self.pool.num_free, exclude=slot)
            if need > self.pool.num_free:
                return False
        mapped = self.slots.mapped[slot]
        if grow:
            extra = min(self.premap_pages, self.layout.slot_pages - self.slots.mapped[slot] - grow,
                        (self.pool.num_free - need) // regions)
            if not self._grow(slot, grow + max(0, extra)) and not (
                extra > 0 and self._grow(slot, grow)
            ):
                return False
        try:
            for page in cow:
                self.regions.copy_on_write(self._first_va_page(slot) + page)
        except VmmError as exc:  # give back the growth; copies already made stay (still exact)
            self._unmap_tail(slot, self.slots.mapped[slot] - mapped)
            if isinstance(exc, MappingBudgetExceeded):
                return False
            raise
        self._hold_slot(request_id, slot, self.num_tokens(request_id) + num_new_tokens)
        return True

    def warm_idle_slots(self, share: float) -> int:
        """Spread ``share`` of the free pool evenly over the empty idle slots, mapped and with
        their page-table entries present (:meth:`MemoryBackend.populate`), as paged mode's one
        zeroed block tensor is before its first step: a request then starts in a slot that is
        mapped and resident, and maps (and faults) only past its share. The rest of the pool
        stays free, so a request that outgrows its share takes free pages, not another slot's.
        A start-up step (nothing is recorded for followers: every rank warms the same way);
        stops early where the VMA budget runs out. Returns the pages each slot got per region.
        """
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        empty = [s for s in sorted(self.slots.idle) if self.slots.mapped[s] == 0]
        if not empty:
            return 0
        per_slot = min(self.layout.slot_pages,
                       int(self.pool.num_free * share) // (len(self.regions) * len(empty)))
        if per_slot <= 0:
            return 0
        nbytes = per_slot * self.pool.page_size
        for slot in empty:
            first = self._first_va_page(slot)
            if not self._grow(slot, per_slot):
                break
            for region in self.regions:
                self.backend.populate(region.va_of(first), nbytes)
        self.warm_pages = per_slot
        return per_slot

    def _hold_slot(self, request_id: str, slot: int, num_tokens: int) -> None:
        if request_id not in self.slots.slot_of:
            self.slots.hold(request_id, slot)
            self._record(Place(request_id, slot))
        self._num_tokens[request_id] = num_tokens
        self._record(Tokens(request_id, num_tokens))

    def _grow(self, slot: int, num: int) -> bool:
        """Map ``num`` more pages at the end of ``slot``'s prefix in every region."""
        if not self.regions.map_new(self._first_va_page(slot) + self.slots.mapped[slot], num):
            return False
        self.slots.mapped[slot] += num
        return True

    def _occupy(self, request_id: str, pages: Sequence[Sequence[int]], num_tokens: int
                ) -> bool:
        """Give ``request_id`` an idle slot whose first pages are ``pages[r]`` (already in use: a
        fork's parent's, or the prefix cache's) in region ``r``: one that still maps them there
        (its last holder's cached prefix: nothing to map), else an emptied one."""
        num = len(pages[0])
        slot = next((s for s in sorted(self.slots.idle) if self.slots.mapped[s] >= num
                     and self.regions.pages(self._first_va_page(s), num) == pages), None)
        if slot is not None:
            self._unmap_tail(slot, self.slots.mapped[slot] - num)  # its own pages past them
            self._hold_slot(request_id, slot, num_tokens)
            return True
        slot = self.slots.emptiest()
        if slot is None:
            return False
        self._unmap_tail(slot, self.slots.mapped[slot])  # it must be empty where they go
        if not self.regions.map_shared(self._first_va_page(slot), pages):
            return False
        self.slots.mapped[slot] = len(pages[0])
        self._hold_slot(request_id, slot, num_tokens)
        return True

    # -- shrinking ----------------------------------------------------------------------------
    def _unmap_tail(self, slot: int, num: int) -> None:
        """Unmap the last ``num`` mapped pages of ``slot`` in every region."""
        if num <= 0:
            return
        self.backend.synchronize()
        self.slots.mapped[slot] -= num
        self.regions.unmap(self._first_va_page(slot) + self.slots.mapped[slot], num)

    def _reclaim(self, pages_wanted: int, exclude: int) -> None:
        """Unmap idle slots (largest first), then surplus tails of running slots, then evict
        pages only the prefix cache holds, until ``pages_wanted`` more pages are free (an
        unmapped page the cache still holds is freed by the eviction, not the unmap)."""
        regions, target = len(self.regions), self.pool.num_free + pages_wanted
        idle = [(s, self.slots.mapped[s]) for s in sorted(
            self.slots.idle, key=lambda s: -self.slots.mapped[s])]
        for slot, spare in idle + self._surplus():
            if self.pool.num_free >= target:
                return
            if slot != exclude and spare > 0:
                take = min(spare, -(-(target - self.pool.num_free) // regions))
                self._unmap_tail(slot, take)
        if self.pool.num_free < target and self.prefix is not None:
            self.prefix.evict(target - self.pool.num_free)

    def _kept_pages(self) -> int:
        """Pages (all regions) kept although no running request needs them: mapped in idle
        slots or held only by the prefix cache (idle pool pages not included)."""
        idle = sum(self.slots.mapped[s] for s in self.slots.idle) * len(self.regions)
        return idle + (self.prefix.num_evictable() if self.prefix is not None else 0)

    def _trim_idle(self) -> None:
        """Keep at most ``max_idle_pages`` pages that no running request uses, all kinds
        together, and return the rest to the OS/driver. Given up first: idle slots' mappings
        (largest slot first), then the least recently used cached prefixes; idle pool pages
        get what the budget leaves (they save only a create call)."""
        budget = self.max_idle_pages
        if budget is None:
            self.pool.trim()
            self._record(TrimPool(None))
            return
        if self._kept_pages() > budget:
            self._reclaim(self._kept_pages() - budget, exclude=-1)
        excess = self._kept_pages() - budget  # unmapped cached pages became cache-only
        if excess > 0 and self.prefix is not None:
            self.prefix.evict(excess)
        keep = max(0, budget - self._kept_pages())
        if self.pool.max_idle_pages is not None:
            keep = min(keep, self.pool.max_idle_pages)
        self.pool.trim(keep)
        self._record(TrimPool(keep))

    def reset_prefix_cache(self) -> int:
        dropped = super().reset_prefix_cache()
        self._trim_idle()  # the pages only the cache held are idle now
        return dropped

    def free(self, request_id: str) -> None:
        slot = self.slots.release(request_id)
        del self._num_tokens[request_id]
        self._record(Forget(request_id))
        first = self._first_va_page(slot)
        # an idle slot keeps its pages for the next request to reuse in place, also those the
        # prefix cache holds (that request takes them over); but no page mapped elsewhere too
        # (a fork, a prefix hit): its next holder would have to copy it
        if any(self._mapped_elsewhere(first + p) for p in range(self.slots.mapped[slot])):
            self._unmap_tail(slot, self.slots.mapped[slot])
        if self.prefix is not None:
            self.prefix.forget(request_id)
        self._trim_idle()

    # -- swapping -----------------------------------------------------------------------------
    def swap_out(self, request_id: str) -> SwappedKV:
        """Copy the request's mapped pages (page-granular) to host memory, then free it."""
        slot, n = self.slots.slot_of[request_id], self._num_tokens[request_id]
        where = (self._first_va_page(slot), self.layout.pages_for(n))
        data = [self._host_copy(v) for v in self.regions.byte_views(*where)]
        self.backend.synchronize()
        swapped = SwappedKV(n, data)
        self._record_swap_out(swapped, SwapOut(request_id, where))
        self.free(request_id)
        return swapped

    def swap_in(self, request_id: str, swapped: SwappedKV) -> bool:
        """Map fresh pages in a slot and copy the saved pages back under them."""
        if request_id in self.slots.slot_of:
            raise ValueError(f"swap_in of {request_id!r} which already holds KV")
        if not self.allocate(request_id, swapped.num_tokens):
            return False
        where = (self._first_va_page(self.slots.slot_of[request_id]),
                 self.layout.pages_for(swapped.num_tokens))
        for view, saved in zip(self.regions.byte_views(*where), swapped.data, strict=True):
            view.copy_(saved, non_blocking=True)
        if self.changes is not None:
            self.changes.append(SwapIn(request_id, where))
            self._swaps_held.discard(request_id)
        return True

    def apply_changes(self, changes: Sequence[KVChange]) -> None:
        """A follower takes the slots and the exact pages rank 0 chose, and moves its own
        bytes; it decides nothing (its prefix cache stays empty: the pages the leader's holds
        keep their references here as :class:`HoldPages`)."""
        regions, slot_pages = self.regions, self.layout.slot_pages
        for change in changes:
            match change:
                case Place(request_id, slot):
                    self.slots.hold(request_id, slot)
                case Tokens(request_id, num_tokens):
                    self._num_tokens[request_id] = num_tokens
                case Forget(request_id):
                    self.slots.release(request_id)
                    del self._num_tokens[request_id]
                case MapPages(va_page, pages, fresh):
                    num = len(pages[0])
                    mapped = (regions.map_new(va_page, num, pages) if fresh
                              else regions.map_shared(va_page, pages))
                    if not mapped:  # only a budget this rank does not share can refuse it
                        raise MappingBudgetExceeded(f"could not map {num} pages at va page "
                                                    f"{va_page} as rank 0 did")
                    slot, index = divmod(va_page, slot_pages)
                    self.slots.mapped[slot] = index + num
                case UnmapPages(va_page, num):
                    self.backend.synchronize()
                    regions.unmap(va_page, num)
                    slot, index = divmod(va_page, slot_pages)
                    self.slots.mapped[slot] = index
                case CopyPage(va_page, pages):
                    regions.copy_on_write(va_page, pages)
                case HoldPages(pages, hold):
                    for page in pages:
                        (self.pool.retain if hold else self.pool.release)(page)
                case TrimPool(keep):
                    self.pool.trim(keep)
                case SwapOut(request_id, where):
                    self._saved[request_id] = [self._host_copy(v)
                                               for v in regions.byte_views(*where)]
                    self.backend.synchronize()
                case SwapIn(request_id, where):
                    for view, saved in zip(regions.byte_views(*where),
                                           self._saved.pop(request_id), strict=True):
                        view.copy_(saved, non_blocking=True)
                case DropSwapped(request_ids):
                    for request_id in request_ids:
                        self._saved.pop(request_id, None)
                case _:
                    raise ValueError(f"a virtual KV cache cannot apply {change!r}")

    # -- sharing ------------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> bool:
        if child_id in self.slots.slot_of:
            raise ValueError(f"fork target {child_id!r} already holds KV")
        length = self._num_tokens[parent_id]
        src = self._first_va_page(self.slots.slot_of[parent_id])
        if not self._occupy(child_id, self.regions.pages(src, self.layout.pages_for(length)),
                            length):
            return False
        if self.prefix is not None:
            self.prefix.inherit(parent_id, child_id)
        return True

    # -- accounting ---------------------------------------------------------------------------
    @property
    def usage(self) -> KVUsage:
        ps, row = self.pool.page_size, self.layout.row_bytes
        useful = np.zeros(self.pool.num_pages, dtype=np.int64)  # live bytes per physical page
        va_pages, live = [], []  # every request's va pages with their live bytes
        for rid, slot in self.slots.slot_of.items():
            n = self._num_tokens[rid]
            need = self.layout.pages_for(n)
            if need:
                first = self._first_va_page(slot)
                va_pages.append(np.arange(first, first + need))
                live.append(np.minimum(ps, n * row - np.arange(need) * ps))
        if va_pages:  # vectorised over requests and regions (this runs every benchmark step)
            va, lv = np.concatenate(va_pages), np.concatenate(live)
            phys = np.concatenate([region.page_at[va] for region in self.regions])
            np.maximum.at(useful, phys, np.tile(lv, len(self.regions)))  # shared: the largest
        cached = 0
        if self.prefix is not None:  # held by the cache alone, or also mapped in an idle slot
            idle = {int(p) for s in self.slots.idle for p in self.regions[0].page_at[
                self._first_va_page(s) : self._first_va_page(s) + self.slots.mapped[s]]}
            refs = self.pool.ref_cnt
            cached = sum(len(p) for p in self.prefix.holds()
                         if refs[p[0]] == 1 or (refs[p[0]] == 2 and p[0] in idle))
        return KVUsage(
            num_requests=len(self.slots.slot_of),
            num_tokens=sum(self._num_tokens.values()),
            capacity_bytes=self.pool.num_pages * ps,
            bytes_in_use=int(np.count_nonzero(useful)) * ps,
            bytes_held=self.pool.num_in_use * ps,
            bytes_created=self.pool.num_created * ps,
            token_bytes=int(useful.sum()),
            virt_reserved_bytes=self.regions.nbytes,
            bytes_cached=cached * ps,
            bytes_allocated=self.backend.allocated_bytes() or 0,
        )

    def check(self) -> None:
        self.pool.check()
        self.slots.check()
        for rid, slot in self.slots.slot_of.items():
            assert self.slots.mapped[slot] >= self.layout.pages_for(self._num_tokens[rid]), rid
        refs = self.regions.check(self.slots.mapped)
        for pages in self.prefix.holds() if self.prefix is not None else []:
            for page in pages:
                refs[page] += 1
            assert len({self.pool.ref_cnt[p] for p in pages}) == 1, "regions out of lockstep"
        assert refs.tolist() == self.pool.ref_cnt, "page ref counts disagree with mappings + cache"

    def close(self) -> None:
        """Free every request, unmap and release every page, the reservations and the
        backend's own resources (its pool file or anchor page), and stop its mapper."""
        if self.mapper is not None:
            self.mapper.close()
            self.mapper = None
        for rid in list(self.slots.slot_of):
            self.free(rid)
        if self.prefix is not None:
            self.prefix.evict(self.pool.num_pages)
        self._layer_views = []
        self.regions.close()
        self.pool.release_all_idle()
        self.backend.close()
        # the prefix cache's units and the regions' change recorder refer back to this
        # manager: no cycle is left to keep it until the cyclic collector
        self.prefix = None
        self.regions.record = None


class PageUnits:
    """Prefix-caching units of a virtual cache: a unit is a page index of a slot, its payload
    one physical page per region (the regions move in lockstep)."""

    def __init__(self, kv: VirtualKVCache) -> None:
        self.kv = kv

    def unit_span(self, page: int) -> tuple[int, int]:
        ps, row = self.kv.pool.page_size, self.kv.layout.row_bytes
        return page * ps // row, -(-(page + 1) * ps // row)

    def unit_payload(self, request_id: str, page: int) -> tuple[int, ...]:
        kv = self.kv
        return kv.regions.pages_at(kv._first_va_page(kv.slots.slot_of[request_id]) + page)

    def hold(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            self.kv.pool.retain(page)
        self.kv._record(HoldPages(pages, hold=True))

    def unhold(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            self.kv.pool.release(page)
        self.kv._record(HoldPages(pages, hold=False))

    def is_cache_only(self, pages: tuple[int, ...]) -> bool:
        # one page index has the same reference count in every region (asserted by check()):
        # look at one
        return self.kv.pool.ref_cnt[pages[0]] == 1

    def payload_units(self, pages: tuple[int, ...]) -> int:
        return len(pages)

    def adopt(self, request_id: str, payloads: list[tuple[int, ...]]) -> int | None:
        """Map the hit pages at the start of an emptied idle slot (like a fork of the cache)."""
        kv = self.kv
        if request_id in kv.slots.slot_of:
            raise ValueError(f"match_prefix for {request_id!r}, which already holds KV")
        tokens = kv.layout.tokens_in(len(payloads))
        per_region = [[pages[r] for pages in payloads] for r in range(len(kv.regions))]
        if tokens == 0 or not kv._occupy(request_id, per_region, tokens):
            return None
        return tokens
