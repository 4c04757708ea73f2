"""How the Triton twins (:mod:`vmkv.kernels.triton_decode`) find and read a token's K/V row:
its int64 offset through a slot id (contiguous, virtual mode) or a block table (paged), and, in
an fp8 cache, the row's values as fp8 and its float16 scale from the two bytes after them.
``triton.jit`` helpers only; the kernels inline them.

Invariants: every offset is int64 (a virtual slot stride times a slot id overflows int32); every
K/V load and block-table load is masked by ``t < seq_lens[b]``, so nothing at or past a
sequence's length is read (its pages need not be mapped), nor before a sliding ``window``
(position p sees keys p - window + 1 .. p; the pages or blocks behind it may be gone).
``head_dim`` must have unit stride.

Paged mode loads one block-table entry per tile when ``block_size % block_n == 0`` and one per
token otherwise (e.g. block size 16 under 64-token tiles); that gather is part of the cost the
twins measure.

An fp8 cache's rows (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``, :mod:`vmkv.kv.spec`): ``head_dim``
fp8 values, then a float16 scale; the kernels take the cache as its bytes (uint8), convert the
values to the query's dtype for the dot and scale each key's score and each value's weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: an fp8 cache's dtype -> (the kernels' ``FP8`` code, the format's largest finite value: a
#: row's scale maps its largest magnitude there)
FP8_CODES = {torch.float8_e4m3fn: (1, 448.0), torch.float8_e5m2: (2, 57344.0)}


@triton.jit
def _tile_rows(Index, index_base, start, t, tok_mask, stride_outer, stride_tok,
               PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 element offsets of the K (or V) rows of tokens ``t`` (a tile starting at ``start``).

    Contiguous: ``index_base`` is the slot id (int64). Paged: it is the offset of the batch
    entry's block-table row.
    """
    if PAGED:
        if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block: one table entry per tile
            blk = tl.load(Index + index_base + start // BLOCK_SIZE).to(tl.int64)
        else:
            blk = tl.load(Index + index_base + t // BLOCK_SIZE, mask=tok_mask, other=0)
            blk = blk.to(tl.int64)
        return blk * stride_outer + (t % BLOCK_SIZE).to(tl.int64) * stride_tok
    else:
        return index_base * stride_outer + t.to(tl.int64) * stride_tok


@triton.jit
def _index_base(Index, b, stride_index, PAGED: tl.constexpr):
    if PAGED:
        return b.to(tl.int64) * stride_index
    else:
        return tl.load(Index + b).to(tl.int64)


@triton.jit
def _fp8_values(x, FP8: tl.constexpr):
    """An fp8 cache's value bytes (uint8) as their fp8 type: e4m3 (FP8 1) or e5m2 (FP8 2)."""
    if FP8 == 1:
        return x.to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e5, bitcast=True)


@triton.jit
def _row_scales(KV, rows, tok_mask, HEAD_DIM: tl.constexpr):
    """Each row's float16 scale (the 2 bytes after its ``HEAD_DIM`` values, little-endian) as
    float32 ``[BLOCK_N]``; 0 where masked."""
    lo = tl.load(KV + rows + HEAD_DIM, mask=tok_mask, other=0).to(tl.uint16)
    hi = tl.load(KV + rows + HEAD_DIM + 1, mask=tok_mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
