"""Which request holds which virtual slot, and how many pages each slot has mapped.

    slot:    0 (anchor) | 1 | 2 | ... | num_slots
    mapped:  0          | 3 | 0 | ... | 5          pages per region (the same in every region)
    dropped: 0          | 1 | 0 | ... | 0          head pages the sliding-window regions gave
                                                   back (they map [dropped, mapped) only)
    holder:  -          | a | - | ... | c          idle slots keep their pages (deferred)

Slot 0 is the anchor slot (see :mod:`vmkv.kv.virtual`): never idle, never held. Pure
bookkeeping: the virtual state's commit (:mod:`vmkv.kv.virtual.state`) maps and unmaps, then
records it here.
"""

from __future__ import annotations

#: the slot that anchors every region's base address (never handed to a request)
ANCHOR_SLOT = 0


class SlotTable:
    """Slots ``1 .. num_slots``: holders, idle set, mapped page counts, slot choice."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.mapped = [0] * (num_slots + 1)  # the anchor slot's pages belong to the regions
        self.dropped = [0] * (num_slots + 1)  # <= mapped; 0 for an idle slot
        self.idle: set[int] = set(range(ANCHOR_SLOT + 1, num_slots + 1))
        self.slot_of: dict[str, int] = {}

    @property
    def num_va_slots(self) -> int:
        """Slots of virtual address space, the anchor slot included."""
        return len(self.mapped)

    def best_fit(self, need: int) -> int | None:
        """The idle slot with the fewest mapped pages that still cover ``need``, else the one
        with the most (fewest new maps); None when no slot is idle."""
        if not self.idle:
            return None
        covering = [s for s in self.idle if self.mapped[s] >= need]
        if covering:
            return min(covering, key=lambda s: (self.mapped[s], s))
        return max(self.idle, key=lambda s: (self.mapped[s], -s))

    def emptiest(self) -> int | None:
        """The idle slot with the fewest mapped pages (to be emptied and refilled)."""
        if not self.idle:
            return None
        return min(self.idle, key=lambda s: (self.mapped[s], s))

    def hold(self, request_id: str, slot: int) -> None:
        self.slot_of[request_id] = slot
        self.idle.discard(slot)

    def release(self, request_id: str) -> int:
        """The slot ``request_id`` held, idle again (KeyError for unknown ids)."""
        slot = self.slot_of.pop(request_id)
        self.idle.add(slot)
        return slot

    def check(self) -> None:
        held = set(self.slot_of.values())
        assert ANCHOR_SLOT not in self.idle and ANCHOR_SLOT not in held
        assert held.isdisjoint(self.idle)
        assert len(held) == len(self.slot_of), "slot given twice"
        assert len(self.slot_of) + len(self.idle) == self.num_slots
        assert all(0 <= d <= m for d, m in zip(self.dropped, self.mapped, strict=True))
        assert not any(self.dropped[s] for s in self.idle), "an idle slot with a dropped head"
