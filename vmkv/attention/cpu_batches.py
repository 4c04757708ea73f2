"""A CPU step's requests, batched into one in-place kernel call per layer for each kind.

A step mixes decodes (1 new token) and prefill chunks (many, causal after the cached context).
The CPU backend hands every decode to :func:`vmkv.kernels.cpu_attention.decode` at once and every
prefill chunk to :func:`vmkv.kernels.cpu_attention.prefill` at once, both reading the cache in
place (slot rows in virtual mode, block-table rows in paged mode); SDPA per request is the
fallback (no compiler, or neither float32 nor bfloat16). An int8 cache (``--kv-cache-dtype
int8``) always takes the kernels: decode reads the int8 rows in place
(:mod:`vmkv.kernels.cpu_attention_int8`), prefill chunks read their rows dequantised into the
model's dtype first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vmkv.kernels import amx_prefill, cpu_attention, cpu_attention_int8
from vmkv.kv.addressing import Addressing


@dataclass
class Rows:
    """How a batch's entries find their cache rows: slot starts or a block table."""

    starts: torch.Tensor | None = None  # virtual: [n] int64 first flat row of each slot
    block_table: torch.Tensor | None = None  # paged: [n, max_blocks] int32
    block_size: int = 0

    @classmethod
    def of(cls, addr: Addressing, entries: np.ndarray) -> Rows:
        """The rows of batch entries ``entries`` of the step addressed by ``addr``."""
        if addr.paged:
            return cls(block_table=torch.from_numpy(np.ascontiguousarray(
                addr.block_table[entries])), block_size=addr.block_size)
        return cls(starts=torch.from_numpy(addr.slot_ids[entries] * addr.slot_tokens))


@dataclass
class DecodeBatch:
    """The decoding requests of a step."""

    query_rows: torch.Tensor | None  # rows of q/out that decode; None: every row decodes
    seq_lens: torch.Tensor  # [n] int32, cached tokens + the new one
    rows: Rows
    #: query_rows are every row of q/out in order (a verify step's chunks only): the kernel
    #: reads q and writes out in place, but never stores the new K/V itself
    in_order: bool = False


@dataclass
class PrefillBatch:
    """The prefill chunks (more than one new token) of a step."""

    q_start: torch.Tensor  # [n] int32 first row of each chunk in q / out
    q_lens: torch.Tensor  # [n] int32 new tokens
    seq_lens: torch.Tensor  # [n] int32 cached + new tokens
    rows: Rows


def use_kernels(dtype: torch.dtype) -> bool:
    """Whether the batched kernels serve this cache (float32, bfloat16 or int8, and the kernel
    libraries built)."""
    if dtype == torch.int8:
        return cpu_attention.available() and cpu_attention_int8.available()
    return dtype in cpu_attention.DTYPE_CODES and cpu_attention.available()


def use_amx_prefill(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill chunks of this cache run on AMX tiles (bfloat16, a head_dim of whole
    32-element rows, the kernel built)."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and amx_prefill.available()


#: a chunk of at most this many tokens after a cached context (speculative decoding's verify
#: step: the last token and its proposals) runs as that many decodes of one request, row j
#: seeing the context and rows 0 .. j: the decode kernel's arithmetic per row, so each row's
#: output is bit for bit what decoding it alone gives (greedy tokens stay the same)
MAX_DECODE_ROWS = 16


def decodes(context_len: int, query_len: int) -> bool:
    """Whether the decode kernel takes a request's rows (one token, or a short chunk after a
    cached context, row by row)."""
    return query_len == 1 or (context_len > 0 and query_len <= MAX_DECODE_ROWS)


def decode_batch(addr: Addressing, context_lens: list[int], query_lens: list[int]
                 ) -> DecodeBatch | None:
    """The decoding rows of a step (:func:`decodes`), addressed for the kernel: one entry per
    row, a short chunk's rows each with its own length; None when there are none."""
    idx = [i for i, (c, n) in enumerate(zip(context_lens, query_lens, strict=True))
           if decodes(c, n)]
    if not idx:
        return None
    offsets = np.cumsum([0, *query_lens[:-1]])
    if all(query_lens[i] == 1 for i in idx):
        return DecodeBatch(
            query_rows=None if len(idx) == len(query_lens) else torch.from_numpy(offsets[idx]),
            seq_lens=torch.tensor([context_lens[i] + 1 for i in idx], dtype=torch.int32),
            rows=Rows.of(addr, np.asarray(idx)))
    # rows of short chunks: never the fused store (row j reads rows the others write)
    entries = np.repeat(np.asarray(idx), [query_lens[i] for i in idx])
    j = np.concatenate([np.arange(query_lens[i]) for i in idx])
    return DecodeBatch(
        query_rows=torch.from_numpy(offsets[entries] + j),
        seq_lens=torch.from_numpy((np.asarray(context_lens)[entries] + j + 1).astype(np.int32)),
        rows=Rows.of(addr, entries), in_order=len(idx) == len(query_lens))


def prefill_batch(addr: Addressing, context_lens: list[int], query_lens: list[int]
                  ) -> PrefillBatch | None:
    """The chunks the decode kernel does not take, addressed for the kernel; None when there
    are none."""
    idx = [i for i, (c, n) in enumerate(zip(context_lens, query_lens, strict=True))
           if not decodes(c, n)]
    if not idx:
        return None
    offsets = np.cumsum([0, *query_lens[:-1]])
    return PrefillBatch(
        q_start=torch.from_numpy(offsets[idx].astype(np.int32)),
        q_lens=torch.tensor([query_lens[i] for i in idx], dtype=torch.int32),
        seq_lens=torch.tensor([context_lens[i] + query_lens[i] for i in idx], dtype=torch.int32),
        rows=Rows.of(addr, np.asarray(idx)))


def run_decode(batch: DecodeBatch, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
               out: torch.Tensor, scale: float,
               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0
               ) -> None:
    """Attend every decode of ``batch`` and write its rows of ``out [T, heads*D]``; with
    ``new_kv = (k, v) [T, kv_heads, D]`` (every row decodes) the kernel stores those rows in
    the cache first. ``window``: the layer's sliding window (0: none)."""
    r = batch.rows
    kernel = cpu_attention_int8.decode if k_flat.dtype == torch.int8 else cpu_attention.decode
    if batch.query_rows is None:
        kernel(q, k_flat, v_flat, batch.seq_lens, scale, starts=r.starts,
               block_table=r.block_table, block_size=r.block_size, new_kv=new_kv, out=out,
               window=window)
        return
    if new_kv is not None:
        raise ValueError("the decode kernel stores new K/V only when every row decodes")
    if batch.in_order:  # every row, in order: no gather of q, no scatter of out
        kernel(q, k_flat, v_flat, batch.seq_lens, scale, starts=r.starts,
               block_table=r.block_table, block_size=r.block_size, out=out, window=window)
        return
    res = kernel(q.index_select(0, batch.query_rows), k_flat, v_flat, batch.seq_lens, scale,
                 starts=r.starts, block_table=r.block_table, block_size=r.block_size,
                 window=window)
    out.index_copy_(0, batch.query_rows, res)


def run_prefill(batch: PrefillBatch, q: torch.Tensor, k_flat: torch.Tensor,
                v_flat: torch.Tensor, out: torch.Tensor, scale: float, window: int = 0) -> None:
    """Attend every chunk of ``batch``, writing its rows of ``out [T, heads*D]`` in place;
    ``window``: the layer's sliding window (0: none; the AMX kernel has none, so a window's
    chunks go to the vector kernel). An int8 cache's rows are dequantised into ``q``'s dtype
    first (each chunk's visible rows once; the kernels then read that buffer as slot rows)."""
    r = batch.rows
    if k_flat.dtype == torch.int8:
        first = ((batch.seq_lens - batch.q_lens - window + 1).clamp(min=0) if window
                 else torch.zeros_like(batch.seq_lens))
        k_flat, v_flat, starts = cpu_attention_int8.dequantize(
            k_flat, v_flat, batch.seq_lens, first, q.dtype, starts=r.starts,
            block_table=r.block_table, block_size=r.block_size)
        r = Rows(starts=starts)
    if not window and use_amx_prefill(q.dtype, q.shape[-1]):
        amx_prefill.prefill(q, k_flat, v_flat, batch.q_start, batch.q_lens, batch.seq_lens,
                            scale, out, starts=r.starts, block_table=r.block_table,
                            block_size=r.block_size)
        return
    cpu_attention.prefill(q, k_flat, v_flat, batch.q_start, batch.q_lens, batch.seq_lens, scale,
                          out, starts=r.starts, block_table=r.block_table,
                          block_size=r.block_size, window=window)
