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

Parts (one module each, the manager in :mod:`~vmkv.kv.virtual.manager` composes them):

    state.py       VirtualState: SlotTable + RegionGroup + token counts, changed only by its
                   commit (the ``changes`` part); PageUnits, the prefix cache's units
    room.py        SlotRoom: planning (slot, pages to grow, pages to copy) and admission
    manager.py     SlotAllocator: allocate / free / fork; VirtualKVCache
    idle.py        IdlePages: reclaim on demand, trim beyond max_idle_pages, warm idle slots
    premap.py      PremapSlots: the background mapper's units (CUDA; the ``mapping`` part)
    accounting.py  VirtualAccounting: usage, describe, check
    (generic: swap, prefix, changes: vmkv/kv/swap.py, prefix.py, changes.py)

A background mapper (CUDA) may run units of ``mapping.units`` between steps; every public
member of the manager, its parts included, first waits for it
(:func:`~vmkv.kv.mapping.waits_for_mapper`, applied once to the class).

Latency hiding: the pool may be pre-created, and half of it then mapped into the idle slots at
start-up with page-table entries present (``VirtualKVCache.warm_idle_slots``, the host
engine's default: paged mode's pre-zeroed tensor, here); growth maps ``premap_pages`` extra
pages when free pages exist (fewer, larger map calls); finished slots keep their pages
(deferred reclamation), also those the prefix cache holds, and a new request takes the idle
slot that fits best and reuses its pages in place (the cache gives up the ones it held): often
no map call, no page fault at all. Pages kept this way are reclaimed on demand, and beyond
``max_idle_pages`` eagerly.
"""

from __future__ import annotations

from vmkv.kv.virtual.manager import VirtualKVCache
from vmkv.kv.virtual.state import PageUnits, VirtualState

__all__ = ["PageUnits", "VirtualKVCache", "VirtualState"]
