"""Paged mode (PagedAttention): a block pool, per-request block tables, copy-on-write.

    kv cache:  [layer, k|v, num_blocks, block_size, kv_head, head_dim]   (plain device memory)
    request r: block_table = [7, 1, 3]   token t lives in block_table[t // bs], row t % bs

Blocks are reference counted; ``fork`` shares every block of the parent. Writing into a shared
*partial* last block copies it once (the writer gets a private copy, the other keeps the
original), exactly as in the seed's ``append_token``; full shared blocks are never written, so
they are never copied. Free blocks form a FIFO queue: allocation takes from the head, release
appends at the tail, a request's blocks in reverse order (its deepest blocks are reused first).

Parts (one module each, the manager in :mod:`~vmkv.kv.paged.manager` composes them):

    state.py       PagedState: the KV tensor, block tables, token counts, changed only by its
                   commit (the ``changes`` part); BlockUnits, the prefix cache's units
    blocks.py      BlockPool (reference counts, FIFO free queue), BlockTableMirror (numpy)
    room.py        BlockRoom: planning (new blocks, copy-on-write) and admission
    manager.py     BlockAllocator: allocate / free / fork; PagedKVCache
    accounting.py  BlockAccounting: usage, describe, check
    (generic: swap, prefix, changes: vmkv/kv/swap.py, prefix.py, changes.py; no mapper)
"""

from __future__ import annotations

from vmkv.kv.paged.blocks import BlockPool, BlockTableMirror
from vmkv.kv.paged.manager import PagedKVCache
from vmkv.kv.paged.state import BlockUnits, PagedState

__all__ = ["BlockPool", "BlockTableMirror", "BlockUnits", "PagedKVCache", "PagedState"]
