"""CPU twins: batched attention reading the KV cache in place (``csrc/cpu_attention.cpp``).

One call per layer covers every decoding request (:func:`decode`), and one every prefill chunk
(:func:`prefill`: many queries per request, causal after its cached context): contiguous slots
(virtual mode, row ``start + t``) or a block table (paged mode, row ``table[t // bs] * bs +
t % bs``). The same loops run in both modes, so they produce bit-identical outputs on the same
data. float32 or bfloat16 tensors (q, K/V and out alike; float32 arithmetic either way).

The library builds once with ``g++ -O3 -fopenmp`` (about 8 s on a 2-core EPYC; cached, see
:mod:`vmkv.kernels.build`). Where it cannot be built (no compiler, a compile error)
:func:`available` is False, one warning says why, and the attention backends fall back to
:data:`FALLBACK`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_attention.cpp"
FLAGS = CPU_FLAGS
LIBRARY = "vmkv_cpu_attention"
#: what runs without the library
FALLBACK = "per-request SDPA instead"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
#: the kernels' element types and their codes in the C ABI
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}
_ARGTYPES = [
    ctypes.c_int,  # element type (DTYPE_CODES)
    _PTR, _I64, _I64,  # q, q strides (batch, head)
    _PTR, _PTR, _I64, _I64,  # k, v, row stride, head stride
    _PTR, _PTR, _I64, _I64,  # starts, block table, table row stride, block size
    _PTR, _I64, _I64, _I64, _I64,  # seq lens, batch, heads, kv heads, head dim
    ctypes.c_float,  # scale
    _PTR, _I64, _I64,  # out, out strides (batch, head)
]


# + q starts, q lens; + the sliding window
_PREFILL_ARGTYPES = _ARGTYPES[:12] + [_PTR, _PTR] + _ARGTYPES[12:] + [_I64]
# + new k, v and strides; + the sliding window
_DECODE_ARGTYPES = _ARGTYPES + [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return build(FLAGS)


@functools.cache
def build(flags: tuple[str, ...], source: Path = SOURCE) -> ctypes.CDLL | None:
    """The kernel library built from ``source`` (another revision's copy, for an A/B) with
    ``flags`` (cached); None where it cannot be built (the reason:
    ``vmkv.kernels.build.load_failure(LIBRARY)``).

    The source has AVX-512, AVX2 and portable paths (the compiler's choice by ``-march``);
    tests build each one the CPU can run (``-mno-avx512f``, ``-mno-avx2``)."""
    lib = load_cpu_library(source, flags, LIBRARY, FALLBACK)
    if lib is None:
        return None
    lib.vmkv_cpu_decode_attention.argtypes = _DECODE_ARGTYPES
    lib.vmkv_cpu_decode_attention.restype = ctypes.c_int
    lib.vmkv_cpu_prefill_attention.argtypes = _PREFILL_ARGTYPES
    lib.vmkv_cpu_prefill_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on first call)."""
    return _lib() is not None


def decode_address() -> int:
    """The address of ``vmkv_cpu_decode_attention`` (for C code that calls the decode kernel
    itself: vmkv.models.quant.decode_loop); RuntimeError when :func:`available` is False."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available (see the log)")
    address = ctypes.cast(lib.vmkv_cpu_decode_attention, ctypes.c_void_p).value
    assert address is not None
    return address


def _checked(kind: str, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
             starts: torch.Tensor | None, block_table: torch.Tensor | None,
             lib: ctypes.CDLL | None = None
             ) -> tuple[ctypes.CDLL, torch.Tensor | None, torch.Tensor | None, int]:
    """Checks both kernels share; the library (``lib``, else the tree's) and the addressing as
    the kernel reads it (``starts`` int64, ``block_table`` int32 and its row stride; the caller
    keeps them alive)."""
    lib = lib or _lib()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available (see the log)")
    if q.dtype not in DTYPE_CODES or k_rows.dtype != q.dtype or v_rows.dtype != q.dtype:
        raise ValueError(f"the CPU {kind} kernel takes float32 or bfloat16 q and K/V of one "
                         f"dtype, got {q.dtype}/{k_rows.dtype}/{v_rows.dtype}")
    if k_rows.stride() != v_rows.stride() or k_rows.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k/v rows need equal strides and unit stride in head_dim")
    return (lib, *addressing_args(starts, block_table))


def addressing_args(starts: torch.Tensor | None, block_table: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The addressing as every CPU attention kernel reads it: exactly one of ``starts`` (int64)
    or ``block_table`` (int32) and the table's row stride (0 without one); the caller keeps
    the returned tensors alive through the call."""
    if (starts is None) == (block_table is None):
        raise ValueError("give exactly one of starts or block_table")
    if block_table is not None:
        block_table = block_table.to(torch.int32).contiguous()
        return None, block_table, block_table.stride(0)
    return starts.to(torch.int64).contiguous(), None, 0


def decode_out_and_new_rows(q: torch.Tensor, kv_heads: int, out: torch.Tensor | None,
                            new_kv: tuple[torch.Tensor, torch.Tensor] | None
                            ) -> tuple[torch.Tensor, tuple]:
    """What every CPU decode kernel (both KV dtypes) takes besides its cache: the output
    ``[B, heads * D]`` in ``q``'s dtype (``out`` checked, or a new tensor) and the new rows'
    arguments ``(k, k_stride_b, k_stride_h, v, v_stride_b, v_stride_h)`` (NULLs without
    ``new_kv``); ValueError naming what is wrong."""
    batch, heads, dim = q.shape
    if out is None:
        out = torch.empty(batch, heads * dim, dtype=q.dtype)
    elif out.shape != (batch, heads * dim) or not out.is_contiguous() or out.dtype != q.dtype:
        raise ValueError(f"out must be contiguous {q.dtype} [{batch}, {heads * dim}], got "
                         f"{out.dtype} {tuple(out.shape)}")
    if new_kv is None:
        return out, (None, 0, 0, None, 0, 0)
    k_new, v_new = new_kv
    for t in (k_new, v_new):
        if t.shape != (batch, kv_heads, dim) or t.stride(-1) != 1 or t.dtype != q.dtype:
            raise ValueError(f"new K/V rows must be {q.dtype} [{batch}, {kv_heads}, {dim}] "
                             f"with unit stride in D, got {t.dtype} {tuple(t.shape)}")
    return out, (k_new.data_ptr(), k_new.stride(0), k_new.stride(1),
                 v_new.data_ptr(), v_new.stride(0), v_new.stride(1))


def decode(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, *, starts: torch.Tensor | None = None,
           block_table: torch.Tensor | None = None, block_size: int = 0,
           new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
           out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Decode attention of ``q [B, heads, D]`` over flat cache rows ``[rows, kv_heads, D]``.

    Exactly one of ``starts`` (int64 ``[B]``: first row of each request's contiguous run) or
    ``block_table`` (int32 ``[B, max_blocks]`` with ``block_size``) addresses the rows; request
    ``b`` reads rows of tokens ``0 .. seq_lens[b]-1`` (int32) and nothing else, or with a
    sliding ``window`` > 0 only its last ``window`` tokens (the rows before them may be
    unmapped pages or freed blocks). With
    ``new_kv = (k, v)`` (each ``[B, kv_heads, D]``, unit stride in D) the kernel first stores
    request ``b``'s new rows ``k[b], v[b]`` at its token ``seq_lens[b] - 1`` (the write and the
    attention in one pass). Returns ``[B, heads * D]`` float32: ``out`` when given (that shape,
    contiguous), else a new tensor; all in ``q``'s dtype (float32 or bfloat16).
    """
    lib, starts, block_table, table_stride = _checked("decode", q, k_rows, v_rows, starts,
                                                      block_table)
    batch, heads, dim = q.shape
    kv_heads = k_rows.shape[1]
    out, fresh = decode_out_and_new_rows(q, kv_heads, out, new_kv)
    lens = seq_lens.to(torch.int32).contiguous()
    err = lib.vmkv_cpu_decode_attention(
        DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_rows.data_ptr(), v_rows.data_ptr(), k_rows.stride(0), k_rows.stride(1),
        starts.data_ptr() if starts is not None else None,
        block_table.data_ptr() if block_table is not None else None, table_stride, block_size,
        lens.data_ptr(), batch, heads, kv_heads, dim, float(scale),
        out.data_ptr(), heads * dim, dim, *fresh, window_arg(window),
    )
    if err:
        raise ValueError(f"bad arguments to the CPU decode kernel: q {tuple(q.shape)}, "
                         f"k {tuple(k_rows.shape)}, block_size {block_size}")
    return out


def prefill(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, q_start: torch.Tensor,
            q_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor, *,
            starts: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
            block_size: int = 0, window: int = 0, lib: ctypes.CDLL | None = None) -> None:
    """Causal attention of prefill chunks, written into ``out`` (by ``lib``, a :func:`build`, else
    the tree's library).

    Entry ``b`` owns rows ``q_start[b] .. + q_lens[b]`` of ``q [T, heads, D]`` and of
    ``out [T, heads * D]`` (other rows are left alone), and has ``seq_lens[b]`` tokens cached
    including those new ones (all int32 ``[B]``); its query ``i`` sees its tokens ``0 ..
    seq_lens[b] - q_lens[b] + i`` (with a sliding ``window`` > 0 only the last ``window`` of
    them: position ``p`` sees ``p - window + 1 .. p``), addressed by ``starts`` or
    ``block_table`` as in :func:`decode`. Nothing else is read.
    """
    lib, starts, block_table, table_stride = _checked("prefill", q, k_rows, v_rows, starts,
                                                      block_table, lib)
    tokens, heads, dim = q.shape
    if out.dtype != q.dtype or out.shape != (tokens, heads * dim) or out.stride(-1) != 1:
        raise ValueError(f"out must be {q.dtype} [{tokens}, {heads * dim}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    q_start, q_lens = (t.to(torch.int32).contiguous() for t in (q_start, q_lens))
    lens = seq_lens.to(torch.int32).contiguous()
    err = lib.vmkv_cpu_prefill_attention(
        DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_rows.data_ptr(), v_rows.data_ptr(), k_rows.stride(0), k_rows.stride(1),
        starts.data_ptr() if starts is not None else None,
        block_table.data_ptr() if block_table is not None else None, table_stride, block_size,
        q_start.data_ptr(), q_lens.data_ptr(), lens.data_ptr(), len(lens), heads,
        k_rows.shape[1], dim, float(scale), out.data_ptr(), out.stride(0), dim, window_arg(window),
    )
    if err:
        raise ValueError(f"bad arguments to the CPU prefill kernel: q {tuple(q.shape)}, "
                         f"k {tuple(k_rows.shape)}, block_size {block_size}")


def window_arg(window: int | None) -> int:
    """A sliding window as the kernels take it: tokens (> 0), or 0 for none."""
    window = int(window or 0)
    if window < 0:
        raise ValueError(f"a sliding window must be positive (0: none), got {window}")
    return window
