"""CPU twins over an int8 KV cache (``csrc/cpu_attention_int8.cpp``; ``--kv-cache-dtype int8``).

A cache row of one head is ``head_dim`` int8 values and a float16 scale (``head_dim + 2``
bytes, :class:`vmkv.kv.spec.KVSpec`), so the flat views the backends hold are
``[rows, kv_heads, head_dim + 2]`` int8. Three calls, each over slot rows (virtual) or a
block table (paged) with one loop body:

- :func:`store`: quantise a step's new K/V rows into the cache (the write ``write_kv`` does);
- :func:`decode`: decode attention reading the int8 rows in place, the new rows quantised in
  the same call (:func:`vmkv.kernels.cpu_attention.decode`'s contract);
- :func:`dequantize`: the rows prefill chunks read, dequantised into a contiguous buffer of the
  model's dtype that the bfloat16 (brgemm) or float32 prefill kernels then read as slot rows.

Where ``head_dim`` is a power of two the rows are stored rotated by a Hadamard matrix
(:func:`rotated`); the kernels rotate the new rows, the query and the outputs themselves, so
every argument and result is in the model's basis. q, the new rows and the outputs are float32
or bfloat16. Built once like the other CPU kernels
(:mod:`vmkv.kernels.build`); where it cannot be built an int8 cache is refused at start-up.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library
from vmkv.kernels.cpu_attention import (
    DTYPE_CODES,
    addressing_args,
    decode_out_and_new_rows,
    window_arg,
)
from vmkv.kernels.scaled_rows import SCALE_BYTES

SOURCE = CSRC / "cpu_attention_int8.cpp"
LIBRARY = "vmkv_cpu_attention_int8"
FALLBACK = "no int8 KV cache (--kv-cache-dtype int8 is refused)"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_STORE_ARGTYPES = [ctypes.c_int, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64,
                   _PTR, _I64, _I64, _PTR, _I64, _I64]
_DECODE_ARGTYPES = [
    ctypes.c_int, _PTR, _I64, _I64,  # dtype, q and its strides (batch, head)
    _PTR, _PTR, _I64, _I64,  # k, v, row stride, head stride (bytes)
    _PTR, _PTR, _I64, _I64,  # starts, block table, table row stride, block size
    _PTR, _I64, _I64, _I64, _I64,  # seq lens, batch, heads, kv heads, head dim
    ctypes.c_float, _PTR, _I64, _I64,  # scale, out and its strides
    _PTR, _I64, _I64, _PTR, _I64, _I64, _I64,  # new k, v and strides; the sliding window
]
_DEQUANT_ARGTYPES = [ctypes.c_int, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64,
                     _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return build(CPU_FLAGS)


@functools.cache
def build(flags: tuple[str, ...], source: Path = SOURCE) -> ctypes.CDLL | None:
    """The library built from ``source`` (another revision's copy, for an A/B) with ``flags``
    (cached); None where it cannot be built (AVX-512 VNNI, AVX2 and portable paths: the
    compiler's choice by ``-march``)."""
    lib = load_cpu_library(source, flags, LIBRARY, FALLBACK)
    if lib is None:
        return None
    for fn, args in ((lib.vmkv_cpu_kv_int8_store, _STORE_ARGTYPES),
                     (lib.vmkv_cpu_decode_attention_int8, _DECODE_ARGTYPES),
                     (lib.vmkv_cpu_kv_int8_dequantize, _DEQUANT_ARGTYPES)):
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the int8 kernels can be used (builds them on first call)."""
    return _lib() is not None


def _library(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    lib = lib or _lib()
    if lib is None:
        raise RuntimeError("the int8 KV kernels are not available (see the log)")
    return lib


def decode_address() -> int:
    """The address of ``vmkv_cpu_decode_attention_int8``, whose C signature is
    ``vmkv_cpu_decode_attention``'s (for C code that calls the decode kernel itself:
    vmkv.models.quant.decode_loop); RuntimeError when :func:`available` is False."""
    address = ctypes.cast(_library().vmkv_cpu_decode_attention_int8, ctypes.c_void_p).value
    assert address is not None
    return address


def head_dim_of(cache_rows: torch.Tensor) -> int:
    """``head_dim`` of int8 cache rows ``[rows, kv_heads, head_dim + 2]``."""
    if cache_rows.dtype != torch.int8 or cache_rows.stride(-1) != 1:
        raise ValueError(f"int8 cache rows must be int8 with unit stride in the last dim, got "
                         f"{cache_rows.dtype} strides {cache_rows.stride()}")
    return cache_rows.shape[-1] - SCALE_BYTES


def store(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> None:
    """Quantise ``k, v [T, kv_heads, D]`` (float32 or bfloat16, unit stride in D) into the
    cache rows ``rows [T]`` (int64; negative: skipped) of ``k_rows, v_rows``."""
    lib = _library(lib)
    dim = head_dim_of(k_rows)
    if k_rows.stride() != v_rows.stride():
        raise ValueError("k/v cache rows need equal strides")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in DTYPE_CODES or t.shape[1:] != (k_rows.shape[1], dim) or \
                t.stride(-1) != 1:
            raise ValueError(f"new {name} rows must be float32/bfloat16 [T, {k_rows.shape[1]}, "
                             f"{dim}] with unit stride in D, got {t.dtype} {tuple(t.shape)}")
    if v.dtype != k.dtype:
        raise ValueError(f"new k and v rows must share a dtype, got {k.dtype}/{v.dtype}")
    rows = rows.to(torch.int64).contiguous()
    if rows.shape != (k.shape[0],) or v.shape[0] != k.shape[0]:
        raise ValueError(f"rows must be [{k.shape[0]}], got {tuple(rows.shape)}")
    err = lib.vmkv_cpu_kv_int8_store(
        DTYPE_CODES[k.dtype], k_rows.data_ptr(), v_rows.data_ptr(), k_rows.stride(0),
        k_rows.stride(1), rows.data_ptr(), k.shape[0], k_rows.shape[1], dim,
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1))
    if err:
        raise ValueError(f"bad arguments to the int8 KV store: cache {tuple(k_rows.shape)}, "
                         f"rows {tuple(k.shape)}")


def decode(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, *, starts: torch.Tensor | None = None,
           block_table: torch.Tensor | None = None, block_size: int = 0,
           new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
           out: torch.Tensor | None = None, window: int = 0,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`vmkv.kernels.cpu_attention.decode` over int8 cache rows ``[rows, kv_heads,
    D + 2]``: ``q [B, heads, D]`` and ``out [B, heads * D]`` in float32 or bfloat16; with
    ``new_kv`` the new rows are quantised into each request's last token first."""
    lib = _library(lib)
    dim = head_dim_of(k_rows)
    batch, heads, qdim = q.shape
    kv_heads = k_rows.shape[1]
    if q.dtype not in DTYPE_CODES or qdim != dim or q.stride(-1) != 1:
        raise ValueError(f"q must be float32/bfloat16 [B, heads, {dim}] with unit stride in D, "
                         f"got {q.dtype} {tuple(q.shape)}")
    if k_rows.stride() != v_rows.stride() or v_rows.dtype != torch.int8:
        raise ValueError("k/v cache rows need equal strides and int8 storage")
    out, fresh = decode_out_and_new_rows(q, kv_heads, out, new_kv)
    starts, block_table, table_stride = addressing_args(starts, block_table)
    lens = seq_lens.to(torch.int32).contiguous()
    err = lib.vmkv_cpu_decode_attention_int8(
        DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_rows.data_ptr(), v_rows.data_ptr(), k_rows.stride(0), k_rows.stride(1),
        starts.data_ptr() if starts is not None else None,
        block_table.data_ptr() if block_table is not None else None, table_stride, block_size,
        lens.data_ptr(), batch, heads, kv_heads, dim, float(scale), out.data_ptr(),
        heads * dim, dim, *fresh, window_arg(window))
    if err:
        raise ValueError(f"bad arguments to the int8 decode kernel: q {tuple(q.shape)}, "
                         f"k {tuple(k_rows.shape)}, block_size {block_size}")
    return out


def dequantize(k_rows: torch.Tensor, v_rows: torch.Tensor, seq_lens: torch.Tensor,
               first: torch.Tensor, dtype: torch.dtype, *, starts: torch.Tensor | None = None,
               block_table: torch.Tensor | None = None, block_size: int = 0,
               lib: ctypes.CDLL | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's rows ``first[b] .. seq_lens[b] - 1`` dequantised to ``dtype``:
    ``(k, v, starts)`` with ``k, v [sum(seq_lens), kv_heads, D]`` contiguous and request ``b``'s
    token ``t`` at row ``starts[b] + t`` (rows before ``first[b]`` are left unset: a sliding
    window never reads them)."""
    lib = _library(lib)
    dim = head_dim_of(k_rows)
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dequantize to float32 or bfloat16, got {dtype}")
    lens = seq_lens.to(torch.int32).contiguous()
    firsts = first.to(torch.int32).contiguous()
    dst_starts = torch.zeros(len(lens), dtype=torch.int64)
    if len(lens) > 1:
        dst_starts[1:] = torch.cumsum(lens[:-1].to(torch.int64), 0)
    total = int(lens.sum())
    k = torch.empty(total, k_rows.shape[1], dim, dtype=dtype)
    v = torch.empty_like(k)
    starts, block_table, table_stride = addressing_args(starts, block_table)
    err = lib.vmkv_cpu_kv_int8_dequantize(
        DTYPE_CODES[dtype], k_rows.data_ptr(), v_rows.data_ptr(), k_rows.stride(0),
        k_rows.stride(1), starts.data_ptr() if starts is not None else None,
        block_table.data_ptr() if block_table is not None else None, table_stride, block_size,
        lens.data_ptr(), firsts.data_ptr(), len(lens), k_rows.shape[1], dim, k.data_ptr(),
        v.data_ptr(), dst_starts.data_ptr())
    if err:
        raise ValueError(f"bad arguments to the int8 dequantize: k {tuple(k_rows.shape)}, "
                         f"block_size {block_size}")
    return k, v, dst_starts


def rotated(head_dim: int) -> bool:
    """Whether rows of this ``head_dim`` are stored rotated (a power of two; the kernels apply
    the Hadamard transform themselves, see the C source's header)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def hadamard_reference(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (D a power of two) times the normalised Sylvester-Hadamard matrix, float32,
    by the kernels' butterflies in their order (so the same bits): strides 1, 2, 4, ... of
    ``(a + b, a - b)``, then ``1 / sqrt(D)``. Its own inverse."""
    dim = x.shape[-1]
    y = x.float().reshape(-1, dim)
    h = 1
    while h < dim:
        pairs = y.view(-1, dim // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], 2).reshape(-1, dim)
        h *= 2
    norm = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(dim)).sqrt()
    return (y * norm).view(x.shape)


def _basis(x: torch.Tensor) -> torch.Tensor:
    return hadamard_reference(x) if rotated(x.shape[-1]) else x.float()


def quantize_reference(x: torch.Tensor) -> torch.Tensor:
    """What :func:`store` writes for ``x [..., D]`` (float32 arithmetic): ``[..., D + 2]``
    int8 rows of ``x`` rotated (:func:`rotated`), each D int8 values then its float16 scale
    (tests compare the kernel to it)."""
    xf = _basis(x)
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(max=65504.0).half()
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    values = torch.round(xf * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8).reshape(*x.shape[:-1], 2)], -1)


def dequantize_reference(rows: torch.Tensor) -> torch.Tensor:
    """``[..., D + 2]`` int8 rows -> ``[..., D]`` float32 values (value * scale) in the model's
    basis (rotated back where rows are rotated): what :func:`dequantize` gives."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    return _basis(rows[..., :-SCALE_BYTES].float() * scale)
