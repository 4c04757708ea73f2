"""Paged mode's accounting: usage by block, the start-up line, and the invariants."""

from __future__ import annotations

from vmkv.kv.accounting import KVAccounting, KVUsage
from vmkv.kv.paged.blocks import BlockPool
from vmkv.kv.paged.state import PagedState
from vmkv.kv.prefix import PrefixCaching


class BlockAccounting(KVAccounting):
    """The accounting part of a paged cache (its ``accounting``)."""

    def __init__(self, state: PagedState, pool: BlockPool,
                 caching: PrefixCaching | None) -> None:
        self._state = state
        self._pool = pool
        self._caching = caching

    @property
    def block_bytes(self) -> int:
        return self._state.block_size * self._state.spec.bytes_per_token

    @property
    def usage(self) -> KVUsage:
        state, pool = self._state, self._pool
        cached = set(self._caching.holds() if self._caching is not None else [])
        cached_only = sum(1 for b in cached if pool.ref_cnt[b] == 1)
        held = pool.num_in_use * self.block_bytes
        capacity = pool.num_blocks * self.block_bytes
        return KVUsage(
            num_requests=len(state.block_tables),
            num_tokens=sum(state.tokens.values()),
            capacity_bytes=capacity,
            bytes_in_use=held - cached_only * self.block_bytes,
            bytes_held=held,
            bytes_created=capacity,
            token_bytes=self._unique_token_bytes(),
            virt_reserved_bytes=0,
            bytes_cached=cached_only * self.block_bytes,
            bytes_allocated=state.kv.numel() * state.kv.element_size(),
        )

    def _unique_token_bytes(self) -> int:
        """Bytes of live token rows, counting rows of a block shared by forks once."""
        state, bs = self._state, self._state.block_size
        filled: dict[int, int] = {}
        for rid, table in state.block_tables.items():
            n = state.tokens[rid]
            for i, block in enumerate(table):
                rows = min(bs, n - i * bs)
                filled[block] = max(filled.get(block, 0), rows)
        return sum(filled.values()) * state.spec.bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self._pool.num_blocks * self._state.block_size

    def describe(self) -> str:
        return f"paged: {self._pool.num_blocks:,} blocks of {self._state.block_size} tokens"

    def check(self) -> None:
        state, pool, bs = self._state, self._pool, self._state.block_size
        refs = [0] * pool.num_blocks
        assert set(state.tokens) == set(state.block_tables), "token counts without a table"
        for rid, table in state.block_tables.items():
            assert len(table) == -(-state.tokens[rid] // bs), rid
            for block in table:
                refs[block] += 1
        for block in self._caching.holds() if self._caching is not None else []:
            refs[block] += 1
        assert refs == pool.ref_cnt, "block ref counts disagree with tables + cache"
        free = set(pool.free_queue)
        assert len(free) == len(pool.free_queue), "a block is queued twice"
        assert all((refs[b] == 0) == (b in free) for b in range(pool.num_blocks))
