"""Twin Triton attention kernels: one body, two ways to find a token's K/V row.

``PAGED`` is a ``tl.constexpr``; everything else (tiles, warps, stages, math) is shared, so the
difference between the twins is exactly the cost of address translation:

    contiguous (virtual mode)  K: [num_slots, slot_tokens, kv_heads, head_dim] strided view
        row(b, t) = slot_ids[b] * stride_outer + t * stride_tok
    paged (block table)        K: [num_blocks, block_size, kv_heads, head_dim]
        row(b, t) = block_table[b, t // block_size] * stride_outer + (t % block_size) * stride_tok

Rows, their invariants (int64 offsets, masked loads) and fp8 rows: :mod:`.triton_rows`.

Decode: one program per (batch entry, kv head, KV split) holding all ``group`` query heads of
that kv head (rows padded to 16 for ``tl.dot``), online softmax over ``block_n``-token tiles;
with ``num_splits > 1`` each split writes a partial result and a second kernel merges them.
Prefill: one program per (request, block of query tokens, kv head), causal with a context offset.

fp32 inputs use exact fp32 dots (no TF32): benchmark in fp16/bf16.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vmkv.kernels.launch import launch
from vmkv.kernels.scaled_rows import FP8_DTYPES, SCALE_BYTES
from vmkv.kernels.triton_rows import FP8_CODES, _fp8_values, _index_base, _row_scales, _tile_rows

__all__ = ["decode_contiguous", "decode_paged", "prefill_contiguous", "prefill_paged"]

LOG2E = 1.4426950408889634
#: integer arguments whose values vary from step to step. Triton compiles a variant per integer
#: argument class (== 1, divisible by 16, other): the block table's width (``stride_index``)
#: moving from 16 to 17 blocks recompiled the paged kernel in the middle of a run (0.4-0.65 s
#: of one step on an H200, docs/gpu-results.md), so it is passed unspecialised.
UNSPECIALIZED = ("stride_index",)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _decode_kernel(
    Q, K, V, Out, Index, SeqLens, PartOut, PartLse,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_k_outer, stride_k_tok, stride_k_head,
    stride_v_outer, stride_v_tok, stride_v_head,
    stride_index, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PAGED: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    first = tl.maximum(seq_len - window, 0)  # the window's first token (NO_WINDOW: 0)
    base = first // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N  # per-sequence split
    lo = base + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = (kvh * GROUP + offs_g).to(tl.int64)
    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    index_base = _index_base(Index, b, stride_index, PAGED)
    k_head = kvh.to(tl.int64) * stride_k_head
    v_head = kvh.to(tl.int64) * stride_v_head
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + offs_n
        tok_mask = (t < hi) & (t >= first)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k_rows = _tile_rows(Index, index_base, start, t, tok_mask, stride_k_outer, stride_k_tok,
                            PAGED, BLOCK_SIZE, BLOCK_N) + k_head
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:  # scaled rows: the dot on the values, each key's scale on its column
            k = _fp8_values(k, FP8).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        if FP8:
            s = s * _row_scales(K, k_rows, tok_mask, HEAD_DIM)[None, :]
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _tile_rows(Index, index_base, start, t, tok_mask, stride_v_outer, stride_v_tok,
                            PAGED, BLOCK_SIZE, BLOCK_N) + v_head
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:  # each value row's scale folded into its softmax weight
            v = _fp8_values(v, FP8).to(q.dtype)
            p = p * _row_scales(V, v_rows, tok_mask, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # an empty split (or seq_len 0): zeros, lse -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        # PartOut: [B, Hq, NUM_SPLITS, BLOCK_D] fp32; PartLse: [B, Hq, NUM_SPLITS] (log2 units)
        part = (b64 * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(PartOut + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(PartLse + part, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    Out, PartOut, PartLse, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + offs_s
    lse = tl.load(PartLse + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # -inf splits weigh 0
    o = tl.load(PartOut + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None],
                other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _prefill_kernel(
    Q, K, V, Out, Index, SeqLens, CuSeqlensQ,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_k_outer, stride_k_tok, stride_k_head,
    stride_v_outer, stride_v_tok, stride_v_head,
    stride_index, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    b = tl.program_id(0)
    q_block = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SeqLens + b)
    context_len = seq_len - q_len

    # rows: BLOCK_Q query tokens x GROUP heads of this kv head (row r: token r // GROUP)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_tok = q_block * BLOCK_Q + offs_m // GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d_mask = offs_d < HEAD_DIM
    heads = (kvh * GROUP + offs_m % GROUP).to(tl.int64)
    q_rows = (q_start + q_tok).to(tl.int64)
    q_pos = context_len + q_tok  # query token's position: it sees keys 0..q_pos
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    index_base = _index_base(Index, b, stride_index, PAGED)
    k_head = kvh.to(tl.int64) * stride_k_head
    v_head = kvh.to(tl.int64) * stride_v_head
    kv_hi = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    first = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)  # no key before loaded
    seen_from = q_pos - window + 1  # each row's first key (negative without a window)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(first // BLOCK_N * BLOCK_N, kv_hi, BLOCK_N):
        t = start + offs_n
        tok_mask = (t < kv_hi) & (t >= first)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k_rows = _tile_rows(Index, index_base, start, t, tok_mask, stride_k_outer, stride_k_tok,
                            PAGED, BLOCK_SIZE, BLOCK_N) + k_head
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = _fp8_values(k, FP8).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if FP8:
            s = s * _row_scales(K, k_rows, tok_mask, HEAD_DIM)[None, :]
        seen = (t[None, :] <= q_pos[:, None]) & (t[None, :] >= seen_from[:, None])
        s = tl.where(tok_mask[None, :] & seen, s, float("-inf"))
        # a row may see nothing of a tile yet (its window starts later): -inf max taken as 0
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _tile_rows(Index, index_base, start, t, tok_mask, stride_v_outer, stride_v_tok,
                            PAGED, BLOCK_SIZE, BLOCK_N) + v_head
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = _fp8_values(v, FP8).to(q.dtype)
            p = p * _row_scales(V, v_rows, tok_mask, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)


# --------------------------------------------------------------------------------------------
# Python wrappers

#: True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they run on CPU tensors)
INTERPRETED = not isinstance(_decode_kernel, triton.runtime.JITFunction)


def _kv_args(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K, V as the kernels take them, FP8 code): an fp8 cache as its bytes (uint8 views, same
    strides), anything else as it is (code 0)."""
    code = FP8_CODES[k.dtype][0] if k.dtype in FP8_DTYPES else 0
    return (k.view(torch.uint8), v.view(torch.uint8), code) if code else (k, v, 0)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
           seq_lens: torch.Tensor, index_dim: int) -> tuple[int, int]:
    """Validate shapes/dtypes/devices; return (group, head_dim)."""
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"k/v must be 4-D and equal in shape, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[2]
    row = head_dim + (SCALE_BYTES if k.dtype in FP8_DTYPES else 0)
    if k.shape[3] != row or num_heads % kv_heads:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} do not fit k {tuple(k.shape)}"
                         + (" (fp8 rows: head_dim values + a 2-byte scale)"
                            if k.dtype in FP8_DTYPES else ""))
    if v.dtype != k.dtype or (q.dtype != k.dtype and k.dtype not in FP8_DTYPES):
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.dtype in FP8_DTYPES and q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"an fp8 cache is read with float queries, got {q.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim, got {x.stride()}")
    for name, x in (("index", index), ("seq_lens", seq_lens)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"{name} must be int32 on {q.device}, got {x.dtype} {x.device}")
    if index.dim() != index_dim or index.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"index {tuple(index.shape)} does not match seq_lens "
                         f"{tuple(seq_lens.shape)}")
    if index_dim == 2 and index.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q/k/v on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"tensors on {q.device} need the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before importing vmkv.kernels.triton_decode")
    return num_heads // kv_heads, head_dim


#: Triton's ``tl.dot`` needs inner sizes >= 16 for 16-bit inputs (Triton 3.6 rejects less)
MIN_DOT = 16


def block_d(head_dim: int) -> int:
    """The head-dim tile: a power of two >= ``head_dim`` and >= :data:`MIN_DOT` (the lanes past
    ``head_dim`` are masked), so every ``tl.dot`` over it is legal for any head size."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def _check_tiles(**tiles: int) -> None:
    for name, size in tiles.items():
        if size < MIN_DOT or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT} (tl.dot's inner "
                             f"size), got {size}")


NO_WINDOW = 2**30  # the kernels' window without one: more tokens than any sequence


def _check_window(window: int) -> int:
    if window < 0:
        raise ValueError(f"a sliding window must be positive (0: none), got {window}")
    return window or NO_WINDOW


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 dots (the reference is fp32); 16-bit inputs ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def _default_splits(q: torch.Tensor, programs: int) -> int:
    if q.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(16, -(-2 * sms // programs)))


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, *, paged: bool, block_size: int,
            num_splits: int | None, block_n: int, num_warps: int, num_stages: int,
            window: int) -> torch.Tensor:
    group, head_dim = _check(q, k, v, index, seq_lens, 2 if paged else 1)
    window = _check_window(window)
    _check_tiles(block_n=block_n)
    if q.dim() != 3 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q must be [B, heads, head_dim] with B={seq_lens.shape[0]}, "
                         f"got {tuple(q.shape)}")
    batch, num_heads, _ = q.shape
    kv_heads = k.shape[2]
    splits = num_splits or _default_splits(q, batch * kv_heads)
    tile_d = block_d(head_dim)
    out = torch.empty_like(q)  # [B, Hq, D]
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, tile_d, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    k, v, fp8 = _kv_args(k, v)
    launch(
        _decode_kernel, (batch, kv_heads, splits),
        q, k, v, out, index, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        index.stride(0) if paged else 0, scale * LOG2E, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=tile_d,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_SIZE=block_size, NUM_SPLITS=splits, PAGED=paged,
        PRECISION=_precision(q.dtype), FP8=fp8, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        launch(
            _merge_splits_kernel, (batch, num_heads),
            out, part_out, part_lse, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=tile_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )
    return out


def decode_contiguous(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
                      slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                      num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                      num_stages: int = 2, window: int = 0) -> torch.Tensor:
    """Decode attention over virtually contiguous slots (one query token per batch entry).

    Shapes: ``q [B, Hq, D]``; ``k_view, v_view [num_slots, slot_tokens, Hkv, D]`` (any strides
    but unit head_dim stride, e.g. a layer of the all-layers layout); ``slot_ids [B]`` and
    ``seq_lens [B]`` int32. Entry ``b`` attends over tokens ``[0, seq_lens[b])`` of slot
    ``slot_ids[b]``; nothing past that is read. Returns ``[B, Hq, D]`` in ``q``'s dtype
    (zeros where ``seq_lens[b] == 0``). ``num_splits`` (None: fill the GPU's SMs) splits each
    sequence's KV range; ``block_n``/``num_warps``/``num_stages`` are the tile config, shared
    with :func:`decode_paged` for a like-for-like comparison. ``window`` > 0: entry ``b``
    attends to (and reads) its last ``window`` tokens only.
    """
    return _decode(q, k_view, v_view, slot_ids, seq_lens, scale, paged=False, block_size=1,
                   num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, window=window)


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                 num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                 num_stages: int = 2, window: int = 0) -> torch.Tensor:
    """Decode attention through a block table (PagedAttention addressing).

    Shapes: ``q [B, Hq, D]``; ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``;
    ``block_table [B, max_blocks]`` int32 (entries past ``ceil(seq_lens[b] / block_size)`` are
    never read); ``seq_lens [B]`` int32. Same contract and tile config as
    :func:`decode_contiguous`.
    """
    return _decode(q, k_cache, v_cache, block_table, seq_lens, scale, paged=True,
                   block_size=k_cache.shape[1], num_splits=num_splits, block_n=block_n,
                   num_warps=num_warps, num_stages=num_stages, window=window)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
             cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
             scale: float, *, paged: bool, block_size: int, block_m: int, block_n: int,
             num_warps: int, num_stages: int, window: int) -> torch.Tensor:
    group, head_dim = _check(q, k, v, index, seq_lens, 2 if paged else 1)
    window = _check_window(window)
    _check_tiles(block_m=block_m, block_n=block_n)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must be int32 [B + 1], got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, heads, head_dim], got {tuple(q.shape)}")
    batch = seq_lens.shape[0]
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    out = torch.empty_like(q)  # [num_tokens, Hq, D]
    grid = (batch, max(1, math.ceil(max_query_len / block_q)), k.shape[2])
    k, v, fp8 = _kv_args(k, v)
    launch(
        _prefill_kernel, grid,
        q, k, v, out, index, seq_lens, cu_seqlens_q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        index.stride(0) if paged else 0, scale * LOG2E, window,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged,
        PRECISION=_precision(q.dtype), FP8=fp8, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def prefill_contiguous(q: torch.Tensor, k_view: torch.Tensor, v_view: torch.Tensor,
                       slot_ids: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       seq_lens: torch.Tensor, max_query_len: int, scale: float, *,
                       block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                       num_stages: int = 2, window: int = 0) -> torch.Tensor:
    """Causal attention of new tokens (prefill chunks, decodes) over virtually contiguous slots.

    Shapes: ``q [num_tokens, Hq, D]`` packed by request, request ``b`` owning rows
    ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` (int32 ``[B + 1]``); ``seq_lens [B]`` int32 counts
    context + new tokens (the new tokens' K/V must already be in the cache); new token ``j`` of
    request ``b`` sits at position ``seq_lens[b] - q_len_b + j`` and sees keys ``0..`` that
    position (with ``window`` > 0 only its last ``window`` keys). ``max_query_len`` (a host
    int, >= every ``q_len_b``) sizes the grid. Returns ``[num_tokens, Hq, D]``.
    """
    return _prefill(q, k_view, v_view, slot_ids, cu_seqlens_q, seq_lens, max_query_len, scale,
                    paged=False, block_size=1, block_m=block_m, block_n=block_n,
                    num_warps=num_warps, num_stages=num_stages, window=window)


def prefill_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                  max_query_len: int, scale: float, *, block_m: int = 64, block_n: int = 64,
                  num_warps: int = 4, num_stages: int = 2, window: int = 0) -> torch.Tensor:
    """:func:`prefill_contiguous` through a block table (``[num_blocks, block_size, Hkv, D]``)."""
    return _prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_query_len,
                    scale, paged=True, block_size=k_cache.shape[1], block_m=block_m,
                    block_n=block_n, num_warps=num_warps, num_stages=num_stages, window=window)
