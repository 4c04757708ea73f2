"""What a paged cache's tensor-parallel ranks share, and the one place that changes it.

    PagedState (the manager's ``changes`` part)
      kv            [lane, k|v, num_blocks, block_size, kv_head, row_dim] this rank's bytes
                    (row_dim: head_dim, + an int8 cache's scale: KVSpec.row_dim)
                    (lanes = layers without sliding-window layers; see blocks.block_groups)
      block_tables  request -> block ids (lists: the truth; ``tables`` mirrors them in numpy),
                    one dict per block group (``group_tables``; ``block_tables`` is group 0's)
      tokens        tokens of room per request
      commit(change) ─▶ _apply_one: SetTable, Tokens, Forget, CopyBlock, SwapOut, SwapIn,
                        DropSwapped

The block pool (free queue, reference counts) and the prefix cache are rank 0's decision state:
the other ranks keep neither, they apply the tables rank 0's decisions produced.
"""

from __future__ import annotations

import torch

from vmkv.kv.changes import (
    ChangeLog,
    CopyBlock,
    DropSwapped,
    Forget,
    KVChange,
    SetTable,
    SwapIn,
    SwapOut,
    Tokens,
)
from vmkv.kv.paged.blocks import BlockPool, BlockTableMirror, block_groups, first_live
from vmkv.kv.spec import KVSpec
from vmkv.kv.swap import host_copy


class PagedState(ChangeLog):
    """Block tables, token counts and the KV tensor of one paged cache, changed only by
    :meth:`commit`."""

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.block_size = block_size
        self.device = device
        #: (layers, window) of each block group; one group of every layer without windows
        self.groups = block_groups(spec)
        self.lanes = len(self.groups[0][0])
        shape = (self.lanes, 2, num_blocks, block_size, spec.num_kv_heads, spec.row_dim)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in self.groups]
        self.block_tables = self.group_tables[0]
        self.mirrors = [BlockTableMirror(tables) for tables in self.group_tables]
        self.tables = self.mirrors[0]
        #: layer -> (block group, lane)
        self.lane_of = {layer: (g, j) for g, (layers, _) in enumerate(self.groups)
                        for j, layer in enumerate(layers)}
        self.tokens: dict[str, int] = {}
        self.saved: dict[str, list[torch.Tensor]] = {}  # swapped-out KV between its two changes
        self._saved_starts: dict[str, tuple[int, ...]] = {}  # each group's first block, saved

    def swap_where(self, request_id: str) -> tuple[int, ...]:
        """The blocks holding ``request_id``'s tokens, group after group (a sliding group's
        from its first live block; swapping in: from where the saved ones started)."""
        if len(self.groups) == 1:
            return tuple(self.block_tables[request_id])
        starts = self._saved_starts.get(request_id) if request_id in self.saved else None
        blocks: list[int] = []
        for g, tables in enumerate(self.group_tables):
            table = tables[request_id]
            blocks += table[starts[g] if starts is not None else first_live(table):]
        return tuple(blocks)

    def _apply_one(self, change: KVChange) -> KVChange | None:
        match change:
            case Tokens():  # every request, every step: first, and no field captures
                self.tokens[change.request_id] = change.num_tokens
            case SetTable(request_id, start, blocks, group):
                table = self.group_tables[group].setdefault(request_id, [])
                del table[start:]
                table.extend(blocks)
            case Forget(request_id):
                del self.tokens[request_id]
                for tables, mirror in zip(self.group_tables, self.mirrors, strict=True):
                    del tables[request_id]
                    mirror.forget(request_id)
            case CopyBlock(src, dst):
                self.kv[:, :, dst].copy_(self.kv[:, :, src])  # one block, every layer
            case SwapOut(request_id, blocks):
                self._saved_starts[request_id] = tuple(
                    first_live(tables[request_id]) for tables in self.group_tables)
                index = torch.tensor(blocks, device=self.device)
                self.saved[request_id] = [host_copy(self.kv.index_select(2, index),
                                                    owned=True)]  # [L, 2, blocks, bs, H, D]
            case SwapIn(request_id, blocks):
                index = torch.tensor(blocks, device=self.device)
                (data,) = self.saved.pop(request_id)
                self._saved_starts.pop(request_id, None)
                self.kv.index_copy_(2, index, data.to(self.device, non_blocking=True))
            case DropSwapped(request_ids):
                for request_id in request_ids:
                    self.saved.pop(request_id, None)
                    self._saved_starts.pop(request_id, None)
            case _:
                raise ValueError(f"a paged KV cache cannot apply {change!r}")
        return change

    def close(self) -> None:
        """Release the KV tensor and any saved KV."""
        self.kv = torch.empty(0, dtype=self.spec.dtype, device=self.device)
        self.saved.clear()


class BlockUnits:
    """Prefix-caching units of a paged cache: a unit is a block, its payload the block id."""

    def __init__(self, state: PagedState, pool: BlockPool) -> None:
        self.state = state
        self.pool = pool

    def unit_span(self, i: int) -> tuple[int, int]:
        return i * self.state.block_size, (i + 1) * self.state.block_size

    def unit_payload(self, request_id: str, i: int) -> int:
        return self.state.block_tables[request_id][i]

    def hold(self, block: int) -> None:
        self.pool.retain(block)

    def unhold(self, block: int) -> None:
        self.pool.release(block)

    def is_cache_only(self, block: int) -> bool:
        return self.pool.ref_cnt[block] == 1

    def payload_units(self, block: int) -> int:
        return 1

    def adopt(self, request_id: str, blocks: list[int]) -> int:
        state = self.state
        if request_id in state.block_tables:
            raise ValueError(f"match_prefix for {request_id!r}, which already holds KV")
        for block in blocks:
            self.pool.retain(block)
        num_tokens = len(blocks) * state.block_size
        state.commit(SetTable(request_id, 0, tuple(blocks)))
        state.commit(Tokens(request_id, num_tokens))
        return num_tokens
