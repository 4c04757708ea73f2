"""Paged mode (PagedAttention): a block pool, per-request block tables, copy-on-write.

    kv cache:  [layer, k|v, num_blocks, block_size, kv_head, head_dim]   (plain device memory)
    request r: block_table = [7, 1, 3]   token t lives in block_table[t // bs], row t % bs

Blocks are reference counted; ``fork`` shares every block of the parent. Writing into a shared
*partial* last block copies it once (the writer gets a private copy, the other keeps the
original), exactly as in the seed's ``append_token``; full shared blocks are never written, so
they are never copied. Free blocks form a FIFO queue: allocation takes from the head, release
appends at the tail, a request's blocks in reverse order (its deepest blocks are reused first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from vmkv.kv.addressing import BlockAddressing
from vmkv.kv.base import KVCacheManager, KVUsage, SwappedKV
from vmkv.kv.changes import (
    CopyBlock,
    DropSwapped,
    Forget,
    KVChange,
    SetTable,
    SwapIn,
    SwapOut,
    Tokens,
)
from vmkv.kv.prefix import PrefixCaching
from vmkv.kv.spec import KVSpec


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


class PagedKVCache(KVCacheManager):
    """Block-table KV cache of ``num_blocks`` blocks of ``block_size`` tokens."""

    kv_mode = "paged"

    def __init__(
        self,
        spec: KVSpec,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int,
        device: str | torch.device = "cpu",
        enable_prefix_caching: bool = False,
        prefix_cache_hash: str = "sha256",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.spec = spec
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks)
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.block_tables: dict[str, list[int]] = {}
        self.tables = BlockTableMirror(self.block_tables)
        self.max_blocks = -(-max_model_len // block_size)
        self._num_tokens: dict[str, int] = {}
        self._saved: dict[str, torch.Tensor] = {}  # a follower's swapped-out KV by request
        if enable_prefix_caching:
            self.prefix = PrefixCaching(BlockUnits(self), prefix_cache_hash)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.block_size * self.spec.bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- contract -----------------------------------------------------------------------------
    def num_tokens(self, request_id: str) -> int:
        return self._num_tokens.get(request_id, 0)

    def request_ids(self) -> list[str]:
        return list(self.block_tables)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def units_of(self, request_id: str) -> list[int]:
        return list(self.block_tables[request_id])

    def addressing(self, request_ids: Sequence[str], context_lens: Sequence[int], *,
                   full_width: bool = False) -> BlockAddressing:
        """The step's block table ``[B, W]`` (``W`` = the longest table, or ``max_blocks``),
        refreshed from the block holding each request's first new token on."""
        bs = self.block_size
        tables = [self.tables.get(rid, c // bs) for rid, c in zip(request_ids, context_lens,
                                                                  strict=True)]
        width = self.max_blocks if full_width else max((len(t) for t in tables), default=1)
        block_table = np.zeros((len(tables), max(width, 1)), dtype=np.int32)  # [B, W]
        for i, t in enumerate(tables):
            block_table[i, : len(t)] = t
        return BlockAddressing(block_table, bs)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_blocks, block_size, kv_head, head_dim]`` K and V of ``layer``."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def _plan(self, request_id: str, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks needed, whether the last block must be copied first)."""
        cur = self.num_tokens(request_id)
        self._check_length(request_id, cur + num_new_tokens)
        table = self.block_tables.get(request_id, [])
        new_blocks = self._blocks_for(cur + num_new_tokens) - len(table)
        cow = (
            num_new_tokens > 0
            and cur % self.block_size != 0
            and self.pool.ref_cnt[table[-1]] > 1
        )
        return new_blocks, cow

    def units_needed(self, request_id: str, num_new_tokens: int) -> int:
        new_blocks, cow = self._plan(request_id, num_new_tokens)
        return new_blocks + cow

    @property
    def free_units(self) -> int:
        return self.pool.num_free + (self.prefix.num_evictable() if self.prefix else 0)

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        need = self.units_needed(request_id, num_new_tokens)
        return need <= self.pool.num_free or need <= self.free_units

    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        new_blocks, cow = self._plan(request_id, num_new_tokens)
        if new_blocks + cow > self.pool.num_free and self.prefix is not None:
            self.prefix.evict(new_blocks + cow - self.pool.num_free)
        got = self.pool.allocate(new_blocks + cow)
        if got is None:
            return False
        table = self.block_tables.setdefault(request_id, [])
        start = len(table) - cow  # the first entry this changes
        if cow:
            self._copy_on_write(table, got.pop(0))
        table.extend(got)
        self._num_tokens[request_id] = self.num_tokens(request_id) + num_new_tokens
        if self.changes is not None:
            self._record_table(request_id, start)
        return True

    def _record_table(self, request_id: str, start: int) -> None:
        table = self.block_tables[request_id]
        self.changes.append(SetTable(request_id, start, tuple(table[start:])))
        self.changes.append(Tokens(request_id, self._num_tokens[request_id]))

    def close(self) -> None:
        """Release the cache tensor and the prefix cache (whose units refer back to this
        manager: dropping it breaks that cycle, so the rest goes when its holders let go)."""
        self.kv = torch.empty(0, dtype=self.spec.dtype, device=self.device)
        self._saved.clear()
        if self.prefix is not None:
            self.prefix.reset()
            self.prefix = None

    def describe(self) -> str:
        return f"paged: {self.pool.num_blocks:,} blocks of {self.block_size} tokens"

    def _copy_on_write(self, table: list[int], new_block: int) -> None:
        old = table[-1]
        self.kv[:, :, new_block].copy_(self.kv[:, :, old])  # the one partial block, all layers
        self._record(CopyBlock(old, new_block))
        self.pool.release(old)
        table[-1] = new_block

    def fork(self, parent_id: str, child_id: str) -> bool:
        if child_id in self.block_tables:
            raise ValueError(f"fork target {child_id!r} already holds KV")
        table = self.block_tables[parent_id]
        for block in table:
            self.pool.retain(block)
        self.block_tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        if self.changes is not None:
            self._record_table(child_id, 0)
        if self.prefix is not None:
            self.prefix.inherit(parent_id, child_id)
        return True

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id)
        self.tables.forget(request_id)
        del self._num_tokens[request_id]
        for block in reversed(table):  # all or nothing; tail blocks reach the queue first
            self.pool.release(block)
        self._record(Forget(request_id))
        if self.prefix is not None:
            self.prefix.forget(request_id)

    def swap_out(self, request_id: str) -> SwappedKV:
        table = torch.tensor(self.block_tables[request_id], device=self.device)
        data = self._host_copy(self.kv.index_select(2, table), owned=True)  # [L,2,blocks,bs,H,D]
        swapped = SwappedKV(self.num_tokens(request_id), [data])
        self._record_swap_out(swapped, SwapOut(request_id, tuple(self.block_tables[request_id])))
        self.free(request_id)
        return swapped

    def swap_in(self, request_id: str, swapped: SwappedKV) -> bool:
        if request_id in self.block_tables:
            raise ValueError(f"swap_in of {request_id!r} which already holds KV")
        if not self.allocate(request_id, swapped.num_tokens):
            return False
        table = torch.tensor(self.block_tables[request_id], device=self.device)
        self.kv.index_copy_(2, table, swapped.data[0].to(self.device, non_blocking=True))
        if self.changes is not None:
            self.changes.append(SwapIn(request_id, tuple(self.block_tables[request_id])))
            self._swaps_held.discard(request_id)
        return True

    def apply_changes(self, changes: Sequence[KVChange]) -> None:
        """A follower keeps the block tables and moves its own bytes; it decides nothing and
        keeps no pool or prefix accounting (rank 0's manager does)."""
        saved = self._saved
        for change in changes:
            match change:
                case SetTable(request_id, start, blocks):
                    table = self.block_tables.setdefault(request_id, [])
                    del table[start:]
                    table.extend(blocks)
                case Tokens(request_id, num_tokens):
                    self._num_tokens[request_id] = num_tokens
                case Forget(request_id):
                    del self.block_tables[request_id], self._num_tokens[request_id]
                    self.tables.forget(request_id)
                case CopyBlock(src, dst):
                    self.kv[:, :, dst].copy_(self.kv[:, :, src])
                case SwapOut(request_id, blocks):
                    index = torch.tensor(blocks, device=self.device)
                    saved[request_id] = self._host_copy(self.kv.index_select(2, index),
                                                        owned=True)
                case SwapIn(request_id, blocks):
                    index = torch.tensor(blocks, device=self.device)
                    self.kv.index_copy_(2, index, saved.pop(request_id).to(self.device))
                case DropSwapped(request_ids):
                    for request_id in request_ids:
                        saved.pop(request_id, None)
                case _:
                    raise ValueError(f"a paged KV cache cannot apply {change!r}")

    # -- accounting ---------------------------------------------------------------------------
    @property
    def usage(self) -> KVUsage:
        cached = set(self.prefix.holds() if self.prefix is not None else [])
        cached_only = sum(1 for b in cached if self.pool.ref_cnt[b] == 1)
        held = self.pool.num_in_use * self.block_bytes
        capacity = self.pool.num_blocks * self.block_bytes
        return KVUsage(
            num_requests=len(self.block_tables),
            num_tokens=sum(self._num_tokens.values()),
            capacity_bytes=capacity,
            bytes_in_use=held - cached_only * self.block_bytes,
            bytes_held=held,
            bytes_created=capacity,
            token_bytes=self._unique_token_bytes(),
            virt_reserved_bytes=0,
            bytes_cached=cached_only * self.block_bytes,
            bytes_allocated=self.kv.numel() * self.kv.element_size(),
        )

    def _unique_token_bytes(self) -> int:
        """Bytes of live token rows, counting rows of a block shared by forks once."""
        filled: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            n = self._num_tokens[rid]
            for i, block in enumerate(table):
                rows = min(self.block_size, n - i * self.block_size)
                filled[block] = max(filled.get(block, 0), rows)
        return sum(filled.values()) * self.spec.bytes_per_token

    def check(self) -> None:
        refs = [0] * self.pool.num_blocks
        for rid, table in self.block_tables.items():
            assert len(table) == self._blocks_for(self._num_tokens[rid]), rid
            for block in table:
                refs[block] += 1
        for block in self.prefix.holds() if self.prefix is not None else []:
            refs[block] += 1
        assert refs == self.pool.ref_cnt, "block ref counts disagree with tables + cache"
        free = set(self.pool.free_queue)
        assert len(free) == len(self.pool.free_queue), "a block is queued twice"
        assert all((refs[b] == 0) == (b in free) for b in range(self.pool.num_blocks))


class BlockUnits:
    """Prefix-caching units of a paged cache: a unit is a block, its payload the block id."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv

    def unit_span(self, i: int) -> tuple[int, int]:
        return i * self.kv.block_size, (i + 1) * self.kv.block_size

    def unit_payload(self, request_id: str, i: int) -> int:
        return self.kv.block_tables[request_id][i]

    def hold(self, block: int) -> None:
        self.kv.pool.retain(block)

    def unhold(self, block: int) -> None:
        self.kv.pool.release(block)

    def is_cache_only(self, block: int) -> bool:
        return self.kv.pool.ref_cnt[block] == 1

    def payload_units(self, block: int) -> int:
        return 1

    def adopt(self, request_id: str, blocks: list[int]) -> int:
        kv = self.kv
        if request_id in kv.block_tables:
            raise ValueError(f"match_prefix for {request_id!r}, which already holds KV")
        for block in blocks:
            kv.pool.retain(block)
        kv.block_tables[request_id] = list(blocks)
        kv._num_tokens[request_id] = len(blocks) * kv.block_size
        if kv.changes is not None:
            kv._record_table(request_id, 0)
        return len(blocks) * kv.block_size
