"""Virtual mode's background pre-mapping: units that map the running requests' next pages on
the mapper thread (:mod:`vmkv.memory.mapper`) while the GPU computes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from vmkv.kv.mapping import KVMapping
from vmkv.kv.virtual.state import VirtualState

if TYPE_CHECKING:
    from vmkv.memory.mapper import BackgroundMapper


class PremapSlots(KVMapping):
    """The mapping part of a virtual cache (its ``mapping``)."""

    def __init__(self, state: VirtualState) -> None:
        super().__init__()
        self._state = state

    def start(self) -> BackgroundMapper | None:
        """A mapper thread for this cache when its pages live on a GPU (there map calls
        overlap the kernels); None on the host, where nothing runs asynchronously."""
        backend = self._state.backend
        if backend.device.type != "cuda":
            return None
        from vmkv.memory.mapper import BackgroundMapper

        mapper = BackgroundMapper(backend)
        self.attach(mapper)
        return mapper

    def units(self, lookahead_tokens: int) -> list[Callable[[], int]]:
        """One unit per running request whose slot lacks the pages its next
        ``lookahead_tokens`` tokens need. A unit maps free pool pages only (it never reclaims
        or evicts, and never unmaps) and returns the pages it mapped per region; it does
        nothing if the request is gone or the pool is short when it runs. Pages mapped ahead
        are surplus: reclaimable, and counted in ``bytes_held``."""
        state = self._state
        units: list[Callable[[], int]] = []
        for rid, slot in state.slots.slot_of.items():
            want = min(state.layout.pages_for(state.tokens[rid] + lookahead_tokens),
                       state.layout.slot_pages)
            if want > state.slots.mapped[slot]:
                units.append(functools.partial(self._premap_slot, rid, slot, want))
        return units

    def _premap_slot(self, request_id: str, slot: int, want: int) -> int:
        """Map ``slot`` up to ``want`` pages per region if the pool has them free (mapper
        thread; the engine waits for it before touching the manager)."""
        state = self._state
        grow = want - state.slots.mapped[slot]
        if state.slots.slot_of.get(request_id) != slot or grow <= 0:
            return 0
        regions, pool = len(state.regions), state.pool
        budget = pool.max_vmas
        if grow * regions > pool.num_free or (
                budget is not None and pool.num_vmas + grow * regions > budget):
            return 0  # checked first, so the growth never rolls back (unmaps) on this thread
        return grow if state.grow(slot, grow) else 0
