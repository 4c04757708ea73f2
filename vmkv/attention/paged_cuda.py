"""Paged mode on CUDA: block-table attention (PagedAttention addressing).

    block_table [B, W] int32: request b's token t lives in block block_table[b, t // bs],
                              row t % bs of the layer's [num_blocks, bs, Hkv, D] cache

Kernels (``kernel=`` or ``$VMKV_ATTENTION_BACKEND``, see :mod:`vmkv.attention.cuda_common`):

  * ``flash-attn``: ``flash_attn_with_kvcache(block_table=...)`` when the package is installed
    and ``block_size % 256 == 0`` (FA2's paged kernels need it); not on the H200 machine.
  * ``triton`` (the default there): the paged twin of :mod:`vmkv.kernels.triton_decode`, the
    decode kernel for decode-only batches and the causal prefill twin otherwise. Same tiles
    and math as the contiguous twin, so virtual-triton vs paged-triton isolates translation.
  * ``sdpa``: gather each request's rows, then SDPA (fallback without Triton).

Block tables are kept as numpy arrays per request and refreshed from the manager's lists only
from the block holding the first new token on (growth appends there; copy-on-write replaces the
partial last block there), so building a decode step costs O(batch), not O(tokens).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import torch

from vmkv.attention.base import AttentionMetadata
from vmkv.attention.cuda_common import (
    CudaAttentionBackend,
    HostStep,
    cumsum0,
    flash_attn_module,
    flash_unsupported,
    requested_kernel,
    token_positions,
    warn_fallback,
)
from vmkv.attention.kv_store import StoreFn, triton_usable
from vmkv.attention.sdpa import attend_gathered
from vmkv.kv.paged import PagedKVCache

FLASH_PAGED_BLOCK = 256  # FA2's paged KV needs block_size % 256 == 0


def resolve_paged_kernel(requested: str, dtype: torch.dtype, head_dim: int, block_size: int,
                         *, flash_attn: bool, triton: bool) -> str:
    """The kernel a paged cache runs with; ValueError for an impossible explicit request."""
    name = "paged-cuda"
    flash_reason = flash_unsupported(dtype, head_dim)
    if flash_reason is None and block_size % FLASH_PAGED_BLOCK:
        flash_reason = (f"FlashAttention-2's paged kernels need block_size % "
                        f"{FLASH_PAGED_BLOCK} == 0, got {block_size}")
    if requested == "aten-flash":
        raise ValueError(f"{name}: kernel 'aten-flash' has no block table in this torch; use "
                         "'triton' or 'flash-attn'")
    if requested == "flash":
        requested = "flash-attn" if flash_attn else "triton"
    if requested == "auto":
        if flash_attn and flash_reason is None:
            return "flash-attn"
        if triton:
            return "triton"
        warn_fallback(name, "Triton cannot run here", "sdpa")
        return "sdpa"
    if requested == "flash-attn":
        if not flash_attn:
            raise ValueError(f"{name}: kernel 'flash-attn' needs the flash_attn package")
        if flash_reason is not None:
            raise ValueError(f"{name}: kernel 'flash-attn': {flash_reason}")
    if requested == "triton" and not triton:
        raise ValueError(f"{name}: kernel 'triton' needs Triton able to launch kernels here "
                         "(not installed, or its launch failed: see the warning)")
    return requested


class BlockTables:
    """numpy copies of a :class:`PagedKVCache`'s block tables, refreshed incrementally.

    Entries are keyed by request id and hold the manager's list object itself: a new list
    (new request, fork, swap-in, readmission) is copied whole, the same list only from
    ``first_dirty`` on.
    """

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self._cache: dict[str, tuple[list[int], np.ndarray, int]] = {}

    def get(self, request_id: str, first_dirty: int) -> np.ndarray:
        """Request ``request_id``'s table as int32 ``[num_blocks]`` (a view: do not keep)."""
        table = self.kv.block_table(request_id)
        n = len(table)
        entry = self._cache.get(request_id)
        if entry is None or entry[0] is not table:
            arr = np.empty(max(16, 2 * n), dtype=np.int32)
            arr[:n] = table
        else:
            _, arr, valid = entry
            if n > len(arr):
                arr = np.resize(arr, 2 * n)
            lo = min(first_dirty, valid, n)
            arr[lo:n] = table[lo:n]
        self._cache[request_id] = (table, arr, n)
        return arr[:n]

    def prune(self) -> None:
        """Forget requests the manager no longer holds."""
        live = self.kv.block_tables
        for rid in [r for r in self._cache if r not in live]:
            del self._cache[rid]


class PagedCudaBackend(CudaAttentionBackend):
    """Attention over a :class:`PagedKVCache` on CUDA.

    Args:
        kv: the paged KV cache.
        kernel: see :mod:`vmkv.attention.cuda_common`.
        flash_attn: replaces the ``flash_attn`` module (tests; the real one runs on GPU only).
        store: replaces the K/V write (tests).
    """

    def __init__(self, kv: PagedKVCache, kernel: str | None = None, *,
                 flash_attn: ModuleType | None = None, store: StoreFn | None = None) -> None:
        super().__init__(kv.device, store)
        self.kv = kv
        self.block_size = kv.block_size
        self.max_blocks = -(-kv.max_model_len // kv.block_size)
        self.max_seq_len_bound = kv.max_model_len
        spec = kv.spec
        self._fa = flash_attn if flash_attn is not None else flash_attn_module()
        self.kernel = resolve_paged_kernel(requested_kernel(kernel), spec.dtype, spec.head_dim,
                                           kv.block_size, flash_attn=self._fa is not None,
                                           triton=triton_usable(kv.device))
        self.name = f"paged-{self.kernel}"
        self.tables = BlockTables(kv)
        self._steps = 0
        # [num_blocks, bs, Hkv, D] per layer and the [rows, Hkv, D] flattening
        self._caches = [kv.layer_kv(i) for i in range(spec.num_layers)]
        self._flat = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in self._caches]

    def flat_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._flat[layer]

    # -- step building ------------------------------------------------------------------------
    def build_step(self, request_ids: list[str], context_lens: list[int],
                   query_lens: list[int], *, pad_to: int | None = None) -> HostStep:
        pad = self._check_pad(query_lens, pad_to)
        bs = self.block_size
        ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        seq = ctx + qlens
        tables = [self.tables.get(rid, c // bs) for rid, c in zip(request_ids, context_lens,
                                                                  strict=True)]
        width = self.max_blocks if pad_to is not None else max((len(t) for t in tables),
                                                               default=1)
        batch = len(tables) + pad
        block_table = np.zeros((batch, max(width, 1)), dtype=np.int32)  # [B, W]
        for i, t in enumerate(tables):
            block_table[i, : len(t)] = t
        req, pos = token_positions(ctx, qlens)
        write = block_table[req, pos // bs].astype(np.int64) * bs + pos % bs  # [T]
        if pad:  # padding: length 0 (nothing read), row -1 (nothing written)
            seq = np.concatenate([seq, np.zeros(pad, dtype=np.int64)])
            qlens = np.concatenate([qlens, np.ones(pad, dtype=np.int64)])
            write = np.concatenate([write, np.full(pad, -1, dtype=np.int64)])
        arrays = {
            "write_rows": write,  # int64 [T]
            "cu_seqlens_q": cumsum0(qlens).astype(np.int32),  # [B+1]
            "seq_lens": seq.astype(np.int32),  # [B]
            "block_table": block_table,  # int32 [B, W]
        }
        if self.kernel == "sdpa":  # every request's rows, for the gather
            greq, gpos = token_positions(np.zeros_like(seq), seq)
            arrays["gather_rows"] = block_table[greq, gpos // bs].astype(np.int64) * bs + gpos % bs
        self._steps += 1
        if self._steps % 256 == 0:
            self.tables.prune()
        is_decode = bool((qlens == 1).all())
        if pad_to is not None:
            max_q, max_seq = 1, self.max_seq_len_bound
        else:
            max_q = int(qlens.max()) if len(qlens) else 1
            max_seq = int(seq.max()) if len(seq) else 1
        return HostStep(list(request_ids), list(context_lens), list(query_lens), arrays,
                        max_q, max_seq, is_decode, pad)

    # -- kernels ------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
               ) -> torch.Tensor:
        x: dict[str, Any] = meta.extra
        k_cache, v_cache = self._caches[layer]
        if self.kernel == "triton":
            from vmkv.kernels import triton_decode as td

            if x["is_decode"]:
                return td.decode_paged(q, k_cache, v_cache, x["block_table"], x["seq_lens"],
                                       scale)
            return td.prefill_paged(q, k_cache, v_cache, x["block_table"], x["cu_seqlens_q"],
                                    x["seq_lens"], x["max_query_len"], scale)
        if self.kernel == "flash-attn":
            return self._flash_attn(q, k_cache, v_cache, meta, scale)
        return self._sdpa(layer, q, meta, scale)

    def _flash_attn(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
        x: dict[str, Any] = meta.extra
        fa: Any = self._fa
        if x["is_decode"]:
            out = fa.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                             cache_seqlens=x["seq_lens"],
                                             block_table=x["block_table"],
                                             softmax_scale=scale, causal=True)
            return out.squeeze(1)
        out = torch.empty_like(q)
        pos = 0
        for b, n in enumerate(meta.query_lens):
            out[pos : pos + n] = fa.flash_attn_with_kvcache(
                q[pos : pos + n].unsqueeze(0), k_cache, v_cache,
                cache_seqlens=x["seq_lens"][b : b + 1], block_table=x["block_table"][b : b + 1],
                softmax_scale=scale, causal=True)[0]
            pos += n
        return out

    def _sdpa(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float
              ) -> torch.Tensor:
        k_flat, v_flat = self._flat[layer]
        rows = meta.extra["gather_rows"]
        assert isinstance(rows, torch.Tensor)
        k_all, v_all = k_flat.index_select(0, rows), v_flat.index_select(0, rows)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        lengths = [c + n for c, n in zip(meta.context_lens, meta.query_lens, strict=True)]
        attend_gathered(out, q, k_all, v_all, meta, lengths, scale)
        return out.view_as(q)
