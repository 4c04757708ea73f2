"""The masked Triton K/V write (imported lazily by :mod:`vmkv.attention.kv_store`).

Importing this module imports Triton, which fixes the interpreter choice (``TRITON_INTERPRET``
is read when the kernel is decorated): CPU tests set it before the first import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vmkv.kernels.launch import launch


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, Rows,
                     stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                     stride_kc_r, stride_kc_h, stride_vc_r, stride_vc_h,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # row -1 (padding) masks every access of this program (broadcast: the interpreter
    # rejects a scalar mask term)
    row_ok = (offs_d[None, :] * 0 + row) >= 0
    mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HEAD_DIM) & row_ok
    k = tl.load(K + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    tl.store(KCache + row * stride_kc_r + offs_h[:, None] * stride_kc_h + offs_d[None, :], k,
             mask=mask)
    v = tl.load(V + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    tl.store(VCache + row * stride_vc_r + offs_h[:, None] * stride_vc_h + offs_d[None, :], v,
             mask=mask)


def store_kv(k_flat: torch.Tensor, v_flat: torch.Tensor, rows: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k, v [T, Hkv, D]`` to rows ``rows [T]`` (int32/int64; negative: skipped) of
    ``k_flat, v_flat [rows, Hkv, D]``. One program per token; no host sync."""
    num_tokens, heads, head_dim = k.shape
    if num_tokens == 0:
        return
    launch(
        _store_kv_kernel, (num_tokens,),
        k, v, k_flat, v_flat, rows,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
