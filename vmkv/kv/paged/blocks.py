"""Paged mode's bookkeeping: the block pool (reference counts, a FIFO free queue), numpy
mirrors of the block tables, and the block groups of a model with sliding-window layers.

Block groups (vLLM's hybrid KV cache manager's rule): the layers are split into groups of
``lanes`` layers each (the greatest common divisor of the layer groups' sizes), every group
has its own block table per request, and all of them draw from one pool of blocks of ``lanes``
layers: block ``b`` of a group is row ``b`` of the ``[lanes, k|v, num_blocks, ...]`` tensor,
its layer ``j`` in lane ``j``. A full-attention group keeps every block; a sliding group gives
back the blocks behind its window (its table then holds :data:`NULL_BLOCK` there), which a
full group may take next.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from vmkv.kv.spec import KVSpec

#: a block table entry that holds nothing (a sliding group's block behind its window)
NULL_BLOCK = -1


def block_groups(spec: KVSpec) -> tuple[tuple[tuple[int, ...], int], ...]:
    """``(layers, window)`` of every block group (window 0: full attention): each layer group
    of ``spec`` split into groups of ``lanes`` layers, full ones first. One group of every
    layer where no layer slides."""
    if not any(spec.windows):
        return ((tuple(range(spec.num_layers)), 0),)
    lanes = math.gcd(*(len(g.layers) for g in spec.groups))
    out = []
    for group in sorted(spec.groups, key=lambda g: g.sliding_window or 0):
        layers = sorted(group.layers)
        out += [(tuple(layers[i : i + lanes]), group.sliding_window or 0)
                for i in range(0, len(layers), lanes)]
    return tuple(out)


def first_live(table: list[int]) -> int:
    """Index of a table's first block that is not :data:`NULL_BLOCK`."""
    return next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))


class BlockPool:
    """``num_blocks`` fixed-size blocks with reference counts and a FIFO free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.peak_in_use = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, num: int) -> list[int] | None:
        """Take ``num`` blocks (``ref_cnt`` 1 each) from the head of the queue, or None."""
        if num > len(self.free_queue):
            return None
        blocks = [self.free_queue.popleft() for _ in range(num)]
        for b in blocks:
            self.ref_cnt[b] = 1
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        return blocks

    def retain(self, block: int) -> None:
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"retain of free block {block}")
        self.ref_cnt[block] += 1

    def release(self, block: int) -> None:
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"release of free block {block} (double free)")
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue.append(block)


class BlockTableMirror:
    """numpy copies of the block tables (lists, the manager's truth), refreshed incrementally.

    An entry holds the list object it copied: a new list (new request, fork, swap-in,
    readmission) is copied whole, the same list only from ``first_dirty`` on (growth appends
    there and copy-on-write replaces the partial last block there), so a decode step costs
    O(batch), not O(tokens).
    """

    def __init__(self, lists: dict[str, list[int]]) -> None:
        self.lists = lists
        self._cache: dict[str, tuple[list[int], np.ndarray, int]] = {}

    def get(self, request_id: str, first_dirty: int) -> np.ndarray:
        """Request ``request_id``'s table as int32 ``[num_blocks]`` (a view: do not keep)."""
        table = self.lists[request_id]
        n = len(table)
        entry = self._cache.get(request_id)
        if entry is None or entry[0] is not table:
            arr = np.empty(max(16, 2 * n), dtype=np.int32)
            arr[:n] = table
        else:
            _, arr, valid = entry
            if n > len(arr):
                arr = np.resize(arr, 2 * n)
            lo = min(first_dirty, valid, n)
            arr[lo:n] = table[lo:n]
        self._cache[request_id] = (table, arr, n)
        return arr[:n]

    def forget(self, request_id: str) -> None:
        self._cache.pop(request_id, None)
