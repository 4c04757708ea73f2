"""The paged KV cache: its allocator, and the manager that composes the parts (the package
docstring, :mod:`vmkv.kv.paged`, draws them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vmkv.kv.addressing import BlockAddressing, GroupedAddressing
from vmkv.kv.base import KVCacheManager
from vmkv.kv.changes import CopyBlock, Forget, SetTable, Tokens
from vmkv.kv.mapping import KVMapping
from vmkv.kv.paged.accounting import BlockAccounting
from vmkv.kv.paged.blocks import NULL_BLOCK, BlockPool, BlockTableMirror, first_live
from vmkv.kv.paged.room import BlockRoom
from vmkv.kv.paged.state import BlockUnits, PagedState
from vmkv.kv.prefix import PrefixCaching, PrefixPart
from vmkv.kv.spec import KVSpec
from vmkv.kv.swap import KVSwap


class BlockAllocator:
    """allocate / free / fork of a paged cache: rank 0 chooses blocks from its pool and
    commits the tables they make."""

    def __init__(self, state: PagedState, pool: BlockPool, room: BlockRoom,
                 caching: PrefixCaching | None) -> None:
        self._state = state
        self._pool = pool
        self._room = room
        self._caching = caching

    def allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """See :meth:`KVCacheManager.allocate`; a shared partial last block is copied first."""
        state, pool = self._state, self._pool
        if len(state.groups) > 1:
            return self._allocate_groups(request_id, num_new_tokens)
        new_blocks, cow = self._room.plan(request_id, num_new_tokens)
        if new_blocks + cow > pool.num_free and self._caching is not None:
            self._caching.evict(new_blocks + cow - pool.num_free)
        got = pool.allocate(new_blocks + cow)
        if got is None:
            return False
        table = state.block_tables.get(request_id)
        if cow:  # the writer gets the copy, the other holders keep the original
            old = table[-1]
            state.commit(CopyBlock(old, got[0]))
            pool.release(old)
        if got or table is None:
            start = (len(table) if table is not None else 0) - cow  # the first entry changed
            state.commit(SetTable(request_id, start, tuple(got)))
        state.commit(Tokens(request_id, state.tokens.get(request_id, 0) + num_new_tokens))
        return True

    def _allocate_groups(self, request_id: str, num_new_tokens: int) -> bool:
        """:meth:`allocate` with block groups: each sliding group first gives back its blocks
        behind the window (the table holds NULL_BLOCK there; no query of this step or later
        sees them), then every group takes its new blocks from the one pool."""
        state, pool = self._state, self._pool
        plans = self._room.plan_groups(request_id, num_new_tokens)
        for g, (drop, _, _) in enumerate(plans):
            if drop:
                table = state.group_tables[g][request_id]
                start = first_live(table)
                behind = table[start : start + drop]
                state.commit(SetTable(request_id, start, (NULL_BLOCK,) * drop
                                      + tuple(table[start + drop :]), g))
                for block in reversed(behind):
                    pool.release(block)
        total = sum(new + cow for _, new, cow in plans)
        got = pool.allocate(total)
        if got is None:
            return False
        for g, (_, new, cow) in enumerate(plans):
            mine, got = got[: new + cow], got[new + cow :]
            table = state.group_tables[g].get(request_id)
            if cow:
                old = table[-1]
                state.commit(CopyBlock(old, mine[0]))
                pool.release(old)
            if mine or table is None:
                start = (len(table) if table is not None else 0) - cow
                state.commit(SetTable(request_id, start, tuple(mine), g))
        state.commit(Tokens(request_id, state.tokens.get(request_id, 0) + num_new_tokens))
        return True

    def free(self, request_id: str) -> None:
        """See :meth:`KVCacheManager.free`."""
        tables = [t[request_id] for t in self._state.group_tables]
        self._state.commit(Forget(request_id))
        for table in tables:
            for block in reversed(table):  # all or nothing; tail blocks reach the queue first
                if block != NULL_BLOCK:
                    self._pool.release(block)
        if self._caching is not None:
            self._caching.forget(request_id)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """See :meth:`KVCacheManager.free` with ``keep_tokens``: every group's blocks past
        the new end are freed (tail first, as :meth:`free` does)."""
        state = self._state
        keep = -(-num_tokens // state.block_size)
        for g, tables in enumerate(state.group_tables):
            dropped = tables[request_id][keep:]
            if dropped:
                state.commit(SetTable(request_id, keep, (), g))
                for block in reversed(dropped):
                    if block != NULL_BLOCK:
                        self._pool.release(block)
        state.commit(Tokens(request_id, num_tokens))

    def fork(self, parent_id: str, child_id: str) -> bool:
        """See :meth:`KVCacheManager.fork`: the child shares every block of the parent."""
        state = self._state
        if child_id in state.block_tables:
            raise ValueError(f"fork target {child_id!r} already holds KV")
        for g, tables in enumerate(state.group_tables):
            table = tables[parent_id]
            for block in table:
                if block != NULL_BLOCK:
                    self._pool.retain(block)
            state.commit(SetTable(child_id, 0, tuple(table), g))
        state.commit(Tokens(child_id, state.tokens[parent_id]))
        if self._caching is not None:
            self._caching.inherit(parent_id, child_id)
        return True


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
        if enable_prefix_caching and any(spec.windows):
            raise ValueError("prefix caching cannot serve sliding-window layers that give their "
                             "blocks back: a cached prefix would lack them")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.spec = spec
        self.device = torch.device(device)
        pool = BlockPool(num_blocks)
        state = PagedState(spec, num_blocks, block_size, self.device)
        caching = (PrefixCaching(BlockUnits(state, pool), prefix_cache_hash)
                   if enable_prefix_caching else None)
        self._room = BlockRoom(state, pool, caching, max_model_len)
        self._allocator = BlockAllocator(state, pool, self._room, caching)
        self._changes, self._caching = state, caching
        self._swap = KVSwap(state, self._allocator)
        self._prefix = PrefixPart(caching)
        self._mapping = KVMapping()
        self._accounting = BlockAccounting(state, pool, caching)
        # the geometry, for tests and benchmarks (not the contract)
        self.pool, self.block_size = pool, block_size
        self.block_tables, self.tables = state.block_tables, state.tables
        self.max_blocks = -(-max_model_len // block_size)

    # -- the contract ---------------------------------------------------------------------------
    def addressing(self, request_ids: Sequence[str], context_lens: Sequence[int], *,
                   full_width: bool = False) -> BlockAddressing | GroupedAddressing:
        """The step's block table ``[B, W]`` (``W`` = the longest table, or ``max_blocks``),
        refreshed from the block holding each request's first new token on; one per block
        group where the layers slide (:class:`GroupedAddressing`)."""
        state = self._changes
        tables = [self._table(mirror, request_ids, context_lens, full_width)
                  for mirror in state.mirrors]
        if len(tables) == 1:
            return tables[0]
        return GroupedAddressing(tuple(tables), tuple(
            state.lane_of[layer][0] for layer in range(self.spec.num_layers)))

    def _table(self, mirror: BlockTableMirror, request_ids: Sequence[str],
               context_lens: Sequence[int], full_width: bool) -> BlockAddressing:
        bs = self.block_size
        tables = [mirror.get(rid, c // bs) for rid, c in zip(request_ids, context_lens,
                                                             strict=True)]
        width = self.max_blocks if full_width else max((len(t) for t in tables), default=1)
        block_table = np.zeros((len(tables), max(width, 1)), dtype=np.int32)  # [B, W]
        for i, t in enumerate(tables):
            block_table[i, : len(t)] = t
        return BlockAddressing(block_table, bs)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_blocks, block_size, kv_head, head_dim]`` K and V of ``layer`` (its lane of
        its block group's tensor)."""
        kv = self._changes.kv
        lane = self._changes.lane_of[layer][1]
        return kv[lane, 0], kv[lane, 1]

    def close(self) -> None:
        """Release the cache tensor and the prefix cache (the rest goes when its holders let
        go)."""
        self._changes.close()
        if self._caching is not None:
            self._caching.reset()
        self._prefix.close()

    # -- paged mode only ------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        """``request_id``'s block ids (KeyError if it holds none)."""
        return self.block_tables[request_id]

    @property
    def kv(self) -> torch.Tensor:
        """``[layer, k|v, num_blocks, block_size, kv_head, head_dim]``: every block."""
        return self._changes.kv
