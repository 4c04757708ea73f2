"""Paged mode on CPU: gather each request's rows by block table, then SDPA.

Row of token ``t`` of a request: ``block_table[t // bs] * bs + t % bs`` in the flat
``[num_blocks * block_size, kv_heads, head_dim]`` view of a layer.
"""

from __future__ import annotations

import torch

from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.sdpa import attend_one
from vmkv.kv.paged import PagedKVCache


class PagedGatherBackend(AttentionBackend):
    """One ``index_select`` gather per layer over all requests' block tables, then SDPA."""

    name = "paged-gather-sdpa"

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1))
                      for k, v in (kv.layer_kv(i) for i in range(kv.spec.num_layers))]

    def prepare(self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
                ) -> AttentionMetadata:
        bs = self.kv.block_size
        seq_rows: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        for rid, ctx, n in zip(request_ids, context_lens, query_lens, strict=True):
            table = torch.tensor(self.kv.block_table(rid), dtype=torch.int64)
            pos = torch.arange(ctx + n)
            rows = table[pos // bs] * bs + pos % bs
            seq_rows.append(rows)
            write.append(rows[ctx:])
        gather = torch.cat(seq_rows)
        return AttentionMetadata(list(request_ids), list(context_lens), list(query_lens),
                                 torch.cat(write), seq_rows, {"gather_rows": gather})

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_flat, v_flat = self._flat[layer]
        k_flat.index_copy_(0, meta.write_rows, k)
        v_flat.index_copy_(0, meta.write_rows, v)
        rows = meta.extra["gather_rows"]
        k_all = k_flat.index_select(0, rows)  # [sum seq_len, kv_heads, D], a copy
        v_all = v_flat.index_select(0, rows)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        pos = kv_pos = 0
        for ctx, n in zip(meta.context_lens, meta.query_lens, strict=True):
            length = ctx + n
            out[pos : pos + n] = attend_one(q[pos : pos + n], k_all[kv_pos : kv_pos + length],
                                            v_all[kv_pos : kv_pos + length], ctx, scale)
            pos += n
            kv_pos += length
        return out
