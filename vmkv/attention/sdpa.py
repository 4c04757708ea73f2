"""Attention of one sequence's new tokens over its cached K/V with torch SDPA (any device).

Used by the CPU backend for prefill chunks and by the CUDA backend's SDPA fallback; the
difference between modes is only how the ``[seq_len, kv_heads, head_dim]`` K/V arrive here (a
strided view of a slot, or a gather through a block table: :func:`attend_each`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of ``n`` new queries at positions ``context_len ..`` over ``k``/``v``;
    with a sliding ``window`` > 0 the query at position ``p`` sees keys ``p - window + 1 .. p``
    only (transformers' rule).

    Shapes: ``q [n, heads, D]``; ``k, v [context_len + n, kv_heads, D]`` (may be strided views);
    returns ``[n, heads * D]``.
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if window and n == 1 and k.shape[0] > window:  # decode: a view of the window's rows
        k, v = k[-window:], v[-window:]
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, seq, D], views
    if n == 1:
        # decode: fold the query heads of a group into the query length (no mask needed)
        qg = q.view(kv_heads, group, d)  # [kv_heads, group, D]
        out = F.scaled_dot_product_attention(qg, kt, vt, scale=scale)
        return out.reshape(1, heads * d)
    # a batch dimension of 1: with 3-D inputs torch's CPU SDPA leaves its flash kernel for the
    # math path (~20x slower in bfloat16 at 640 tokens)
    qt = q.transpose(0, 1)[None]  # [1, heads, n, D]
    out = _prefill(qt, kt[None], vt[None], context_len, scale, group, window)[0]  # [heads, n, D]
    return out.transpose(0, 1).reshape(n, heads * d)  # [n, heads*D]


def _prefill(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, context_len: int,
             scale: float, group: int, window: int) -> torch.Tensor:
    n = qt.shape[-2]
    if context_len == 0 and (not window or window >= n):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                              enable_gqa=group > 1)
    seq = context_len + n
    # new token i (position context_len + i) sees positions 0 .. context_len + i, or with a
    # window only context_len + i - window + 1 .. context_len + i
    mask = torch.ones(n, seq, dtype=torch.bool, device=qt.device).tril(context_len)
    if window:
        mask = mask.triu(context_len - window + 1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                          enable_gqa=group > 1)


def window_start(context_len: int, window: int) -> int:
    """The first token a step's queries after ``context_len`` cached ones see (0 without a
    ``window``): nothing before it is read."""
    return max(0, context_len - window + 1) if window else 0


def attend_each(out: torch.Tensor, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                context_lens: list[int], query_lens: list[int],
                seq_rows: list[slice | torch.Tensor | None], scale: float,
                window: int = 0) -> None:
    """Fill ``out [T, Hq*D]`` request by request. Request i's keys are ``k_flat[seq_rows[i]]``:
    a slice of contiguous rows (virtual slots: a view, no copy) or an index tensor (block
    tables: a gather); a request whose rows are None is left alone (a kernel wrote it). With a
    sliding ``window`` only the rows from the window's first token on are read (a view that
    starts there, or a gather of those rows)."""
    pos = 0
    for rows, ctx, n in zip(seq_rows, context_lens, query_lens, strict=True):
        if rows is not None:
            lo = window_start(ctx, window)
            if isinstance(rows, slice):
                seen = slice(rows.start + lo, rows.stop)
                k, v = k_flat[seen], v_flat[seen]  # [len - lo, Hkv, D] views
            else:
                k, v = k_flat.index_select(0, rows[lo:]), v_flat.index_select(0, rows[lo:])
            out[pos : pos + n] = attend_one(q[pos : pos + n], k, v, ctx - lo, scale, window)
        pos += n
