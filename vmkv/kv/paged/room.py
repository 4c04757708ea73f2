"""Room per request in paged mode: a request's blocks, and what more tokens would take."""

from __future__ import annotations

from vmkv.kv.paged.blocks import NULL_BLOCK, BlockPool, first_live
from vmkv.kv.paged.state import PagedState
from vmkv.kv.prefix import PrefixCaching
from vmkv.kv.room import KVRoom


class BlockRoom(KVRoom):
    """Planning and admission questions of one paged cache (no side effects)."""

    def __init__(self, state: PagedState, pool: BlockPool, caching: PrefixCaching | None,
                 max_model_len: int) -> None:
        super().__init__(state.tokens, max_model_len)
        self._state = state
        self._pool = pool
        self._caching = caching

    def units_of(self, request_id: str) -> list[int]:
        return [b for tables in self._state.group_tables for b in tables[request_id]]

    def plan(self, request_id: str, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks needed, whether the last block must be copied first); ValueError past
        ``max_model_len``."""
        bs = self._state.block_size
        cur = self._tokens.get(request_id, 0)
        if cur + num_new_tokens > self.max_model_len:
            self.check_length(request_id, cur + num_new_tokens)
        table = self._state.block_tables.get(request_id, [])
        new_blocks = -(-(cur + num_new_tokens) // bs) - len(table)
        cow = num_new_tokens > 0 and cur % bs != 0 and self._pool.ref_cnt[table[-1]] > 1
        return new_blocks, cow

    def plan_groups(self, request_id: str, num_new_tokens: int
                    ) -> list[tuple[int, int, bool]]:
        """Per block group: (blocks before its window that go back first, new blocks, whether
        the last block must be copied first); ValueError past ``max_model_len``."""
        state, bs = self._state, self._state.block_size
        cur = self._tokens.get(request_id, 0)
        if cur + num_new_tokens > self.max_model_len:
            self.check_length(request_id, cur + num_new_tokens)
        out = []
        for tables, (_, window) in zip(state.group_tables, state.groups, strict=True):
            table = tables.get(request_id, [])
            new_blocks = -(-(cur + num_new_tokens) // bs) - len(table)
            cow = (num_new_tokens > 0 and cur % bs != 0 and table[-1] != NULL_BLOCK
                   and self._pool.ref_cnt[table[-1]] > 1)
            drop = (max(0, min(max(0, cur - window + 1) // bs, len(table)) - first_live(table))
                    if window else 0)
            out.append((drop, new_blocks, cow))
        return out

    def units_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Blocks ``num_new_tokens`` more would take; with block groups, net of the blocks the
        sliding groups give back, and a long remaining prefill counted as steps of at most a
        window for them (what they hold at most while it runs)."""
        state = self._state
        if len(state.groups) == 1:
            new_blocks, cow = self.plan(request_id, num_new_tokens)
            return new_blocks + cow
        bs, cur = state.block_size, self._tokens.get(request_id, 0)
        need = 0
        for (drop, new, cow), tables, (_, window) in zip(
                self.plan_groups(request_id, num_new_tokens), state.group_tables, state.groups,
                strict=True):
            if window and num_new_tokens > window:  # what a sliding group holds at the end
                table = tables.get(request_id, [])
                first = max(0, cur + num_new_tokens - 2 * window + 1) // bs
                end = -(-(cur + num_new_tokens) // bs)
                need += (end - first) - (len(table) - first_live(table)) + cow
                continue
            need += new + cow - drop
        return max(0, need)

    @property
    def free_units(self) -> int:
        evictable = self._caching.num_evictable() if self._caching is not None else 0
        return self._pool.num_free + evictable

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` of ``num_new_tokens`` in one step would find its blocks
        (a sliding group holds every block of one step)."""
        if len(self._state.groups) == 1:
            need = self.units_needed(request_id, num_new_tokens)
        else:
            need = sum(new + cow - drop
                       for drop, new, cow in self.plan_groups(request_id, num_new_tokens))
        return need <= self._pool.num_free or need <= self.free_units
