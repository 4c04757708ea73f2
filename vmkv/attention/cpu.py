"""Attention on CPU, both KV modes: K/V read in place through the step's addressing.

A step's decodes go to one batched kernel call per layer, and its prefill chunks to another
(:mod:`vmkv.attention.cpu_batches`: slot rows in virtual mode, block-table rows in paged mode).
In bfloat16 where :func:`vmkv.attention.cpu_batches.use_amx_prefill` holds, every prefill chunk
goes to :mod:`vmkv.kernels.amx_prefill`; otherwise to the batched kernel, long chunks too (since
its loops were blocked over query rows it beats torch's SDPA flash kernel: float32, 4 x 512 fresh
prompts, 30 layers on a 2-core EPYC, 301-322 ms against 581-631 ms). Without the kernels (no
compiler, or neither float32 nor bfloat16) every request runs torch's SDPA over a strided view of
the slot (virtual, the cache read in place) or a block-table gather (paged). Nothing past a
request's length is read, so pages beyond it may stay unmapped. An int8 cache
(``--kv-cache-dtype int8``: rows ``[kv_heads, head_dim + 2]``, a scale after each head's values)
is written by the quantising store and read only by the kernels (no SDPA fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vmkv.attention import cpu_batches
from vmkv.attention.base import AttentionBackend, AttentionMetadata
from vmkv.attention.sdpa import attend_each
from vmkv.attention.step import token_positions
from vmkv.kernels import cpu_attention_int8
from vmkv.kv.addressing import BlockAddressing, SlotAddressing, by_group
from vmkv.kv.base import KVCacheManager


@dataclass
class GroupRows:
    """Where one addressing's (a block group's) rows are: the new rows to write, the decodes
    and the prefill chunks the kernels take, the rows of the requests left to SDPA."""

    write_rows: torch.Tensor
    decode: cpu_batches.DecodeBatch | None
    prefill: cpu_batches.PrefillBatch | None
    seq_rows: list[slice | torch.Tensor | None]  # None: a kernel attends it


@dataclass
class CpuStepMetadata(AttentionMetadata):
    """A CPU step: the decodes and the prefill chunks the kernels take, and the rows of the
    requests left to SDPA (None for the kernels' ones); with block groups (paged mode,
    sliding-window layers) those of each group, layer ``l`` reading ``groups[layer_group[l]]``
    (the fields above are group 0's)."""

    decode: cpu_batches.DecodeBatch | None
    prefill: cpu_batches.PrefillBatch | None
    seq_rows: list[slice | torch.Tensor | None]  # None: a kernel attends it
    groups: list[GroupRows] | None = None
    layer_group: tuple[int, ...] | None = None

    def rows_of(self, layer: int) -> GroupRows | CpuStepMetadata:
        """The rows ``layer`` reads (this metadata itself with one group)."""
        if self.layer_group is None or self.groups is None:
            return self
        return self.groups[self.layer_group[layer]]


class CpuAttentionBackend(AttentionBackend):
    """Batched in-place decode and prefill kernels (SDPA per request without them), over any
    KV manager on the CPU. ``batched_decode`` / ``batched_prefill`` switch the kernels off
    (benchmarks compare)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.name = f"{kv.kv_mode}-cpu"
        # [outer * inner, kv_heads, D] row views per layer (no copies)
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1))
                      for k, v in (kv.layer_kv(i) for i in range(kv.spec.num_layers))]
        self.batched_decode = self.batched_prefill = cpu_batches.use_kernels(kv.spec.dtype)
        #: an int8 cache: written by the quantising store, read by the kernels only
        self.int8 = kv.spec.quantized
        if self.int8 and not self.batched_decode:
            raise RuntimeError("--kv-cache-dtype int8 needs the CPU attention kernels, which "
                               "could not be built (see the log); use --kv-cache-dtype auto")
        #: each layer's sliding window in tokens (0: full attention), applied by every path
        self.windows = kv.spec.windows

    def close(self) -> None:
        self._flat = []

    def prepare(self, request_ids: list[str], context_lens: list[int], query_lens: list[int]
                ) -> CpuStepMetadata:
        addr = self.kv.addressing(request_ids, context_lens)
        ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        req, pos = token_positions(ctx, qlens)
        addrs, layer_group = by_group(addr)
        groups = [self._rows(a, req, pos, context_lens, query_lens) for a in addrs]
        first = groups[0]
        return CpuStepMetadata(list(request_ids), list(context_lens), list(query_lens),
                               first.write_rows, addr, first.decode, first.prefill,
                               first.seq_rows, groups if layer_group else None, layer_group)

    def _rows(self, addr: SlotAddressing | BlockAddressing, req: np.ndarray, pos: np.ndarray,
              context_lens: list[int], query_lens: list[int]) -> GroupRows:
        decode = (cpu_batches.decode_batch(addr, context_lens, query_lens)
                  if self.batched_decode else None)
        prefill = (cpu_batches.prefill_batch(addr, context_lens, query_lens)
                   if self.batched_prefill else None)
        seq_rows: list[slice | torch.Tensor | None] = []
        for b, (c, n) in enumerate(zip(context_lens, query_lens, strict=True)):
            if (decode is not None and cpu_batches.decodes(c, n)) or (
                    prefill is not None and not cpu_batches.decodes(c, n)):
                seq_rows.append(None)  # a kernel reads it in place
                continue
            rows = addr.sequence_rows(b, c + n)
            seq_rows.append(rows if isinstance(rows, slice) else torch.from_numpy(rows))
        return GroupRows(torch.from_numpy(addr.rows(req, pos)), decode, prefill, seq_rows)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """As the base class; when every request of the step decodes, the decode kernel stores
        the new K/V rows itself, in the same call (no separate write)."""
        assert isinstance(meta, CpuStepMetadata)
        rows = meta.rows_of(layer)
        if rows.decode is None or rows.decode.query_rows is not None:
            return super().forward(layer, q, k, v, meta, scale)
        k_flat, v_flat = self._flat[layer]
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, Hq*D]
        cpu_batches.run_decode(rows.decode, q, k_flat, v_flat, out, scale, new_kv=(k, v),
                               window=self.windows[layer])
        return out

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        assert isinstance(meta, CpuStepMetadata)
        write_rows = meta.rows_of(layer).write_rows
        k_flat, v_flat = self._flat[layer]
        if self.int8:
            cpu_attention_int8.store(k_flat, v_flat, write_rows, k, v)
            return
        k_flat.index_copy_(0, write_rows, k)
        v_flat.index_copy_(0, write_rows, v)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
               ) -> torch.Tensor:
        assert isinstance(meta, CpuStepMetadata)
        k_flat, v_flat = self._flat[layer]
        window, rows = self.windows[layer], meta.rows_of(layer)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, Hq*D]
        if rows.decode is not None:
            cpu_batches.run_decode(rows.decode, q, k_flat, v_flat, out, scale, window=window)
        if rows.prefill is not None:
            cpu_batches.run_prefill(rows.prefill, q, k_flat, v_flat, out, scale, window)
        if any(r is not None for r in rows.seq_rows):
            if self.int8:
                raise RuntimeError("an int8 KV cache is read by the batched kernels only "
                                   "(batched_decode and batched_prefill must stay on)")
            attend_each(out, q, k_flat, v_flat, meta.context_lens, meta.query_lens,
                        rows.seq_rows, scale, window)
        return out
