"""Room per request in paged mode: a request's blocks, and what more tokens would take."""

from __future__ import annotations

from vmkv.kv.paged.blocks import BlockPool
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
        return list(self._state.block_tables[request_id])

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

    def units_needed(self, request_id: str, num_new_tokens: int) -> int:
        new_blocks, cow = self.plan(request_id, num_new_tokens)
        return new_blocks + cow

    @property
    def free_units(self) -> int:
        evictable = self._caching.num_evictable() if self._caching is not None else 0
        return self._pool.num_free + evictable

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        need = self.units_needed(request_id, num_new_tokens)
        return need <= self._pool.num_free or need <= self.free_units
