"""How a step's requests find their K/V rows: what a KV manager hands the attention layer.

Both modes expose each layer's cache as a 4-D view ``[outer, inner, kv_heads, head_dim]``
(``kv.layer_kv(layer)``) whose flattening ``[outer * inner, kv_heads, head_dim]`` is the row
space; a step's addressing says where request ``b``'s token ``t`` lives in it:

    SlotAddressing  (virtual)  row(b, t) = slot_ids[b] * slot_tokens + t
                               outer = slot (0: the anchor slot), inner = slot_tokens
    BlockAddressing (paged)    row(b, t) = block_table[b, t // bs] * bs + t % bs
                               outer = block, inner = block_size

With sliding-window layers in paged mode each block group has its own table
(:class:`GroupedAddressing`; virtual mode keeps one slot per request for every layer).

Kernels get the *index* (slot ids, or the block table) and the 4-D views; the K/V write and the
SDPA fallback get rows. Built on the host (numpy) once per step by
``kv.addressing(request_ids, context_lens)``; padding entries (a CUDA graph's unused batch
rows) address the anchor slot or block 0 and are given length 0 by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np


@dataclass(frozen=True)
class SlotAddressing:
    """Virtual mode: each request's tokens are consecutive rows of its slot."""

    paged: ClassVar[bool] = False

    slot_ids: np.ndarray  # [B] int64, >= 1 for requests (0: the anchor slot, for padding)
    slot_tokens: int  # rows per slot

    def __len__(self) -> int:
        return len(self.slot_ids)

    def rows(self, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """int64 flat rows of tokens ``pos`` of batch entries ``req`` (same shapes)."""
        return self.slot_ids[req] * self.slot_tokens + pos

    def sequence_rows(self, b: int, length: int) -> slice:
        """Rows of entry ``b``'s first ``length`` tokens: one contiguous stretch."""
        start = int(self.slot_ids[b]) * self.slot_tokens
        return slice(start, start + length)

    def kernel_arrays(self, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """What kernels read: ``slot_ids [B]`` int32, and FlashAttention's varlen
        ``cu_seqlens_k [B+1]`` int32 = each slot's first row (not monotonic; entry B closes the
        last sequence)."""
        starts = self.slot_ids * self.slot_tokens
        last = starts[-1] + seq_lens[-1] if len(starts) else 0
        return {"cu_seqlens_k": np.append(starts, last).astype(np.int32),
                "slot_ids": self.slot_ids.astype(np.int32)}

    def padded(self, num: int) -> SlotAddressing:
        """``num`` more entries addressing the anchor slot."""
        return SlotAddressing(np.concatenate([self.slot_ids, np.zeros(num, np.int64)]),
                              self.slot_tokens)


@dataclass(frozen=True)
class BlockAddressing:
    """Paged mode: each request's tokens live in the blocks its table row lists."""

    paged: ClassVar[bool] = True

    block_table: np.ndarray  # [B, W] int32 (entries past a request's blocks: 0, never read)
    block_size: int

    def __len__(self) -> int:
        return len(self.block_table)

    def rows(self, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return self.block_table[req, pos // bs].astype(np.int64) * bs + pos % bs

    def sequence_rows(self, b: int, length: int) -> np.ndarray:
        """Rows of entry ``b``'s first ``length`` tokens (a gather)."""
        return self.rows(np.full(length, b), np.arange(length, dtype=np.int64))

    def kernel_arrays(self, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """What kernels read: ``block_table [B, W]`` int32."""
        return {"block_table": self.block_table}

    def padded(self, num: int) -> BlockAddressing:
        """``num`` more entries of zeros (the same width)."""
        pad = np.zeros((num, self.block_table.shape[1]), np.int32)
        return BlockAddressing(np.concatenate([self.block_table, pad]), self.block_size)


@dataclass(frozen=True)
class GroupedAddressing:
    """Paged mode with block groups (sliding-window layers): one block table per group;
    layer ``l`` reads through ``groups[layer_group[l]]``. A sliding group's entries behind its
    window are ``-1`` (the null block): no kernel reads them."""

    paged: ClassVar[bool] = True

    groups: tuple[BlockAddressing, ...]
    layer_group: tuple[int, ...]  # [L] block group of each layer

    def __len__(self) -> int:
        return len(self.groups[0])

    def padded(self, num: int) -> GroupedAddressing:
        return GroupedAddressing(tuple(g.padded(num) for g in self.groups), self.layer_group)


Addressing = SlotAddressing | BlockAddressing | GroupedAddressing


def by_group(addr: Addressing) -> tuple[tuple[SlotAddressing | BlockAddressing, ...],
                                          tuple[int, ...] | None]:
    """(the addressing of each group, each layer's group or None: one group for all)."""
    if isinstance(addr, GroupedAddressing):
        return addr.groups, addr.layer_group
    return (addr,), None
