"""Paged mode on CPU: decodes read blocks in place through the block table; prefill chunks
gather their rows by block table, then SDPA.

Row of token ``t`` of a request: ``block_table[t // bs] * bs + t % bs`` in the flat
``[num_blocks * block_size, kv_heads, head_dim]`` view of a layer.
"""

from __future__ import annotations

import torch

from vmkv.attention import cpu_decode
from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.sdpa import attend_gathered
from vmkv.kv.paged import PagedKVCache


class PagedGatherBackend(AttentionBackend):
    """Batched in-place block-table decode kernel + gather-then-SDPA prefill."""

    name = "paged-cpu"

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1))
                      for k, v in (kv.layer_kv(i) for i in range(kv.spec.num_layers))]
        self.batched_decode = cpu_decode.use_kernel(kv.spec.dtype)

    def _rows(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        bs = self.kv.block_size
        pos = torch.arange(start, stop)
        return torch.tensor(table, dtype=torch.int64)[pos // bs] * bs + pos % bs

    def prepare(self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
                ) -> AttentionMetadata:
        tables = [self.kv.block_table(rid) for rid in request_ids]
        idx, rows = cpu_decode.decode_positions(query_lens)
        batched = self.batched_decode and bool(idx)
        seq_rows: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        for table, ctx, n in zip(tables, context_lens, query_lens, strict=True):
            if batched and n == 1:  # the kernel reads it in place: only the new row is needed
                seq_rows.append(torch.empty(0, dtype=torch.int64))
                write.append(self._rows(table, ctx, ctx + 1))
            else:
                rows_i = self._rows(table, 0, ctx + n)
                seq_rows.append(rows_i)
                write.append(rows_i[ctx:])
        extra: dict[str, object] = {"gather_rows": torch.cat(seq_rows)}
        if batched:
            width = max(len(tables[i]) for i in idx)
            table_t = torch.zeros(len(idx), width, dtype=torch.int32)
            for j, i in enumerate(idx):
                table_t[j, : len(tables[i])] = torch.tensor(tables[i], dtype=torch.int32)
            extra["decode"] = cpu_decode.DecodeBatch(
                query_rows=cpu_decode.query_rows(rows, sum(query_lens)),
                seq_lens=torch.tensor([context_lens[i] + 1 for i in idx], dtype=torch.int32),
                block_table=table_t, block_size=self.kv.block_size)
        return AttentionMetadata(list(request_ids), list(context_lens), list(query_lens),
                                 torch.cat(write), seq_rows, extra)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_flat, v_flat = self._flat[layer]
        out = cpu_decode.write_and_decode(meta, q, k, v, k_flat, v_flat, scale)
        rows = meta.extra["gather_rows"]
        if rows.numel():
            k_all = k_flat.index_select(0, rows)  # [sum seq_len of gathered requests, H, D]
            v_all = v_flat.index_select(0, rows)
            attend_gathered(out, q, k_all, v_all, meta, [len(s) for s in meta.seq_rows], scale)
        return out
