"""The masked Triton K/V write (imported lazily by :mod:`vmkv.attention.kv_store`).

Importing this module imports Triton, which fixes the interpreter choice (``TRITON_INTERPRET``
is read when the kernel is decorated): CPU tests set it before the first import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vmkv.kernels.launch import launch
from vmkv.kernels.triton_rows import FP8_CODES


@triton.jit
def _fp8_grid(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """``y`` (float32, within the format's range) rounded to nearest even on the grid of an fp8
    format with ``MANT`` mantissa bits and smallest normal exponent ``EMIN``, in float32
    arithmetic, so the conversion that follows is exact. (Triton's interpreter drops the carry
    when a conversion rounds up into the next binade: 126 became 64 in e4m3.)"""
    e = ((tl.abs(y).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # the binade of |y|
    e = tl.maximum(e, EMIN)  # below it: the subnormals' fixed step
    step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MANT)
    inv = ((127 - e + MANT) << 23).to(tl.float32, bitcast=True)
    return ((y * inv + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: round half to even


@triton.jit
def _quantized_row(x, mask, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x [BLOCK_H, BLOCK_D]`` -> (fp8 value bytes as uint8, each head's float16 scale
    ``[BLOCK_H]``): scale = fp16(max|x| / FP8_MAX), values = fp8(clamp(x / scale)) rounded to
    nearest even; an all-zero head stores scale 0 and zeros."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    scale16 = (tl.max(tl.abs(xf), 1) / FP8_MAX).to(tl.float16)
    scale = scale16.to(tl.float32)
    inv = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale, 1.0), 0.0)
    y = tl.clamp(xf * inv[:, None], -FP8_MAX, FP8_MAX)
    if FP8 == 1:  # noqa: SIM108 - a constexpr branch of a Triton kernel
        y8 = _fp8_grid(y, 3, -6).to(tl.float8e4nv)
    else:
        y8 = _fp8_grid(y, 2, -14).to(tl.float8e5)
    return y8.to(tl.uint8, bitcast=True), scale16


@triton.jit
def _store_rows(X, Cache, t, row, stride_x_t, stride_x_h, stride_c_r, stride_c_h, offs_h,
                offs_d, mask, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr,
                FP8_MAX: tl.constexpr):
    x = tl.load(X + t * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :], mask=mask)
    dst = Cache + row * stride_c_r + offs_h * stride_c_h  # [BLOCK_H] each head's row
    if FP8:
        values, scale = _quantized_row(x, mask, FP8, FP8_MAX)
        tl.store(dst[:, None] + offs_d[None, :], values, mask=mask)
        bits = scale.to(tl.uint16, bitcast=True)
        head_ok = tl.max(mask.to(tl.int32), 1) > 0  # [BLOCK_H]: a head of a written row
        tl.store(dst + HEAD_DIM, (bits & 0xFF).to(tl.uint8), mask=head_ok)
        tl.store(dst + HEAD_DIM + 1, (bits >> 8).to(tl.uint8), mask=head_ok)
    else:
        tl.store(dst[:, None] + offs_d[None, :], x, mask=mask)


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, Rows,
                     stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                     stride_kc_r, stride_kc_h, stride_vc_r, stride_vc_h,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                     FP8_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # row -1 (padding) masks every access of this program (broadcast: the interpreter
    # rejects a scalar mask term)
    row_ok = (offs_d[None, :] * 0 + row) >= 0
    mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HEAD_DIM) & row_ok
    _store_rows(K, KCache, t, row, stride_k_t, stride_k_h, stride_kc_r, stride_kc_h, offs_h,
                offs_d, mask, HEADS, HEAD_DIM, FP8, FP8_MAX)
    _store_rows(V, VCache, t, row, stride_v_t, stride_v_h, stride_vc_r, stride_vc_h, offs_h,
                offs_d, mask, HEADS, HEAD_DIM, FP8, FP8_MAX)


def store_kv(k_flat: torch.Tensor, v_flat: torch.Tensor, rows: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k, v [T, Hkv, D]`` to rows ``rows [T]`` (int32/int64; negative: skipped) of
    ``k_flat, v_flat [rows, Hkv, D]``, or of an fp8 cache's ``[rows, Hkv, D + 2]`` (each head
    quantized per token: D fp8 values, then its float16 scale). One program per token; no
    host sync."""
    num_tokens, heads, head_dim = k.shape
    if num_tokens == 0:
        return
    fp8, fp8_max = FP8_CODES.get(k_flat.dtype, (0, 1.0))
    if fp8:  # the cache as its bytes
        k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
    launch(
        _store_kv_kernel, (num_tokens,),
        k, v, k_flat, v_flat, rows,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8, FP8_MAX=fp8_max, num_warps=4,
    )
