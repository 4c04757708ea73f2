"""Paged mode's accounting: usage by block, the start-up line, and the invariants."""

from __future__ import annotations

from vmkv.kv.accounting import KVAccounting, KVUsage
from vmkv.kv.paged.blocks import NULL_BLOCK, BlockPool, first_live
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
        state = self._state
        return state.block_size * 2 * state.lanes * state.spec.head_bytes

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
        for tables in state.group_tables:
            for rid, table in tables.items():
                n = state.tokens[rid]
                for i, block in enumerate(table):
                    if block != NULL_BLOCK:
                        filled[block] = max(filled.get(block, 0), min(bs, n - i * bs))
        return sum(filled.values()) * self.block_bytes // bs

    @property
    def capacity_tokens(self) -> int:
        """The longest request the blocks hold alone (a sliding group at a window and a step
        of a window)."""
        state, bs = self._state, self._state.block_size
        windows = [window for _, window in state.groups]
        full = windows.count(0)
        sliding = sum(-(-2 * w // bs) + 1 for w in windows if w)
        if not full:
            return state.block_size * self._pool.num_blocks if sliding <= self._pool.num_blocks \
                else 0
        return max(0, self._pool.num_blocks - sliding) // full * bs

    def describe(self) -> str:
        state = self._state
        line = f"paged: {self._pool.num_blocks:,} blocks of {state.block_size} tokens"
        if len(state.groups) == 1:
            return line
        sliding = sum(1 for _, window in state.groups if window)
        return (f"{line} x {state.lanes} layers, {len(state.groups)} block groups "
                f"({sliding} sliding-window: blocks behind the window go back)")

    def check(self) -> None:
        state, pool, bs = self._state, self._pool, self._state.block_size
        refs = [0] * pool.num_blocks
        for tables, (_, window) in zip(state.group_tables, state.groups, strict=True):
            assert set(state.tokens) == set(tables), "token counts without a table"
            for rid, table in tables.items():
                assert len(table) == -(-state.tokens[rid] // bs), rid
                live = first_live(table)
                assert window or live == 0, f"a full group's table lacks blocks: {rid}"
                assert NULL_BLOCK not in table[live:], f"a hole in {rid}'s table"
                for block in table[live:]:
                    refs[block] += 1
        for block in self._caching.holds() if self._caching is not None else []:
            refs[block] += 1
        assert refs == pool.ref_cnt, "block ref counts disagree with tables + cache"
        free = set(pool.free_queue)
        assert len(free) == len(pool.free_queue), "a block is queued twice"
        assert all((refs[b] == 0) == (b in free) for b in range(pool.num_blocks))
