"""Room per request in virtual mode: a slot's mapped pages, and what a growth would take."""

from __future__ import annotations

from vmkv.kv.room import KVRoom
from vmkv.kv.virtual.idle import IdlePages
from vmkv.kv.virtual.state import VirtualState


class SlotRoom(KVRoom):
    """Planning and admission questions of one virtual cache (no side effects)."""

    def __init__(self, state: VirtualState, idle: IdlePages, max_model_len: int) -> None:
        super().__init__(state.tokens, max_model_len)
        self._state = state
        self._idle = idle

    def units_of(self, request_id: str) -> list[int]:
        state = self._state
        slot = state.slots.slot_of[request_id]
        first = state.first_va_page(slot)
        return state.regions[0].page_at[first : first + state.slots.mapped[slot]].tolist()

    def plan(self, request_id: str, num_new_tokens: int) -> tuple[int | None, int, list[int]]:
        """(slot, pages to grow per region, slot page indices to copy before writing); slot
        None when no slot is idle for a new request. ValueError past ``max_model_len``."""
        state, layout = self._state, self._state.layout
        cur = self._tokens.get(request_id, 0)
        new_len = cur + num_new_tokens
        if new_len > self.max_model_len:
            self.check_length(request_id, new_len)
        need = layout.pages_for(new_len)
        slot = state.slots.slot_of.get(request_id)
        if slot is None:  # an idle slot: its own pages up to the first one cached
            slot = state.slots.best_fit(need)
            if slot is None:
                return None, 0, []
            return slot, max(0, need - self._idle.first_cached(slot)), []
        mapped = state.slots.mapped[slot]
        cow = []
        if num_new_tokens:
            first, page_at = state.first_va_page(slot), state.regions[0].page_at
            for p in range(layout.first_page_of(cur), min(need, mapped)):
                if state.pool.is_shared(int(page_at[first + p])):  # a fork's, or cached
                    cow.append(p)
        return slot, max(0, need - mapped), cow

    def units_needed(self, request_id: str, num_new_tokens: int) -> int | None:
        """Pages (all regions) ``num_new_tokens`` more would take. With sliding-window
        regions, net of the head pages they give back, and a long remaining prefill counted as
        steps of at most a window (what they hold at most while it runs)."""
        slot, grow, cow = self.plan(request_id, num_new_tokens)
        if slot is None:
            return None
        state = self._state
        regions, keep = len(state.regions), state.regions.keep
        window = state.layout.drop_window
        if not window or keep == regions:
            return (grow + len(cow)) * regions
        held = request_id in state.slots.slot_of
        mapped = state.slots.mapped[slot] if held else self._idle.first_cached(slot)
        dropped = state.slots.dropped[slot] if held else 0
        cur = self._tokens.get(request_id, 0)
        last_step = max(cur, cur + num_new_tokens - window)  # the last step's first token
        end = mapped + grow
        start = max(dropped, min(state.layout.first_kept_page(last_step), end))
        sliding = (end - start) - (mapped - dropped) + len(cow)  # per sliding region
        return max(0, (grow + len(cow)) * keep + sliding * (regions - keep))

    @property
    def free_units(self) -> int:
        return self._state.pool.num_free + self._idle.reclaimable(exclude=-1)

    def own_spare(self, request_id: str, num_new_tokens: int) -> int:
        """Pages (per region) of a running request's slot past what ``num_new_tokens`` more
        need: a copy-on-write may take them back when nothing else is free."""
        state = self._state
        slot = state.slots.slot_of.get(request_id)
        if slot is None:
            return 0
        new_len = self._tokens.get(request_id, 0) + num_new_tokens
        return max(0, state.slots.mapped[slot] - state.layout.pages_for(new_len))

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        slot, grow, cow = self.plan(request_id, num_new_tokens)
        if slot is None:
            return False
        regions = len(self._state.regions)
        need = (grow + len(cow)) * regions
        spare = self.own_spare(request_id, num_new_tokens) * regions  # none where it grows
        return need <= self._state.pool.num_free + self._idle.reclaimable(slot) + spare
