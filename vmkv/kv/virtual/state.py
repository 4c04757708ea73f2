"""What a virtual cache's tensor-parallel ranks share, and the one place that changes it.

    VirtualState (the manager's ``changes`` part)
      slots      who holds which slot, pages mapped per slot       SlotTable
      regions    the mappings, in lockstep over every region       RegionGroup over the PagePool
      tokens     tokens of room per request
      commit(change) ─▶ _apply_one: Place, Tokens, Forget, MapFresh/MapPages, UnmapPages,
                        DropPages, CopyPage, HoldPages, TrimPool, SwapOut, SwapIn, DropSwapped

Rank 0's parts decide (which slot, how many pages, what to reclaim or evict) and express each
step as a change through the small verbs below (``grow``, ``unmap_tail``, ``drop_behind``,
``hold``, ``share``, ``copy_on_write``, ``hold_pages``, ``trim_pool``, ``forget``); each verb is
a :meth:`commit`, so what rank 0 did is what the log holds and what the other ranks apply.

Sliding-window layers (the per-layer layout's regions past ``layout.num_full_regions``) give
back the pages behind their window as a request advances (``drop_behind``: whole pages before
the page of the step's first visible token); their part of a slot is ``[dropped, mapped)``,
still at the same addresses, so the kernels read a view that starts at the window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vmkv.kv.changes import (
    ChangeLog,
    CopyPage,
    DropPages,
    DropSwapped,
    Forget,
    HoldPages,
    KVChange,
    MapFresh,
    MapPages,
    Place,
    SwapIn,
    SwapOut,
    Tokens,
    TrimPool,
    UnmapPages,
)
from vmkv.kv.spec import VirtualLayout
from vmkv.kv.swap import host_copy
from vmkv.kv.virtual.regions import RegionGroup, head_of
from vmkv.kv.virtual.slots import SlotTable
from vmkv.memory.pool import PagePool


class VirtualState(ChangeLog):
    """Slots, mapped pages and token counts of one virtual cache, changed only by
    :meth:`commit`."""

    def __init__(self, pool: PagePool, layout: VirtualLayout, num_slots: int) -> None:
        super().__init__()
        self.pool = pool
        self.backend = pool.backend
        self.layout = layout
        self.slots = SlotTable(num_slots)
        if layout.slot_bytes * self.slots.num_va_slots >= 1 << 46:
            raise ValueError(
                f"{num_slots} slots of {layout.slot_bytes} B exceed the 64 TiB of virtual "
                "address space vmkv allows itself; lower max_num_seqs or max_model_len")
        self.regions = RegionGroup(pool, layout, self.slots.num_va_slots)
        self.tokens: dict[str, int] = {}
        self.saved: dict[str, list[torch.Tensor]] = {}  # swapped-out KV between its two changes
        self._saved_head: dict[str, int] = {}  # the sliding regions' dropped pages, swapped out

    # -- reading ------------------------------------------------------------------------------
    def first_va_page(self, slot: int) -> int:
        return slot * self.layout.slot_pages

    def swap_where(self, request_id: str) -> tuple[int, int, int]:
        """(first va page, pages, pages the sliding regions dropped) holding
        ``request_id``'s tokens."""
        slot = self.slots.slot_of[request_id]
        return (self.first_va_page(slot), self.layout.pages_for(self.tokens[request_id]),
                self.slots.dropped[slot])

    # -- the verbs rank 0 decides with (each one commit) ----------------------------------------
    def grow(self, slot: int, num: int) -> bool:
        """Map ``num`` more free pages at the end of ``slot``'s prefix in every region; False
        (nothing changed) when the pool or the VMA budget is short."""
        va_page = self.first_va_page(slot) + self.slots.mapped[slot]
        return self.commit(MapFresh(va_page, num)) is not None

    def unmap_tail(self, slot: int, num: int) -> None:
        """Unmap the last ``num`` mapped pages of ``slot`` in every region."""
        if num > 0:
            va_page = self.first_va_page(slot) + self.slots.mapped[slot] - num
            self.commit(UnmapPages(va_page, num))

    def drop_behind(self, slot: int, num_tokens: int) -> int:
        """Give back the sliding regions' pages of ``slot`` that no query after
        ``num_tokens`` cached tokens sees (none without sliding regions); returns how many
        (per sliding region)."""
        first_kept = min(self.layout.first_kept_page(num_tokens), self.slots.mapped[slot])
        dropped = self.slots.dropped[slot]
        if first_kept <= dropped:
            return 0
        self.commit(DropPages(self.first_va_page(slot) + dropped, first_kept - dropped))
        return first_kept - dropped

    def hold(self, request_id: str, slot: int, num_tokens: int) -> None:
        """``request_id`` holds ``slot`` (if it did not yet) with room for ``num_tokens``."""
        if request_id not in self.slots.slot_of:
            self.commit(Place(request_id, slot))
        self.commit(Tokens(request_id, num_tokens))

    def share(self, request_id: str, pages: Sequence[Sequence[int]], num_tokens: int) -> bool:
        """Give ``request_id`` an idle slot whose first pages are ``pages[r]`` (already in use:
        a fork's parent's, or the prefix cache's) in region ``r``: one that still maps them
        there (its last holder's cached prefix: nothing to map), else an emptied one."""
        slots, num = self.slots, len(pages[0])
        slot = next((s for s in sorted(slots.idle) if slots.mapped[s] >= num
                     and self.regions.pages(self.first_va_page(s), num) == pages), None)
        if slot is not None:
            self.unmap_tail(slot, slots.mapped[slot] - num)  # its own pages past them
            self.hold(request_id, slot, num_tokens)
            return True
        slot = slots.emptiest()
        if slot is None:
            return False
        self.unmap_tail(slot, slots.mapped[slot])  # it must be empty where they go
        shared = MapPages(self.first_va_page(slot), tuple(map(tuple, pages)), fresh=False)
        if self.commit(shared) is None:
            return False
        self.hold(request_id, slot, num_tokens)
        return True

    def copy_on_write(self, va_page: int) -> None:
        """Give ``va_page`` a private copy of its shared page in every region."""
        self.commit(CopyPage(va_page))

    def hold_pages(self, pages: tuple[int, ...], hold: bool) -> None:
        """The prefix cache takes (``hold``) or drops a reference on ``pages``."""
        self.commit(HoldPages(pages, hold))

    def trim_pool(self, keep: int | None) -> None:
        """Return idle pool pages to the OS/driver beyond ``keep`` (None: the pool's default)."""
        self.commit(TrimPool(keep))

    def forget(self, request_id: str) -> int:
        """``request_id`` holds nothing any more; returns the slot it held (idle now, its pages
        still mapped). KeyError for unknown ids."""
        slot = self.slots.slot_of[request_id]
        self.commit(Forget(request_id))
        return slot

    # -- applying -----------------------------------------------------------------------------
    def _apply_one(self, change: KVChange) -> KVChange | None:
        regions, slots = self.regions, self.slots
        match change:
            case Tokens():  # every request, every step: first, and no field captures
                self.tokens[change.request_id] = change.num_tokens
            case MapFresh(va_page, num):
                if not regions.map_new(va_page, num):
                    return None
                self._set_mapped(va_page, num)
                return MapPages(va_page, tuple(map(tuple, regions.pages(va_page, num))), True)
            case MapPages(va_page, pages, fresh):
                num = len(pages[0])
                if not (regions.map_new(va_page, num, pages) if fresh
                        else regions.map_shared(va_page, pages)):
                    return None
                self._set_mapped(va_page, num)
                if not fresh and regions.keep < len(regions):  # a share keeps a dropped head
                    slots.dropped[va_page // self.layout.slot_pages] = head_of(
                        pages[regions.keep])
            case UnmapPages(va_page, num):
                self.backend.synchronize()  # no queued kernel may read them any more
                slot = va_page // self.layout.slot_pages
                regions.unmap(va_page, num, self.first_va_page(slot) + slots.dropped[slot])
                self._set_mapped(va_page, 0)
            case DropPages(va_page, num):
                self.backend.synchronize()
                regions.drop(va_page, num)
                slot, index = divmod(va_page, self.layout.slot_pages)
                slots.dropped[slot] = index + num
            case Place(request_id, slot):
                slots.hold(request_id, slot)
            case Forget(request_id):
                slots.release(request_id)
                del self.tokens[request_id]
            case CopyPage(va_page, pages):
                fresh = regions.copy_on_write(va_page, pages)
                return CopyPage(va_page, fresh) if pages is None else change
            case HoldPages(pages, hold):
                for page in pages:
                    (self.pool.retain if hold else self.pool.release)(page)
            case TrimPool(keep):
                self.pool.trim(keep)
            case SwapOut(request_id, where):
                self.saved[request_id] = [host_copy(v) for v in regions.byte_views(*where)]
                self._saved_head[request_id] = where[2]
                self.backend.synchronize()
            case SwapIn(request_id, where):
                # back where it was; the sliding regions' head (fresh pages) is dropped later
                views = regions.byte_views(where[0], where[1],
                                           self._saved_head.pop(request_id, 0))
                for view, saved in zip(views, self.saved.pop(request_id), strict=True):
                    view.copy_(saved, non_blocking=True)
            case DropSwapped(request_ids):
                for request_id in request_ids:
                    self.saved.pop(request_id, None)
                    self._saved_head.pop(request_id, None)
            case _:
                raise ValueError(f"a virtual KV cache cannot apply {change!r}")
        return change

    def _set_mapped(self, va_page: int, num: int) -> None:
        """The slot of ``va_page`` now maps its pages up to ``va_page + num`` (a growth or a
        share ends there, an unmap of its tail starts there: ``num`` 0)."""
        slot, index = divmod(va_page, self.layout.slot_pages)
        self.slots.mapped[slot] = index + num
        self.slots.dropped[slot] = min(self.slots.dropped[slot], index + num)


class PageUnits:
    """Prefix-caching units of a virtual cache: a unit is a page index of a slot, its payload
    one physical page per region (the regions move in lockstep)."""

    def __init__(self, state: VirtualState) -> None:
        self.state = state

    def unit_span(self, page: int) -> tuple[int, int]:
        ps, row = self.state.pool.page_size, self.state.layout.row_bytes
        return page * ps // row, -(-(page + 1) * ps // row)

    def unit_payload(self, request_id: str, page: int) -> tuple[int, ...]:
        state = self.state
        return state.regions.pages_at(
            state.first_va_page(state.slots.slot_of[request_id]) + page)

    def hold(self, pages: tuple[int, ...]) -> None:
        self.state.hold_pages(pages, hold=True)

    def unhold(self, pages: tuple[int, ...]) -> None:
        self.state.hold_pages(pages, hold=False)

    def is_cache_only(self, pages: tuple[int, ...]) -> bool:
        # one page index has the same reference count in every region (asserted by check()):
        # look at one
        return self.state.pool.ref_cnt[pages[0]] == 1

    def payload_units(self, pages: tuple[int, ...]) -> int:
        return len(pages)

    def adopt(self, request_id: str, payloads: list[tuple[int, ...]]) -> int | None:
        """Map the hit pages at the start of an emptied idle slot (like a fork of the cache)."""
        state = self.state
        if request_id in state.slots.slot_of:
            raise ValueError(f"match_prefix for {request_id!r}, which already holds KV")
        tokens = state.layout.tokens_in(len(payloads))
        per_region = [[pages[r] for pages in payloads] for r in range(len(state.regions))]
        if tokens == 0 or not state.share(request_id, per_region, tokens):
            return None
        return tokens
