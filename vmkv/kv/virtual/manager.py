"""The virtual KV cache: its allocator, and the manager that composes the parts (the package
docstring, :mod:`vmkv.kv.virtual`, draws them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vmkv.kv.addressing import SlotAddressing
from vmkv.kv.base import KVCacheManager
from vmkv.kv.changes import Tokens
from vmkv.kv.mapping import waits_for_mapper
from vmkv.kv.prefix import PrefixCaching, PrefixPart
from vmkv.kv.spec import KVSpec, VirtualLayout
from vmkv.kv.swap import KVSwap
from vmkv.kv.virtual.accounting import VirtualAccounting
from vmkv.kv.virtual.idle import IdlePages
from vmkv.kv.virtual.premap import PremapSlots
from vmkv.kv.virtual.room import SlotRoom
from vmkv.kv.virtual.state import PageUnits, VirtualState
from vmkv.memory.errors import MappingBudgetExceeded, VmmError
from vmkv.memory.pool import PagePool


class SlotAllocator:
    """allocate / free / fork of a virtual cache: rank 0's decisions, made through the
    state's verbs (each a change)."""

    def __init__(self, state: VirtualState, room: SlotRoom, idle: IdlePages,
                 caching: PrefixCaching | None, premap_pages: int) -> None:
        self._state = state
        self._room = room
        self._idle = idle
        self._caching = caching
        self.premap_pages = premap_pages

    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """See :meth:`KVCacheManager.allocate`."""
        state, idle = self._state, self._idle
        slots, pool = state.slots, state.pool
        slot, grow, cow = self._room.plan(request_id, num_new_tokens)
        if slot is None:
            return False
        # pages no query of this step or later sees go back (to the OS too, past
        # max_idle_memory, once this growth took what it reuses)
        dropped = (state.drop_behind(slot, state.tokens[request_id])
                   if request_id in slots.slot_of else 0)
        regions = len(state.regions)
        need = (grow + len(cow)) * regions
        if request_id not in slots.slot_of:
            # an idle slot may still map pages the cache holds (its last request's prefix):
            # they stay the cache's (unmapped here, not overwritten, evictable if need be);
            # fresh pages replace them
            state.unmap_tail(slot, slots.mapped[slot] - idle.first_cached(slot))
        if need > pool.num_free:
            idle.reclaim(need - pool.num_free, exclude=slot)
        if need > pool.num_free:  # copies (no growth) may take the slot's own spare tail
            spare = self._room.own_spare(request_id, num_new_tokens)
            state.unmap_tail(slot, min(spare, -(-(need - pool.num_free) // regions)))
        if need > pool.num_free:
            return False
        mapped = slots.mapped[slot]
        if grow:
            extra = min(self.premap_pages, state.layout.slot_pages - mapped - grow,
                        (pool.num_free - need) // regions)
            if not state.grow(slot, grow + max(0, extra)) and not (
                extra > 0 and state.grow(slot, grow)
            ):
                return False
        try:
            for page in cow:
                state.copy_on_write(state.first_va_page(slot) + page)
        except VmmError as exc:  # give back the growth; copies already made stay (still exact)
            state.unmap_tail(slot, slots.mapped[slot] - mapped)
            if isinstance(exc, MappingBudgetExceeded):
                return False
            raise
        state.hold(request_id, slot, state.tokens.get(request_id, 0) + num_new_tokens)
        if dropped and idle.max_idle_pages is not None:
            idle.trim()
        return True

    def free(self, request_id: str) -> None:
        """See :meth:`KVCacheManager.free`."""
        state, idle = self._state, self._idle
        slot = state.forget(request_id)
        first, mapped = state.first_va_page(slot), state.slots.mapped[slot]
        # an idle slot keeps its pages for the next request to reuse in place, also those the
        # prefix cache holds (that request takes them over); but no page mapped elsewhere too
        # (a fork, a prefix hit): its next holder would have to copy it; nor a slot whose
        # sliding regions gave back their head (the next request starts at token 0)
        if state.slots.dropped[slot] or any(idle.mapped_elsewhere(first + p)
                                            for p in range(mapped)):
            state.unmap_tail(slot, mapped)
        if self._caching is not None:
            self._caching.forget(request_id)
        idle.trim()

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """See :meth:`KVCacheManager.free` with ``keep_tokens``: the length moves back; pages
        past the new end stay mapped as slack up to ``premap_pages`` (what a growth would map
        ahead anyway), the rest are unmapped (back to the pool)."""
        state = self._state
        slot = state.slots.slot_of[request_id]
        state.commit(Tokens(request_id, num_tokens))
        excess = state.slots.mapped[slot] - state.layout.pages_for(num_tokens) - self.premap_pages
        if excess > 0:
            state.unmap_tail(slot, excess)
            if self._idle.max_idle_pages is not None:
                self._idle.trim()

    def fork(self, parent_id: str, child_id: str) -> bool:
        """See :meth:`KVCacheManager.fork`: the child's slot maps the parent's pages."""
        state = self._state
        if child_id in state.slots.slot_of:
            raise ValueError(f"fork target {child_id!r} already holds KV")
        length = state.tokens[parent_id]
        src = state.first_va_page(state.slots.slot_of[parent_id])
        if not state.share(child_id, state.regions.pages(src, state.layout.pages_for(length)),
                           length):
            return False
        if self._caching is not None:
            self._caching.inherit(parent_id, child_id)
        return True


@waits_for_mapper
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
        spec: per-token KV shape (one full-attention layer group).
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
        self.device = pool.backend.device
        state = VirtualState(pool, VirtualLayout(layout, spec, pool.page_size, max_model_len),
                             num_slots)
        if enable_prefix_caching and state.layout.drop_window:
            raise ValueError("prefix caching cannot serve sliding-window layers that give their "
                             "pages back (the per-layer layout): a cached prefix would lack them")
        caching = (PrefixCaching(PageUnits(state), prefix_cache_hash) if enable_prefix_caching
                   else None)
        idle = IdlePages(state, caching, max_idle_pages)
        self._room = SlotRoom(state, idle, max_model_len)
        self._allocator = SlotAllocator(state, self._room, idle, caching, premap_pages)
        self._changes, self._idle, self._caching = state, idle, caching
        self._swap = KVSwap(state, self._allocator)
        self._prefix = PrefixPart(caching, after_reset=idle.trim)  # cache-only pages are idle
        self._mapping = PremapSlots(state)
        self._accounting = VirtualAccounting(state, idle, caching)
        # the geometry, for tests and benchmarks (not the contract)
        self.pool, self.backend, self.layout = pool, pool.backend, state.layout
        self.slots, self.regions, self.premap_pages = state.slots, state.regions, premap_pages
        self._layer_views = state.regions.layer_views(state.slots.num_va_slots)

    # -- the contract ---------------------------------------------------------------------------
    def addressing(self, request_ids: Sequence[str], context_lens: Sequence[int], *,
                   full_width: bool = False) -> SlotAddressing:
        slot_of = self.slots.slot_of
        ids = np.fromiter((slot_of[r] for r in request_ids), np.int64, len(request_ids))
        return SlotAddressing(ids, self.layout.slot_tokens)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_slots + 1, slot_tokens, kv_head, head_dim]`` strided K and V views of
        ``layer`` (index 0 is the anchor slot; its base is always mapped)."""
        return self._layer_views[layer]

    def close(self) -> None:
        """Free every request, unmap and release every page, the reservations and the
        backend's own resources (its pool file or anchor page), and stop its mapper."""
        self._mapping.close()
        for rid in list(self.slots.slot_of):
            self._allocator.free(rid)
        if self._caching is not None:
            self._caching.evict(self.pool.num_pages)
        self._layer_views = []
        self.regions.close()
        self.pool.release_all_idle()
        self.backend.close()
        self._prefix.close()

    # -- virtual mode only --------------------------------------------------------------------
    def warm_idle_slots(self, share: float) -> int:
        """Map ``share`` of the free pool into the idle slots at start-up (see
        :meth:`~vmkv.kv.virtual.idle.IdlePages.warm`); the pages each slot got per region."""
        return self._idle.warm(share)

    def slot(self, request_id: str) -> int:
        """The slot ``request_id`` holds (KeyError if none)."""
        return self.slots.slot_of[request_id]

    def mapped_pages(self, slot: int) -> int:
        """Pages (per region) ``slot`` has mapped."""
        return self.slots.mapped[slot]
