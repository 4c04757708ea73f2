"""Pages no running request needs: kept for reuse, reclaimed on demand, trimmed to a budget.

    kept:  idle slots' mappings (deferred reclamation, warm slots) | surplus tails of running
           slots (pre-mapped) | pages only the prefix cache holds | idle pool pages
    reclaim(n):  idle slots (largest first), then surplus tails, then cache-only pages (LRU)
    trim():      after a free, keep at most ``max_idle_pages`` of them, all kinds together

Decisions only: every mapping, eviction and trim goes through the state's verbs
(:mod:`vmkv.kv.virtual.state`), so they are changes like any other.
"""

from __future__ import annotations

from vmkv.kv.prefix import PrefixCaching
from vmkv.kv.virtual.state import VirtualState


class IdlePages:
    """The idle/trim policy of one virtual cache."""

    def __init__(self, state: VirtualState, caching: PrefixCaching | None,
                 max_idle_pages: int | None) -> None:
        self.state = state
        self.caching = caching
        self.max_idle_pages = max_idle_pages
        self.warm_pages = 0  # pages per slot and region mapped at start-up (warm)

    # -- what is kept -------------------------------------------------------------------------
    def cached(self, va_page: int) -> bool:
        """Whether the prefix cache holds the pages at ``va_page``."""
        return self.caching is not None and self.caching.holds_payload(
            self.state.regions.pages_at(va_page))

    def first_cached(self, slot: int) -> int:
        """Index of the first of ``slot``'s mapped pages the prefix cache holds (its mapped
        count if none)."""
        state = self.state
        first, mapped = state.first_va_page(slot), state.slots.mapped[slot]
        return next((p for p in range(mapped) if self.cached(first + p)), mapped)

    def mapped_elsewhere(self, va_page: int) -> bool:
        """Whether the page at ``va_page`` is mapped somewhere else too (a fork, a prefix
        hit); a page also held by the prefix cache alone is not."""
        state = self.state
        refs = state.pool.ref_cnt[int(state.regions[0].page_at[va_page])]
        return refs - self.cached(va_page) > 1

    def surplus(self) -> list[tuple[int, int]]:
        """(slot, pages beyond what its tokens need) of every running request."""
        state = self.state
        return [(slot, state.slots.mapped[slot] - state.layout.pages_for(state.tokens[rid]))
                for rid, slot in state.slots.slot_of.items()]

    def reclaimable(self, exclude: int) -> int:
        """Pages (all regions) that unmapping idle slots and surplus tails, and evicting pages
        only the prefix cache holds, would free (``exclude``: the slot being allocated)."""
        slots = self.state.slots
        total = sum(slots.mapped[s] for s in slots.idle if s != exclude)
        if exclude in slots.idle:  # a newcomer's idle slot: the cached pages it gives up
            total += slots.mapped[exclude] - self.first_cached(exclude)
        total += sum(n for slot, n in self.surplus() if slot != exclude)
        evictable = self.caching.num_evictable() if self.caching is not None else 0
        return total * len(self.state.regions) + evictable

    def kept_pages(self) -> int:
        """Pages (all regions) kept although no running request needs them: mapped in idle
        slots or held only by the prefix cache (idle pool pages not included)."""
        slots = self.state.slots
        idle = sum(slots.mapped[s] for s in slots.idle) * len(self.state.regions)
        return idle + (self.caching.num_evictable() if self.caching is not None else 0)

    # -- giving up ----------------------------------------------------------------------------
    def reclaim(self, pages_wanted: int, exclude: int) -> None:
        """Unmap idle slots (largest first), then surplus tails of running slots, then evict
        pages only the prefix cache holds, until ``pages_wanted`` more pages are free (an
        unmapped page the cache still holds is freed by the eviction, not the unmap)."""
        state = self.state
        pool, slots = state.pool, state.slots
        regions, target = len(state.regions), pool.num_free + pages_wanted
        idle = [(s, slots.mapped[s]) for s in sorted(slots.idle, key=lambda s: -slots.mapped[s])]
        for slot, spare in idle + self.surplus():
            if pool.num_free >= target:
                return
            if slot != exclude and spare > 0:
                state.unmap_tail(slot, min(spare, -(-(target - pool.num_free) // regions)))
        if pool.num_free < target and self.caching is not None:
            self.caching.evict(target - pool.num_free)

    def trim(self) -> None:
        """Keep at most ``max_idle_pages`` pages that no running request uses, all kinds
        together, and return the rest to the OS/driver. Given up first: idle slots' mappings
        (largest slot first), then the least recently used cached prefixes; idle pool pages
        get what the budget leaves (they save only a create call)."""
        state, budget = self.state, self.max_idle_pages
        if budget is None:
            state.trim_pool(None)
            return
        if self.kept_pages() > budget:
            self.reclaim(self.kept_pages() - budget, exclude=-1)
        excess = self.kept_pages() - budget  # unmapped cached pages became cache-only
        if excess > 0 and self.caching is not None:
            self.caching.evict(excess)
        keep = max(0, budget - self.kept_pages())
        if state.pool.max_idle_pages is not None:
            keep = min(keep, state.pool.max_idle_pages)
        state.trim_pool(keep)

    # -- start-up -----------------------------------------------------------------------------
    def warm(self, share: float) -> int:
        """Spread ``share`` of the free pool evenly over the empty idle slots, mapped and with
        their page-table entries present (:meth:`MemoryBackend.populate`), as paged mode's one
        zeroed block tensor is before its first step: a request then starts in a slot that is
        mapped and resident, and maps (and faults) only past its share. The rest of the pool
        stays free, so a request that outgrows its share takes free pages, not another slot's.
        A start-up step (before any rank records: every rank warms the same way); stops early
        where the VMA budget runs out. Returns the pages each slot got per region.
        """
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        state = self.state
        slots, pool = state.slots, state.pool
        empty = [s for s in sorted(slots.idle) if slots.mapped[s] == 0]
        if not empty:
            return 0
        per_slot = min(state.layout.slot_pages,
                       int(pool.num_free * share) // (len(state.regions) * len(empty)))
        if per_slot <= 0:
            return 0
        nbytes = per_slot * pool.page_size
        for slot in empty:
            first = state.first_va_page(slot)
            if not state.grow(slot, per_slot):
                break
            for region in state.regions:
                state.backend.populate(region.va_of(first), nbytes)
        self.warm_pages = per_slot
        return per_slot
