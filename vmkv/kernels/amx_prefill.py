"""bfloat16 prefill attention on AMX tiles, both KV modes (``csrc/cpu_amx_prefill.cpp``).

Flash attention of prefill chunks whose two products per key tile (``S = Q K^T``, ``O += P V``)
run on oneDNN's brgemm ukernel, the one torch exports (:func:`vmkv.kernels.cpu_bf16.ukernel`);
K^T and V are packed once per (request, KV head, chunk of up to 512 keys) from the cache rows,
read in place: slot rows (virtual mode) or a block table (paged mode), the twins' one
difference; each product is one ukernel call per chunk.
Same arguments and results as :func:`vmkv.kernels.cpu_attention.prefill` for bfloat16.
:func:`available` is True where the bf16 kernels run (:mod:`vmkv.kernels.cpu_bf16`) and this
library builds.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vmkv.kernels import cpu_bf16
from vmkv.kernels.build import CPU_FLAGS, CSRC, load_cpu_library

SOURCE = CSRC / "cpu_amx_prefill.cpp"
LIBRARY = "vmkv_cpu_amx_prefill"
#: what runs where it did not build
FALLBACK = "bfloat16 prefill through SDPA"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if cpu_bf16.unavailable_reason() is not None:
        return None
    lib = load_cpu_library(SOURCE, CPU_FLAGS, LIBRARY, FALLBACK)
    if lib is None:
        return None
    lib.vmkv_amx_prefill_attention.argtypes = [
        _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR,
        _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _I64, _I64, _PTR, _PTR]
    lib.vmkv_amx_prefill_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the AMX prefill runs here (bf16 hardware, torch's ukernel, the library)."""
    return _lib() is not None


def prefill(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, q_start: torch.Tensor,
            q_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor, *,
            starts: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
            block_size: int = 0) -> None:
    """:func:`vmkv.kernels.cpu_attention.prefill` for bfloat16 on AMX: entry ``b``'s rows
    ``q_start[b] .. + q_lens[b]`` of ``out [T, heads * D]`` get its causal attention over its
    ``seq_lens[b]`` cached rows (``[rows, kv_heads, D]`` views, unit stride in D, addressed by
    ``starts`` or ``block_table``). ``D`` must be a multiple of 32."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the AMX prefill kernel is not available here")
    tensors = (q, k_rows, v_rows, out)
    if any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in tensors):
        raise ValueError("the AMX prefill takes bfloat16 q, K/V and out with unit stride in D")
    if k_rows.stride() != v_rows.stride():
        raise ValueError("k/v rows need equal strides")
    if (starts is None) == (block_table is None):
        raise ValueError("give exactly one of starts or block_table")
    tokens, heads, dim = q.shape
    if out.shape != (tokens, heads * dim):
        raise ValueError(f"out must be [{tokens}, {heads * dim}], got {tuple(out.shape)}")
    table = block_table.to(torch.int32).contiguous() if block_table is not None else None
    first = starts.to(torch.int64).contiguous() if starts is not None else None
    q_start, q_lens, lens = (t.to(torch.int32).contiguous() for t in (q_start, q_lens, seq_lens))
    brgemm, release = cpu_bf16.ukernel() or (0, 0)
    err = lib.vmkv_amx_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_rows.data_ptr(), v_rows.data_ptr(),
        k_rows.stride(0), k_rows.stride(1),
        first.data_ptr() if first is not None else None,
        table.data_ptr() if table is not None else None,
        table.stride(0) if table is not None else 0, block_size, q_start.data_ptr(),
        q_lens.data_ptr(), lens.data_ptr(), len(lens), heads, k_rows.shape[1], dim,
        float(scale), out.data_ptr(), out.stride(0), dim, brgemm, release)
    if err == 1:
        raise ValueError(f"bad arguments to the AMX prefill kernel: q {tuple(q.shape)}, "
                         f"k {tuple(k_rows.shape)}, block_size {block_size}")
    if err:
        raise RuntimeError("the AMX prefill kernel's ukernel failed")
