"""Virtual mode's accounting: usage by physical page, the start-up line, the backend's
counters, the VMA budget, and the invariants (``check``)."""

from __future__ import annotations

import numpy as np

from vmkv.kv.accounting import KVAccounting, KVUsage
from vmkv.kv.prefix import PrefixCaching
from vmkv.kv.virtual.idle import IdlePages
from vmkv.kv.virtual.state import VirtualState
from vmkv.memory.region import UNMAPPED


class VirtualAccounting(KVAccounting):
    """The accounting part of a virtual cache (its ``accounting``)."""

    def __init__(self, state: VirtualState, idle: IdlePages,
                 caching: PrefixCaching | None) -> None:
        self._state = state
        self._idle = idle
        self._caching = caching

    @property
    def usage(self) -> KVUsage:
        state = self._state
        pool, slots, regions, layout = state.pool, state.slots, state.regions, state.layout
        ps, row = pool.page_size, layout.row_bytes
        useful = np.zeros(pool.num_pages, dtype=np.int64)  # live bytes per physical page
        va_pages, live = [], []  # every request's va pages with their live bytes
        for rid, slot in slots.slot_of.items():
            n = state.tokens[rid]
            need = layout.pages_for(n)
            if need:
                first = state.first_va_page(slot)
                va_pages.append(np.arange(first, first + need))
                live.append(np.minimum(ps, n * row - np.arange(need) * ps))
        if va_pages:  # vectorised over requests and regions (this runs every benchmark step)
            va, lv = np.concatenate(va_pages), np.concatenate(live)
            phys = np.concatenate([region.page_at[va] for region in regions])
            lv = np.tile(lv, len(regions))
            kept = phys != UNMAPPED  # a sliding region's dropped head holds nothing
            np.maximum.at(useful, phys[kept], lv[kept])  # shared: the largest
        cached = 0
        if self._caching is not None:  # held by the cache alone, or also mapped in an idle slot
            idle = {int(p) for s in slots.idle for p in regions[0].page_at[
                state.first_va_page(s) : state.first_va_page(s) + slots.mapped[s]]}
            refs = pool.ref_cnt
            cached = sum(len(p) for p in self._caching.holds()
                         if refs[p[0]] == 1 or (refs[p[0]] == 2 and p[0] in idle))
        return KVUsage(
            num_requests=len(slots.slot_of),
            num_tokens=sum(state.tokens.values()),
            capacity_bytes=pool.num_pages * ps,
            bytes_in_use=int(np.count_nonzero(useful)) * ps,
            bytes_held=pool.num_in_use * ps,
            bytes_created=pool.num_created * ps,
            token_bytes=int(useful.sum()),
            virt_reserved_bytes=regions.nbytes,
            bytes_cached=cached * ps,
            bytes_allocated=state.backend.allocated_bytes() or 0,
        )

    @property
    def capacity_tokens(self) -> int:
        """The longest request the pool holds alone (the sliding regions at a window and a
        step of a window, where they give pages back)."""
        state = self._state
        layout, regions, keep = state.layout, len(state.regions), state.regions.keep
        if keep == regions:
            return layout.tokens_in(state.pool.num_pages // regions)
        sliding = (regions - keep) * layout.pages_for(2 * layout.drop_window)
        if keep == 0:
            return layout.slot_tokens if sliding <= state.pool.num_pages else 0
        return layout.tokens_in(max(0, state.pool.num_pages - sliding) // keep)

    def describe(self) -> str:
        state = self._state
        lay = state.layout
        return (f"virtual: {state.regions.nbytes / 2**30:,.1f} GiB reserved "
                f"({state.slots.num_slots} slots x {lay.slot_tokens:,} tokens), layout "
                f"{lay.name}, page {lay.page_size // 1024} KiB = "
                f"{lay.page_size / lay.row_bytes:.2f} tokens, {state.pool.num_created} pages "
                f"pre-created, {self._idle.warm_pages} per slot and region mapped at start-up")

    def memory_stats(self) -> dict[str, dict[str, float]]:
        return self._state.backend.stats.as_dict()

    @property
    def vma_budget(self) -> int | None:
        return self._state.pool.max_vmas

    def limit_vma_budget(self, budget: int) -> None:
        pool = self._state.pool
        if pool.max_vmas is not None:
            pool.max_vmas = min(pool.max_vmas, budget)

    def check(self) -> None:
        state = self._state
        state.pool.check()
        state.slots.check()
        for rid, slot in state.slots.slot_of.items():
            assert state.slots.mapped[slot] >= state.layout.pages_for(state.tokens[rid]), rid
        assert set(state.tokens) == set(state.slots.slot_of), "token counts without a slot"
        refs = state.regions.check(state.slots.mapped, state.slots.dropped)
        for pages in self._caching.holds() if self._caching is not None else []:
            for page in pages:
                refs[page] += 1
            assert len({state.pool.ref_cnt[p] for p in pages}) == 1, "regions out of lockstep"
        assert refs.tolist() == state.pool.ref_cnt, "page ref counts disagree with mappings + cache"
